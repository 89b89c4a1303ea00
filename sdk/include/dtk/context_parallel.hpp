// dtk/context_parallel.hpp — how context parallelism splits a sequence (ABI 2.20,
// dtk_build_context.cp_rank/cp_size; Megatron's --context-parallel-size).
//
// Megatron's get_batch_on_this_cp_rank: the sequence in 2 x cp equal chunks, rank r keeping chunks
// r and 2 cp - 1 - r. Under the causal mask a query attends to the keys before it, so the early
// chunks cost little and the late ones much; pairing the i-th from the front with the i-th from
// the back gives every rank the same share of the attention's work. The step splits its
// micro-batch so (tokens, labels, loss mask, position ids: each its own positions); the model's
// attention puts the whole sequence back together (dtk/layers/context_parallel.hpp). Header-only:
// the step plugins use it without the layers library.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtk {

// This rank's share of `x` along `dim`: chunks cp_rank and 2 cp_size - 1 - cp_rank of its 2 x
// cp_size equal chunks, in that order (a copy). `x` itself where cp_size is 1. The length must be
// a multiple of 2 x cp_size (the host checks train.seq_length).
inline at::Tensor context_parallel_share(const at::Tensor& x, int64_t dim, int32_t cp_rank, int32_t cp_size) {
  if (cp_size <= 1) return x;
  const int64_t chunks = 2 * static_cast<int64_t>(cp_size), length = x.size(dim);
  if (length % chunks != 0)
    throw std::invalid_argument("context parallelism " + std::to_string(cp_size) + " splits a sequence of " +
                                std::to_string(length) + " positions into " + std::to_string(chunks) +
                                " equal chunks: the length must be a multiple of " + std::to_string(chunks));
  const int64_t c = length / chunks;
  return at::cat({x.narrow(dim, cp_rank * c, c), x.narrow(dim, (chunks - 1 - cp_rank) * c, c)}, dim);
}

// The whole sequence from the ranks' shares laid side by side in rank order along `dim` (rank 0's
// two chunks, rank 1's, ...): the chunks put back in the sequence's order (a copy). The inverse of
// taking every rank's context_parallel_share and concatenating them.
inline at::Tensor context_parallel_whole(const at::Tensor& shares, int64_t dim, int32_t cp_size) {
  if (cp_size <= 1) return shares;
  const int64_t chunks = 2 * static_cast<int64_t>(cp_size), c = shares.size(dim) / chunks;
  std::vector<at::Tensor> order;
  order.reserve(static_cast<size_t>(chunks));
  // Natural chunk k < cp is rank k's first chunk; chunk k >= cp is rank 2 cp - 1 - k's second.
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t at_rank = k < cp_size ? k : chunks - 1 - k, second = k < cp_size ? 0 : 1;
    order.push_back(shares.narrow(dim, (2 * at_rank + second) * c, c));
  }
  return at::cat(order, dim);
}

}  // namespace dtk
