// dtk/layers/recompute.hpp — full activation recomputation of a block (Megatron's
// CheckpointFunction with one block per call), for model plugins.
#pragma once

#include <dtk/layers/dropout.hpp>

#include <functional>

namespace dtk::layers {

// A block's computation: x -> output, drawing its dropout from `rng`. It must read only x, the
// model's parameters and what it captures; captures are held until the backward, so capture
// tensors and pointers by value.
using RecomputedBlock = std::function<at::Tensor(const at::Tensor& x, DropoutRng& rng)>;

// Runs `block` on x keeping none of its activations: the autograd graph holds only x and the
// states of rng's generators before the block. The backward reruns the block from those states
// with grad enabled and backpropagates through it, so the output, the dropout masks and every
// gradient equal the plain block's; rng advances as the plain block advances it. Without grad mode
// (evaluation), or when x does not require grad (nothing to recompute from), it is block(x, rng).
at::Tensor recompute(const at::Tensor& x, DropoutRng& rng, RecomputedBlock block);

}  // namespace dtk::layers
