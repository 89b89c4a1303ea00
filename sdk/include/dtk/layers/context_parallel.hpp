// dtk/layers/context_parallel.hpp — the attention of a context-parallel model (ABI 2.20,
// DTK_GROUP_CONTEXT_PARALLEL), by one of Megatron's two exchanges (--cp-comm-type; ABI 2.21,
// dtk_build_context.cp_comm_type). Each rank of the group holds its share of the sequence
// (dtk/context_parallel.hpp) for every head.
//
// a2a (DeepSpeed-Ulysses): before core attention one all-to-all trades the share for the whole
// sequence of 1 / cp of the heads: each rank sends every other rank its positions of that rank's
// heads. Core attention then runs unchanged on whole sequences (the causal mask, a window, a given
// mask, dropout, every kernel), and one all-to-all back returns the context to the sequence shares
// for the output projection. Each moves the layer's projection once, 1 - 1/cp of it over the
// wire; the backward is the mirror exchange. The heads (for grouped-query attention the key/value
// groups) of a tensor-parallel rank must divide by cp.
//
// all_gather (Megatron's and Transformer Engine's all-gather of keys and values): one all-gather
// gives every rank the whole sequence's keys and values (for grouped-query attention only the
// groups'), and each of the rank's two chunks of queries attends over the keys up to its own end
// (the causal mask's rows of those positions; a window or a given mask likewise). The backward
// reduce-scatters the keys' and values' gradients back to their ranks. No condition on the heads;
// each rank holds the whole sequence's keys and values while a layer's attention runs.
#pragma once

#include <dtk/abi.h>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/fused_kernels.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dtk::layers {

struct ContextParallel {
  int32_t rank = 0;
  int32_t size = 1;
  int32_t comm = DTK_CP_COMM_A2A;  // dtk_build_context.cp_comm_type
  bool active() const { return size > 1; }
  // Whether attention gathers the whole sequence's keys and values (all_gather) rather than
  // trading the shares for heads (a2a).
  bool gathers_keys() const { return active() && comm == DTK_CP_COMM_ALL_GATHER; }
  // Of `units` heads (or key/value groups) on a tensor-parallel rank, those whose core attention
  // this rank runs: units / cp under a2a, all of them otherwise.
  int64_t attention_units(int64_t units) const { return active() && !gathers_keys() ? units / size : units; }

  // a2a: x [b, s / cp, units * w], this rank's share of the sequence for `units` heads (or
  // key/value groups) of w channels each -> [b, s, units / cp * w], the whole sequence in order for
  // the units [rank * units / cp, (rank + 1) * units / cp). Differentiable; x itself where inactive
  // or under all_gather (as is sequence_from_heads: attend_whole_keys reaches the sequence there).
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

  // all_gather: Megatron's core attention (attention_ops) of this rank's queries q [b, s / cp,
  // heads, hd] over the whole sequence, whose keys and values this rank holds its share of (k, v
  // [b, s / cp, groups, hd]; gathered here, their gradients reduce-scattered back). Each of the
  // share's two chunks of queries attends over the keys from the sequence's start to its own end:
  // the causal mask's rows, or those of `given` ([b or 1, 1, s, s], the whole sequence's; true =
  // masked; one letting a query see a later chunk's key throws), with a window (`window` >= 0) too.
  // `keep`: a mask drawn for gathered_probs_shape (undefined: no dropout). On a GPU without `given`
  // each chunk runs DTK's attention kernel (fused_attention, where `kernels` and the operands let
  // it: its queries the last of the keys' positions), on the CPU in fp32 without a window
  // causal_attention, else attention_ops with the chunk's mask.
  // The context [b, s / cp, heads * hd] in the share's order; differentiable in q, k and v.
  at::Tensor attend_whole_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                               const at::Tensor& given, int64_t window, const DropoutMask& keep,
                               const FusedKernels& kernels) const;
  // The shape the attention dropout's mask is drawn for under all_gather, [b, heads, share / 2,
  // 2 x s] (s = share x cp): per query of a chunk, the whole sequence's keys once for each of the
  // share's two chunks, so chunk j's probabilities [b, heads, share / 2, keys] read the columns j x
  // s .. j x s + keys - 1 of each row (DropoutMask::columns), and Domino's chunks slice it by rows.
  std::vector<int64_t> gathered_probs_shape(int64_t b, int64_t heads, int64_t share) const;
};

}  // namespace dtk::layers
