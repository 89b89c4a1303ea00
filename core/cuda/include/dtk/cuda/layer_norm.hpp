// dtk/cuda/layer_norm.hpp — the residual add fused with the LayerNorm that follows it (GPT's
// `h = x + branch; layer_norm(h, w, b)`), forward and backward in one kernel each
// (src/layer_norm.cu), for dtk::layers::add_layer_norm (dtk/layers/norms.hpp) on a GPU. The
// arithmetic is that of the LibTorch ops it replaces (an add in T, then ATen's LayerNorm kernel,
// which computes in fp32 itself), T the input's type:
//   h_j = T(x_j + r_j),  mean = sum_j h_j / n,  rstd = 1 / sqrt(sum_j (h_j - mean)^2 / n + eps),
//   y_j = T((h_j - mean) rstd w_j + b_j)
// backward, with g the incoming gradient of y and gh that of h (the residual stream's):
//   xhat_j = (h_j - mean) rstd,  dx_j = T(gh_j + T(rstd (g_j w_j - sum_k g_k w_k / n
//                                                          - xhat_j sum_k g_k w_k xhat_k / n)))
//   dw_j = sum_rows g_j xhat_j,  db_j = sum_rows g_j   (fp32, summed in a fixed order)
// where the ops read and write the row five times forward (the add's three, the norm's two) and
// the backward adds the residual's gradient in a pass of its own.
// With the residual branch's bias c (a row-parallel product made without it: Megatron's
// skip_bias_add), r_j above is T(r_j + c_j), and the backward also writes dc_j = sum_rows dr_j
// (fp32, fixed order, dr the branch's gradient): the bias's add and its gradient's column sums
// cost no pass of their own. With the branch's dropout (Megatron's bias-dropout-add; DTK's
// counter-based mask, dtk/cuda/dropout.hpp, hashed per element here), r_j is then
// D(r_j) = kept ? T(r_j scale) : 0, and the backward writes the branch's own gradient
// dr_j = kept ? T(dx_j scale) : 0 next to dx: dropout's two passes each way become none.
#pragma once

#include <cstdint>

#include "dtk/cuda/dropout.hpp"
#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// The largest hidden size the kernels take (the backward keeps a block's weight and bias
// gradients in shared memory); larger rows take the reference ops.
constexpr int64_t kLayerNormMaxHidden = 8192;

// x, residual, sum, y: [rows, hidden] contiguous; residual_bias (or null: none), weight, bias:
// [hidden]; all of `type` (fp32, bf16 or fp16). Writes sum = T(x + residual) (with a residual_bias
// c: T(x + T(residual + c)); with residual_dropout (or null: none) the branch through its mask
// first, element row * hidden + j of the residual being element row * hidden + j of the mask's
// tensor, whose runs (run_numel, when strided) must hold whole rows), y = LayerNorm(sum), and
// mean and rstd (fp32 [rows], saved for the backward).
void add_layer_norm_forward(const void* x, const void* residual, const void* residual_bias,
                            const DropoutBits* residual_dropout, const void* weight, const void* bias, ElementType type,
                            int64_t rows, int64_t hidden, double eps, void* sum, void* y, float* mean, float* rstd,
                            StreamHandle stream);

// fp32 workspace the backward needs: [2, layer_norm_backward_blocks(rows, hidden), hidden], or
// [3, ...] with the residual's bias gradient.
int64_t layer_norm_backward_blocks(int64_t rows, int64_t hidden);

// dy (the gradient of y), dsum (that of the sum, or null: none), sum, dx: [rows, hidden] of
// `type`; weight [hidden] of `type`; mean, rstd from the forward. Writes dx (the gradient of x,
// and of residual when there is no residual_dropout), dweight and dbias (fp32 [hidden], summed
// over the rows in a fixed order: deterministic), through `partial` (fp32 [2,
// layer_norm_backward_blocks(rows, hidden), hidden]). With residual_dropout (the forward's mask;
// null: none), dresidual ([rows, hidden] of `type`) gets the residual's own gradient, dx through
// the mask. dresidual_bias (fp32 [hidden], or null: none) gets the column sums of the residual's
// gradient, the residual bias's gradient; `partial` is then [3, layer_norm_backward_blocks(rows,
// hidden), hidden].
void add_layer_norm_backward(const void* dy, const void* dsum, const void* sum, const void* weight, ElementType type,
                             int64_t rows, int64_t hidden, const float* mean, const float* rstd,
                             const DropoutBits* residual_dropout, void* dx, void* dresidual, float* partial,
                             float* dweight, float* dbias, float* dresidual_bias, StreamHandle stream);

}  // namespace dtk::cuda
