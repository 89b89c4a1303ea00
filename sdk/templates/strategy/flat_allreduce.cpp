// template_flat_allreduce — an example parallel-strategy plugin built out of tree against the
// installed DTK SDK.
//
// Data parallelism with ONE collective per step: after the last micro-batch's backward every
// gradient is copied into one flat fp32 buffer, the buffer is all-reduced (averaged) over the
// data-parallel group, and the averages are copied back. Per-parameter all-reduces pay the
// collective's latency once per tensor; the flat buffer pays it once (Megatron's and DeepSpeed's
// gradient buckets are the same idea, overlapped with backward).
//
// The strategy contract (docs/plugin-guide.md, "Contracts"), in the order the host calls it:
//   setup(model)          once, before the optimizer exists: read model.parameters()
//   optimizer_params()    the tensors the optimizer updates (here: the parameters themselves)
//   per iteration:        before_backward(micro-batch i) ... reduce_gradients() ->
//                         clip_and_norm(max_norm) -> optimizer_step() unless the norm is not
//                         finite (the host skips the update) -> zero_grad()
//   clip_and_norm         returns the global gradient norm over data AND tensor-parallel ranks
//                         (every rank must return the same value) and clips to max_norm (> 0)
//   state_save/load       what a resumed run needs besides the model and optimizer
#include <dtk/strategy.hpp>

#include <ATen/ATen.h>

#include <cmath>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_bool("average", "true", "Average (not sum) gradients over data-parallel ranks."),
};

class FlatAllReduce : public dtk::Strategy {
 public:
  explicit FlatAllReduce(const dtk::BuildContext& ctx)
      : average_(ctx.options.get_bool("average")), tp_rank_(ctx.tp_rank) {}

  void setup(const dtk::ModelHandle& model) override {
    params_ = model.parameters();
    for (const auto& p : params_)
      if (p.tensor.scalar_type() != at::kFloat)
        throw dtk::Error("parameter '" + p.name + "' is " + std::string(at::toString(p.tensor.scalar_type())) +
                         ": this template keeps no fp32 master weights (see plugins/strategies/ddp); train in fp32",
                         DTK_ERR_UNSUPPORTED);
  }

  std::vector<dtk::Param> optimizer_params() override { return params_; }

  void reduce_gradients() override {
    if (dtk::Comm::size(DTK_GROUP_DATA_PARALLEL) <= 1) return;
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (auto& p : params_) {
      // A parameter the loss did not reach this step still takes part (as zeros), so every rank
      // sends a buffer of the same layout.
      if (!p.tensor.grad().defined()) p.tensor.mutable_grad() = at::zeros_like(p.tensor);
      grads.push_back(p.tensor.grad().reshape({-1}));
    }
    at::Tensor flat = at::cat(grads);
    dtk::Comm::all_reduce(flat, DTK_GROUP_DATA_PARALLEL, average_ ? DTK_REDUCE_AVG : DTK_REDUCE_SUM);
    int64_t offset = 0;
    for (auto& p : params_) {
      const int64_t n = p.tensor.numel();
      p.tensor.grad().copy_(flat.narrow(0, offset, n).view_as(p.tensor));
      offset += n;
    }
  }

  // Megatron's clip_grad_norm_fp32: a parameter split over TP ranks counts on every TP rank, a
  // replicated one on TP rank 0 only; the squares are summed over the model-parallel group.
  double clip_and_norm(double max_norm) override {
    at::NoGradGuard no_grad;
    // Summed on the gradients' device (one host sync, at .item()), in fp64.
    at::Tensor total;
    for (const auto& p : params_) {
      if (!p.tensor.grad().defined() || (!p.info.tensor_parallel && tp_rank_ != 0)) continue;
      at::Tensor sq = dtk::sum_of_squares(p.tensor.grad());
      total = total.defined() ? total + sq : sq;
    }
    if (!total.defined()) total = at::zeros({}, params_.front().tensor.options().dtype(at::kDouble));
    dtk::Comm::all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM);
    const double norm = std::sqrt(total.item<double>());
    if (max_norm > 0 && std::isfinite(norm) && norm > max_norm)
      for (auto& p : params_)
        if (p.tensor.grad().defined()) p.tensor.grad().mul_(max_norm / (norm + 1e-6));
    return norm;
  }

  void zero_grad() override {
    for (auto& p : params_) p.tensor.mutable_grad() = at::Tensor();
  }

 private:
  bool average_;
  int32_t tp_rank_;
  std::vector<dtk::Param> params_;
};

}  // namespace

DTK_PLUGIN("template_flat_allreduce", DTK_KIND_STRATEGY, "0.1.0",
           "Out-of-tree example: data parallel with one flat all-reduce per step", DTK_TORCH_VERSION,
           dtk::strategy_api<FlatAllReduce>(), kOptions)
