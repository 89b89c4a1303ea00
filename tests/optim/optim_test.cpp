// The optimizer plugins and the ddp strategy's clipping, checked against LibTorch's own
// implementations (torch::optim::AdamW/SGD, torch::nn::utils::clip_grad_norm_) step by step.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

// clip_grad.h is not self-contained: it needs torch/types.h first.
#include <torch/nn/utils/clip_grad.h>

#include <map>

#include "dtk/core/components/components.hpp"
#include "optim_support.hpp"

using namespace dtk_optim_support;

namespace {

const std::string kDir = DTK_TEST_PLUGIN_DIR;

std::vector<at::Tensor> make_params(uint64_t seed) {
  at::manual_seed(seed);
  // The last one is a transposed (non-contiguous) view: optimizers take their general path there.
  return {at::randn({8, 16}), at::randn({16}), at::randn({3, 5, 7}), at::randn({4}), at::randn({6, 10}).t()};
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

// The same random gradient into both copies.
void set_grads(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, int step) {
  at::manual_seed(1000 + step);
  for (size_t i = 0; i < a.size(); ++i) {
    at::Tensor g = at::randn_like(a[i]);
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
}

void expect_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double tol, int step) {
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(at::allclose(a[i], b[i], tol, tol))
        << "param " << i << " after step " << step << ": max diff " << (a[i] - b[i]).abs().max().item<double>();
}

}  // namespace

TEST(AdamW, MatchesTorchOptimAdamWWithTwoGroups) {
  auto base = make_params(1);
  auto mine = clones(base), ref = clones(base);
  // Group 0 decays (weights), group 1 does not (biases/norms), as the pipeline builds them.
  PluginOptimizer opt(plugin(kDir, "dtk_plugin_adamw.so"), {{"beta1", "0.9"}, {"beta2", "0.95"}, {"eps", "1e-8"}},
                      {{{mine[0], mine[2], mine[4]}, 0.1}, {{mine[1], mine[3]}, 0.0}});
  const double lr = 3e-2;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  ASSERT_FALSE(mine[4].is_contiguous());
  groups.emplace_back(std::vector<at::Tensor>{ref[0], ref[2], ref[4]},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1)));
  groups.emplace_back(std::vector<at::Tensor>{ref[1], ref[3]},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.0)));
  torch::optim::AdamW torch_opt(std::move(groups));
  for (int step = 1; step <= 6; ++step) {
    set_grads(mine, ref, step);
    opt.step(lr, step);
    torch_opt.step();
    expect_close(mine, ref, 1e-6, step);
  }
  // The update really moved the parameters (a no-op optimizer would fail above only by luck).
  EXPECT_GT((mine[0] - base[0]).abs().max().item<double>(), 1e-2);
}

// The SIMD cpu_adam plugin is the same update as torch.optim.AdamW (and Adam with L2 when
// adamw_mode=false), including strided parameters and two weight-decay groups.
TEST(CpuAdam, MatchesTorchOptimAdamWAndAdam) {
  for (bool adamw_mode : {true, false}) {
    auto base = make_params(4);
    auto mine = clones(base), ref = clones(base);
    PluginOptimizer opt(
        plugin(kDir, "dtk_plugin_cpu_adam.so"),
        {{"beta1", "0.9"}, {"beta2", "0.95"}, {"eps", "1e-8"}, {"adamw_mode", adamw_mode ? "true" : "false"}},
        {{{mine[0], mine[2], mine[4]}, 0.1}, {{mine[1], mine[3]}, 0.0}});
    const double lr = 3e-2;
    auto options = [&](double wd) -> std::unique_ptr<torch::optim::OptimizerOptions> {
      if (adamw_mode)
        return std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd));
      return std::make_unique<torch::optim::AdamOptions>(
          torch::optim::AdamOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd));
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{ref[0], ref[2], ref[4]}, options(0.1));
    groups.emplace_back(std::vector<at::Tensor>{ref[1], ref[3]}, options(0.0));
    std::unique_ptr<torch::optim::Optimizer> torch_opt;
    if (adamw_mode)
      torch_opt = std::make_unique<torch::optim::AdamW>(std::move(groups));
    else
      torch_opt = std::make_unique<torch::optim::Adam>(std::move(groups));
    for (int step = 1; step <= 6; ++step) {
      set_grads(mine, ref, step);
      opt.step(lr, step);
      torch_opt->step();
      expect_close(mine, ref, 1e-6, step);
    }
    EXPECT_GT((mine[0] - base[0]).abs().max().item<double>(), 1e-2) << "adamw_mode " << adamw_mode;
  }
}

