// dtk/layers/norms.hpp — the normalisations of GPT (LayerNorm) and Llama (RMSNorm), for any model
// plugin. Megatron's arithmetic in fp32 whatever the parameters' type, the result in the input's
// type. On a GPU each is a fused kernel: LayerNorm is ATen's (it reads bf16/fp16 and computes in
// fp32 itself), RMSNorm DTK's own forward and backward kernels (dtk/cuda/rms_norm.hpp) where the
// build has CUDA; on the CPU, and wherever a kernel does not apply, LibTorch ops.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtk::layers {

// LayerNorm over the last dimension with weight w and bias b.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps);

// RMSNorm over the last dimension (Megatron's RMSNorm, torch.nn.RMSNorm):
//   y = T(T(x / sqrt(mean(x^2) + eps)) * weight), the normalisation in fp32, T = x's type.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The same as LibTorch ops on any device: the reference the GPU kernel is tested against.
at::Tensor rms_norm_ops(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace dtk::layers
