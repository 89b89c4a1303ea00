// Mixture of experts (dtk/layers/moe.hpp; model.num_experts, Megatron-LM's --num-experts):
//   * the SDK's MoeMlp equals a reference written here token by token in plain ATen (each token's
//     k experts run one at a time and are summed with their weights), forward and every gradient,
//     for GELU and SwiGLU experts, with and without biases, softmax before or after the top-k and a
//     scaling factor;
//   * the load-balancing and z-losses are Megatron's formulas (written out here) and reach the
//     router's gradient without changing the output;
//   * end to end through `dtk train` and `dtk launch` (real processes over Gloo), for gpt and
//     llama with the auxiliary losses on: DP 2 equals one process with 2 micro-batches (the
//     losses' gradient is scaled as the step's: 1 / micro-batches), TP 2 equals TP 1 with and
//     without sequence parallelism (the router's partial gradients), PP 2 equals PP 1 (the first
//     stage's layers' losses reach their routers), ZeRO-3 equals ddp, full recomputation equals
//     none; every layer or every second one;
//   * the start-up line counts the routed experts only in the FLOPs; bad inputs are one line.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <dtk/layers/moe.hpp>

#include "dtk/core/components/services.hpp"
#include "dtk/core/optim/aux_loss.hpp"

#include <map>
#include <regex>
#include <string>
#include <vector>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"
#include "../common/tensorboard_reader.hpp"

namespace {

using dtk::layers::MoeConfig;
using dtk::layers::MoeMlp;

at::Tensor gelu(const std::vector<at::Tensor>& p) { return at::gelu(p[0]); }
at::Tensor swiglu(const std::vector<at::Tensor>& p) { return at::silu(p[0]) * p[1]; }

struct Case {
  const char* name;
  int inputs;  // 1: GELU experts, 2: SwiGLU
  bool bias, pre_softmax;
  double scaling;
};

MoeMlp make_layer(const MoeConfig& c, int64_t hidden, const Case& k) {
  dtk::layers::ParamFactory f;
  f.gen = dtk::layers::seeded_generator(11);
  std::vector<std::string> inputs =
      k.inputs == 1 ? std::vector<std::string>{"fc1"} : std::vector<std::string>{"gate", "up"};
  MoeMlp m(c, hidden, inputs, "fc2", k.bias, 0.3, 0.2, dtk::layers::TPGroup{}, f);
  // Non-zero biases, so that their gradients and the weighting of the output bias are checked.
  at::manual_seed(5);
  for (auto& e : m.experts) {
    for (auto& in : e.in)
      if (in.bias.defined()) in.bias.data().normal_(0, 0.1);
    if (e.out.bias.defined()) e.out.bias.data().normal_(0, 0.1);
  }
  return m;
}

// The layer token by token: each token's top-k experts (softmax of the top-k logits, or top-k of
// the softmax), each expert's MLP on the token alone, summed with the weights.
at::Tensor router_logits(const MoeMlp& m, const at::Tensor& rows) {
  const at::Tensor logits = at::matmul(rows, m.router.t());
  return m.router_bias.defined() ? logits + m.router_bias : logits;
}

at::Tensor reference(const MoeMlp& m, const MoeConfig& c, const at::Tensor& x, bool swiglu_experts) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const at::Tensor logits = router_logits(m, rows);
  std::vector<at::Tensor> out;
  for (int64_t t = 0; t < rows.size(0); ++t) {
    at::Tensor probs, chosen;
    if (c.pre_softmax) {
      std::tie(probs, chosen) = at::softmax(logits[t], 0).topk(c.topk);
    } else {
      at::Tensor top;
      std::tie(top, chosen) = logits[t].topk(c.topk);
      probs = at::softmax(top, 0);
    }
    if (c.topk_scaling_factor > 0) probs = probs * c.topk_scaling_factor;
    at::Tensor y = at::zeros({x.size(-1)});
    for (int64_t j = 0; j < c.topk; ++j) {
      const auto& e = m.experts[static_cast<size_t>(chosen[j].item<int64_t>())];
      std::vector<at::Tensor> projected;
      for (const auto& in : e.in)
        projected.push_back(at::matmul(in.weight, rows[t]) + (in.bias.defined() ? in.bias : at::zeros({1})));
      at::Tensor expert = at::matmul(e.out.weight, swiglu_experts ? swiglu(projected) : gelu(projected));
      if (e.out.bias.defined()) expert = expert + e.out.bias;
      y = y + probs[j] * expert;
    }
    out.push_back(y);
  }
  return at::stack(out).view(x.sizes());
}

