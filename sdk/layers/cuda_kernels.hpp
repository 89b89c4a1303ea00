// cuda_kernels.hpp (private to dtk::layers) — the LibTorch side of DTK's own GPU kernels
// (core/cuda: dtk/cuda/cross_entropy.hpp, rms_norm.hpp, rotary.hpp) for the layers. Each kernel has a
// LibTorch-op reference in the layer that calls it; a call here returns false (or `applies` is
// false) where the kernel does not apply: a CPU tensor, a build without CUDA (DTK_HAVE_CUDA) or
// without a CUDA LibTorch (DTK_TORCH_CUDA), a dtype or shape the kernel does not take. The
// caller then runs the reference.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace dtk::layers::gpu {

// The cross entropy of a chunk of logit rows [n, V] (fp32/bf16/fp16, unit stride in V) against
// `col` (int64 [n], -1 where the target is not in these columns), fp32 [n] max/sum/loss written;
// with `grads` the logits become softmax - onehot in place. False where it does not apply.
bool cross_entropy_rows(const at::Tensor& logits, const at::Tensor& col, const at::Tensor& max, const at::Tensor& sum,
                        const at::Tensor& loss, bool grads);
// Whether cross_entropy_rows runs on logits of `type` on `device`.
bool cross_entropy_applies(const at::Device& device, at::ScalarType type);

// RMSNorm (y = T(T(x r) w), r = rsqrt(mean x^2 + eps)) over the last dimension.
bool rms_norm_applies(const at::Tensor& x, const at::Tensor& weight);
// y (x's shape and type) and r (fp32, one per row).
std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);
// dx (x's shape and type) and dweight (weight's type).
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                    const at::Tensor& weight, const at::Tensor& rstd);

// Rotary embeddings (dtk/layers/rotary.hpp): x [b, s, heads, hd] (unit stride in hd), cos/sin
// fp32 [b, s, 1, dim] contiguous on x's device.
bool rotary_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// dx from dy (x's shape and type).
at::Tensor rotary_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace dtk::layers::gpu
