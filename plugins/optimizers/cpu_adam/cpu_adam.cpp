// cpu_adam — Adam/AdamW on the host with the SIMD kernel (AVX-512 / AVX2 / scalar, chosen at run
// time; dtk/kernels/cpu_adam.hpp). The same update as the `adamw` plugin and torch.optim.AdamW, bit for
// bit on this LibTorch, several times faster on large parameter counts (docs/benchmarks.md).
// DeepSpeed's DeepSpeedCPUAdam is the model: ZeRO-Offload runs this step on fp32 master weights
// in host memory. Its checkpoint state has the adamw plugin's names ("g0.<param>.exp_avg"), so a
// run can switch between the two.
#include <ATen/Parallel.h>
#include <dtk/optimizer.hpp>

#include <cmath>

#include <dtk/kernels/cpu_adam.hpp>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_float("beta1", "0.9", "Adam beta1 (Megatron's --adam_beta1)."),
    dtk::opt_float("beta2", "0.999", "Adam beta2 (Megatron's --adam_beta2)."),
    dtk::opt_float("eps", "1e-8", "Adam epsilon (Megatron's --adam_eps)."),
    dtk::opt_bool("adamw_mode", "true",
                  "Decoupled weight decay (AdamW); false folds weight decay into the gradient (Adam with L2), "
                  "as DeepSpeed's adamw_mode."),
    dtk::opt_bool("bias_correction", "true", "Adam's bias correction of both moments."),
    dtk::opt_int("threads", "0", "Threads of the update; 0 = LibTorch's intra-op threads (dtk --threads)."),
};

// The kernel indexes contiguous host arrays: a gradient is used as it is when it is fp32 or bf16
// and contiguous, else converted once.
at::Tensor kernel_grad(const at::Tensor& g) {
  const bool ready =
      g.device().is_cpu() && g.is_contiguous() && (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16);
  return ready ? g : g.to(at::kCPU, at::kFloat).contiguous();
}

class CpuAdam : public dtk::Optimizer {
 public:
  CpuAdam(const dtk::BuildContext& ctx, std::vector<dtk::ParamGroup> groups)
      : groups_(std::move(groups)),
        beta1_(ctx.options.get_float("beta1")),
        beta2_(ctx.options.get_float("beta2")),
        eps_(ctx.options.get_float("eps")),
        adamw_(ctx.options.get_bool("adamw_mode")),
        bias_correction_(ctx.options.get_bool("bias_correction")),
        threads_(static_cast<int>(ctx.options.get_int("threads"))) {
    if (beta1_ < 0 || beta1_ >= 1) throw dtk::Error("option 'beta1' must be in [0, 1)");
    if (beta2_ < 0 || beta2_ >= 1) throw dtk::Error("option 'beta2' must be in [0, 1)");
    if (eps_ <= 0) throw dtk::Error("option 'eps' must be > 0");
    if (threads_ < 0) throw dtk::Error("option 'threads' must be >= 0");
    for (const auto& g : groups_)
      for (size_t i = 0; i < g.params.size(); ++i)
        if (!g.params[i].device().is_cpu() || g.params[i].scalar_type() != at::kFloat)
          throw dtk::Error("parameter '" + g.names[i] + "' is " +
                           std::string(c10::toString(g.params[i].scalar_type())) + " on " + g.params[i].device().str() +
                           ": cpu_adam steps fp32 host tensors (use fp32 master weights, or the adamw plugin)");
    DTK_LOG(INFO) << "SIMD kernel: " << dtk::cpu_adam::isa_name(dtk::cpu_adam::active_isa());
  }

  void step(const dtk_optimizer_step_args& args) override {
    at::NoGradGuard no_grad;
    const int64_t step = moments_.begin_update(args);
    dtk::cpu_adam::RunOptions run = dtk::cpu_adam::default_run_options();
    run.threads = threads_ > 0 ? threads_ : at::get_num_threads();
    const dtk::Betas betas = dtk::step_betas(args, beta1_, beta2_);
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const auto& g = groups_[gi];
      dtk::cpu_adam::AdamParams k;
      k.lr = static_cast<float>(g.lr_at(args));
      k.beta1 = static_cast<float>(betas.beta1), k.beta2 = static_cast<float>(betas.beta2);
      k.eps = static_cast<float>(eps_);
      k.weight_decay = static_cast<float>(g.decay_at(args));
      k.adamw = adamw_, k.bias_correction = bias_correction_;
      k.step = step;
      k.grad_scale = static_cast<float>(args.grad_scale);
      for (size_t i = 0; i < g.params.size(); ++i) {
        const at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        const at::Tensor grad = kernel_grad(p.grad());
        // A strided parameter (a transposed view) is stepped in a contiguous copy and written back.
        at::Tensor work = p.is_contiguous() ? p : p.contiguous();
        at::Tensor& m = moments_.exp_avg[gi][i];
        at::Tensor& v = moments_.exp_avg_sq[gi][i];
        if (!m.defined()) m = at::zeros(p.sizes(), p.options()), v = at::zeros(p.sizes(), p.options());
        float* param = work.data_ptr<float>();
        if (grad.scalar_type() == at::kBFloat16)
          dtk::cpu_adam::adam_step_bf16_grad(param, reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()),
                                             m.data_ptr<float>(), v.data_ptr<float>(), p.numel(), k, nullptr, nullptr,
                                             run);
        else
          dtk::cpu_adam::adam_step(param, grad.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), p.numel(),
                                   k, nullptr, nullptr, run);
        if (!work.is_same(p)) p.copy_(work);
      }
    }
  }

  dtk::TensorList state_save() override { return moments_.save(groups_); }
  // fp32, contiguous, on the host: what the kernel indexes.
  void state_load(const dtk::TensorList& state) override { moments_.load(state, groups_, /*contiguous=*/true); }

 private:
  std::vector<dtk::ParamGroup> groups_;
  dtk::AdamMoments moments_{groups_};
  double beta1_, beta2_, eps_;
  bool adamw_, bias_correction_;
  int threads_;
};

}  // namespace

DTK_PLUGIN("cpu_adam", DTK_KIND_OPTIMIZER, "1.0.0",
           "Adam/AdamW with a SIMD host kernel (AVX-512/AVX2), DeepSpeed CPU-Adam style; ZeRO-Offload's step",
           DTK_TORCH_VERSION, dtk::optimizer_api<CpuAdam>(), kOptions)
