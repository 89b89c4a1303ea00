// ddp — plain data parallelism, Megatron's DistributedDataParallel without buckets:
// gradients are averaged over the data-parallel group after the last micro-batch's backward;
// the global gradient norm follows Megatron's clip_grad_norm_fp32 (TP-sharded parameters on
// every TP rank, replicated ones once, summed over the model-parallel group).
// With one process every collective is the identity, so this is also the single-device path.
#include <dtk/tensor.hpp>

#include <cmath>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_bool("average_gradients", "true", "Average (not sum) gradients over data-parallel ranks."),
};

class Ddp : public dtk::Strategy {
 public:
  explicit Ddp(const dtk::BuildContext& ctx)
      : average_(ctx.options.get_bool("average_gradients")), tp_rank_(ctx.tp_rank) {}

  void setup(const dtk::ModelHandle& model) override { params_ = model.parameters(); }

  std::vector<dtk::Param> optimizer_params() override { return params_; }

  void reduce_gradients() override {
    if (dtk::Comm::size(DTK_GROUP_DATA_PARALLEL) == 1) return;
    for (auto& p : params_) {
      if (!p.tensor.grad().defined()) continue;
      dtk::Comm::all_reduce(p.tensor.grad(), DTK_GROUP_DATA_PARALLEL, average_ ? DTK_REDUCE_AVG : DTK_REDUCE_SUM);
    }
  }

  double clip_and_norm(double max_norm) override {
    at::NoGradGuard no_grad;
    // Accumulate on the gradients' device (one host sync at the end, not one per parameter).
    at::Tensor total;
    for (auto& p : params_) {
      const at::Tensor& g = p.tensor.grad();
      if (!g.defined()) continue;
      // Replicated parameters are counted on TP rank 0 only, so the sum is not duplicated.
      if (!p.info.tensor_parallel && tp_rank_ != 0) continue;
      at::Tensor sq = g.to(at::kDouble).pow(2).sum();
      total = total.defined() ? total + sq : sq;
    }
    if (!total.defined()) total = at::zeros({}, at::kDouble);
    dtk::Comm::all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM);
    const double norm = std::sqrt(total.item<double>());
    if (max_norm > 0 && std::isfinite(norm)) {
      const double coeff = max_norm / (norm + 1e-6);
      if (coeff < 1.0)
        for (auto& p : params_)
          if (p.tensor.grad().defined()) p.tensor.grad().mul_(coeff);
    }
    return norm;
  }

  void zero_grad() override {
    for (auto& p : params_)
      if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
  }

 private:
  bool average_;
  int32_t tp_rank_;
  std::vector<dtk::Param> params_;
};

}  // namespace

DTK_PLUGIN("ddp", DTK_KIND_STRATEGY, "1.0.0", "Data parallel gradient averaging with Megatron's global-norm clipping",
           DTK_TORCH_VERSION, dtk::strategy_api<Ddp>(), kOptions)