// Megatron's switch_load_balancing_loss_func and z_loss_func, written out: E * coeff / (k T^2) *
// sum_e (sum_t p[t, e]) * (tokens that chose e); coeff * mean_t logsumexp(logits[t])^2.
at::Tensor reference_aux_losses(const MoeMlp& m, const MoeConfig& c, const at::Tensor& x) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const at::Tensor logits = router_logits(m, rows);
  const int64_t t = rows.size(0), e = c.num_experts;
  const at::Tensor chosen = std::get<1>(logits.topk(c.topk, -1));
  at::Tensor counts = at::zeros({e});
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < c.topk; ++j) counts[chosen[i][j].item<int64_t>()] += 1;
  const at::Tensor balance = (at::softmax(logits, -1).sum(0) * counts).sum() *
                             (static_cast<double>(e) * c.aux_loss_coeff / (c.topk * static_cast<double>(t * t)));
  const at::Tensor z = at::logsumexp(logits, -1).square().mean() * c.z_loss_coeff;
  return balance + z;
}

std::vector<at::Tensor> grads_of(const MoeMlp& m, const at::Tensor& x) {
  std::vector<at::Tensor> out{x.grad(), m.router.grad()};
  if (m.router_bias.defined()) out.push_back(m.router_bias.grad());
  for (const auto& e : m.experts) {
    for (const auto& in : e.in) {
      out.push_back(in.weight.grad());
      if (in.bias.defined()) out.push_back(in.bias.grad());
    }
    out.push_back(e.out.weight.grad());
    if (e.out.bias.defined()) out.push_back(e.out.bias.grad());
  }
  return out;
}

void zero_grads(const MoeMlp& m, at::Tensor& x) {
  x.mutable_grad() = at::Tensor();
  m.router.mutable_grad() = at::Tensor();
  if (m.router_bias.defined()) m.router_bias.mutable_grad() = at::Tensor();
  for (const auto& e : m.experts) {
    for (const auto& in : e.in) {
      in.weight.mutable_grad() = at::Tensor();
      if (in.bias.defined()) in.bias.mutable_grad() = at::Tensor();
    }
    e.out.weight.mutable_grad() = at::Tensor();
    if (e.out.bias.defined()) e.out.bias.mutable_grad() = at::Tensor();
  }
}

// The layer's output and gradients against the reference's, for one configuration; with
// auxiliary losses the reference adds them to its objective.
void expect_layer_equals_reference(const Case& k, double aux_coeff, double z_coeff) {
  MoeConfig c;
  c.num_experts = 5, c.topk = 2, c.ffn = 6;
  c.pre_softmax = k.pre_softmax, c.topk_scaling_factor = k.scaling;
  c.aux_loss_coeff = aux_coeff, c.z_loss_coeff = z_coeff;
  const MoeMlp m = make_layer(c, 8, k);
  at::manual_seed(3);
  at::Tensor x = at::randn({3, 7, 8}).requires_grad_(true);
  const at::Tensor weights = at::randn({3, 7, 8});
  const ::dtk::layers::ExpertActivation act = k.inputs == 1 ? gelu : swiglu;

  const at::Tensor got = m.forward(x, act);
  (got * weights).sum().backward();
  const std::vector<at::Tensor> got_grads = grads_of(m, x);
  zero_grads(m, x);

  const at::Tensor want = reference(m, c, x, k.inputs == 2);
  at::Tensor objective = (want * weights).sum();
  if (aux_coeff > 0 || z_coeff > 0) objective = objective + reference_aux_losses(m, c, x);
  objective.backward();
  const std::vector<at::Tensor> want_grads = grads_of(m, x);

  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6))
      << k.name << ": output differs by " << (got - want).abs().max().item<double>();
  ASSERT_EQ(got_grads.size(), want_grads.size());
  for (size_t i = 0; i < got_grads.size(); ++i) {
    ASSERT_TRUE(got_grads[i].defined()) << k.name << ": gradient " << i << " missing";
    EXPECT_TRUE(at::allclose(got_grads[i], want_grads[i], 1e-5, 1e-6))
        << k.name << ": gradient " << i << " differs by " << (got_grads[i] - want_grads[i]).abs().max().item<double>();
  }
}

const Case kCases[] = {
    {"GELU experts with biases", 1, true, false, 0.0},
    {"SwiGLU experts without biases", 2, false, false, 0.0},
    {"softmax before the top-k, scaled", 1, true, true, 2.5},
};

}  // namespace

