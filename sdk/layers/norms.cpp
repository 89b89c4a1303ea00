// norms.cpp — see norms.hpp.
#include <dtk/layers/norms.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include "cuda_kernels.hpp"
#include "dropout_rows.hpp"

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// RMSNorm through DTK's GPU kernels: one pass forward (r saved per row), one backward.
struct FusedRmsNorm : public torch::autograd::Function<FusedRmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    RECORD_FUNCTION("dtk::rms_norm", std::vector<c10::IValue>());
    auto [y, rstd] = gpu::rms_norm_forward(x, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::rms_norm_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    auto [dx, dweight] = gpu::rms_norm_backward(grad[0], saved[0], saved[1], saved[2]);
    return {dx, dweight, at::Tensor()};
  }
};

// The residual add and RMSNorm through DTK's kernels: outputs {sum, y}; the backward adds the
// sum's own gradient (the residual stream's) to the norm's and gives it to both inputs.
struct FusedAddRmsNorm : public torch::autograd::Function<FusedAddRmsNorm> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps) {
    RECORD_FUNCTION("dtk::add_rms_norm", std::vector<c10::IValue>());
    auto [sum, y, rstd] = gpu::add_rms_norm_forward(x, residual, weight, eps);
    ctx->save_for_backward({sum, weight, rstd});
    ctx->set_materialize_grads(false);  // an unused sum (a final norm's) has no gradient to read
    return {sum, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::add_rms_norm_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    if (!grad[1].defined()) return {grad[0], grad[0], at::Tensor(), at::Tensor()};  // only the sum was used
    auto [dx, dweight] = gpu::add_rms_norm_backward(grad[1], grad[0], saved[0], saved[1], saved[2]);
    return {dx, dx, dweight, at::Tensor()};
  }
};

// The residual add and LayerNorm through DTK's kernels, the same way; with the residual branch's
// bias (a row-parallel product's, left out of it) added to the branch in the same pass, and its
// gradient (the column sums of the branch's) made in the backward's; with the branch's dropout
// mask applied to the branch there too, forward and backward.
struct FusedAddLayerNorm : public torch::autograd::Function<FusedAddLayerNorm> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                               const c10::optional<at::Tensor>& residual_bias, const DropoutMask& residual_keep,
                               const at::Tensor& w, const at::Tensor& b, double eps) {
    RECORD_FUNCTION("dtk::add_layer_norm", std::vector<c10::IValue>());
    const at::Tensor c = residual_bias.has_value() ? *residual_bias : at::Tensor();
    auto [sum, y, mean, rstd] = gpu::add_layer_norm_forward(x, residual, c, residual_keep, w, b, eps);
    ctx->save_for_backward({sum, w, mean, rstd});
    ctx->saved_data["residual_bias"] = c.defined();
    save_mask(ctx, "residual_keep", residual_keep);
    ctx->set_materialize_grads(false);  // an unused sum (a final norm's) has no gradient to read
    return {sum, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::add_layer_norm_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const bool with_bias = ctx->saved_data["residual_bias"].toBool();
    const DropoutMask keep = saved_mask(ctx, "residual_keep");
    if (!grad[1].defined()) {  // only the sum was used
      const at::Tensor& g = grad[0];
      const at::Tensor dr = g.defined() && keep.defined() ? apply_dropout(g, keep) : g;
      const at::Tensor dc = with_bias && dr.defined() ? column_sums(dr).to(saved[1].scalar_type()) : at::Tensor();
      return {g, dr, dc, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const gpu::AddLayerNormGrads d =
        gpu::add_layer_norm_backward(grad[1], grad[0], saved[0], saved[1], saved[2], saved[3], keep, with_bias);
    return {d.dx, d.dresidual, d.dresidual_bias, at::Tensor(), d.dw, d.db, at::Tensor()};
  }

  // The sums over every row of g's last dimension, in fp32.
  static at::Tensor column_sums(const at::Tensor& g) {
    return at::sum(g.reshape({-1, g.size(-1)}), {0}, /*keepdim=*/false, at::kFloat);
  }
};

}  // namespace

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  // A GPU's kernel reads bf16/fp16 and computes in fp32 itself (as Megatron's fused LayerNorm):
  // fp32 copies of x, w and b and the cast back cost four passes per norm (issue 33's profile).
  // The CPU keeps the fp32 copies (its bf16 kernel differs across LibTorch versions).
  if (x.scalar_type() == at::kFloat || (!x.is_cpu() && w.scalar_type() == x.scalar_type()))
    return at::layer_norm(x, {x.size(-1)}, w, b, eps);
  return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, w.to(at::kFloat), b.to(at::kFloat), eps).to(x.scalar_type());
}

