// dtk/layers/lm_head.hpp — the output layer and its cross entropy in one pass over chunks of tokens, so the
// [tokens, vocabulary] logits and their gradient never exist whole (Liger-Kernel's
// FusedLinearCrossEntropy, with Megatron's vocab-parallel cross entropy inside).
//
// Unfused, a GPT-2-vocabulary model spends most of its non-GEMM time and memory on the logits:
// [8 x 256 tokens, 50304] fp32 is 412 MB, written by the product, read and rewritten by max,
// subtract, exp, sum and divide, cloned for the gradient and read twice more by the two backward
// products. Here each chunk of C tokens (512 by default) goes through:
//
//   logits_c = x_c W^T                      one GEMM (this rank's vocabulary rows under TP)
//   m = rowmax, s = sum exp(logits_c - m)   all-reduced MAX / SUM over the TP group, as Megatron
//   loss_c = log s + m - logits_c[target]   the target logit all-reduced with s
//   D_c = exp(logits_c - m) / s - onehot    the gradient of the loss w.r.t. the logits
//   gx_c = D_c W,   gW += D_c^T x_c         the two backward GEMMs, computed now
//
// Computing the gradients in forward assumes each token's loss gradient is known: backward
// scales gx row by row by the incoming per-token gradient g (exact: gx_n = g_n D_n W), and gW by
// the value c most tokens share (the causal-LM step's mean gives every token 1/N); tokens whose
// g differs (a loss mask) get their D recomputed from the saved m and s and added with weight
// g - c. So any incoming gradient is exact, and the common one costs nothing extra.
//
// Any device. The cross entropy's passes over a chunk run either as host row passes (CPU only:
// each row's max, exp-sum and normalisation while it is in cache, softmax_rows.cpp) or as LibTorch
// ops (amax, gather, exp_, sum, div_, scatter_add_: a GPU's path, and on the CPU the proof that
// the GPU's arithmetic equals the unfused logits). On a GPU with bf16 weights the three GEMMs run
// in bf16 and the log-softmax in fp32, chunk by chunk (llm.c's fused classifier, Liger's fused
// linear cross entropy): with one tensor-parallel rank one kernel per chunk reads the bf16 logits
// twice and writes D over them in bf16 (the ops' path makes them fp32 and passes over them seven
// times); a chunk is about 1 GiB of logits there, 512 tokens on the CPU.
#pragma once

#include <dtk/layers/tensor_parallel.hpp>

namespace dtk::layers {

// How a chunk's cross entropy runs: kAuto is kHost on the CPU; on a GPU DTK's fused kernel
// (dtk/cuda/cross_entropy.hpp, on logits in the weights' type) where the build has it and there is
// one tensor-parallel rank, else kOps. kHost on a GPU tensor is an error.
enum class CrossEntropyRows : int64_t { kAuto = 0, kHost = 1, kOps = 2 };

// Per-token loss [...] (fp32) of logits = x weight^T against `labels` [...] (global ids), weight
// this rank's [V / tp, h] vocabulary rows. `x` must already be in the TP region
// (copy_to_tp_region): its gradient here is this rank's partial sum. chunk_tokens <= 0: 512 on
// the CPU, about 1 GiB of fp32 logits elsewhere. Backward runs once (no retain_graph).
at::Tensor fused_lm_head_loss(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& labels,
                              const TPGroup& tp, int64_t chunk_tokens, CrossEntropyRows rows = CrossEntropyRows::kAuto);

}  // namespace dtk::layers
