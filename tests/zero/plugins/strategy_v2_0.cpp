// A strategy whose function table has ABI 2.0's size (what a plugin built for 2.0 ships): the
// 2.1 entries get_info, gather_parameters and memory_usage lie beyond its struct_size, and a host
// that called them would abort here. Plain data parallelism (fp32): gradients averaged over the
// data-parallel group, Megatron's global norm; it must train exactly like the ddp plugin.
#include <dtk/strategy.hpp>

#include <cmath>
#include <cstdlib>

namespace {

class V20 : public dtk::Strategy {
 public:
  explicit V20(const dtk::BuildContext& ctx) : tp_rank_(ctx.tp_rank) {}
  void setup(const dtk::ModelHandle& model) override { params_ = model.parameters(); }
  std::vector<dtk::Param> optimizer_params() override { return params_; }
  void reduce_gradients() override {
    for (auto& p : params_)
      if (p.tensor.grad().defined()) dtk::Comm::all_reduce(p.tensor.grad(), DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_AVG);
  }
  double clip_and_norm(double max_norm) override {
    at::NoGradGuard no_grad;
    at::Tensor total = at::zeros({}, at::kDouble);
    for (auto& p : params_)
      if (p.tensor.grad().defined() && (p.info.tensor_parallel || tp_rank_ == 0))
        total += dtk::sum_of_squares(p.tensor.grad());
    dtk::Comm::all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM);
    const double norm = std::sqrt(total.item<double>());
    const double coeff = max_norm / (norm + 1e-6);
    if (max_norm > 0 && std::isfinite(norm) && coeff < 1.0)
      for (auto& p : params_)
        if (p.tensor.grad().defined()) p.tensor.grad().mul_(coeff);
    return norm;
  }
  void zero_grad() override {
    for (auto& p : params_) p.tensor.mutable_grad() = at::Tensor();
  }

 private:
  int tp_rank_;
  std::vector<dtk::Param> params_;
};

[[noreturn]] void called_beyond_struct_size() {
  std::fprintf(stderr, "strategy_v2_0: the host called a function beyond the table's struct_size\n");
  std::abort();
}

const dtk_strategy_api* api_2_0() {
  static const dtk_strategy_api api = [] {
    dtk_strategy_api a = *dtk::strategy_api<V20>();
    a.struct_size = dtk_strategy_api_STRUCT_SIZE_2_0;
    a.get_info = [](dtk_strategy*, dtk_strategy_info*) -> dtk_status* { called_beyond_struct_size(); };
    a.gather_parameters = [](dtk_strategy*, int32_t) -> dtk_status* { called_beyond_struct_size(); };
    a.memory_usage = [](dtk_strategy*, dtk_memory_usage*) -> dtk_status* { called_beyond_struct_size(); };
    return a;
  }();
  return &api;
}

}  // namespace

DTK_PLUGIN("strategy_v2_0", DTK_KIND_STRATEGY, "1.0.0", "ABI 2.0-sized strategy table (test)", DTK_TORCH_VERSION,
           api_2_0(), DTK_NO_OPTIONS)
