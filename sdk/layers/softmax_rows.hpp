// softmax_rows.hpp — the cross entropy's per-row passes over a block of fp32 logits, for the
// fused output layer (lm_head.cpp). Internal to dtk::layers, not installed.
//
// Each function works on rows [0, n) of a row-major block, row i at x + i * ld, `width` columns;
// the caller splits rows over threads. A GPT-2-vocabulary row is 50304 floats (201 KB): it fits
// in a core's L2, so a caller that runs all three passes on one row before the next (one process,
// no tensor-parallel all-reduce between the passes) reads and writes each logit in memory once,
// where the equivalent LibTorch ops (amax, sub_, exp_, sum, div_, scatter_add_) make seven passes
// over the whole [tokens, vocabulary] block.
//
// The arithmetic is Megatron's _VocabParallelCrossEntropy's, in its order: subtract the row's
// maximum, exponentiate, sum, divide. exp is a vectorised Cephes expf (relative error ~1 ulp,
// exactly 0 below -87.3); the reductions keep 8 partial results per row. A NaN logit makes the
// row's sum, and so its loss, NaN.
#pragma once

#include <cstdint>

namespace dtk::layers::softmax_rows {

// max[i] = the largest logit of row i (NaNs are skipped here; the sum below propagates them).
void row_max(const float* x, int64_t n, int64_t width, int64_t ld, float* max);

// For each row i: e_ij = exp(x_ij - max[i]); sum[i] = sum_j e_ij; target[i] = x_i,col[i] - max[i]
// where col[i] >= 0, else 0. With `write`, x_ij becomes e_ij. `col` may be null (no targets).
void exp_sum(float* x, int64_t n, int64_t width, int64_t ld, const float* max, const int64_t* col, float* sum,
             float* target, bool write);

// For each row i: x_ij = x_ij / sum[i], minus 1 at column col[i] when col[i] >= 0 — the gradient
// of the loss w.r.t. the logits, softmax - onehot, from exp_sum's output.
void normalize_minus_onehot(float* x, int64_t n, int64_t width, int64_t ld, const float* sum, const int64_t* col);

// Softmax's backward on one row of n probabilities p (attention.cpp): with `mult` (a dropout's
// keep multipliers, 0 or 1 / (1 - p)) the incoming gradient is first g_j * mult_j; then
// g_j = p_j (g_j - sum_k g_k p_k), in place.
void softmax_backward_row(const float* p, float* g, const float* mult, int64_t n);

}  // namespace dtk::layers::softmax_rows
