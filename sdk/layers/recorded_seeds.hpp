// recorded_seeds.hpp (private to the SDK's layers) — dropout masks in a step the host records into
// a CUDA graph (train.cuda_graphs, dtk/capture.hpp). A mask's seed is drawn on the host, and a
// graph replays the constants it recorded, so a mask drawn while recording holds a seed slot
// instead: a one-element tensor on the compute device that the host fills anew before each replay
// by drawing from the mask's generator (dtk_capture_ext.seed_slot, ABI 2.6). Every replay so draws
// the seeds an uncaptured micro-batch would, from the same generators, in the same order.
//
// A recomputed layer (full recomputation, Domino's) draws from a clone of the generators taken
// before its forward, so that its masks repeat the forward's. In a recording a clone draws
// nothing of its own: its k-th draw is the slot of its source's k-th draw after the clone point.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace dtk::layers::recorded_seeds {

// Whether the host draws seeds for a recorded step (a host of ABI >= 2.6).
bool available();
// The slot of the seed of `gen`'s next draw in this recording (a CPU generator, or a clone
// noted below).
at::Tensor next(at::Generator& gen);
// `copy` was just cloned from `source` while recording: its draws repeat source's from here on.
void note_clone(at::Generator& source, at::Generator& copy);

}  // namespace dtk::layers::recorded_seeds
