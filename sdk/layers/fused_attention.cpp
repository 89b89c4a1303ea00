// fused_attention.cpp — attention_ops, fused_attention (dtk/layers/attention.hpp): Megatron's
// CoreAttention as tensor ops, and DTK's GPU kernel for it (cuda_kernels.hpp) as an autograd
// function.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <dtk/gemm.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/plugin.hpp>

#include <string>

#include "cuda_kernels.hpp"
#include "dropout_rows.hpp"

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FusedAttention : public torch::autograd::Function<FusedAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, const DropoutMask& keep, int64_t window) {
    RECORD_FUNCTION("dtk::attention", std::vector<c10::IValue>());
    auto [out, lse] = gpu::attention_forward(q, k, v, scale, keep, window);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    save_mask(ctx, "keep", keep);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::attention_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    auto [dq, dk, dv] = gpu::attention_backward(grad[0], saved[3], saved[4], saved[0], saved[1], saved[2],
                                                ctx->saved_data["scale"].toDouble(), saved_mask(ctx, "keep"),
                                                ctx->saved_data["window"].toInt());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// a [..., m, k] b [..., k, n] of one narrow type on the CPU, both ways widened to fp32 and rounded
// once (dtk/gemm.hpp's rule, where LibTorch's bf16 bmm accumulates in bf16). The narrow operands
// are saved, not widened copies, and contiguous, as at::matmul saves the copies its reshape
// makes of strided views (k and v are views into the fused QKV projection, which may then be
// freed): the activations' memory is at::matmul's. The fp32 copies and result are transient.
struct WidenedMatmul : public torch::autograd::Function<WidenedMatmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    ctx->save_for_backward({a.contiguous(), b.contiguous()});
    return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor g = grad[0].to(at::kFloat);
    at::Tensor ga, gb;
    if (ctx->needs_input_grad(0)) ga = at::matmul(g, b.to(at::kFloat).transpose(-1, -2)).to(a.scalar_type());
    if (ctx->needs_input_grad(1)) gb = at::matmul(a.to(at::kFloat).transpose(-1, -2), g).to(b.scalar_type());
    return {ga, gb};
  }
};

// The attention's batched products: widened where dtk/gemm.hpp widens the type (same batch sizes).
at::Tensor batched_product(const at::Tensor& a, const at::Tensor& b) {
  if (a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == b.scalar_type() &&
      dtk::cpu_widens(a.scalar_type()) && a.dim() >= 3 && a.dim() == b.dim() &&
      a.sizes().slice(0, a.dim() - 2) == b.sizes().slice(0, b.dim() - 2))
    return WidenedMatmul::apply(a, b);
  return at::matmul(a, b);
}

}  // namespace

at::Tensor attention_ops(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                         const at::Tensor& mask, const DropoutMask& keep) {
  const int64_t b = q.size(0), s = q.size(1), heads = q.size(2), hd = q.size(3);
  const int64_t t = k.size(1), groups = k.size(2), per_group = heads / groups;
  const at::Tensor qh = q.transpose(1, 2);                    // [b, heads, s, hd]
  at::Tensor kh = k.transpose(1, 2), vh = v.transpose(1, 2);  // [b, groups, t, hd]
  if (per_group > 1) {
    // expand + reshape, not repeat_interleave: ATen's computes its output size on the host (a
    // synchronisation per call on a GPU).
    const auto repeat = [&](const at::Tensor& x) {
      return x.unsqueeze(2).expand({b, groups, per_group, t, hd}).reshape({b, heads, t, hd});
    };
    kh = repeat(kh);
    vh = repeat(vh);
  }
  // q is scaled before the product (Megatron folds the scale into baddbmm's alpha): the unscaled
  // q k^T can overflow fp16. exp(-10000 - max) is exactly 0 in fp32.
  const at::Tensor scores = batched_product(qh * scale, kh.transpose(-1, -2));
  const at::Tensor probs = at::softmax(scores.to(at::kFloat).masked_fill(mask, -10000.0), -1).to(q.scalar_type());
  // [b, heads, s, hd] -> [b, s, heads * hd]
  return batched_product(apply_dropout(probs, keep), vh).transpose(1, 2).reshape({b, s, heads * hd});
}

bool fused_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DropoutMask& keep,
                             const FusedKernels& kernels) {
  return kernels.attention && q.dim() == 4 && k.dim() == 4 && q.size(1) <= k.size(1) &&
         gpu::attention_applies(q, k, v, keep);
}

at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           const DropoutMask& keep, int64_t window) {
  const int64_t b = q.size(0), s = q.size(1), heads = q.size(2), hd = q.size(3);
  if (window < -1) throw Error("fused_attention: window " + std::to_string(window) + " (-1 for none, else 0 or more)");
  return FusedAttention::apply(q, k, v, scale, keep, window).view({b, s, heads * hd});
}

}  // namespace dtk::layers