// cpu_adam keeps the adamw plugin's state names: a run can switch optimizers at a checkpoint.
TEST(CpuAdam, ContinuesFromTheAdamWPluginsState) {
  auto a = clones(make_params(5));
  auto scratch = clones(a);
  PluginOptimizer adamw(plugin(kDir, "dtk_plugin_adamw.so"), {}, {{a, 0.05}});
  for (int step = 1; step <= 3; ++step) {
    set_grads(a, scratch, step);
    adamw.step(1e-2, step);
  }
  auto b = clones(a);
  PluginOptimizer cpu(plugin(kDir, "dtk_plugin_cpu_adam.so"), {}, {{b, 0.05}});
  cpu.state_load(adamw.state_save());
  for (int step = 4; step <= 6; ++step) {
    set_grads(a, b, step);
    adamw.step(1e-2, step);
    cpu.step(1e-2, step);
    expect_close(a, b, 1e-6, step);
  }
  EXPECT_EQ(cpu.state_save().size(), 1u + 2u * a.size());
}

TEST(Sgd, MatchesTorchOptimSgd) {
  for (bool nesterov : {false, true}) {
    auto base = make_params(2);
    auto mine = clones(base), ref = clones(base);
    PluginOptimizer opt(plugin(kDir, "dtk_plugin_sgd.so"),
                        {{"momentum", "0.9"}, {"nesterov", nesterov ? "true" : "false"}}, {{mine, 0.01}});
    torch::optim::SGD torch_opt(ref, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(nesterov).weight_decay(0.01));
    for (int step = 1; step <= 5; ++step) {
      set_grads(mine, ref, step);
      opt.step(0.1, step);
      torch_opt.step();
      expect_close(mine, ref, 1e-6, step);
    }
  }
}

// ABI 2.2: per step, a group's weight decay is its weight_decay x weight_decay_scale, and its
// learning rate the step's x lr_scale; every first-party optimizer equals torch.optim with those
// values set on its param groups before each step.
TEST(Optimizers, FollowTheWeightDecayScheduleAndEachGroupsLrScale) {
  const double lr = 3e-2;
  const std::vector<double> lr_scales = {0.5, 2.0}, group_wd = {0.1, 0.03};
  for (const std::string name : {"adamw", "cpu_adam", "sgd"}) {
    auto base = make_params(7);
    auto mine = clones(base), ref = clones(base);
    const std::map<std::string, std::string> opts =
        name == "sgd" ? std::map<std::string, std::string>{{"momentum", "0"}} : std::map<std::string, std::string>{};
    PluginOptimizer opt(plugin(kDir, "dtk_plugin_" + name + ".so"), opts,
                        {{{mine[0], mine[2], mine[4]}, group_wd[0]}, {{mine[1], mine[3]}, group_wd[1]}}, lr_scales);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{ref[0], ref[2], ref[4]});
    groups.emplace_back(std::vector<at::Tensor>{ref[1], ref[3]});
    std::unique_ptr<torch::optim::Optimizer> torch_opt;
    if (name == "sgd")
      torch_opt = std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(lr));
    else
      torch_opt = std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(lr));
    for (int step = 1; step <= 5; ++step) {
      const double scale = 0.2 * step;  // a weight-decay increment
      for (size_t g = 0; g < 2; ++g) {
        auto& o = torch_opt->param_groups()[g].options();
        if (name == "sgd") {
          static_cast<torch::optim::SGDOptions&>(o).lr(lr * lr_scales[g]).weight_decay(group_wd[g] * scale);
        } else {
          static_cast<torch::optim::AdamWOptions&>(o).lr(lr * lr_scales[g]).weight_decay(group_wd[g] * scale);
        }
      }
      set_grads(mine, ref, step);
      opt.step(lr, step, scale);
      torch_opt->step();
      expect_close(mine, ref, 1e-6, step);
    }
    EXPECT_GT((mine[1] - base[1]).abs().max().item<double>(), 1e-2) << name;
  }
}

