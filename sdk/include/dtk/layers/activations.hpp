// dtk/layers/activations.hpp — the MLPs' activations: GPT's with the bias of the product before
// it, gelu(x + b), exact or the tanh approximation (Megatron's --openai-gelu), and Llama's SwiGLU,
// silu(gate) * up. On a GPU one DTK kernel each way: bias + GELU (dtk/cuda/bias_gelu.hpp) the add
// and the GELU in one pass forward, the GELU's gradient and the bias's (its column sums) in one
// pass backward; SwiGLU (dtk/cuda/swiglu.hpp) one pass each way, keeping only its inputs for the
// backward. On the CPU, and wherever a kernel does not apply, LibTorch ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <dtk/layers/fused_kernels.hpp>
#include <dtk/layers/tensor_parallel.hpp>

namespace dtk::layers {

// gelu(x + bias) over x [..., n], bias [n]; `tanh`: the tanh approximation, else the exact erf.
at::Tensor bias_gelu(const at::Tensor& x, const at::Tensor& bias, bool tanh, const FusedKernels& kernels = {});

// The same as LibTorch ops on any device: the reference the GPU kernel is tested against.
at::Tensor bias_gelu_ops(const at::Tensor& x, const at::Tensor& bias, bool tanh);

// gelu(fc.forward(x)): a column-parallel product and the GELU after it (GPT's dense_h_to_4h). On
// the CPU, with sequence parallelism, without a bias, or wherever the kernel does not apply, exactly
// that (the bias added inside the product); on a GPU the product without its bias, then
// bias_gelu's kernel.
at::Tensor column_linear_gelu(const ColumnParallelLinear& fc, const at::Tensor& x, bool tanh,
                              const FusedKernels& kernels = {});

// silu(gate) * up (SwiGLU's elementwise half), gate and up of one shape and type.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, const FusedKernels& kernels = {});

// The same as LibTorch ops on any device: the reference the GPU kernel is tested against.
at::Tensor swiglu_ops(const at::Tensor& gate, const at::Tensor& up);

}  // namespace dtk::layers