TEST(MoeLayer, EqualsATokenByTokenReferenceForwardAndBackward) {
  for (const Case& k : kCases) expect_layer_equals_reference(k, 0.0, 0.0);
}

TEST(MoeLayer, AuxiliaryLossesAreMegatronsAndReachOnlyTheGradients) {
  for (const Case& k : kCases) expect_layer_equals_reference(k, 0.1, 0.01);
  // The guard: the losses do change the router's gradient (so the test above checks them).
  MoeConfig c;
  c.num_experts = 5, c.topk = 2, c.ffn = 6, c.aux_loss_coeff = 0.1;
  const MoeMlp with = make_layer(c, 8, kCases[0]);
  c.aux_loss_coeff = 0.0;
  const MoeMlp without = make_layer(c, 8, kCases[0]);
  at::manual_seed(3);
  const at::Tensor x = at::randn({3, 7, 8});
  with.forward(x.clone().requires_grad_(true), gelu).sum().backward();
  without.forward(x.clone().requires_grad_(true), gelu).sum().backward();
  EXPECT_GT((with.router.grad() - without.router.grad()).abs().max().item<double>(), 1e-4);
}

TEST(MoeLayer, EveryExpertGetsAGradientEvenWhenNoTokenChoseIt) {
  MoeConfig c;
  c.num_experts = 8, c.topk = 1, c.ffn = 4, c.pre_softmax = true;
  const MoeMlp m = make_layer(c, 8, kCases[0]);
  at::Tensor x = at::randn({1, 2, 8}).requires_grad_(true);  // 2 tokens: at most 2 of 8 experts chosen
  m.forward(x, gelu).sum().backward();
  int unused = 0;
  for (const auto& e : m.experts) {
    ASSERT_TRUE(e.in[0].weight.grad().defined());
    ASSERT_TRUE(e.out.weight.grad().defined());
    if (e.out.weight.grad().abs().max().item<double>() == 0.0) ++unused;
  }
  EXPECT_GE(unused, 6);  // zero, not missing: every strategy sees every parameter's gradient
}

// The host's dtk.ext.aux_loss.v1: the factor the micro-batch runner last set, and the mode.
TEST(MoeLayer, TheHostHandsOutTheStepsLossFactor) {
  const dtk_host_services* host = dtk::core::host_services();
  const auto* ext = static_cast<const dtk_aux_loss_ext*>(host->get_extension(DTK_EXT_AUX_LOSS_V1));
  ASSERT_NE(ext, nullptr);
  ASSERT_GE(ext->struct_size, dtk_aux_loss_ext_STRUCT_SIZE_2_9);
  dtk::core::aux_loss::set_backward_scale(0.25, false);
  EXPECT_EQ(ext->backward_scale(), 0.25);
  EXPECT_EQ(ext->per_token_loss(), 0);
  dtk::core::aux_loss::set_backward_scale(1024.0, true);
  EXPECT_EQ(ext->backward_scale(), 1024.0);
  EXPECT_EQ(ext->per_token_loss(), 1);
  dtk::core::aux_loss::set_backward_scale(1.0, false);
}

// ---------------------------------------------------------------------------------------------
// End to end.

namespace {

constexpr size_t kIters = 6;

// A tiny MoE model on synthetic tokens: 4 layers, 4 experts of which 2 per token, both auxiliary
// losses on, 6 iterations of 8 samples, no dropout (the comparisons are exact).
std::string train(const std::string& model, const std::string& extra = "") {
  return "train --config " + std::string(DTK_SOURCE_DIR) + "/configs/" + model +
         "-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=4 "
         "--set model.vocab_size=256 --set dataset.vocab_size=256 --set train.seq_length=16 "
         "--set train.micro_batch_size=4 --set train.global_batch_size=8 --set train.train_iters=6 "
         "--set lr.lr_warmup_iters=1 --set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 "
         "--set model.hidden_dropout=0 --set model.attention_dropout=0 "
         "--set model.num_experts=4 --set model.moe_router_topk=2 --set model.moe_aux_loss_coeff=0.05 "
         "--set model.moe_z_loss_coeff=0.01 " +
         extra;
}

dtk_test::Curve curve_of(const std::string& model, int nproc, const std::string& args, const std::string& name) {
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  return dtk_test::run_curve(launch + train(model) + args, DTK_TEST_TMP, "moe-" + model + "-" + name);
}

}  // namespace

