// dtk/cuda/bias_gelu.hpp — the bias add fused with the GELU after it (GPT's MLP: gelu(x W^T + b)
// with the product made without its bias), forward and backward in one kernel each
// (src/bias_gelu.cu), for dtk::layers::bias_gelu (dtk/layers/activations.hpp) on a GPU. The
// arithmetic is that of the LibTorch ops it replaces (an add in T, then ATen's GELU, which
// computes in fp32), T the input's type, h = T(x + b):
//   exact: y = T(h Phi(h)),  Phi(h) = (1 + erf(h / sqrt 2)) / 2,
//          dh = T(dy (Phi(h) + h exp(-h^2 / 2) / sqrt(2 pi)))
//   tanh:  t = tanh(sqrt(2 / pi) (h + 0.044715 h^3)),  y = T(h (1 + t) / 2),
//          dh = T(dy ((1 + t) / 2 + h (1 - t^2) sqrt(2 / pi) (1 + 3 0.044715 h^2) / 2))
// and the bias's gradient, the column sums of dh, in the backward's same pass (fp32, blocks'
// partial sums added in a fixed order: deterministic) instead of a reduction of its own.
#pragma once

#include <cstdint>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// x, y: [rows, cols] contiguous; bias: [cols]; all of `type` (fp32, bf16 or fp16). `tanh`: the
// tanh approximation (Megatron's --openai-gelu), else the exact erf form.
void bias_gelu_forward(const void* x, const void* bias, ElementType type, int64_t rows, int64_t cols, bool tanh,
                       void* y, StreamHandle stream);

// fp32 workspace the backward needs: [bias_gelu_backward_groups(rows), cols].
int64_t bias_gelu_backward_groups(int64_t rows);

// dy, x, dx: [rows, cols] of `type`; bias [cols]. Writes dx (the gradient of x, rounded to T) and
// dbias (fp32 [cols], the column sums of the rounded dx) through `partial`.
void bias_gelu_backward(const void* dy, const void* x, const void* bias, ElementType type, int64_t rows, int64_t cols,
                        bool tanh, void* dx, float* partial, float* dbias, StreamHandle stream);

}  // namespace dtk::cuda
