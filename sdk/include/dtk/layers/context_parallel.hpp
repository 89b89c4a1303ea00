// dtk/layers/context_parallel.hpp — the attention of a context-parallel model (ABI 2.20,
// DTK_GROUP_CONTEXT_PARALLEL): Megatron's all-to-all context parallelism (--cp-comm-type a2a,
// DeepSpeed-Ulysses).
//
// Each rank of the group holds its share of the sequence (dtk/context_parallel.hpp) for every
// head. Before core attention one all-to-all trades that for the whole sequence of 1 / cp of the
// heads: each rank sends every other rank its positions of that rank's heads. Core attention then
// runs unchanged on whole sequences (the causal mask, a window, a given mask, dropout, every
// kernel), and one all-to-all back returns the context to the sequence shares for the output
// projection. Each moves the layer's projection once, 1 - 1/cp of it over the wire; the backward
// is the mirror exchange. The heads (for grouped-query attention the key/value groups) of a
// tensor-parallel rank must divide by cp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dtk::layers {

struct ContextParallel {
  int32_t rank = 0;
  int32_t size = 1;
  bool active() const { return size > 1; }

  // x [b, s / cp, units * w], this rank's share of the sequence for `units` heads (or key/value
  // groups) of w channels each -> [b, s, units / cp * w], the whole sequence in order for the
  // units [rank * units / cp, (rank + 1) * units / cp). Differentiable; x itself where inactive.
  at::Tensor heads_from_sequence(const at::Tensor& x, int64_t units) const;
  // The inverse: x [b, s, units * w] of this rank's `units` -> [b, s / cp, cp * units * w].
  at::Tensor sequence_from_heads(const at::Tensor& x, int64_t units) const;
  // Position ids [b, s / cp] of this rank's share -> [b, s] of the whole sequence in order (one
  // all-gather; no gradient).
  at::Tensor whole_positions(const at::Tensor& positions) const;
  // Any x [b, s / cp, ...] of this rank's share -> [b, s, ...] of the whole sequence in order (one
  // all-gather; no gradient: for what a layer decides on a whole sequence, an MoE router's
  // capacity or balancing), and back: this rank's share of a whole-sequence [b, s, ...].
  at::Tensor whole_sequence(const at::Tensor& share) const;
  at::Tensor share_of_sequence(const at::Tensor& whole) const;
  // This rank's share of 0 .. s - 1 for each of b sequences, [b, s / cp] int64 on `device`.
  at::Tensor share_of_positions(int64_t b, int64_t s, at::Device device) const;
};

}  // namespace dtk::layers