TEST(Moe, DataTensorAndPipelineParallelEqualOneProcess) {
  for (const std::string model : {"gpt", "llama"}) {
    const dtk_test::Curve one = curve_of(model, 1, "", "one");
    ASSERT_EQ(one.run.code, 0) << one.run.out;
    // The losses' gradient is scaled as the step's loss: two micro-batches here, one per rank there.
    expect_same_curve(one, curve_of(model, 2, "", "dp2"), kIters, model + " DP 2");
    expect_same_curve(one, curve_of(model, 2, "--set distributed.tensor_model_parallel_size=2 ", "tp2"), kIters,
                      model + " TP 2");
    expect_same_curve(
        one,
        curve_of(model, 2, "--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true ",
                 "sp2"),
        kIters, model + " TP 2 with sequence parallelism");
    expect_same_curve(one, curve_of(model, 2, "--set distributed.pipeline_model_parallel_size=2 ", "pp2"), kIters,
                      model + " PP 2");
  }
}

// With Megatron-LM's per-token loss the losses' gradient is multiplied by the micro-batch's tokens
// and divided, with the step's, by the global batch's: DP 2 still equals one process.
TEST(Moe, PerTokenLossKeepsTheAuxiliaryLossesWeight) {
  const std::string per_token = "--set train.calculate_per_token_loss=true ";
  const dtk_test::Curve one = curve_of("gpt", 1, per_token, "per-token-one");
  expect_same_curve(one, curve_of("gpt", 2, per_token, "per-token-dp2"), kIters, "per-token loss, DP 2");
  // Every token counts and the micro-batches are equal: the per-token loss is the default's, the
  // losses' token factor included (a wrong factor changes the router's gradient).
  expect_same_curve(curve_of("gpt", 1, "", "default-one"), one, kIters, "per-token loss against the default");
}

// The guard for the equalities above: the losses do move the curves (beyond their tolerance).
TEST(Moe, AuxiliaryLossesChangeTheTraining) {
  const dtk_test::Curve with = curve_of("gpt", 1, "", "with-losses");
  const dtk_test::Curve without =
      curve_of("gpt", 1, "--set model.moe_aux_loss_coeff=0 --set model.moe_z_loss_coeff=0 ", "without-losses");
  const dtk_test::Curve z_only = curve_of("gpt", 1, "--set model.moe_aux_loss_coeff=0 ", "z-only");
  ASSERT_EQ(with.norm.size(), kIters);
  ASSERT_EQ(without.norm.size(), kIters);
  ASSERT_EQ(z_only.norm.size(), kIters);
  EXPECT_GT(std::abs(with.norm.at(1) - without.norm.at(1)), 1e-3 * without.norm.at(1));
  EXPECT_GT(std::abs(z_only.norm.at(1) - without.norm.at(1)), 1e-4 * without.norm.at(1));
}

namespace {

// A run's logged MoE losses per iteration (TensorBoard, full precision).
std::map<std::string, std::map<int64_t, float>> logged_losses(int nproc, const std::string& args,
                                                              const std::string& name) {
  const std::string tb = dtk_test::fresh_dir(DTK_TEST_TMP, "tb-moe-logged-" + name);
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  const dtk_test::Result r =
      dtk_test::run_dtk(launch + train("gpt") + args + " --set logging.tensorboard_dir=" + tb, 300);
  EXPECT_EQ(r.code, 0) << name << "\n" << r.out;
  auto scalars = dtk_test::read_scalars(tb);
  return {{"load_balancing_loss", scalars["load_balancing_loss"]}, {"z_loss", scalars["z_loss"]}};
}

}  // namespace

// The log line's load_balancing_loss and z_loss (Megatron's names: the losses without their
// coefficients, averaged over the MoE layers and micro-batches) are the same figures whichever way
// the model is split; a balanced router's load-balancing loss is about 1.
TEST(Moe, LoggedLossesAreTheSameHoweverTheModelIsSplit) {
  const auto one = logged_losses(1, "", "one");
  ASSERT_EQ(one.at("load_balancing_loss").size(), kIters);
  ASSERT_EQ(one.at("z_loss").size(), kIters);
  EXPECT_GT(one.at("load_balancing_loss").at(1), 0.9);
  EXPECT_LT(one.at("load_balancing_loss").at(1), 2.0);
  EXPECT_GT(one.at("z_loss").at(1), 0.0);
  const std::pair<const char*, const char*> splits[] = {
      {"dp2", ""},
      {"tp2", "--set distributed.tensor_model_parallel_size=2 "},
      {"sp2", "--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true "},
      {"pp2", "--set distributed.pipeline_model_parallel_size=2 "}};
  for (const auto& [name, args] : splits) {
    const auto got = logged_losses(2, args, name);
    for (const char* loss : {"load_balancing_loss", "z_loss"}) {
      ASSERT_EQ(got.at(loss).size(), kIters) << name << " " << loss;
      for (const auto& [it, v] : one.at(loss))
        EXPECT_NEAR(got.at(loss).at(it), v, 1e-5 * std::abs(v)) << name << " " << loss << " at iteration " << it;
    }
  }
  // Without the losses' coefficients nothing is logged (and a dense model logs neither).
  const dtk_test::Result plain =
      dtk_test::run_dtk(train("gpt") + "--set model.moe_aux_loss_coeff=0 --set model.moe_z_loss_coeff=0", 300);
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_EQ(plain.out.find("load_balancing_loss"), std::string::npos) << plain.out;
  const dtk_test::Result with = dtk_test::run_dtk(train("gpt"), 300);
  EXPECT_NE(with.out.find("| load_balancing_loss: "), std::string::npos) << with.out;
  EXPECT_NE(with.out.find("| z_loss: "), std::string::npos) << with.out;
}

