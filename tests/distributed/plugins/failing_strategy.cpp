// failing_ddp — test-only strategy: data-parallel gradient averaging (like ddp, no clipping)
// that throws on one chosen rank at a chosen iteration, so the launcher's failure path can be
// exercised with a real training run.
#include <dtk/strategy.hpp>

#include <cmath>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_int("fail_rank", "-1", "Data-parallel rank that fails (-1: none)."),
    dtk::opt_int("fail_iteration", "2", "Iteration (1-based) whose gradient reduction fails."),
};

class FailingDdp : public dtk::Strategy {
 public:
  explicit FailingDdp(const dtk::BuildContext& ctx)
      : fail_rank_(ctx.options.get_int("fail_rank")),
        fail_iteration_(ctx.options.get_int("fail_iteration")),
        dp_rank_(ctx.dp_rank) {}
  void setup(const dtk::ModelHandle& model) override { params_ = model.parameters(); }
  std::vector<dtk::Param> optimizer_params() override { return params_; }
  void reduce_gradients() override {
    if (++iteration_ == fail_iteration_ && dp_rank_ == fail_rank_)
      throw dtk::Error("injected failure at iteration " + std::to_string(iteration_));
    for (auto& p : params_)
      if (p.tensor.grad().defined()) dtk::Comm::all_reduce(p.tensor.grad(), DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_AVG);
  }
  double clip_and_norm(double) override { return 1.0; }
  void zero_grad() override {
    for (auto& p : params_)
      if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
  }

 private:
  int64_t fail_rank_, fail_iteration_, iteration_ = 0;
  int32_t dp_rank_;
  std::vector<dtk::Param> params_;
};

}  // namespace

DTK_PLUGIN("failing_ddp", DTK_KIND_STRATEGY, "1.0.0", "Test: ddp that fails on one rank", DTK_TORCH_VERSION,
           dtk::strategy_api<FailingDdp>(), kOptions)