// ABI 2.14: an update's betas from the host (DeepSpeed's OneCycle cycles beta1, beta2 0.99)
// replace the configured ones, bias corrections included; both Adam plugins equal
// torch.optim.AdamW with the param groups' betas changed before each step. The configured betas
// (0.5, 0.5) would give other values.
TEST(Optimizers, AdamFollowsEachUpdatesBetas) {
  const double lr = 2e-2;
  const std::vector<std::pair<double, double>> betas = {{0.8, 0.99}, {0.89, 0.99}, {0.85, 0.99}, {0.81, 0.99},
                                                        {0.8, 0.99}, {0.86, 0.99}, {0.9, 0.99}};
  for (const std::string name : {"adamw", "cpu_adam"}) {
    auto base = make_params(11);
    auto mine = clones(base), ref = clones(base), configured = clones(base);
    const std::map<std::string, std::string> opts = {{"beta1", "0.5"}, {"beta2", "0.5"}};
    PluginOptimizer opt(plugin(kDir, "dtk_plugin_" + name + ".so"), opts, {{mine, 0.1}});
    PluginOptimizer fixed(plugin(kDir, "dtk_plugin_" + name + ".so"), opts, {{configured, 0.1}});
    torch::optim::AdamW torch_opt(ref, torch::optim::AdamWOptions(lr).weight_decay(0.1));
    for (size_t k = 0; k < betas.size(); ++k) {
      const int step = static_cast<int>(k) + 1;
      static_cast<torch::optim::AdamWOptions&>(torch_opt.param_groups()[0].options())
          .betas({betas[k].first, betas[k].second});
      set_grads(mine, ref, step);
      for (size_t i = 0; i < configured.size(); ++i) configured[i].mutable_grad() = mine[i].grad().clone();
      opt.step_with_betas(lr, step, betas[k].first, betas[k].second);
      fixed.step(lr, step);
      torch_opt.step();
      expect_close(mine, ref, 1e-6, step);
    }
    EXPECT_GT((mine[0] - configured[0]).abs().max().item<double>(), 1e-3) << name << ": the betas changed nothing";
  }
}

TEST(AdamW, StateRoundTripContinuesExactly) {
  const auto& p = plugin(kDir, "dtk_plugin_adamw.so");
  auto a = clones(make_params(3));
  auto scratch = clones(a);
  PluginOptimizer first(p, {}, {{a, 0.05}});
  for (int step = 1; step <= 3; ++step) {
    set_grads(a, scratch, step);
    first.step(1e-2, step);
  }
  // A second optimizer over a copy of the parameters, loaded from the first one's state, must
  // continue exactly as the first (same moments, same step count for bias correction).
  auto b = clones(a);
  PluginOptimizer second(p, {}, {{b, 0.05}});
  const dtk::TensorList state = first.state_save();
  ASSERT_EQ(state.size(), 1u + 2u * a.size());  // step + exp_avg/exp_avg_sq per parameter
  second.state_load(state);
  for (int step = 4; step <= 6; ++step) {
    set_grads(a, b, step);
    first.step(1e-2, step);
    second.step(1e-2, step);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "param " << i << " step " << step;
  }
  // Without the state the continuation differs (the test can fail).
  auto c = clones(make_params(3));
  EXPECT_FALSE(at::equal(c[0], a[0]));
}

