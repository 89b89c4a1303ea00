// dtk/cuda/rms_norm.hpp — RMSNorm forward and backward in one kernel each (src/rms_norm.cu), for
// dtk::layers::rms_norm (dtk/layers/norms.hpp) on a GPU. The arithmetic is Megatron's RMSNorm as
// LibTorch ops compute it (the reference, norms.cpp): the normalised row in fp32, rounded to the
// input's type, times the weight in that type:
//   r = 1 / sqrt(mean_j x_j^2 + eps),  y_j = T(T(x_j r) w_j)
// where the ops make an fp32 copy of x, five passes and as many temporaries forward, twice that
// backward. The add_ forms fuse the residual add before the norm (llama's `h = x + branch;
// rms_norm(h)`): h = T(x + residual) written and normalised in the same kernel; backward, the
// gradient of h (the residual stream's, dsum) added to the norm's: dx = T(dsum + T(the norm's dx)).
#pragma once

#include <cstdint>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// The largest hidden size the kernels take (the backward keeps a row's weight gradient in shared
// memory); larger rows take the reference ops.
constexpr int64_t kRmsNormMaxHidden = 8192;

// x, y: [rows, hidden] contiguous; weight: [hidden]; all of `type` (fp32, bf16 or fp16). rstd:
// fp32 [rows], r per row (saved for the backward).
void rms_norm_forward(const void* x, const void* weight, ElementType type, int64_t rows, int64_t hidden, double eps,
                      void* y, float* rstd, StreamHandle stream);

// fp32 workspace the backward needs: [rms_norm_backward_blocks(rows, hidden), hidden].
int64_t rms_norm_backward_blocks(int64_t rows, int64_t hidden);

// dy, x, dx: [rows, hidden] of `type`; weight [hidden] of `type`; rstd from the forward. Writes
// dx and dweight (fp32 [hidden], summed over the rows in a fixed order: deterministic), through
// `partial` (fp32 [rms_norm_backward_blocks(rows, hidden), hidden]).
void rms_norm_backward(const void* dy, const void* x, const void* weight, ElementType type, int64_t rows,
                       int64_t hidden, const float* rstd, void* dx, float* partial, float* dweight,
                       StreamHandle stream);

// The residual add and RMSNorm: x, residual, sum, y [rows, hidden] of `type`; writes
// sum = T(x + residual), y = RMSNorm(sum) and rstd.
void add_rms_norm_forward(const void* x, const void* residual, const void* weight, ElementType type, int64_t rows,
                          int64_t hidden, double eps, void* sum, void* y, float* rstd, StreamHandle stream);

// Its backward: `x` is the forward's sum, dsum the gradient of the sum (null: none); dx is the
// gradient of both x and residual. Workspace and dweight as rms_norm_backward's.
void add_rms_norm_backward(const void* dy, const void* dsum, const void* x, const void* weight, ElementType type,
                           int64_t rows, int64_t hidden, const float* rstd, void* dx, float* partial, float* dweight,
                           StreamHandle stream);

}  // namespace dtk::cuda
