// activations.cpp — see activations.hpp.
#include <dtk/layers/activations.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <dtk/module_hooks.hpp>

#include "cuda_kernels.hpp"

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Bias + GELU through DTK's GPU kernels: x (the product without its bias) saved, not x + b.
struct FusedBiasGelu : public torch::autograd::Function<FusedBiasGelu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias, bool tanh) {
    RECORD_FUNCTION("dtk::bias_gelu", std::vector<c10::IValue>());
    ctx->save_for_backward({x, bias});
    ctx->saved_data["tanh"] = tanh;
    return gpu::bias_gelu_forward(x, bias, tanh);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::bias_gelu_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    auto [dx, dbias] = gpu::bias_gelu_backward(grad[0], saved[0], saved[1], ctx->saved_data["tanh"].toBool());
    return {dx, dbias, at::Tensor()};
  }
};

// SwiGLU through DTK's GPU kernels: gate and up saved (the ops keep silu(gate) too).
struct FusedSwiglu : public torch::autograd::Function<FusedSwiglu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    RECORD_FUNCTION("dtk::swiglu", std::vector<c10::IValue>());
    ctx->save_for_backward({gate, up});
    return gpu::swiglu_forward(gate, up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::swiglu_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    auto [dgate, dup] = gpu::swiglu_backward(grad[0], saved[0], saved[1]);
    return {dgate, dup};
  }
};

at::Tensor gelu(const at::Tensor& x, bool tanh) { return tanh ? at::gelu(x, "tanh") : at::gelu(x); }

}  // namespace

at::Tensor bias_gelu_ops(const at::Tensor& x, const at::Tensor& bias, bool tanh) { return gelu(x + bias, tanh); }

at::Tensor bias_gelu(const at::Tensor& x, const at::Tensor& bias, bool tanh, const FusedKernels& kernels) {
  if (kernels.bias_gelu && x.dim() > 0 && bias.dim() == 1 && x.size(-1) == bias.size(0) &&
      gpu::bias_gelu_applies(x.device(), x.scalar_type(), bias))
    return FusedBiasGelu::apply(x, bias, tanh);
  return bias_gelu_ops(x, bias, tanh);
}

at::Tensor swiglu_ops(const at::Tensor& gate, const at::Tensor& up) { return at::silu(gate) * up; }

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, const FusedKernels& kernels) {
  if (kernels.swiglu && gpu::swiglu_applies(gate, up)) return FusedSwiglu::apply(gate, up);
  return swiglu_ops(gate, up);
}

at::Tensor column_linear_gelu(const ColumnParallelLinear& fc, const at::Tensor& x, bool tanh,
                              const FusedKernels& kernels) {
  // The kernel's conditions, known before the product: x W^T has x's type and device and the
  // bias's size. Sequence parallelism gathers the input inside fc.forward: the plain path.
  if (kernels.bias_gelu && fc.bias.defined() && !fc.tp.splits_sequence() &&
      x.scalar_type() == fc.weight.scalar_type() && x.device() == fc.weight.device() &&
      gpu::bias_gelu_applies(x.device(), x.scalar_type(), fc.bias))
    return FusedBiasGelu::apply(dtk::linear(copy_to_tp_region(x, fc.tp), fc.weight), fc.bias, tanh);
  return gelu(fc.forward(x), tanh);
}

}  // namespace dtk::layers