// A model whose parameters are given tensors: enough to drive the ddp strategy through the ABI.
class FixedModel : public dtk::Model {
 public:
  explicit FixedModel(const dtk::BuildContext&) {}
  static std::vector<at::Tensor>& source() {
    static std::vector<at::Tensor> s;
    return s;
  }
  dtk::TensorList forward(const dtk::TensorList&) override { return {}; }
  std::vector<dtk::Param> parameters() override {
    std::vector<dtk::Param> out;
    for (size_t i = 0; i < source().size(); ++i) {
      dtk::Param p;
      p.name = "p" + std::to_string(i);
      p.tensor = source()[i];
      out.push_back(p);
    }
    return out;
  }
  void set_training(bool) override {}
  dtk_model_info info() override { return dtk_model_info{sizeof(dtk_model_info), 0, 0, 0, 0, 0, 0, 0, 0}; }
};

// The ddp strategy, set up through its ABI table over a FixedModel holding `params`.
struct DdpOver {
  DdpOver(const std::vector<at::Tensor>& params, const std::map<std::string, std::string>& user)
      : api(plugin(kDir, "dtk_plugin_ddp.so").api_as<dtk_strategy_api>()),
        options(dtk::host::resolve_options(plugin(kDir, "dtk_plugin_ddp.so"), user)) {
    FixedModel::source() = params;
    dtk_build_context b = context(options.get());
    check(model_api->create(&b, &model));
    dtk_model_ref ref{sizeof(dtk_model_ref), model_api, model};
    check(api->create(&b, &s));
    check(api->setup(s, &ref));
  }
  ~DdpOver() {
    api->destroy(s);
    model_api->destroy(model);
  }
  DdpOver(const DdpOver&) = delete;
  DdpOver& operator=(const DdpOver&) = delete;

  const dtk_strategy_api* api;
  dtk::host::OptionValues options;
  const dtk_model_api* model_api = dtk::model_api<FixedModel>();
  dtk_model* model = nullptr;
  dtk_strategy* s = nullptr;
};

// The host moves a model that did not honour the build context's dtype (abi.h dtk_model_api.to),
// in place: the parameter tensors keep their identity, so references taken earlier stay valid.
TEST(ModelInstance, MovesAModelThatIgnoredTheContextsDtype) {
  static const dtk_plugin_entry entry = {dtk_plugin_entry_STRUCT_SIZE,
                                         DTK_ABI_MAJOR,
                                         DTK_ABI_MINOR,
                                         "",
                                         "fixed",
                                         DTK_KIND_MODEL,
                                         "0",
                                         "test model",
                                         nullptr,
                                         nullptr,
                                         nullptr,
                                         nullptr,
                                         0,
                                         nullptr};
  dtk::host::Plugin plugin;
  plugin.entry = &entry;
  plugin.api = dtk::model_api<FixedModel>();
  const std::vector<at::Tensor> params = {at::ones({3}, at::kDouble), at::zeros({2, 2}, at::kBFloat16)};
  FixedModel::source() = params;
  dtk::host::OptionValues none({});
  dtk::core::ModelInstance model(plugin, context(none.get()));  // the context asks for fp32
  for (const auto& p : model.parameters()) EXPECT_EQ(p.tensor.scalar_type(), at::kFloat) << p.name;
  EXPECT_EQ(params[0].scalar_type(), at::kFloat);  // moved in place
  EXPECT_TRUE(at::equal(params[0], at::ones({3})));
  // A model that honours the context is left alone.
  FixedModel::source() = {at::ones({3})};
  const void* before = FixedModel::source()[0].data_ptr();
  dtk::core::ModelInstance same(plugin, context(none.get()));
  EXPECT_EQ(FixedModel::source()[0].data_ptr(), before);
}

TEST(Ddp, ClipMatchesTorchClipGradNorm) {
  for (double max_norm : {0.5, 1e6, 0.0}) {
    auto mine = clones(make_params(4)), ref = clones(mine);
    set_grads(mine, ref, 7);
    DdpOver ddp(mine, {});
    const auto* api = ddp.api;
    dtk_strategy* s = ddp.s;
    dtk_clip_args clip{dtk_clip_args_STRUCT_SIZE, max_norm, 0.0};
    check(api->clip_and_norm(s, &clip));
    const double norm = clip.norm;
    const double expected =
        max_norm > 0 ? torch::nn::utils::clip_grad_norm_(ref, max_norm) : torch::nn::utils::clip_grad_norm_(ref, 1e30);
    EXPECT_NEAR(norm, expected, 1e-4 * expected) << "max_norm " << max_norm;
    for (size_t i = 0; i < mine.size(); ++i)
      EXPECT_TRUE(at::allclose(mine[i].grad(), ref[i].grad(), 1e-6, 1e-7)) << "grad " << i << " max_norm " << max_norm;
    check(api->zero_grad(s));
    EXPECT_FALSE(mine[0].grad().defined());
  }
}

