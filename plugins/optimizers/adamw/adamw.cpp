// adamw — Adam with decoupled weight decay (Loshchilov & Hutter), the update Megatron-LM and
// DeepSpeed use for GPT pretraining (torch.optim.AdamW / apex FusedAdam with adam_w_mode):
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   p -= lr * wd * p;  p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
#include <ATen/Parallel.h>
#include <dtk/optimizer.hpp>

#include <cmath>
#include <vector>

#if DTK_HAVE_CUDA
#include "dtk/cuda/adamw.hpp"
#endif
#if DTK_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

// The fused fp32 CPU update: one pass that reads p, g, m, v once and writes p, m, v once
// (28 bytes per parameter), where the tensor-op formulation makes about a dozen passes. The loop
// body has no branches, so the compiler vectorises it (this file is built with -O3
// -fno-math-errno so that sqrt vectorises too); at::parallel_for splits it over the intra-op
// threads. The arithmetic is torch.optim.AdamW's, in the same order.
struct AdamWScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, decay, step_size, inv_sqrt_bc2, eps, inv_grad_scale;
};

void fused_adamw(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n,
                 const AdamWScalars& k) {
  at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float grad = g[i] * k.inv_grad_scale;
      const float mi = k.beta1 * m[i] + k.one_minus_beta1 * grad;
      const float vi = k.beta2 * v[i] + k.one_minus_beta2 * grad * grad;
      m[i] = mi;
      v[i] = vi;
      const float denom = std::sqrt(vi) * k.inv_sqrt_bc2 + k.eps;
      p[i] = p[i] * k.decay - k.step_size * mi / denom;
    }
  });
}

#if DTK_HAVE_CUDA
// On a GPU: fp32 p, m, v and an fp32 or bf16 gradient, contiguous, go to the fused multi-tensor
// kernel (core/cuda/src/adamw.cu): one launch per 32 tensors instead of a dozen per tensor.
bool cuda_fusable(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &m, &v})
    if (!t->is_cuda() || t->scalar_type() != at::kFloat || !t->is_contiguous()) return false;
  return g.is_cuda() && g.device() == p.device() && g.is_contiguous() &&
         (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16);
}

dtk::cuda::StreamHandle torch_stream(const at::Tensor& t) {
#if DTK_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  (void)t;
  return dtk::cuda::default_stream();  // where LibTorch launches unless told otherwise
#endif
}
#endif

bool fusable(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &g, &m, &v})
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous()) return false;
  return true;
}

const dtk_option_spec kOptions[] = {
    dtk::opt_float("beta1", "0.9", "Adam beta1 (Megatron's --adam_beta1)."),
    dtk::opt_float("beta2", "0.999", "Adam beta2 (Megatron's --adam_beta2)."),
    dtk::opt_float("eps", "1e-8", "Adam epsilon (Megatron's --adam_eps)."),
};

class AdamW : public dtk::Optimizer {
 public:
  AdamW(const dtk::BuildContext& ctx, std::vector<dtk::ParamGroup> groups)
      : groups_(std::move(groups)),
        beta1_(ctx.options.get_float("beta1")),
        beta2_(ctx.options.get_float("beta2")),
        eps_(ctx.options.get_float("eps")) {
    if (beta1_ < 0 || beta1_ >= 1) throw dtk::Error("option 'beta1' must be in [0, 1)");
    if (beta2_ < 0 || beta2_ >= 1) throw dtk::Error("option 'beta2' must be in [0, 1)");
    if (eps_ <= 0) throw dtk::Error("option 'eps' must be > 0");
  }

  void step(const dtk_optimizer_step_args& args) override {
    at::NoGradGuard no_grad;
    const int64_t step = moments_.begin_update(args);
    const auto [beta1, beta2] = dtk::step_betas(args, beta1_, beta2_);
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      auto& g = groups_[gi];
      const double lr = g.lr_at(args);
      const double weight_decay = g.decay_at(args);
      const AdamWScalars k{static_cast<float>(beta1),
                           static_cast<float>(beta2),
                           static_cast<float>(1.0 - beta1),
                           static_cast<float>(1.0 - beta2),
                           static_cast<float>(1.0 - lr * weight_decay),
                           static_cast<float>(lr / bc1),
                           static_cast<float>(1.0 / std::sqrt(bc2)),
                           static_cast<float>(eps_),
                           static_cast<float>(1.0 / args.grad_scale)};
#if DTK_HAVE_CUDA
      // Per gradient dtype and device: the tensors of one fused launch.
      std::vector<std::vector<dtk::cuda::AdamWTensor>> cuda_batches;
      std::vector<std::pair<bool, at::Tensor>> cuda_batch_of;  // (bf16 grads, a tensor on that device)
#endif
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        at::Tensor grad = p.grad();
        at::Tensor& m = moments_.exp_avg[gi][i];
        at::Tensor& v = moments_.exp_avg_sq[gi][i];
        if (!m.defined()) {
          m = at::zeros_like(p, at::MemoryFormat::Preserve);
          v = at::zeros_like(p, at::MemoryFormat::Preserve);
        }
#if DTK_HAVE_CUDA
        if (cuda_fusable(p, grad, m, v)) {
          const bool bf16 = grad.scalar_type() == at::kBFloat16;
          size_t b = 0;
          while (b < cuda_batch_of.size() &&
                 (cuda_batch_of[b].first != bf16 || cuda_batch_of[b].second.device() != p.device()))
            ++b;
          if (b == cuda_batch_of.size()) {
            cuda_batch_of.emplace_back(bf16, p);
            cuda_batches.emplace_back();
          }
          cuda_batches[b].push_back(
              {p.data_ptr<float>(), grad.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(), p.numel()});
          continue;
        }
#endif
        if (fusable(p, grad, m, v)) {
          fused_adamw(p.data_ptr<float>(), grad.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), p.numel(),
                      k);
          continue;
        }
        // Any other dtype/device/layout: the same update with tensor ops.
        if (args.grad_scale != 1.0) grad = grad / args.grad_scale;
        m.mul_(beta1).add_(grad, 1.0 - beta1);
        v.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        if (weight_decay != 0) p.mul_(1.0 - lr * weight_decay);
        at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(eps_);
        p.addcdiv_(m, denom, -lr / bc1);
      }
#if DTK_HAVE_CUDA
      for (size_t b = 0; b < cuda_batches.size(); ++b) {
        const dtk::cuda::AdamWScalars ck{k.beta1, k.beta2, k.one_minus_beta1, k.one_minus_beta2, k.decay,
                                         k.step_size, k.inv_sqrt_bc2, k.eps, k.inv_grad_scale};
        const at::Tensor& any = cuda_batch_of[b].second;
        const dtk::cuda::DeviceGuard on(any.device().index());
        dtk::cuda::fused_adamw(cuda_batches[b], cuda_batch_of[b].first, ck, torch_stream(any));
      }
#endif
    }
  }

  dtk::TensorList state_save() override { return moments_.save(groups_); }
  // Same dtype, device and (dense) layout as the parameter, so the fused path stays in bounds.
  void state_load(const dtk::TensorList& state) override { moments_.load(state, groups_, /*contiguous=*/false); }

 private:
  std::vector<dtk::ParamGroup> groups_;
  dtk::AdamMoments moments_{groups_};
  double beta1_, beta2_, eps_;
};

}  // namespace

DTK_PLUGIN("adamw", DTK_KIND_OPTIMIZER, "1.0.0", "Adam with decoupled weight decay (Megatron/DeepSpeed default)",
           DTK_TORCH_VERSION, dtk::optimizer_api<AdamW>(), kOptions)
