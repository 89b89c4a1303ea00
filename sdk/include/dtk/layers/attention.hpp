// dtk/layers/attention.hpp — core attention for the decoder layers: Megatron's CoreAttention as
// tensor ops (attention_ops, the reference), causal attention on the CPU that skips the masked
// half (causal_attention_qkv on gpt's fused projection, causal_attention on separate and grouped
// operands, llama's and context parallelism's chunks), and on a GPU DTK's flash kernel for
// attention with dropout or a window, and for context parallelism's chunks (fused_attention).
// Without either a GPU layer uses LibTorch's fused attention.
//
// Megatron's CoreAttention forms all [s, s] scores of each head, fills the upper triangle with
// -10000, takes the softmax in fp32 (where exp(-10000 - max) is exactly 0), applies dropout and
// multiplies by V, every step a pass over a [b, heads, s, s] tensor, with copies to make the
// heads contiguous for the batched products. Here each (sequence, head) works in blocks of 64
// query rows: the scores of a block exist only for the keys at or before its last row, the
// softmax covers each row's unmasked prefix, and the products read Q, K, V straight from the
// fused QKV projection and write the context in its [b, s, heads * head_dim] layout, through
// dtk/gemm.hpp. With 4 blocks (s = 256) that is 10 of 16 score blocks; the result is the masked
// softmax's, the same up to the order of the sums.
//
// Dropout on the probabilities uses the mask `keep` of a [b, heads, s, s] tensor (dropout.hpp):
// the same bits as apply_dropout on the full probabilities, so a chunked schedule (Domino)
// passing a mask of rows gets the same masks. Saved for backward: the QKV input and the
// probabilities [b, heads, s, s] (the masked part never written), or, with recompute_probs
// (Megatron's recompute_granularity=selective), only the QKV input: backward forms the
// probabilities again block by block, the same values, for one more Q K^T product per block.
#pragma once

#include <dtk/layers/dropout.hpp>
#include <dtk/layers/fused_kernels.hpp>

namespace dtk::layers {

// Whether causal_attention_qkv takes this input: a CPU fp32 tensor [b, s, heads * 3 * head_dim],
// contiguous.
bool causal_attention_supported(const at::Tensor& qkv);

// The context [b, s, heads * head_dim] of causal self-attention over `qkv` [b, s, heads * 3 *
// head_dim], Megatron's layout (per head: query, key, value, each head_dim wide): softmax(q k^T
// * scale) with the future masked, dropout `keep` (undefined: none) on the probabilities, times
// v. Differentiable in qkv.
at::Tensor causal_attention_qkv(const at::Tensor& qkv, int64_t heads, double scale, const DropoutMask& keep,
                                bool recompute_probs = false);

// causal_attention_qkv's kernel over separate operands: q [b, s, heads, hd] and k, v [b, t, groups,
// hd] (t >= s; strided views with unit stride in hd; grouped-query attention where groups <
// heads), query i at position t - s + i seeing the keys up to it (as window_mask places it), keep
// undefined, a mask drawn for [b, heads, s, t] (or rows of one) or a block of t columns of a wider
// one (DropoutMask::columns). Where causal_attention_applies: CPU fp32. The context [b, s, heads *
// hd]; differentiable in q, k and v (their gradients three tensors). Saved for backward: the
// operands and the probabilities [b, heads, s, t] (none with recompute_probs).
bool causal_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DropoutMask& keep);
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const DropoutMask& keep, bool recompute_probs = false);

// Megatron's CoreAttention over q [b, s, heads, hd] and k, v [b, t, groups, hd] (grouped-query
// attention where groups < heads: query head h reads group h / (heads / groups)): scores = (q *
// scale) k^T in the inputs' type (on the CPU a bf16 or fp16 product widened to fp32 and rounded
// once where dtk/gemm.hpp widens that type, forward and backward), masked positions (`mask` true,
// broadcast to [b, heads, s, t]) at -10000 and softmax in fp32, probabilities back in the inputs' type, dropout `keep`
// (a mask of [b, heads, s, t]) applied, times v. The context [b, s, heads * hd]; differentiable.
at::Tensor attention_ops(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                         const at::Tensor& mask, const DropoutMask& keep);

// Megatron's sliding-window attention (--window-size W,0): the query at position p (query i of s
// over t keys sits at p = t - s + i) sees the keys at positions p - W to p, itself and the W
// before it (Hugging Face's sliding_window W + 1). Returns `mask` ([.., s, t], true = masked;
// undefined: the causal one) with the keys before each query's window masked too, [1, 1, s, t]
// where `mask` is undefined.
at::Tensor window_mask(const at::Tensor& mask, int64_t s, int64_t t, int64_t window, at::Device device);

// Whether fused_attention takes these operands: on a GPU in bf16 or fp16, head_dim 64 or 128 with
// unit stride, s <= t, the other strides multiples of 8; keep undefined, a mask drawn for [b,
// heads, s, t] (or rows of one: a Domino chunk's) or a block of t columns of a wider one
// (DropoutMask::columns); kernels.attention on.
bool fused_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DropoutMask& keep,
                             const FusedKernels& kernels);
// Causal attention_ops (the future masked; with s < t query i sits at position t - s + i, as in
// window_mask, and sees the keys up to it) by DTK's kernel (dtk/cuda/attention.hpp): the
// probabilities never in memory, the dropout's bits those apply_dropout gives the whole
// probabilities (so recomputation, Domino's chunks and a CPU run see the same masks); saved for
// backward: q, k, v, the context and one fp32 log-sum-exp per query row; the backward is
// deterministic. `window` >= 0: a sliding window, attention_ops with window_mask's mask, each
// query's walk bounded by it (64 s (ceil(W / 64) + 1) scores a head instead of s^2 / 2); -1:
// none. The context [b, s, heads * hd]; differentiable in q, k and v. No fallback: call it where
// fused_attention_applies says so (it throws elsewhere), attention_ops otherwise.
at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           const DropoutMask& keep, int64_t window = -1);

}  // namespace dtk::layers