// Mixed precision: bf16 parameters trained through the ddp strategy with fp32 masters follow an
// fp32 torch::optim::AdamW exactly (the bf16 params are the rounded masters); without masters
// the same tiny updates vanish in bf16.
TEST(Ddp, Bf16ParametersTrainOnFp32Masters) {
  for (bool masters : {true, false}) {
    at::manual_seed(5);
    std::vector<at::Tensor> model = {
        (at::ones({64}) + 0.01 * at::randn({64})).to(at::kBFloat16).set_requires_grad(true)};
    std::vector<at::Tensor> ref = {model[0].detach().to(at::kFloat).clone().set_requires_grad(true)};
    const at::Tensor start = model[0].detach().clone();
    DdpOver ddp(model, {{"fp32_master_weights", masters ? "true" : "false"}});
    const auto* api = ddp.api;
    dtk_strategy* s = ddp.s;
    // The optimizer is built over what the strategy hands out: the fp32 masters.
    std::vector<dtk::Param> params;
    dtk_param_visitor v = dtk::collecting_visitor(&params);
    check(api->optimizer_params(s, &v));
    std::vector<at::Tensor> handed;
    for (auto& p : params) handed.push_back(p.tensor);
    ASSERT_EQ(handed[0].scalar_type(), masters ? at::kFloat : at::kBFloat16);
    PluginOptimizer opt(plugin(kDir, "dtk_plugin_adamw.so"), {}, {{handed, 0.0}});
    torch::optim::AdamW torch_opt(ref, torch::optim::AdamWOptions(1e-4).weight_decay(0.0));
    const double lr = 1e-4;  // updates ~1e-4, far below bf16's spacing of 2^-7 near 1.0
    for (int step = 1; step <= 5; ++step) {
      at::manual_seed(100 + step);
      at::Tensor g = at::randn({64}).to(at::kBFloat16);
      model[0].mutable_grad() = g;
      ref[0].mutable_grad() = g.to(at::kFloat);
      check(api->reduce_gradients(s));
      dtk_clip_args clip{dtk_clip_args_STRUCT_SIZE, 0.0, 0.0};
      check(api->clip_and_norm(s, &clip));
      dtk_optimizer_ref oref = opt.ref();
      dtk_optimizer_step_args args{dtk_optimizer_step_args_STRUCT_SIZE, lr, step, 1.0, 1.0};
      const dtk_strategy_step_args step_args{dtk_strategy_step_args_STRUCT_SIZE, &oref, &args};
      check(api->optimizer_step(s, &step_args));
      torch_opt.step();
      check(api->zero_grad(s));
    }
    if (masters) {
      EXPECT_TRUE(at::allclose(handed[0], ref[0], 1e-6, 1e-7)) << (handed[0] - ref[0]).abs().max().item<double>();
      EXPECT_TRUE(at::equal(model[0], handed[0].to(at::kBFloat16)));  // params are the rounded masters
      // The masters moved by ~5 lr although the bf16 weights could not represent that alone.
      EXPECT_GT((handed[0] - start.to(at::kFloat)).abs().max().item<double>(), 1e-4);
      // Checkpoint state carries the masters.
      dtk::SinkCollector saved;
      check(api->state_save(s, saved.sink()));
      ASSERT_EQ(saved.items().size(), 1u);
      EXPECT_EQ(saved.items()[0].first, "master.p0");
    } else {
      EXPECT_TRUE(at::equal(model[0], start));  // every update rounded away: why masters exist
    }
  }
}