at::Tensor rms_norm_ops(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return (xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type()) * weight;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const FusedKernels& kernels) {
  if (kernels.rms_norm && gpu::rms_norm_applies(x, weight)) return FusedRmsNorm::apply(x, weight, eps);
  return rms_norm_ops(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> add_layer_norm_ops(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& w, const at::Tensor& b, double eps) {
  at::Tensor h = x + residual;
  at::Tensor y = layer_norm(h, w, b, eps);
  return {std::move(h), std::move(y)};
}

std::pair<at::Tensor, at::Tensor> add_rms_norm_ops(const at::Tensor& x, const at::Tensor& residual,
                                                   const at::Tensor& weight, double eps) {
  at::Tensor h = x + residual;
  at::Tensor y = rms_norm_ops(h, weight, eps);
  return {std::move(h), std::move(y)};
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                 const at::Tensor& b, double eps, const FusedKernels& kernels) {
  return add_bias_layer_norm(x, residual, at::Tensor(), w, b, eps, kernels);
}

std::pair<at::Tensor, at::Tensor> add_bias_layer_norm_ops(const at::Tensor& x, const at::Tensor& branch,
                                                          const at::Tensor& branch_bias, const at::Tensor& w,
                                                          const at::Tensor& b, double eps) {
  return add_layer_norm_ops(x, branch_bias.defined() ? branch + branch_bias : branch, w, b, eps);
}

std::pair<at::Tensor, at::Tensor> add_bias_dropout_layer_norm_ops(const at::Tensor& x, const at::Tensor& branch,
                                                                  const at::Tensor& branch_bias,
                                                                  const DropoutMask& branch_keep, const at::Tensor& w,
                                                                  const at::Tensor& b, double eps) {
  const at::Tensor biased = branch_bias.defined() ? branch + branch_bias : branch;
  return add_layer_norm_ops(x, branch_keep.defined() ? apply_dropout_ops(biased, branch_keep) : biased, w, b, eps);
}

std::pair<at::Tensor, at::Tensor> add_bias_layer_norm(const at::Tensor& x, const at::Tensor& branch,
                                                      const at::Tensor& branch_bias, const at::Tensor& w,
                                                      const at::Tensor& b, double eps, const FusedKernels& kernels) {
  return add_bias_dropout_layer_norm(x, branch, branch_bias, DropoutMask{}, w, b, eps, kernels);
}

std::pair<at::Tensor, at::Tensor> add_bias_dropout_layer_norm(const at::Tensor& x, const at::Tensor& branch,
                                                              const at::Tensor& branch_bias,
                                                              const DropoutMask& branch_keep, const at::Tensor& w,
                                                              const at::Tensor& b, double eps,
                                                              const FusedKernels& kernels) {
  // The bias and the dropout join the kernel together (bias_add: Megatron's bias-dropout fusion).
  // The kernel finds a row's mask bits from its first one: a strided mask's runs must hold whole
  // rows (a sequence shard's do).
  const bool kernel_takes_branch = (!branch_bias.defined() && !branch_keep.defined()) || kernels.bias_add;
  const bool mask_by_rows = !branch_keep.defined() || (x.dim() > 0 && branch_keep.run_numel % x.size(-1) == 0);
  if (kernels.add_norm && kernel_takes_branch && mask_by_rows &&
      gpu::add_layer_norm_applies(x, branch, branch_bias, w, b)) {
    const c10::optional<at::Tensor> c =
        branch_bias.defined() ? c10::optional<at::Tensor>(branch_bias) : c10::optional<at::Tensor>();
    const auto out = FusedAddLayerNorm::apply(x, branch, c, branch_keep, w, b, eps);
    return {out[0], out[1]};
  }
  // The bias added and the dropout applied on their own (dropout's kernel on a GPU), then the
  // add + norm (their kernel where it alone applies).
  if (branch_bias.defined() || branch_keep.defined()) {
    const at::Tensor biased = branch_bias.defined() ? branch + branch_bias : branch;
    return add_bias_dropout_layer_norm(x, apply_dropout(biased, branch_keep), at::Tensor(), DropoutMask{}, w, b, eps,
                                       kernels);
  }
  return add_layer_norm_ops(x, branch, w, b, eps);
}

bool layer_norm_takes_branch_bias(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                  const FusedKernels& kernels) {
  // A branch like x and a bias like w (a product's output and bias have the parameters' type).
  return kernels.add_norm && kernels.bias_add && gpu::add_layer_norm_applies(x, x, w, w, b);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps, const FusedKernels& kernels) {
  if (kernels.add_norm && gpu::add_rms_norm_applies(x, residual, weight)) {
    const auto out = FusedAddRmsNorm::apply(x, residual, weight, eps);
    return {out[0], out[1]};
  }
  // The plain add, then rms_norm (DTK's RMSNorm kernel where it alone applies, else the ops).
  at::Tensor h = x + residual;
  at::Tensor y = rms_norm(h, weight, eps, kernels);
  return {std::move(h), std::move(y)};
}

}  // namespace dtk::layers