TEST(Moe, ZeroRecomputeAndLayerFrequencyRunTheSameModel) {
  const dtk_test::Curve ddp = curve_of("gpt", 2, "", "ddp");
  expect_same_curve(ddp, curve_of("gpt", 2, "--strategy zero --set strategy.stage=3 ", "zero3"), kIters,
                    "ZeRO-3 against ddp");
  const dtk_test::Curve one = curve_of("gpt", 1, "", "one");
  expect_same_curve(one, curve_of("gpt", 1, "--set model.recompute_activations=full ", "full-recompute"), kIters,
                    "full recomputation");
  // Every second layer an MoE layer: a different model that trains, with fewer parameters.
  const dtk_test::Curve half = curve_of("gpt", 1, "--set model.moe_layer_freq=2 ", "freq2");
  ASSERT_EQ(half.run.code, 0) << half.run.out;
  EXPECT_NE(half.loss.at(kIters), one.loss.at(kIters));
}

TEST(Moe, TrainsAndCountsOnlyTheRoutedExpertsInTheFlops) {
  const dtk_test::Curve moe = curve_of("gpt", 1, "", "flops");
  ASSERT_EQ(moe.run.code, 0) << moe.run.out;
  EXPECT_LT(moe.loss.at(kIters), moe.loss.at(1)) << moe.run.out;
  // gpt-tiny's hidden 64: each MoE layer's 4 experts hold 2 x 64 x 256 weights and 256 + 64 biases,
  // of which a token runs 2 experts.
  std::smatch m;
  const std::regex re(
      "N = ([0-9]+) parameters a token runs \\(of the whole model's ([0-9]+): its routed experts only\\)");
  ASSERT_TRUE(std::regex_search(moe.run.out, m, re)) << moe.run.out;
  const long long active = std::stoll(m[1]), whole = std::stoll(m[2]);
  const long long expert = 2LL * 64 * 256 + 256 + 64;
  EXPECT_EQ(whole - active, 4LL * (4 - 2) * expert) << moe.run.out;
}

TEST(Moe, BadInputsAreOneLine) {
  const std::string base = "train --config " + std::string(DTK_SOURCE_DIR) +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set train.train_iters=2 "
                           "--set lr.lr_warmup_iters=1 ";
  const std::pair<std::string, std::string> cases[] = {
      {"--set model.moe_router_topk=3", "option 'moe_router_topk' does nothing without num_experts > 0"},
      {"--set model.num_experts=4 --set model.moe_router_topk=5",
       "option 'moe_router_topk' must be in [1, num_experts = 4], got 5"},
      {"--set model.num_experts=4 --set model.moe_aux_loss_coeff=-1",
       "option 'moe_aux_loss_coeff' must be finite and >= 0"},
      {"--set model.num_experts=4 --set model.moe_layer_freq=0", "option 'moe_layer_freq' must be >= 1, got 0"},
      {"--set model.num_experts=4 --set model.moe_router_topk=1",
       "moe_router_topk=1 needs moe_router_pre_softmax=true"},
      {"--set model.num_experts=4 --set model.domino_chunks=2 --set distributed.tensor_model_parallel_size=1",
       "domino_chunks > 1 runs dense MLPs only"},
  };
  for (const auto& [args, line] : cases) {
    const dtk_test::Result r = dtk_test::run_dtk(base + args, 120);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.out.find("dtk: error: "), std::string::npos) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(line), std::string::npos) << args << "\n" << r.out;
  }
}
