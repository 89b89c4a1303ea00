// dtk/cuda/squares.hpp — the sum of the squares of many tensors' elements in one pass on the GPU
// (src/squares.cu), for Megatron's global gradient norm: what clip_grad_norm_fp32's
// multi_tensor_l2norm does in apex, but accumulated in fp64 as dtk::sum_of_squares does on the
// CPU (each fp32 square is exact in fp64, so ZeRO's partitions and ddp's whole parameters give the
// same norm to ~1e-15), and deterministic: every block sums a fixed 64K-element slice in a fixed
// tree, and one last block adds the block sums in order. No host synchronisation: the result
// stays on the device until the caller reads it (once per step).
#pragma once

#include <cstdint>
#include <vector>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// One tensor's elements: contiguous, on the device.
struct SquaresTensor {
  const void* data;
  int64_t n;
  ElementType type;
};

// Doubles of workspace sum_of_squares needs for `tensors` (one per 64K-element slice, at least 1).
int64_t sum_of_squares_workspace(const std::vector<SquaresTensor>& tensors);

// Queues *out = sum over every element x of every tensor of double(x)^2 on `stream` (a few
// launches: up to 32 tensors of one element type each, then one to add the slices' sums).
// `workspace` holds sum_of_squares_workspace(tensors) doubles on the device; `out` one double.
void sum_of_squares(const std::vector<SquaresTensor>& tensors, double* workspace, double* out, StreamHandle stream);

}  // namespace dtk::cuda
