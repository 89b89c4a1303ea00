// dtk/cuda/attention.hpp — causal self-attention, optionally in a sliding window, with DTK's
// counter-based dropout on the probabilities (dtk/cuda/dropout.hpp), forward and backward without
// the [seq, seq] probabilities ever in memory (src/attention.cu): FlashAttention-2's loop order
// (Dao, 2023), in bf16/fp16 tensor-core products with fp32 accumulation and an fp32 online
// softmax.
//
// Why DTK's own: the fused attention of LibTorch 2.x draws its dropout mask from the CUDA
// generator in its own order, so a layer recomputed in backward, a Domino chunk of the batch or a
// CPU run would draw other masks. Here element (b, h, i, j) of the probabilities is kept when
// DTK's hash of its index in a [batch, heads, seq, seq] mask keeps it: the bits apply_dropout
// gives the materialised probabilities, in every schedule and on every device. Without it the
// layers form the probabilities [batch, heads, seq, seq] in memory (Megatron's CoreAttention):
// at GPT-2's shape 0.8 GB a layer in bf16 and several passes over it each way. Without dropout
// the layers keep LibTorch's fused attention, except in a sliding window (LibTorch's has none).
//
// Arithmetic: S = scale q k^T (fp32 from the products), P = softmax(S) over the keys j <= i (and
// j >= i - window in a window) in fp32 (online: each 64-key tile rescales what came before),
// O = (P Z) V with Z = keep *
// dropout.scale (1 without dropout), the unnormalised P Z rounded to T (the inputs' type) for the
// product and O divided by the softmax's sum in fp32 at the end. Backward is FlashAttention-2's:
// P again from the scores and the saved log-sum-exp, dV = (P Z)^T dO, dS = P (Z dO V^T - D) with
// D = rowsum(dO O) (= rowsum(P Z dO V^T)), rounded to T for dQ = scale dS K and dK = scale dS^T Q.
#pragma once

#include <cstdint>

#include "dtk/cuda/dropout.hpp"
#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// Where a [batch, seq, heads, head_dim] operand lives: element (b, i, h, d) at
// b * batch + i * seq + h * head + d (strides in elements; unit stride in head_dim). Every
// stride a multiple of 8 and every pointer 16-byte aligned (the kernels move 16 bytes a load).
struct AttentionLayout {
  int64_t batch = 0, seq = 0, head = 0;
};

// heads a multiple of groups (grouped-query attention: query head h reads key/value group
// h / (heads / groups)); seq queries over `keys` keys (0: seq), keys >= seq: query i sits at
// position keys - seq + i and sees the keys up to it (the causal diagonal bottom-right aligned,
// as FlashAttention's and dtk::layers::window_mask's rule: a chunk of a sequence's queries over
// the keys from the sequence's start to the chunk's end).
struct AttentionShape {
  int64_t batch = 0, seq = 0, heads = 0, groups = 0, head_dim = 0;
  int64_t keys = 0;
};

// Whether the kernels take this type and head_dim on `device`: bf16 or fp16, head_dim 64 or 128,
// a GPU of compute capability 8.0 or later with the shared memory a block of the kernels takes
// (up to 103 KB: A100, H100 and H200 have it; sm_86/89 GPUs only for head_dim 64).
bool attention_supported(ElementType type, int64_t head_dim, int device);

// The attention's operands. dropout: null for none; else the mask of a [batch, heads, seq, keys]
// tensor (rows of a larger one through its offset), run_numel 0; or a block of keys columns
// (run_numel = keys) of a wider mask whose rows are row_numel elements apart, from its offset
// (dtk::layers::DropoutMask::columns).
struct AttentionArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  AttentionLayout q_layout, k_layout, v_layout;
  ElementType type = ElementType::kBFloat16;
  AttentionShape shape;
  float scale = 1.0f;  // of the scores, 1 / sqrt(head_dim) in the layers
  const DropoutBits* dropout = nullptr;
  // A sliding window (Megatron's --window-size W,0): the query at position p sees keys p - window
  // to p only; the walks skip the key tiles before each query tile's window. -1: none (plain
  // causal).
  int64_t window = -1;
};

// out [batch, seq, heads, head_dim] contiguous of the type (k and v [batch, keys, groups,
// head_dim] in their layouts); lse fp32 [batch, heads, seq]: each
// query row's log-sum-exp of its scaled scores (what backward recomputes the probabilities from).
void attention_forward(const AttentionArgs& a, void* out, float* lse, StreamHandle stream);

// dq, dk, dv (written, not accumulated; dk and dv summed over a group's query heads) in their
// layouts, from dout and out (contiguous like forward's out) and forward's lse; deterministic (no
// atomics). Workspace: delta fp32 [batch, heads, seq], any contents.
struct AttentionGrads {
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  AttentionLayout dq_layout, dk_layout, dv_layout;
  float* delta = nullptr;
};
void attention_backward(const AttentionArgs& a, const void* dout, const void* out, const float* lse,
                        const AttentionGrads& g, StreamHandle stream);

}  // namespace dtk::cuda
