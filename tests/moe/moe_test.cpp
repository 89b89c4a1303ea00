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
//   * the router's input jitter (Megatron's) scales the router's input only, with noise that
//     recomputation and tensor and sequence parallelism draw alike;
//   * the start-up line counts the routed experts only in the FLOPs; bad inputs are one line.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <dtk/layers/moe.hpp>

#include "dtk/core/components/services.hpp"
#include "dtk/core/optim/aux_loss.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"
#include "../common/tensorboard_reader.hpp"
#include "../model/hf_reader.hpp"

namespace {

using dtk::layers::MoeConfig;
using dtk::layers::MoeMlp;

at::Tensor gelu(const std::vector<at::Tensor>& p) { return at::gelu(p[0]); }
at::Tensor swiglu(const std::vector<at::Tensor>& p) { return at::silu(p[0]) * p[1]; }

// The routed experts, then the shared one where the layer has it.
std::vector<MoeMlp::Expert*> experts_of(const MoeMlp& m) {
  auto& layer = const_cast<MoeMlp&>(m);
  std::vector<MoeMlp::Expert*> out;
  for (auto& e : layer.experts) out.push_back(&e);
  if (m.has_shared_expert()) out.push_back(&layer.shared);
  return out;
}

struct Case {
  const char* name;
  int inputs;  // 1: GELU experts, 2: SwiGLU
  bool bias, pre_softmax;
  double scaling;
  bool sigmoid = false;
  int64_t num_groups = 0, group_topk = 0;  // group-limited routing
  int64_t shared_ffn = 0;                  // a shared expert
  bool shared_gate = false;
  bool expert_bias = false;  // auxiliary-loss-free balancing's bias on the choice
  bool sqrt_softplus = false;  // sqrt(softplus(logits)) where `sigmoid` says sigmoid(logits)
};

MoeConfig config_of(const Case& k) {
  MoeConfig c;
  c.num_experts = 6, c.topk = 2, c.ffn = 6;
  c.pre_softmax = k.pre_softmax, c.topk_scaling_factor = k.scaling;
  c.score = k.sqrt_softplus ? dtk::layers::MoeScore::kSqrtSoftplus
            : k.sigmoid     ? dtk::layers::MoeScore::kSigmoid
                            : dtk::layers::MoeScore::kSoftmax;
  c.num_groups = k.num_groups, c.group_topk = k.group_topk;
  c.shared_ffn = k.shared_ffn, c.shared_gate = k.shared_gate;
  c.expert_bias = k.expert_bias;
  return c;
}

MoeMlp make_layer(const MoeConfig& c, int64_t hidden, const Case& k) {
  dtk::layers::ParamFactory f;
  f.gen = dtk::layers::seeded_generator(11);
  std::vector<std::string> inputs =
      k.inputs == 1 ? std::vector<std::string>{"fc1"} : std::vector<std::string>{"gate", "up"};
  MoeMlp m(c, hidden, inputs, "fc2", k.bias, 0.3, 0.2, dtk::layers::TPGroup{}, f);
  // Non-zero biases, so that their gradients and the weighting of the output bias are checked.
  at::manual_seed(5);
  for (MoeMlp::Expert* e : experts_of(m)) {
    for (auto& in : e->in)
      if (in.bias.defined()) in.bias.data().normal_(0, 0.1);
    if (e->out.bias.defined()) e->out.bias.data().normal_(0, 0.1);
  }
  // An expert bias of the size of the scores' differences, so that it changes choices.
  if (m.expert_bias.defined()) m.expert_bias.normal_(0, 0.3);
  return m;
}

// The layer token by token: each token's top-k experts (softmax of the top-k logits, top-k of the
// softmax, or sigmoid scores normalised over the top-k; from its best groups when routing is
// group-limited), each expert's MLP on the token alone, summed with the weights; then the shared
// expert on the token, times its gate.
at::Tensor router_logits(const MoeMlp& m, const at::Tensor& rows) {
  const at::Tensor logits = at::matmul(rows, m.router.t());
  return m.router_bias.defined() ? logits + m.router_bias : logits;
}

// Megatron's group_limited_topk for one token: the groups' scores (the sum of their topk /
// group_topk best), the group_topk best groups kept, the top-k of what they hold.
at::Tensor chosen_experts(const MoeConfig& c, const at::Tensor& scores) {
  if (c.group_topk == 0) return std::get<1>(scores.topk(c.topk));
  const int64_t per_group = c.num_experts / c.num_groups;
  std::vector<std::pair<double, int64_t>> groups;
  for (int64_t g = 0; g < c.num_groups; ++g) {
    const at::Tensor best = std::get<0>(scores.narrow(0, g * per_group, per_group).topk(c.topk / c.group_topk));
    groups.emplace_back(best.sum().item<double>(), g);
  }
  std::sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  at::Tensor masked = at::full_like(scores, -std::numeric_limits<double>::infinity());
  for (int64_t i = 0; i < c.group_topk; ++i) {
    const int64_t g = groups[static_cast<size_t>(i)].second;
    masked.narrow(0, g * per_group, per_group).copy_(scores.narrow(0, g * per_group, per_group));
  }
  return std::get<1>(masked.topk(c.topk));
}

at::Tensor mlp(const MoeMlp::Expert& e, const at::Tensor& row, bool swiglu_experts) {
  std::vector<at::Tensor> projected;
  for (const auto& in : e.in)
    projected.push_back(at::matmul(in.weight, row) + (in.bias.defined() ? in.bias : at::zeros({1})));
  at::Tensor y = at::matmul(e.out.weight, swiglu_experts ? swiglu(projected) : gelu(projected));
  return e.out.bias.defined() ? y + e.out.bias : y;
}

// Sigmoid scores, or Megatron's sqrtsoftplus: sqrt(log(1 + e^x)).
at::Tensor gate(const MoeConfig& c, const at::Tensor& logits) {
  return c.score == dtk::layers::MoeScore::kSigmoid ? at::sigmoid(logits) : at::log1p(at::exp(logits)).sqrt();
}

// Each token's chosen experts and their weights.
struct Route {
  at::Tensor chosen, probs;  // [k]
};

std::vector<Route> reference_routes(const MoeMlp& m, const MoeConfig& c, const at::Tensor& rows) {
  const at::Tensor logits = router_logits(m, rows);
  std::vector<Route> routes;
  for (int64_t t = 0; t < rows.size(0); ++t) {
    at::Tensor probs, chosen;
    if (c.score != dtk::layers::MoeScore::kSoftmax) {
      const at::Tensor scores = gate(c, logits[t]);
      chosen = chosen_experts(c, m.expert_bias.defined() ? scores + m.expert_bias : scores);
      probs = scores.index_select(0, chosen);
      probs = probs / (probs.sum() + 1e-20);
    } else if (c.pre_softmax) {
      const at::Tensor scores = at::softmax(logits[t], 0);
      chosen = chosen_experts(c, scores);
      probs = scores.index_select(0, chosen);
    } else {
      chosen = chosen_experts(c, logits[t]);
      probs = at::softmax(logits[t].index_select(0, chosen), 0);
    }
    if (c.topk_scaling_factor > 0) probs = probs * c.topk_scaling_factor;
    routes.push_back({chosen, probs});
  }
  return routes;
}

// The (token, expert) choices token dropping drops.
using Dropped = std::set<std::pair<int64_t, int64_t>>;

// Megatron's apply_router_token_dropping written out expert by expert: the capacity is
// ceil(T k / experts * factor); an expert routed more tokens keeps those with the highest weights
// (policy probs; ties: the earlier token) or the first (policy position), in Megatron's token
// order, [sequence, batch]: row b * positions + s is its token s * batch + b.
Dropped reference_drops(const MoeConfig& c, const std::vector<Route>& routes, int64_t batch) {
  const auto tokens = static_cast<int64_t>(routes.size());
  const int64_t positions = tokens / batch;
  const auto capacity = static_cast<size_t>(
      std::ceil(static_cast<double>(tokens * c.topk) / static_cast<double>(c.num_experts) * c.capacity_factor));
  Dropped dropped;
  for (int64_t e = 0; e < c.num_experts; ++e) {
    std::vector<std::tuple<double, int64_t, int64_t>> routed;  // (-weight or 0, Megatron's index, row)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < c.topk; ++j) {
        if (routes[t].chosen[j].item<int64_t>() != e) continue;
        const double key =
            c.drop_policy == dtk::layers::MoeDropPolicy::kProbs ? -routes[t].probs[j].item<double>() : 0.0;
        routed.emplace_back(key, (t % positions) * batch + t / positions, t);
      }
    std::sort(routed.begin(), routed.end());
    for (size_t i = capacity; i < routed.size(); ++i) dropped.insert({std::get<2>(routed[i]), e});
  }
  return dropped;
}

// The layer on x token by token along the given routes (the dropped choices left out).
at::Tensor routed_reference(const MoeMlp& m, const MoeConfig& c, const at::Tensor& x, bool swiglu_experts,
                            const std::vector<Route>& routes, const Dropped& dropped = {}) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  std::vector<at::Tensor> out;
  for (int64_t t = 0; t < rows.size(0); ++t) {
    const at::Tensor &chosen = routes[t].chosen, &probs = routes[t].probs;
    at::Tensor y = at::zeros({x.size(-1)});
    for (int64_t j = 0; j < c.topk; ++j) {
      const int64_t e = chosen[j].item<int64_t>();
      if (!dropped.count({t, e})) y = y + probs[j] * mlp(m.experts[static_cast<size_t>(e)], rows[t], swiglu_experts);
    }
    if (m.has_shared_expert()) {
      at::Tensor shared = mlp(m.shared, rows[t], swiglu_experts);
      if (m.shared_gate.defined()) shared = shared * at::sigmoid(at::dot(m.shared_gate[0], rows[t]));
      y = y + shared;
    }
    out.push_back(y);
  }
  return at::stack(out).view(x.sizes());
}

// `router_x`: the router's input where it is not x (the input jitter's x * noise).
at::Tensor reference(const MoeMlp& m, const MoeConfig& c, const at::Tensor& x, bool swiglu_experts,
                     const Dropped& dropped = {}, const at::Tensor& router_x = {}) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  return routed_reference(m, c, x, swiglu_experts,
                          reference_routes(m, c, router_x.defined() ? router_x.reshape({-1, x.size(-1)}) : rows),
                          dropped);
}

// One token's weights at the given experts, as reference_routes weighs a top-k choice.
Route weighed(const MoeConfig& c, const at::Tensor& logits, const at::Tensor& chosen) {
  at::Tensor probs;
  if (c.score != dtk::layers::MoeScore::kSoftmax) {
    probs = gate(c, logits).index_select(0, chosen);
    probs = probs / (probs.sum() + 1e-20);
  } else {
    probs =
        c.pre_softmax ? at::softmax(logits, 0).index_select(0, chosen) : at::softmax(logits.index_select(0, chosen), 0);
  }
  if (c.topk_scaling_factor > 0) probs = probs * c.topk_scaling_factor;
  return {chosen, probs};
}

// Megatron-LM's sinkhorn (moe_utils.py) as it writes it: a while loop on the mean change of d1.
at::Tensor megatron_sinkhorn(const at::Tensor& logits, double tol = 1e-4) {
  const at::Tensor cost = at::exp(logits);
  at::Tensor d0 = at::ones({cost.size(0)}), d1 = at::ones({cost.size(1)});
  double error = 1e9;
  at::Tensor d1_old = d1;
  while (error > tol) {
    d0 = 1.0 / static_cast<double>(d0.size(0)) / ((d1 * cost).sum(1) + 1e-8);
    d1 = 1.0 / static_cast<double>(d1.size(0)) / ((d0.unsqueeze(1) * cost).sum(0) + 1e-8);
    error = (d1_old - d1).abs().mean().item<double>();
    d1_old = d1;
  }
  return d1 * cost * d0.unsqueeze(1);
}

// Megatron's compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func (over the
// micro-batch, or per sequence and averaged: its seq_aux_loss) and z_loss_func, written out:
// scores p = softmax(logits) or sigmoid(logits) / its sum, each token's plain top-k of p;
// E * coeff / (k T^2) * sum_e (sum_t p[t, e]) * (tokens that chose e); coeff * mean_t logsumexp^2.
at::Tensor switch_loss(const at::Tensor& scores, const MoeConfig& c, double coeff) {
  const int64_t t = scores.size(0), e = c.num_experts;
  const at::Tensor chosen = std::get<1>(scores.topk(c.topk, -1));
  at::Tensor counts = at::zeros({e});
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < c.topk; ++j) counts[chosen[i][j].item<int64_t>()] += 1;
  return (scores.sum(0) * counts).sum() * (static_cast<double>(e) * coeff / (c.topk * static_cast<double>(t * t)));
}

at::Tensor reference_aux_losses(const MoeMlp& m, const MoeConfig& c, const at::Tensor& x) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const at::Tensor logits = router_logits(m, rows);
  at::Tensor scores = at::softmax(logits, -1);
  if (c.score != dtk::layers::MoeScore::kSoftmax) {
    scores = gate(c, logits);
    scores = scores / (scores.sum(-1, true) + 1e-20);
  }
  at::Tensor balance = at::zeros({});
  if (c.seq_aux_loss_coeff > 0) {
    const int64_t sequences = x.size(0), positions = x.size(1);
    for (int64_t b = 0; b < sequences; ++b)
      balance = balance + switch_loss(scores.narrow(0, b * positions, positions), c, c.seq_aux_loss_coeff) / sequences;
  }
  if (c.aux_loss_coeff > 0) balance = balance + switch_loss(scores, c, c.aux_loss_coeff);
  const at::Tensor z = at::logsumexp(logits, -1).square().mean() * c.z_loss_coeff;
  return balance + z;
}

std::vector<at::Tensor> grads_of(const MoeMlp& m, const at::Tensor& x) {
  std::vector<at::Tensor> out{x.grad(), m.router.grad()};
  if (m.router_bias.defined()) out.push_back(m.router_bias.grad());
  for (const MoeMlp::Expert* e : experts_of(m)) {
    for (const auto& in : e->in) {
      out.push_back(in.weight.grad());
      if (in.bias.defined()) out.push_back(in.bias.grad());
    }
    out.push_back(e->out.weight.grad());
    if (e->out.bias.defined()) out.push_back(e->out.bias.grad());
  }
  if (m.shared_gate.defined()) out.push_back(m.shared_gate.grad());
  if (m.residual_coefficient.defined())
    out.insert(out.end(), {m.residual_coefficient.grad(), m.residual_coefficient_bias.grad()});
  return out;
}

void zero_grads(const MoeMlp& m, at::Tensor& x) {
  x.mutable_grad() = at::Tensor();
  m.router.mutable_grad() = at::Tensor();
  if (m.router_bias.defined()) m.router_bias.mutable_grad() = at::Tensor();
  for (const MoeMlp::Expert* e : experts_of(m)) {
    for (const auto& in : e->in) {
      in.weight.mutable_grad() = at::Tensor();
      if (in.bias.defined()) in.bias.mutable_grad() = at::Tensor();
    }
    e->out.weight.mutable_grad() = at::Tensor();
    if (e->out.bias.defined()) e->out.bias.mutable_grad() = at::Tensor();
  }
  if (m.shared_gate.defined()) m.shared_gate.mutable_grad() = at::Tensor();
  if (m.residual_coefficient.defined()) {
    m.residual_coefficient.mutable_grad() = at::Tensor();
    m.residual_coefficient_bias.mutable_grad() = at::Tensor();
  }
}

// The layer's gradients (grads_of) against the reference's within rtol 1e-5 and `atol`. An expert no
// token chose has no gradient in the reference, and a zero one in the layer.
void expect_same_grads(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, double atol,
                       const std::string& what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    EXPECT_TRUE(got[i].defined()) << what << ": gradient " << i << " missing";
    if (!got[i].defined()) continue;
    const at::Tensor want_grad = want[i].defined() ? want[i] : at::zeros_like(got[i]);
    EXPECT_TRUE(at::allclose(got[i], want_grad, 1e-5, atol))
        << what << ": gradient " << i << " differs by " << (got[i] - want_grad).abs().max().item<double>();
  }
}

// The layer's output and gradients against the reference's, for one configuration; with
// auxiliary losses the reference adds them to its objective.
// With token dropping (`dropping` sets its options) the reference leaves out what
// reference_drops drops; returns how many choices that is.
// Which load-balancing losses aux_coeff weighs: aux_loss, seq_aux_loss, or both listed (seq_aux_loss
// at half the coefficient).
enum class Balance { kAux, kSeq, kBoth };

size_t expect_layer_equals_reference(const Case& k, double aux_coeff, double z_coeff, Balance balance = Balance::kAux,
                                     const std::function<void(MoeConfig&)>& dropping = {}) {
  MoeConfig c = config_of(k);
  c.z_loss_coeff = z_coeff;
  if (balance != Balance::kSeq) c.aux_loss_coeff = aux_coeff;
  if (balance != Balance::kAux) c.seq_aux_loss_coeff = balance == Balance::kBoth ? aux_coeff / 2 : aux_coeff;
  if (dropping) dropping(c);
  const MoeMlp m = make_layer(c, 8, k);
  at::manual_seed(3);
  at::Tensor x = at::randn({3, 7, 8}).requires_grad_(true);
  const at::Tensor weights = at::randn({3, 7, 8});
  const ::dtk::layers::ExpertActivation act = k.inputs == 1 ? gelu : swiglu;
  std::string what = std::string(k.name) + (balance == Balance::kSeq    ? " (seq)"
                                            : balance == Balance::kBoth ? " (aux and seq)"
                                                                        : "");
  if (c.drops_tokens())
    what += " (capacity factor " + std::to_string(c.capacity_factor) +
            (c.drop_policy == dtk::layers::MoeDropPolicy::kProbs ? ", probs" : ", position") +
            (c.pad_to_capacity ? ", padded)" : ")");

  const at::Tensor got = m.forward(x, act);
  (got * weights).sum().backward();
  const std::vector<at::Tensor> got_grads = grads_of(m, x);
  zero_grads(m, x);

  const Dropped dropped =
      c.drops_tokens() ? reference_drops(c, reference_routes(m, c, x.reshape({-1, 8})), x.size(0)) : Dropped{};
  const at::Tensor want = reference(m, c, x, k.inputs == 2, dropped);
  at::Tensor objective = (want * weights).sum();
  if (aux_coeff > 0 || z_coeff > 0) objective = objective + reference_aux_losses(m, c, x);
  objective.backward();
  const std::vector<at::Tensor> want_grads = grads_of(m, x);

  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6))
      << what << ": output differs by " << (got - want).abs().max().item<double>();
  expect_same_grads(got_grads, want_grads, 1e-6, what);
  return dropped.size();
}

const Case kCases[] = {
    {"GELU experts with biases", 1, true, false, 0.0},
    {"SwiGLU experts without biases", 2, false, false, 0.0},
    {"softmax before the top-k, scaled", 1, true, true, 2.5},
    {"sigmoid scores (DeepSeek-V3), scaled", 2, false, false, 2.5, true},
    {"group-limited, softmax after the top-k", 1, true, false, 0.0, false, 3, 1},
    {"group-limited sigmoid, shared expert", 2, false, false, 0.0, true, 3, 2, 4},
    {"softmax before the top-k, gated shared expert with biases", 1, true, true, 0.0, false, 0, 0, 4, true},
    {"sigmoid with expert bias, group-limited", 2, false, false, 0.0, true, 3, 2, 0, false, true},
    {"sqrtsoftplus, scaled, gated shared expert", 1, true, false, 1.5, true, 0, 0, 4, true, false, true},
    {"sqrtsoftplus with expert bias, group-limited", 2, false, false, 0.0, true, 3, 2, 0, false, true, true},
};

}  // namespace

TEST(MoeLayer, EqualsATokenByTokenReferenceForwardAndBackward) {
  for (const Case& k : kCases) expect_layer_equals_reference(k, 0.0, 0.0);
}

TEST(MoeLayer, AuxiliaryLossesAreMegatronsAndReachOnlyTheGradients) {
  for (const Case& k : kCases) {
    expect_layer_equals_reference(k, 0.1, 0.01);
    expect_layer_equals_reference(k, 0.1, 0.0, Balance::kSeq);
    expect_layer_equals_reference(k, 0.1, 0.01, Balance::kBoth);
  }
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

// Token dropping (Megatron's --moe-expert-capacity-factor): 21 tokens choosing 2 of 6 experts, a
// capacity of 4 (factor 0.5), 7 (1.0), the tokens (3.0) or above them (4.0): nothing dropped; each drop policy,
// padded to capacity or not, biased experts (the output bias weighted by the kept choices) and
// sigmoid scores steered by the expert bias; the auxiliary losses on (they see every choice).
TEST(MoeLayer, TokenDroppingKeepsWhatMegatronsCapacityKeeps) {
  using dtk::layers::MoeDropPolicy;
  for (const Case* k : {&kCases[0], &kCases[7]})
    for (const MoeDropPolicy policy : {MoeDropPolicy::kProbs, MoeDropPolicy::kPosition})
      for (const bool pad : {false, true}) {
        std::map<double, size_t> dropped;
        for (const double factor : {0.5, 1.0, 3.0, 4.0})
          dropped[factor] = expect_layer_equals_reference(*k, 0.1, 0.01, Balance::kAux, [&](MoeConfig& c) {
            c.capacity_factor = factor;
            c.drop_policy = policy;
            c.pad_to_capacity = pad;
          });
        // The guard: the reference does drop (every expert keeps at most 4 of 42 choices: 18 left).
        EXPECT_GE(dropped[0.5], 18u) << k->name;
        EXPECT_GT(dropped[0.5], dropped[1.0]) << k->name;
        EXPECT_EQ(dropped[3.0], 0u) << k->name;  // a capacity of 21: every token fits
        EXPECT_EQ(dropped[4.0], 0u) << k->name;
      }
}

// Generation (a key/value cache) routes every token whatever the capacity, as Megatron's inference
// router: the dropless reference; the training forward drops.
TEST(MoeLayer, GenerationRoutesDroplessWhateverTheCapacity) {
  MoeConfig c = config_of(kCases[0]);
  c.capacity_factor = 0.5;
  const MoeMlp m = make_layer(c, 8, kCases[0]);
  at::manual_seed(6);
  const at::Tensor x = at::randn({3, 7, 8});
  at::NoGradGuard no_grad;
  const at::Tensor generated = m.forward(x, gelu, /*generating=*/true);
  EXPECT_TRUE(at::allclose(generated, reference(m, c, x, false), 1e-5, 1e-6));
  EXPECT_FALSE(at::allclose(m.forward(x, gelu), generated, 1e-3, 1e-3));
}

namespace {

// DeepSpeed's top1gating and top2gating (deepspeed/moe/sharded_moe.py) written out as DeepSpeed
// writes them: tokens in its order (x [s, b, h] reshaped, so token p = s * batch + b is row
// b * positions + s here), one-hot masks, capacity buffers by cumsum, random token selection by
// topk over the mask times the uniforms, and the combine weights [S, E]; then every expert on
// every token, weighted, with no second bias. `uniforms`: the draws the layer makes from the
// same generator, by row ([rows, 1] for top-1's selection, [rows, E] for top-2's Gumbel noise).
struct DeepSpeedGate {
  at::Tensor out;    // [b, s, h]
  at::Tensor l_aux;  // DeepSpeed's, without the coefficient
  int64_t dropped = 0;
};

DeepSpeedGate deepspeed_reference(const MoeMlp& m, const MoeConfig& c, const at::Tensor& x, bool training,
                                  const at::Tensor& uniforms) {
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2), e = c.num_experts, tokens = b * s;
  const at::Tensor order = at::arange(tokens).view({b, s}).t().reshape(-1);  // DeepSpeed's token p: this row
  const at::Tensor xs = x.transpose(0, 1).reshape({tokens, h});
  const at::Tensor logits = at::matmul(xs.to(at::kFloat), m.router.to(at::kFloat).t());
  const at::Tensor gates = at::softmax(logits, 1);
  const double factor = training || c.eval_capacity_factor == 0 ? c.capacity_factor : c.eval_capacity_factor;
  const auto capacity_of = [&](double f) {
    const auto cap = static_cast<int64_t>(
        std::ceil(static_cast<float>(static_cast<double>(tokens) / static_cast<double>(e)) * static_cast<float>(f)));
    return std::max(cap, c.min_capacity);
  };
  const bool drops = c.capacity_factor > 0;
  DeepSpeedGate r;
  const at::Tensor indices1 = at::argmax(gates, 1);
  at::Tensor mask1 = at::one_hot(indices1, e);
  const at::Tensor me = gates.mean(0), ce = mask1.to(at::kFloat).mean(0);
  at::Tensor combine;
  if (c.topk > 2) {  // topkgating: the k highest logits, capacity by them scattered into zeros ("probs")
    const auto [top_gate, top_idx] = at::topk(logits, c.topk, 1);
    const at::Tensor masked_gates = at::zeros_like(logits).scatter(1, top_idx, top_gate);
    at::Tensor mask = at::zeros_like(gates).scatter(1, top_idx, 1.0);
    r.l_aux = (me * mask.mean(0)).mean() * static_cast<double>(e * e) / static_cast<double>(c.topk);
    if (drops) {
      // (Above T tokens torch.topk refuses DeepSpeed's capacity; then every choice fits.)
      const int64_t capacity = std::min(capacity_of(factor * static_cast<double>(c.topk)), tokens);
      const at::Tensor top = std::get<1>(at::topk(masked_gates, capacity, 0, true, false));
      const at::Tensor kept = mask * at::zeros_like(mask).scatter_(0, top, 1.0);
      r.dropped = (mask.sum() - kept.sum()).item<int64_t>();
      mask = kept;
    }
    combine = gates * mask;
    combine = combine / at::clamp_min(combine.sum(1, true), std::numeric_limits<float>::epsilon());
  } else if (c.topk == 1) {
    r.l_aux = (me * ce).sum() * static_cast<double>(e);
    if (drops) {
      const int64_t capacity = capacity_of(factor);
      const at::Tensor rand = mask1 * uniforms.index_select(0, order);
      const at::Tensor top = std::get<1>(at::topk(rand, capacity, 0));
      const at::Tensor kept = mask1 * at::zeros_like(mask1).scatter_(0, top, 1);
      r.dropped = (mask1.sum() - kept.sum()).item<int64_t>();
      mask1 = kept;
    }
    combine = gates * mask1.to(at::kFloat);
  } else {
    at::Tensor noisy = logits;
    if (c.second_expert_sampling) noisy = logits + (-at::log(-at::log(uniforms.index_select(0, order))));
    at::Tensor mask2 = at::one_hot(at::argmax(noisy.masked_fill(mask1.to(at::kBool), -INFINITY), 1), e);
    const at::Tensor locations1 = at::cumsum(mask1, 0) - 1;
    const at::Tensor locations2 = at::cumsum(mask2, 0) - 1 + mask1.sum(0, true);
    r.l_aux = (me * ce).mean() * static_cast<double>(e * e);
    if (drops) {
      const int64_t capacity = capacity_of(factor * 2);
      const at::Tensor before = mask1.sum() + mask2.sum();
      mask1 = mask1 * at::lt(locations1, capacity);
      mask2 = mask2 * at::lt(locations2, capacity);
      r.dropped = (before - mask1.sum() - mask2.sum()).item<int64_t>();
    }
    at::Tensor gates1 = (gates * mask1.to(at::kFloat)).sum(1), gates2 = (gates * mask2.to(at::kFloat)).sum(1);
    const at::Tensor denom = at::clamp_min(gates1 + gates2, std::numeric_limits<float>::epsilon());
    gates1 = gates1 / denom, gates2 = gates2 / denom;
    combine = gates1.unsqueeze(1) * mask1.to(at::kFloat) + gates2.unsqueeze(1) * mask2.to(at::kFloat);
  }
  std::vector<at::Tensor> rows;
  for (int64_t p = 0; p < tokens; ++p) {
    at::Tensor y = at::zeros({h});
    for (int64_t j = 0; j < e; ++j) {
      const MoeMlp::Expert& ex = m.experts[static_cast<size_t>(j)];
      // (DeepSpeed's experts drop the bias their second projection returns.)
      const at::Tensor inner = at::gelu(at::matmul(ex.in[0].weight, xs[p]) + ex.in[0].bias);
      y = y + combine[p][j] * at::matmul(ex.out.weight, inner);
    }
    rows.push_back(y);
  }
  at::Tensor out = at::stack(rows);
  if (c.residual) {  // DeepSpeed's residual MoE: its dense MLP (no second bias) mixed per token
    const MoeMlp::Expert& mlp = m.shared;
    const at::Tensor dense =
        at::matmul(at::gelu(at::matmul(xs, mlp.in[0].weight.t()) + mlp.in[0].bias), mlp.out.weight.t());
    const at::Tensor mix = at::softmax(at::matmul(xs, m.residual_coefficient.t()) + m.residual_coefficient_bias, 1);
    out = out * mix.select(1, 0).unsqueeze(1) + dense * mix.select(1, 1).unsqueeze(1);
  }
  r.out = out.view({s, b, h}).transpose(0, 1);
  return r;
}

// The draws the layer makes for the gate's noise from a generator seeded `seed`.
at::Tensor gate_uniforms(uint64_t seed, std::vector<int64_t> shape) {
  at::Generator gen = dtk::layers::seeded_generator(seed);
  const int64_t numel = shape[0] * shape[1];
  return dtk::layers::uniform_noise_on(dtk::layers::draw_uniforms(shape, gen), numel, 0.0, 1.0, at::kCPU).view(shape);
}

}  // namespace

// DeepSpeed's gate (moe_gate=deepspeed, Megatron-DeepSpeed's MoE) equals DeepSpeed's algorithm
// written out (deepspeed_reference), output and every gradient with its l_aux in the objective:
// top-1 with random token selection, top-2 with and without the Gumbel-sampled second expert, and
// topkgating's top-3 and top-4; capacities that drop (factor 0.5 and 1.0), one that
// moe_min_capacity raises, one that keeps everything, dropless, and evaluation's factor. The experts have no second
// bias, the router none.
TEST(MoeLayer, DeepSpeedGateIsDeepSpeedsTopKGate) {
  struct GateCase {
    int64_t topk;
    double factor, eval_factor;
    int64_t min_capacity;
    bool sampling, training;
    bool residual = false;
  };
  const GateCase cases[] = {
      {1, 0.5, 0, 0, true, true},       {1, 1.0, 0, 4, true, true},       {1, 0.1, 0, 4, true, true},
      {1, 6.0, 0, 0, true, true},       {1, 0.0, 0, 0, true, true},       {1, 0.5, 2.0, 4, true, false},
      {2, 0.5, 0, 0, true, true},       {2, 1.0, 0, 4, true, true},       {2, 0.5, 0, 0, false, true},
      {2, 0.1, 0, 4, false, true},      {2, 0.0, 0, 0, true, true},       {2, 2.0, 0.5, 4, true, false},
      {1, 0.5, 0, 0, true, true, true}, {2, 1.0, 0, 4, true, true, true}, {3, 0.5, 0, 0, false, true},
      {4, 1.0, 0, 4, false, true},      {3, 0.1, 0, 4, false, true},      {3, 6.0, 0, 0, false, true},
      {3, 0.0, 0, 0, false, true},      {3, 2.0, 0.5, 4, false, false},   {3, 0.5, 0, 0, false, true, true}};
  int64_t dropped_top1 = 0, dropped_top2 = 0, dropped_topk = 0;
  for (const GateCase& g : cases) {
    MoeConfig c;
    c.num_experts = 6, c.topk = g.topk, c.ffn = 6, c.aux_loss_coeff = 0.1;
    c.gate = dtk::layers::MoeGate::kDeepSpeed;
    c.capacity_factor = g.factor, c.eval_capacity_factor = g.eval_factor, c.min_capacity = g.min_capacity;
    c.second_expert_sampling = g.sampling;
    c.residual = g.residual;
    const MoeMlp m = make_layer(c, 8, kCases[0]);
    if (g.residual) {  // a coefficient bias that moves the mix
      ASSERT_FALSE(m.shared.out.bias.defined());
      at::manual_seed(8);
      m.residual_coefficient_bias.data().normal_(0, 0.5);
    }
    ASSERT_FALSE(m.router_bias.defined());
    ASSERT_FALSE(m.experts[0].out.bias.defined());
    ASSERT_TRUE(m.experts[0].in[0].bias.defined());
    const std::string what = "top-" + std::to_string(g.topk) + ", factor " + std::to_string(g.factor) +
                             (g.training ? "" : " (evaluation, " + std::to_string(g.eval_factor) + ")") +
                             ", min capacity " + std::to_string(g.min_capacity) + (g.sampling ? "" : ", argmax") +
                             (g.residual ? ", residual" : "");
    at::manual_seed(3);
    at::Tensor x = at::randn({3, 7, 8}).requires_grad_(true);
    const at::Tensor weights = at::randn({3, 7, 8});
    at::Generator gen = dtk::layers::seeded_generator(21);
    const at::Tensor got = m.forward(x, gelu, /*generating=*/false, &gen, g.training);
    (got * weights).sum().backward();
    const std::vector<at::Tensor> got_grads = grads_of(m, x);
    zero_grads(m, x);

    // The layer draws once per forward: the selection's uniforms (top-1, only when it drops) or
    // the Gumbel noise's (top-2 with sampling).
    const at::Tensor uniforms = gate_uniforms(21, {21, g.topk == 1 ? 1 : 6});  // (top-k draws none)
    const DeepSpeedGate want = deepspeed_reference(m, c, x, g.training, uniforms);
    ((want.out * weights).sum() + want.l_aux * c.aux_loss_coeff).backward();
    EXPECT_TRUE(at::allclose(got, want.out, 1e-5, 1e-6))
        << what << ": output differs by " << (got - want.out).abs().max().item<double>();
    expect_same_grads(got_grads, grads_of(m, x), 1e-6, what);
    (g.topk == 1 ? dropped_top1 : g.topk == 2 ? dropped_top2 : dropped_topk) += want.dropped;
    // Where the layer draws (top-1 dropping, top-2 sampling), other draws give another output.
    if ((g.topk == 1 && want.dropped > 0) || (g.topk == 2 && g.sampling)) {
      at::Generator other = dtk::layers::seeded_generator(22);
      at::NoGradGuard no_grad;
      EXPECT_FALSE(at::allclose(m.forward(x, gelu, false, &other, g.training), got, 1e-4, 1e-5)) << what;
    }
    if (g.factor == 6.0 || g.factor == 0.0) {
      EXPECT_EQ(want.dropped, 0) << what;
    }
    if (g.factor == 0.1) {
      EXPECT_GT(want.dropped, 0) << what << ": the least capacity, 4, still drops some";
    }
  }
  // The guard: the reference does drop, so the selection is checked.
  EXPECT_GE(dropped_top1, 10);
  EXPECT_GE(dropped_top2, 10);
  EXPECT_GE(dropped_topk, 10);
}

// The gate's capacity is DeepSpeed's _capacity: ceil(T / E * f * k) in fp32, at least the minimum,
// the evaluation factor in evaluation (the training one where it is 0).
TEST(MoeLayer, DeepSpeedGateCapacityIsDeepSpeeds) {
  MoeConfig c;
  c.num_experts = 8, c.topk = 1, c.capacity_factor = 1.25, c.min_capacity = 4;
  EXPECT_EQ(c.deepspeed_capacity(1024, true), 160);  // 128 * 1.25
  EXPECT_EQ(c.deepspeed_capacity(16, true), 4);      // ceil(2.5) = 3, raised to 4
  EXPECT_EQ(c.deepspeed_capacity(10, true), 4);      // ceil(1.5625) = 2, raised to 4
  c.topk = 2;
  EXPECT_EQ(c.deepspeed_capacity(1024, true), 320);
  c.eval_capacity_factor = 2.0;
  EXPECT_EQ(c.deepspeed_capacity(1024, false), 512);
  EXPECT_EQ(c.deepspeed_capacity(1024, true), 320);
  c.topk = 1, c.eval_capacity_factor = 0.0, c.min_capacity = 0, c.capacity_factor = 0.3;
  EXPECT_EQ(c.deepspeed_capacity(10, false), 1);  // ceil(1.25f * 0.3f) = 1
  c.capacity_factor = 1.1;
  EXPECT_EQ(c.deepspeed_capacity(80, true), 11);  // 10 * 1.1 in fp32 is 11 (in fp64 11.000000000000002: 12)
  c.num_experts = 6, c.capacity_factor = 0.1, c.min_capacity = 4;
  EXPECT_EQ(c.deepspeed_capacity(21, true), 4);  // ceil(0.35) = 1, raised to 4
}

// Generation routes DeepSpeed's gate without noise and dropless: each token's best expert (top-1)
// or two best, weighted as the gate weighs them.
TEST(MoeLayer, DeepSpeedGateGeneratesDroplessWithoutNoise) {
  for (const int64_t k : {1, 2}) {
    MoeConfig c;
    c.num_experts = 6, c.topk = k, c.ffn = 6, c.gate = dtk::layers::MoeGate::kDeepSpeed, c.capacity_factor = 0.5;
    c.second_expert_sampling = k == 2;
    const MoeMlp m = make_layer(c, 8, kCases[0]);
    at::manual_seed(6);
    const at::Tensor x = at::randn({3, 7, 8});
    at::NoGradGuard no_grad;
    const at::Tensor generated = m.forward(x, gelu, /*generating=*/true);
    MoeConfig plain = c;
    plain.capacity_factor = 0.0, plain.second_expert_sampling = false;
    const at::Tensor want = deepspeed_reference(m, plain, x, false, at::Tensor()).out;
    EXPECT_TRUE(at::allclose(generated, want, 1e-5, 1e-6)) << "top-" << k;
    at::Generator gen = dtk::layers::seeded_generator(2);
    EXPECT_FALSE(at::allclose(m.forward(x, gelu, false, &gen), generated, 1e-3, 1e-3)) << "top-" << k;
  }
}

// Megatron's input jitter: the router, and only the router, sees x times Uniform(1 - eps, 1 + eps)
// noise, one draw of the generator per forward (the noise of the SDK's hashed draws, checked here
// for its range, mean and slicing); the experts get x itself. Generation draws none.
TEST(MoeLayer, InputJitterScalesTheRoutersInputOnly) {
  const Case& k = kCases[0];
  MoeConfig c = config_of(k);
  c.input_jitter_eps = 0.3;  // large enough to change choices
  const MoeMlp m = make_layer(c, 8, k);
  at::manual_seed(3);
  at::Tensor x = at::randn({3, 7, 8}).requires_grad_(true);
  const at::Tensor weights = at::randn({3, 7, 8});
  at::Generator gen = dtk::layers::seeded_generator(21), copy = dtk::layers::seeded_generator(21);

  const at::Tensor got = m.forward(x, gelu, false, &gen);
  (got * weights).sum().backward();
  const std::vector<at::Tensor> got_grads = grads_of(m, x);
  zero_grads(m, x);

  const dtk::layers::DropoutMask draw = dtk::layers::draw_uniforms({3, 7, 8}, copy);
  const at::Tensor noise = dtk::layers::uniform_noise_on(draw, x.numel(), 0.7, 1.3, x.device()).view(x.sizes());
  const at::Tensor want = reference(m, c, x, false, {}, x * noise);
  (want * weights).sum().backward();
  const std::vector<at::Tensor> want_grads = grads_of(m, x);
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << "output differs by " << (got - want).abs().max().item<double>();
  ASSERT_EQ(got_grads.size(), want_grads.size());
  for (size_t i = 0; i < got_grads.size(); ++i) {
    const at::Tensor want_grad = want_grads[i].defined() ? want_grads[i] : at::zeros_like(got_grads[i]);
    EXPECT_TRUE(got_grads[i].defined() && at::allclose(got_grads[i], want_grad, 1e-5, 1e-6)) << "gradient " << i;
  }
  // One draw each: the generators agree afterwards.
  EXPECT_EQ(dtk::layers::draw_uniforms({1}, gen).seed, dtk::layers::draw_uniforms({1}, copy).seed);

  at::NoGradGuard no_grad;
  // The noise matters: without it (or with the experts' input jittered too) the output differs.
  const at::Tensor plain = reference(m, c, x, false);
  EXPECT_GT((got - plain).abs().max().item<double>(), 1e-3) << "the jitter changed nothing";
  EXPECT_GT((got - reference(m, c, x * noise, false)).abs().max().item<double>(), 1e-3);
  // Generation draws nothing and routes x itself; a forward that draws needs its generator.
  EXPECT_TRUE(at::allclose(m.forward(x, gelu, /*generating=*/true), plain, 1e-5, 1e-6));
  EXPECT_THROW(m.forward(x, gelu), dtk::Error);

  // The noise: within [1 - eps, 1 + eps], mean 1, and a slice of a draw (a sequence-parallel
  // rank's rows, a chunk of rows) is the slice of the whole draw's noise.
  at::Generator g = dtk::layers::seeded_generator(5);
  const dtk::layers::DropoutMask whole = dtk::layers::draw_uniforms({4, 64, 96}, g);
  const at::Tensor n = dtk::layers::uniform_noise_on(whole, 4 * 64 * 96, 0.9, 1.1, at::kCPU).view({4, 64, 96});
  EXPECT_GE(n.min().item<float>(), 0.9f);  // the bounds as fp32 rounds them
  EXPECT_LE(n.max().item<float>(), 1.1f);
  EXPECT_NEAR(n.mean().item<double>(), 1.0, 1e-3);
  EXPECT_GT(n.std().item<double>(), 0.05);  // 0.2 / sqrt(12) = 0.058
  const at::Tensor shard =
      dtk::layers::uniform_noise_on(whole.sequence_rows(64, 32, 32), 4 * 32 * 96, 0.9, 1.1, at::kCPU);
  EXPECT_TRUE(at::equal(shard.view({4, 32, 96}), n.narrow(1, 32, 32)));
  const at::Tensor rows = dtk::layers::uniform_noise_on(whole.rows(1, 2), 2 * 64 * 96, 0.9, 1.1, at::kCPU);
  EXPECT_TRUE(at::equal(rows.view({2, 64, 96}), n.narrow(0, 1, 2)));
}

// The expert bias's loads are Megatron's final routing map: the kept choices, or with padding every
// expert's capacity; the two policies keep different tokens.
TEST(MoeLayer, TokenDroppingCountsTheKeptChoicesForTheExpertBias) {
  MoeConfig c = config_of(kCases[7]);
  c.capacity_factor = 0.5;
  at::manual_seed(4);
  const at::Tensor x = at::randn({3, 7, 8});
  std::map<dtk::layers::MoeDropPolicy, at::Tensor> outputs;
  for (const auto policy : {dtk::layers::MoeDropPolicy::kProbs, dtk::layers::MoeDropPolicy::kPosition}) {
    c.drop_policy = policy;
    const MoeMlp m = make_layer(c, 8, kCases[7]);
    outputs[policy] = m.forward(x.clone().requires_grad_(true), swiglu);
    const std::vector<Route> routes = reference_routes(m, c, x.reshape({-1, 8}));
    const Dropped dropped = reference_drops(c, routes, 3);
    at::Tensor want = at::zeros({c.num_experts});
    for (int64_t t = 0; t < 21; ++t)
      for (int64_t j = 0; j < c.topk; ++j) {
        const int64_t e = routes[t].chosen[j].item<int64_t>();
        if (!dropped.count({t, e})) want[e] += 1;
      }
    EXPECT_TRUE(at::equal(m.expert_load, want)) << m.expert_load << want;
    EXPECT_LE(m.expert_load.max().item<double>(), 4.0);
  }
  EXPECT_FALSE(at::allclose(outputs.begin()->second, outputs.rbegin()->second));
  c.pad_to_capacity = true;
  const MoeMlp padded = make_layer(c, 8, kCases[7]);
  padded.forward(x.clone().requires_grad_(true), swiglu);
  EXPECT_TRUE(at::equal(padded.expert_load, at::full({c.num_experts}, 4.0))) << padded.expert_load;
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

// Auxiliary-loss-free balancing: the training forwards count each expert's choices (not
// evaluation's), and after the iteration every bias moves by the rate toward the mean load
// (Megatron's get_updated_expert_bias, written out), the counts restarting from zero.
TEST(MoeLayer, ExpertBiasFollowsTheTrainingLoads) {
  MoeConfig c = config_of(kCases[7]);
  c.bias_update_rate = 0.25;
  const MoeMlp m = make_layer(c, 8, kCases[7]);
  ASSERT_TRUE(m.expert_bias.defined());
  const at::Tensor before = m.expert_bias.clone();
  at::manual_seed(4);
  const at::Tensor x = at::randn({2, 5, 8});
  {
    at::NoGradGuard evaluation;
    m.forward(x, swiglu);
  }
  EXPECT_EQ(m.expert_load.sum().item<double>(), 0.0);
  m.forward(x.clone().requires_grad_(true), swiglu);
  m.forward(x.clone().requires_grad_(true), swiglu);
  // Two forwards of 10 tokens choosing 2 experts each; the reference's choices, counted.
  at::Tensor want_load = at::zeros({c.num_experts});
  const at::Tensor logits = router_logits(m, x.reshape({-1, 8}));
  for (int64_t t = 0; t < 10; ++t) {
    const at::Tensor chosen = chosen_experts(c, at::sigmoid(logits[t]) + m.expert_bias);
    for (int64_t j = 0; j < c.topk; ++j) want_load[chosen[j].item<int64_t>()] += 2;
  }
  ASSERT_TRUE(at::equal(m.expert_load, want_load)) << m.expert_load << want_load;
  dtk::layers::end_moe_iteration({const_cast<MoeMlp*>(&m)});
  const at::Tensor want_bias = before + (want_load.mean() - want_load).sign() * 0.25;
  EXPECT_TRUE(at::allclose(m.expert_bias, want_bias)) << m.expert_bias << want_bias;
  EXPECT_EQ(m.expert_load.sum().item<double>(), 0.0);
  EXPECT_FALSE(at::equal(m.expert_bias, before));
}

// moe_router_load_balancing_type and moe_aux_loss_coeff: one type, or Megatron's lists (a
// coefficient per type), each wrong form refused naming it.
TEST(MoeLayer, BalanceTypesReadMegatronsLists) {
  MoeConfig c;
  dtk::layers::parse_moe_balance("aux_loss", "0.01", c);
  EXPECT_EQ(c.aux_loss_coeff, 0.01);
  EXPECT_EQ(c.seq_aux_loss_coeff + c.global_aux_loss_coeff, 0.0);
  dtk::layers::parse_moe_balance("seq_aux_loss, global_aux_loss", "1e-3,1e-4", c);
  EXPECT_EQ(c.aux_loss_coeff, 0.0);
  EXPECT_EQ(c.seq_aux_loss_coeff, 1e-3);
  EXPECT_EQ(c.global_aux_loss_coeff, 1e-4);
  dtk::layers::parse_moe_balance(" aux_loss , seq_aux_loss", " 0.5 ,0.25 ", c);  // spaces around items
  EXPECT_EQ(c.aux_loss_coeff, 0.5);
  EXPECT_EQ(c.seq_aux_loss_coeff, 0.25);
  EXPECT_EQ(c.global_aux_loss_coeff, 0.0);
  dtk::layers::parse_moe_balance("none", "0", c);
  EXPECT_FALSE(c.balances());
  EXPECT_EQ(c.routing, dtk::layers::MoeRouting::kTopK);
  dtk::layers::parse_moe_balance("sinkhorn", "0", c);  // balancing by the choice, no loss
  EXPECT_EQ(c.routing, dtk::layers::MoeRouting::kSinkhorn);
  EXPECT_FALSE(c.balances());
  dtk::layers::parse_moe_balance("quantile_balancing", "0", c);
  EXPECT_EQ(c.routing, dtk::layers::MoeRouting::kQuantileBalancing);
  dtk::layers::parse_moe_balance("aux_loss", "0.01", c);
  EXPECT_EQ(c.routing, dtk::layers::MoeRouting::kTopK);
  const std::pair<std::pair<const char*, const char*>, const char*> bad[] = {
      {{"aux_loss,global_aux_loss", "0.01"}, "gives 1 coefficient(s) for the 2 load-balancing type(s)"},
      {{"aux_loss", "0.01,0.02"}, "gives 2 coefficient(s) for the 1 load-balancing type(s)"},
      {{"aux_loss,aux_loss", "1,1"}, "lists aux_loss twice"},
      {{"sinkhorn,aux_loss", "0,0.1"}, "sinkhorn chooses the experts itself and adds no loss: list it alone"},
      {{"aux_loss,quantile_balancing", "0.1,0"}, "quantile_balancing chooses the experts itself"},
      {{"sinkhorn", "0.01"}, "moe_aux_loss_coeff must be 0 with moe_router_load_balancing_type=sinkhorn"},
      {{"switch", "0"},
       "'switch' is not one of aux_loss, seq_aux_loss, global_aux_loss (or sinkhorn, quantile_balancing, none "
       "alone)"},
      {{"none,aux_loss", "0,1"}, "'none' is not one of"},
      {{"aux_loss", "x"}, "'x' is not a number"},
      {{"aux_loss", "-1"}, "must be finite and >= 0, got -1"},
      {{"aux_loss", ""}, "'' is not a number"},
      {{"none", "0.1"}, "weighs no loss with moe_router_load_balancing_type=none"},
      {{"none", "0.1,0.2"}, "gives 2 coefficient(s) for the 1 load-balancing type(s)"},
      {{"aux_loss,", "0.1,0.1"}, "'' is not one of"},
      {{"aux _loss", "0.1"}, "'aux _loss' is not one of"},
      {{"sinkhorn,foo", "0,0"}, "sinkhorn chooses the experts itself"},
      {{"aux_loss", "1 e-3"}, "'1 e-3' is not a number"}};
  for (const auto& [args, want] : bad) {
    try {
      dtk::layers::parse_moe_balance(args.first, args.second, c);
      ADD_FAILURE() << args.first << " / " << args.second << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
}

// Megatron's global_aux_loss in one process: each training forward's loss is Switch
// Transformer's with the tokens per expert averaged over this iteration's forwards so far
// (_apply_global_aux_loss written out: E * coeff / (k T^2) * sum_e (sum_t p[t, e]) * mean_f
// counts_f[e]); evaluation counts nothing; end_moe_iteration restarts the counts.
TEST(MoeLayer, GlobalAuxLossAveragesTheTokensPerExpertOverTheIteration) {
  MoeConfig c = config_of(kCases[0]);
  c.global_aux_loss_coeff = 0.1;
  const MoeMlp m = make_layer(c, 8, kCases[0]);
  at::manual_seed(5);
  std::vector<at::Tensor> counts;  // each counted forward's tokens per expert
  const auto expect_forward = [&](const at::Tensor& input, const std::string& what) {
    at::Tensor x = input.clone().requires_grad_(true);
    const at::Tensor weights = at::randn(x.sizes());
    (m.forward(x, gelu) * weights).sum().backward();
    const std::vector<at::Tensor> got = grads_of(m, x);
    zero_grads(m, x);
    const at::Tensor scores = at::softmax(router_logits(m, x.reshape({-1, 8})), -1);
    at::Tensor mine = at::zeros({c.num_experts});
    const at::Tensor chosen = std::get<1>(scores.topk(c.topk, -1));
    for (int64_t t = 0; t < scores.size(0); ++t)
      for (int64_t j = 0; j < c.topk; ++j) mine[chosen[t][j].item<int64_t>()] += 1;
    counts.push_back(mine);
    const at::Tensor mean_counts = at::stack(counts).mean(0);
    const double tokens = static_cast<double>(scores.size(0));
    const at::Tensor loss = (scores.sum(0) * mean_counts).sum() *
                            (static_cast<double>(c.num_experts) * c.global_aux_loss_coeff / (c.topk * tokens * tokens));
    ((reference(m, c, x, false) * weights).sum() + loss).backward();
    const std::vector<at::Tensor> want = grads_of(m, x);
    zero_grads(m, x);
    ASSERT_EQ(m.global_forwards, static_cast<int64_t>(counts.size())) << what;
    EXPECT_TRUE(at::equal(m.global_tokens, at::stack(counts).sum(0))) << what << m.global_tokens;
    for (size_t i = 0; i < 2; ++i)  // the input's and the router's gradients carry the loss
      EXPECT_TRUE(at::allclose(got[i], want[i], 1e-5, 1e-6))
          << what << ": gradient " << i << " differs by " << (got[i] - want[i]).abs().max().item<double>();
  };
  const at::Tensor first = at::randn({2, 5, 8});
  expect_forward(first, "the first forward");
  {
    at::NoGradGuard evaluation;
    m.forward(at::randn({2, 5, 8}), gelu);
  }
  expect_forward(at::randn({2, 5, 8}) * 3, "the second forward");
  expect_forward(at::randn({2, 5, 8}), "the third forward");
  // The guard: the running mean is not the forward's own counts (which aux_loss would use).
  EXPECT_FALSE(at::equal(counts.back() * 3, at::stack(counts).sum(0)));
  dtk::layers::end_moe_iteration({const_cast<MoeMlp*>(&m)});
  EXPECT_EQ(m.global_forwards, 0);
  counts.clear();
  expect_forward(first, "the next iteration's first forward");
  // The older name does the same work (models written against it restart the counts too).
  dtk::layers::update_expert_biases({const_cast<MoeMlp*>(&m)});
  EXPECT_EQ(m.global_forwards, 0);
}

// The SDK's sinkhorn against Megatron's loop as written: the same matrix, whose columns then sum
// to 1 / experts (each scaled last) and rows to about 1 / tokens.
TEST(MoeLayer, SinkhornIsMegatronsScaling) {
  at::manual_seed(7);
  // Logits that favour the later experts, as an unbalanced router's.
  const at::Tensor logits = at::randn({40, 6}) * 2 + at::arange(6).to(at::kFloat);
  const at::Tensor got = dtk::layers::sinkhorn(logits);
  const at::Tensor want = megatron_sinkhorn(logits);
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-8)) << (got - want).abs().max();
  EXPECT_TRUE(at::allclose(got.sum(0), at::full({6}, 1.0 / 6), 1e-5)) << got.sum(0);
  EXPECT_TRUE(at::allclose(got.sum(1), at::full({40}, 1.0 / 40), 1e-2)) << got.sum(1);
}

namespace {

// How many of the routes chose expert e.
int64_t chose(const std::vector<Route>& routes, int64_t e) {
  int64_t n = 0;
  for (const Route& r : routes) n += r.chosen.eq(e).sum().item<int64_t>();
  return n;
}

// The layer's output and its input's, router's and experts' gradients against the reference's along
// `routes` (made from the router's logits of x's rows).
void expect_routed_like(const MoeMlp& m, const MoeConfig& c, const Case& k, const at::Tensor& input, bool training,
                        const std::function<std::vector<Route>(const at::Tensor&)>& routes, const std::string& what) {
  const ::dtk::layers::ExpertActivation act = k.inputs == 1 ? gelu : swiglu;
  at::Tensor x = input.clone().requires_grad_(true);
  const at::Tensor weights = at::randn(x.sizes());
  const at::Tensor got = m.forward(x, act, /*generating=*/false, nullptr, training);
  (got * weights).sum().backward();
  const std::vector<at::Tensor> got_grads = grads_of(m, x);
  zero_grads(m, x);
  const at::Tensor want = routed_reference(m, c, x, k.inputs == 2, routes(router_logits(m, x.reshape({-1, 8}))));
  (want * weights).sum().backward();
  const std::vector<at::Tensor> want_grads = grads_of(m, x);
  zero_grads(m, x);
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << what << ": output differs by " << (got - want).abs().max();
  // (atol 1e-5: the reference sums the experts' gradients in another order)
  expect_same_grads(got_grads, want_grads, 1e-5, what);
}

}  // namespace

// moe_router_load_balancing_type=sinkhorn (Megatron's sinkhorn_load_balancing): in training each
// token's experts are the top-k of sinkhorn(logits), in evaluation of the weights; the weights are
// sigmoid(logits) for one expert, else the softmax over all, at the chosen. Forward and backward
// equal that reference, and on a router that favours one expert sinkhorn spreads the tokens.
TEST(MoeLayer, SinkhornChoosesByTheScaledLogitsInTrainingAndTheWeightsInEvaluation) {
  for (const Case& kase : {kCases[0], kCases[1]})
    for (const int64_t k : {1, 2}) {
      MoeConfig c = config_of(kase);
      c.topk = k;
      c.routing = dtk::layers::MoeRouting::kSinkhorn;
      const MoeMlp m = make_layer(c, 8, kase);
      at::manual_seed(9);
      // Every token leans toward expert 0.
      const at::Tensor lean = m.router[0].detach() / m.router[0].detach().norm();
      const at::Tensor x = at::randn({3, 7, 8}) * 0.3 + lean * 3.0;
      const std::string what = std::string(kase.name) + ", top-" + std::to_string(k);
      const auto weights_of = [&](const at::Tensor& logits) {
        return k == 1 ? at::sigmoid(logits) : at::softmax(logits, -1);
      };
      std::vector<Route> trained, evaluated;
      const auto routes = [&](bool training, std::vector<Route>& out) {
        return [&, training](const at::Tensor& logits) {
          const at::Tensor w = weights_of(logits);
          const at::Tensor chosen =
              std::get<1>((training ? megatron_sinkhorn(logits.detach()) : w.detach()).topk(k, -1));
          out.clear();
          for (int64_t t = 0; t < logits.size(0); ++t) out.push_back({chosen[t], w[t].index_select(0, chosen[t])});
          return out;
        };
      };
      expect_routed_like(m, c, kase, x, true, routes(true, trained), what + ", training");
      expect_routed_like(m, c, kase, x, false, routes(false, evaluated), what + ", evaluation");
      // Top-k sends most of the 21 tokens to expert 0; sinkhorn about its share, 21 k / 6.
      EXPECT_GT(chose(evaluated, 0), 10) << what << ": the router does not favour expert 0";
      EXPECT_LE(chose(trained, 0), 21 * k / 6 + 2) << what;
    }
}

// moe_router_load_balancing_type=quantile_balancing (Megatron's qb_dual_update, then
// _update_router_qb_beta), written out: the top-k of logits - beta, weighted by the score function
// at the chosen; a training forward with gradients estimates, per expert, the (target + 1)-th best
// over the tokens of logits - alpha (alpha: each token's (k + 1)-th best of logits - beta, target =
// tokens * k / experts); after the iteration beta = ema * beta + (1 - ema) * the estimates' mean,
// centred. Evaluation estimates nothing.
TEST(MoeLayer, QuantileBalancingChoosesByItsBiasAndEstimatesItAsMegatron) {
  for (const Case& kase : {kCases[0], kCases[2], kCases[3]}) {
    MoeConfig c = config_of(kase);
    c.routing = dtk::layers::MoeRouting::kQuantileBalancing;
    c.quantile_ema = 0.25;
    const MoeMlp m = make_layer(c, 8, kase);
    ASSERT_TRUE(m.qb_beta.defined()) << kase.name;
    at::manual_seed(13);
    at::Tensor(m.qb_beta).normal_(0, 0.3);
    std::vector<at::Tensor> estimates;
    const auto routes = [&](bool estimate) {
      return [&, estimate](const at::Tensor& logits) {
        const at::Tensor l = logits.detach();
        const auto [best, index] = (l - m.qb_beta).topk(c.topk + 1, -1);
        std::vector<Route> out;
        for (int64_t t = 0; t < l.size(0); ++t) out.push_back(weighed(c, logits[t], index[t].narrow(0, 0, c.topk)));
        if (estimate) {
          const int64_t target = l.size(0) * c.topk / c.num_experts;
          at::Tensor quantile = at::zeros({c.num_experts});
          for (int64_t e = 0; e < c.num_experts; ++e) {
            const at::Tensor column = std::get<0>(at::sort(l.select(1, e) - best.select(1, c.topk), 0, true));
            quantile[e] = column[target];
          }
          estimates.push_back(quantile);
        }
        return out;
      };
    };
    const std::string what = kase.name;
    const at::Tensor first = at::randn({3, 7, 8});
    expect_routed_like(m, c, kase, first, true, routes(true), what + ", first forward");
    {
      at::NoGradGuard evaluation;
      m.forward(at::randn({3, 7, 8}), kase.inputs == 1 ? gelu : swiglu, false, nullptr, false);
    }
    expect_routed_like(m, c, kase, at::randn({3, 7, 8}) * 2, true, routes(true), what + ", second forward");
    ASSERT_EQ(m.qb_forwards, 2) << what;
    EXPECT_TRUE(at::allclose(m.qb_estimates, estimates[0] + estimates[1], 1e-5, 1e-6)) << what;
    at::Tensor want = m.qb_beta * 0.25 + (estimates[0] + estimates[1]) / 2 * 0.75;
    want = want - want.mean();
    dtk::layers::end_moe_iteration({const_cast<MoeMlp*>(&m)});
    EXPECT_TRUE(at::allclose(m.qb_beta, want, 1e-5, 1e-6)) << what << m.qb_beta << want;
    EXPECT_EQ(m.qb_forwards, 0) << what;
    // The next iteration chooses with the moved bias.
    expect_routed_like(m, c, kase, first, true, routes(true), what + ", next iteration");
  }
}

// Megatron-LM's --moe-layer-freq: an integer or a Python list of 0/1 per layer.
TEST(MoeLayer, LayerFrequencyReadsMegatronsListPatterns) {
  MoeConfig c;
  c.num_experts = 4;
  dtk::layers::parse_moe_layer_freq("2", c);
  EXPECT_EQ(c.layer_freq, 2);
  EXPECT_TRUE(c.layer_pattern.empty());
  EXPECT_EQ(c.num_moe_layers(5), 3);  // layers 0, 2, 4
  dtk::layers::parse_moe_layer_freq("([0]*3+[1]*11)", c);
  ASSERT_EQ(c.layer_pattern.size(), 14u);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_EQ(c.num_moe_layers(14), 11);
  dtk::layers::parse_moe_layer_freq("\"[1, 0,1,0]\"", c);
  EXPECT_EQ(c.layer_pattern, (std::vector<bool>{true, false, true, false}));
  dtk::layers::parse_moe_layer_freq("[0,1]*2+[1]", c);
  EXPECT_EQ(c.layer_pattern, (std::vector<bool>{false, true, false, true, true}));
  // The forms of Megatron's help text and of Python: a repeated sum, a count before the list.
  dtk::layers::parse_moe_layer_freq("([1]*3+[0]*1)*3", c);
  EXPECT_EQ(c.layer_pattern,
            (std::vector<bool>{true, true, true, false, true, true, true, false, true, true, true, false}));
  dtk::layers::parse_moe_layer_freq("2*[0]+([1])*2*2", c);
  EXPECT_EQ(c.layer_pattern, (std::vector<bool>{false, false, true, true, true, true}));
  dtk::layers::parse_moe_layer_freq("4", c);
  EXPECT_TRUE(c.layer_pattern.empty());
  for (const char* bad : {"", "[2]*3", "[0]*", "[0]*3+", "[]", "every", "[0]x3", "[1]*99999999", "[1]*0", "([1]*2",
                          "[1,]", "-1", "2.0", "[1]*1024*1024*2", "3[1]"})
    EXPECT_THROW(dtk::layers::parse_moe_layer_freq(bad, c), std::invalid_argument) << bad;
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

using Scalars = std::map<std::string, std::map<int64_t, float>>;

// A run's curve and every scalar it logged (TensorBoard, full precision: the MoE losses too).
std::pair<dtk_test::Curve, Scalars> run_logged(const std::string& model, int nproc, const std::string& args,
                                               const std::string& name) {
  const std::string tb = dtk_test::fresh_dir(DTK_TEST_TMP, "tb-moe-logged-" + name);
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  dtk_test::Curve c;
  c.run = dtk_test::run_dtk(launch + train(model) + args + " --set logging.tensorboard_dir=" + tb, 300);
  EXPECT_EQ(c.run.code, 0) << name << "\n" << c.run.out;
  Scalars scalars = dtk_test::read_scalars(tb);
  c.loss = scalars["lm loss"];
  c.norm = scalars["grad-norm"];
  return {c, scalars};
}

Scalars logged_losses(int nproc, const std::string& args, const std::string& name) {
  return run_logged("gpt", nproc, args, name).second;
}

// The splits every MoE feature must equal one process under (2 processes each).
const std::pair<const char*, const char*> kSplits[] = {
    {"dp2", ""},
    {"tp2", "--set distributed.tensor_model_parallel_size=2 "},
    {"sp2", "--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true "},
    {"pp2", "--set distributed.pipeline_model_parallel_size=2 "}};

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
  for (const auto& [name, args] : kSplits) {
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

// The router's input jitter in a whole model: TP 2 with and without sequence parallelism, full and
// selective recomputation equal one process (the noise is the same draw however the model is split
// or rerun), also with hidden dropout and evaluations between the steps (the jitter's draws and the
// masks' come from one stream in the same order either way); and the jitter changes the training
// (the guard for those equalities).
TEST(Moe, InputJitterIsTheSameHoweverTheModelIsSplitOrRecomputed) {
  const std::string jitter = "--set model.moe_input_jitter_eps=0.2 ";
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  const std::string sp2 = tp2 + "--set distributed.sequence_parallel=true ";
  const std::string full = "--set model.recompute_activations=full ";
  const std::string selective = "--set model.recompute_activations=selective --set model.recompute_modules=moe ";
  // One process's curve, and each run of `runs` (processes, flags) equal to it.
  const auto expect_equal_runs = [&](const std::string& model, const std::string& args, const std::string& tag,
                                     const std::vector<std::pair<int, std::string>>& runs) {
    const dtk_test::Curve one = curve_of(model, 1, jitter + args, tag + "-one");
    for (const auto& [nproc, split] : runs)
      expect_same_curve(one, curve_of(model, nproc, jitter + args + split, tag + "-" + std::to_string(nproc) + split),
                        kIters, model + " " + tag + ", " + split);
    return one;
  };
  const std::map<std::string, dtk_test::Curve> jittered = {
      {"gpt", expect_equal_runs("gpt", "", "jitter", {{2, tp2}, {2, sp2}, {1, full}, {1, selective}})},
      {"llama", expect_equal_runs("llama", "", "jitter", {{2, sp2}})}};
  expect_equal_runs("gpt", "--set model.hidden_dropout=0.1 --set eval.eval_interval=3 ", "jitter-dropout",
                    {{2, sp2}, {1, full}, {1, selective}});
  for (const auto& [model, with] : jittered) {
    const dtk_test::Curve plain = curve_of(model, 1, "", "jitter-none");
    ASSERT_EQ(plain.loss.size(), kIters) << plain.run.out;
    ASSERT_EQ(with.loss.size(), kIters) << with.run.out;
    EXPECT_GT(std::abs(plain.loss.at(kIters) - with.loss.at(kIters)), 1e-5 * std::abs(plain.loss.at(kIters))) << model;
  }
}

// Megatron's global_aux_loss in whole runs. Its tokens per expert are the data-parallel ranks'
// sum and T their tokens, so DP 2 (one micro-batch of 4 sequences each) at coefficient 2c equals
// one process with one micro-batch of all 8 at aux_loss c (each rank's loss is half the global
// batch's, the gradients are averaged), curves and logged loss alike; with 2 micro-batches the
// counts are the running mean over the iteration's micro-batches, which TP 2 (with and without
// sequence parallelism), PP 2, full recomputation, PP 2 with it (1F1B: each micro-batch counted
// once, in order) and EP 2 (against DP 2) keep; and the running mean changes the curve.
TEST(Moe, GlobalAuxLossIsTheGlobalBatchsHoweverSplit) {
  const std::string global = "--set model.moe_router_load_balancing_type=global_aux_loss ";
  const auto [big_batch, big_logged] =
      run_logged("gpt", 1, "--set model.moe_aux_loss_coeff=0.5 --set train.micro_batch_size=8 ", "global-mb8");
  const auto [dp2, dp2_logged] = run_logged("gpt", 2, global + "--set model.moe_aux_loss_coeff=1 ", "global-dp2");
  expect_same_curve(big_batch, dp2, kIters, "global_aux_loss DP 2 against aux_loss on the whole batch");
  ASSERT_EQ(dp2_logged.count("global_load_balancing_loss"), 1u);
  ASSERT_EQ(dp2_logged.at("global_load_balancing_loss").size(), kIters);
  for (const auto& [it, v] : big_logged.at("load_balancing_loss"))
    EXPECT_NEAR(dp2_logged.at("global_load_balancing_loss").at(it), v, 1e-5 * std::abs(v)) << "iteration " << it;

  const std::string args = global + "--set model.moe_aux_loss_coeff=0.5 ";
  const auto one_run = run_logged("gpt", 1, args, "global-one");
  const dtk_test::Curve& one = one_run.first;
  const std::map<int64_t, float>& one_loss = one_run.second.at("global_load_balancing_loss");
  ASSERT_EQ(one_loss.size(), kIters);
  // Curves and logged loss equal one process's (under TP without SP each rank logs half).
  const auto expect_same_run = [&](int nproc, const std::string& run_args, const std::string& name) {
    const auto [got, got_logged] = run_logged("gpt", nproc, run_args, name);
    expect_same_curve(one, got, kIters, "global_aux_loss, " + name);
    ASSERT_EQ(got_logged.count("global_load_balancing_loss"), 1u) << name;
    for (const auto& [it, v] : one_loss)
      EXPECT_NEAR(got_logged.at("global_load_balancing_loss").at(it), v, 1e-5 * std::abs(v))
          << name << " at iteration " << it;
  };
  const std::string full = "--set model.recompute_activations=full ";
  for (const auto& [name, split] : kSplits)
    if (std::string(name) != "dp2") expect_same_run(2, args + split, std::string("global-") + name);
  expect_same_run(1, args + full, "global-full");
  expect_same_run(2, args + full + "--set distributed.pipeline_model_parallel_size=2 ", "global-pp2-full");
  // DP 2 with two micro-batches of 2 sequences per rank at twice the coefficient: each micro-batch's
  // counts are one process's micro-batch of 4 (both ranks' rows), T twice a rank's, the gradients
  // averaged; with full recomputation the counts' all-reduce runs in the backward among ddp's
  // overlapped gradient all-reduces.
  const std::string dp2_mb2 = global + "--set model.moe_aux_loss_coeff=1 --set train.micro_batch_size=2 ";
  expect_same_run(2, dp2_mb2, "global-dp2-mb2");
  expect_same_run(2, dp2_mb2 + full, "global-dp2-mb2-full");
  // Under ZeRO-3 with recomputation the counts' all-reduce runs in the backward, among the
  // strategy's own collectives.
  const dtk_test::Curve dp2_half = curve_of("gpt", 2, args, "global-dp2-half");
  expect_same_curve(dp2_half,
                    curve_of("gpt", 2, args + "--set distributed.expert_model_parallel_size=2 ", "global-ep2"), kIters,
                    "global_aux_loss, EP 2 against DP 2");
  expect_same_curve(dp2_half,
                    curve_of("gpt", 2, args + full + "--strategy zero --set strategy.stage=3 ", "global-zero3"), kIters,
                    "global_aux_loss, ZeRO-3 with full recomputation against ddp");
  // aux_loss reads its micro-batch's counts, global_aux_loss sums a copy of them over the
  // data-parallel ranks: listed with a negligible global coefficient, DP 2 trains as aux_loss alone.
  expect_same_curve(curve_of("gpt", 2, "--set model.moe_aux_loss_coeff=0.3 ", "aux-dp2"),
                    curve_of("gpt", 2,
                             "--set model.moe_router_load_balancing_type=aux_loss,global_aux_loss "
                             "--set model.moe_aux_loss_coeff=0.3,1e-12 ",
                             "listed-negligible-global-dp2"),
                    kIters, "aux_loss with a negligible global_aux_loss listed, DP 2, against aux_loss alone");
  // Megatron's lists: aux_loss and global_aux_loss, their losses added and each logged; SP 2 and PP 2
  // equal one process.
  const std::string listed =
      "--set model.moe_router_load_balancing_type=aux_loss,global_aux_loss --set model.moe_aux_loss_coeff=0.3,0.5 ";
  const auto [both, both_logged] = run_logged("gpt", 1, listed, "listed-one");
  for (const char* name : {"load_balancing_loss", "global_load_balancing_loss"})
    EXPECT_EQ(both_logged.count(name), 1u) << name << "\n" << both.run.out;
  for (const auto& [name, split] : kSplits)
    if (std::string(name) == "sp2" || std::string(name) == "pp2")
      expect_same_curve(both, curve_of("gpt", 2, listed + split, std::string("listed-") + name), kIters,
                        std::string("aux_loss and global_aux_loss listed, ") + name);
  ASSERT_EQ(both.norm.size(), kIters) << both.run.out;
  ASSERT_EQ(one.norm.size(), kIters) << one.run.out;
  EXPECT_GT(std::abs(both.norm.at(1) - one.norm.at(1)), 1e-4 * one.norm.at(1));  // aux_loss's share counts
  // The guard: with two micro-batches the running mean is not each micro-batch's own counts.
  const dtk_test::Curve aux = curve_of("gpt", 1, "--set model.moe_aux_loss_coeff=0.5 ", "global-aux");
  ASSERT_EQ(aux.norm.size(), kIters) << aux.run.out;
  ASSERT_EQ(one.norm.size(), kIters) << one.run.out;
  EXPECT_GT(std::abs(aux.norm.at(1) - one.norm.at(1)), 1e-4 * one.norm.at(1));
}

// moe_router_load_balancing_type=sinkhorn and quantile_balancing through whole runs: DP 2, TP 2,
// SP 2 (the whole sequence's logits gathered for the choice), PP 2, EP 2 and full recomputation (the
// recomputing pass chooses as the first: the training flag, not gradient mode, picks sinkhorn)
// equal one process (quantile_balancing's estimates averaged over the data-parallel ranks as over
// the micro-batches); its bias is saved and resumed exactly. The guards: sinkhorn routes differently from the first
// iteration, and quantile_balancing (bias 0 at first) as plain top-k in the first and differently after.
TEST(Moe, SinkhornAndQuantileBalancingEqualOneProcessHoweverSplit) {
  const std::string no_loss = "--set model.moe_aux_loss_coeff=0 ";
  const dtk_test::Curve plain =
      curve_of("gpt", 1, no_loss + "--set model.moe_router_load_balancing_type=none ", "choice-plain");
  ASSERT_EQ(plain.loss.size(), kIters) << plain.run.out;
  for (const std::string type : {"sinkhorn", "quantile_balancing"}) {
    const std::string args = no_loss + "--set model.moe_router_load_balancing_type=" + type + " " +
                             (type == "sinkhorn" ? "" : "--set model.moe_router_quantile_balancing_ema=0.5 ");
    const dtk_test::Curve one = curve_of("gpt", 1, args, type + "-one");
    ASSERT_EQ(one.loss.size(), kIters) << one.run.out;
    for (const auto& [name, split] : kSplits)
      expect_same_curve(one, curve_of("gpt", 2, args + split, type + "-" + name), kIters, type + ", " + name);
    expect_same_curve(one, curve_of("gpt", 1, args + "--set model.recompute_activations=full ", type + "-full"), kIters,
                      type + ", full recomputation");
    expect_same_curve(one, curve_of("gpt", 2, args + "--set distributed.expert_model_parallel_size=2 ", type + "-ep2"),
                      kIters, type + ", EP 2");
    if (type == "sinkhorn") {
      EXPECT_NE(one.loss.at(1), plain.loss.at(1));
      continue;
    }
    EXPECT_EQ(one.loss.at(1), plain.loss.at(1));
    EXPECT_NE(one.loss.at(kIters), plain.loss.at(kIters));
    const std::string ck = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-qb-checkpoint");
    const dtk_test::Curve first =
        curve_of("gpt", 1, args + "--set checkpoint.save=" + ck + " --set train.exit_interval=3 ", "qb-first-half");
    ASSERT_EQ(first.loss.size(), 3u) << first.run.out;
    const dtk_test::Curve resumed = curve_of("gpt", 1, args + "--set checkpoint.load=" + ck + " ", "qb-resumed");
    ASSERT_EQ(resumed.loss.size(), kIters - 3) << resumed.run.out;
    for (int64_t it = 4; it <= static_cast<int64_t>(kIters); ++it) {
      EXPECT_EQ(resumed.loss.at(it), one.loss.at(it)) << "resumed, iteration " << it;
      EXPECT_EQ(resumed.norm.at(it), one.norm.at(it)) << "resumed, iteration " << it;
    }
    // The bias (a buffer every rank holds whole) carried by dtk checkpoint convert: to EP 2 x TP 2,
    // and from there (expert-parallel rank 0's copy) back to one process.
    const std::pair<std::string, std::string> conversions[] = {
        {"--expert_model_parallel_size 2 --tensor_model_parallel_size 2",
         "--set distributed.expert_model_parallel_size=2 --set distributed.tensor_model_parallel_size=2 "},
        {"--expert_model_parallel_size 1 --tensor_model_parallel_size 1", ""}};
    std::string from = ck;
    for (const auto& [flags, layout] : conversions) {
      const std::string to = from + (layout.empty() ? "-one" : "-ep2-tp2");
      const dtk_test::Result convert = dtk_test::run_dtk("checkpoint convert " + from + " " + to + " " + flags, 120);
      ASSERT_EQ(convert.code, 0) << convert.out;
      const dtk_test::Curve split =
          curve_of("gpt", layout.empty() ? 1 : 4, args + layout + "--set checkpoint.load=" + to + " ",
                   "qb" + to.substr(ck.size()));
      ASSERT_EQ(split.loss.size(), kIters - 3) << split.run.out;
      for (int64_t it = 4; it <= static_cast<int64_t>(kIters); ++it) {
        EXPECT_NEAR(split.loss.at(it), one.loss.at(it), 1e-5 * one.loss.at(it)) << flags << ", iteration " << it;
        EXPECT_NEAR(split.norm.at(it), one.norm.at(it), 1e-5 * one.norm.at(it)) << flags << ", iteration " << it;
      }
      from = to;
    }
  }
}

namespace {

// DeepSeek-V3's MoE in llama: 8 experts, sigmoid scores routed within each token's best group of
// 4 and steered by the expert bias, the sequence-level load-balancing loss, a gated shared expert,
// the first layer dense.
const std::string kDeepSeek =
    "--set model.num_experts=8 --set model.moe_router_score_function=sigmoid --set model.moe_router_num_groups=2 "
    "--set model.moe_router_group_topk=1 --set model.moe_router_load_balancing_type=seq_aux_loss "
    "--set model.moe_shared_expert_intermediate_size=64 --set model.moe_shared_expert_gate=true "
    "--set 'model.moe_layer_freq=([0]*1+[1]*3)' --set model.moe_router_enable_expert_bias=true "
    "--set model.moe_router_bias_update_rate=0.1 ";

std::pair<dtk_test::Curve, Scalars> deepseek_run(int nproc, const std::string& args, const std::string& name) {
  return run_logged("llama", nproc, kDeepSeek + args, "deepseek-" + name);
}

}  // namespace

// Every DeepSeek-V3 piece at once (each checked against the token-by-token reference above) equals
// one process under DP, TP, SP and PP, and logs Megatron's seq_load_balancing_loss the same way.
TEST(Moe, DeepSeekStyleRoutingEqualsOneProcessHoweverSplit) {
  const auto [one, one_logged] = deepseek_run(1, "", "one");
  ASSERT_EQ(one.loss.size(), kIters) << one.run.out;
  const std::map<int64_t, float>& balance = one_logged.at("seq_load_balancing_loss");
  ASSERT_EQ(balance.size(), kIters) << one.run.out;
  EXPECT_GT(balance.at(1), 0.9);
  EXPECT_LT(balance.at(1), 2.0);
  EXPECT_EQ(one_logged.count("load_balancing_loss"), 0u);
  EXPECT_NE(one.run.out.find("| seq_load_balancing_loss: "), std::string::npos) << one.run.out;
  for (const auto& [name, args] : kSplits) {
    const auto [got, logged] = deepseek_run(2, args, name);
    expect_same_curve(one, got, kIters, std::string("DeepSeek-style ") + name);
    ASSERT_EQ(logged.count("seq_load_balancing_loss"), 1u) << name;
    for (const auto& [it, v] : balance)
      EXPECT_NEAR(logged.at("seq_load_balancing_loss").at(it), v, 1e-5 * std::abs(v)) << name << " at " << it;
  }
  // The interleaved schedule's model chunks each move their layers' biases (ABI 2.11 through the
  // host's chunk table).
  const auto [interleaved, interleaved_logged] = deepseek_run(
      2, "--set distributed.pipeline_model_parallel_size=2 --set distributed.virtual_pipeline_model_parallel_size=2 ",
      "vpp2");
  expect_same_curve(one, interleaved, kIters, "DeepSeek-style interleaved PP 2");
  // The guards: without the group limit the same model trains differently from the first
  // iteration, and without the expert bias from the second (the first update's).
  const auto [ungrouped, ungrouped_logged] =
      deepseek_run(1, "--set model.moe_router_num_groups=0 --set model.moe_router_group_topk=0 ", "ungrouped");
  ASSERT_EQ(ungrouped.loss.size(), kIters);
  EXPECT_GT(std::abs(ungrouped.norm.at(1) - one.norm.at(1)), 1e-4 * one.norm.at(1));
  const auto [unbiased, unbiased_logged] = deepseek_run(
      1, "--set model.moe_router_enable_expert_bias=false --set model.moe_router_bias_update_rate=1e-3 ", "unbiased");
  ASSERT_EQ(unbiased.loss.size(), kIters);
  EXPECT_EQ(unbiased.loss.at(1), one.loss.at(1));
  EXPECT_NE(unbiased.loss.at(kIters), one.loss.at(kIters));
}

// The expert bias is the model's state: a run stopped after iteration 3 (train.exit_interval saves
// it) and resumed goes on exactly as the uninterrupted one, and so, within 1e-5, does the
// checkpoint converted to TP 2 and PP 2 (a bias lost on the way would route differently).
TEST(Moe, ExpertBiasIsSavedResumedAndConverted) {
  const std::string ck = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-expert-bias-checkpoint");
  const auto [whole, whole_logged] = deepseek_run(1, "", "uninterrupted");
  ASSERT_EQ(whole.loss.size(), kIters) << whole.run.out;
  const auto [first, first_logged] =
      deepseek_run(1, "--set checkpoint.save=" + ck + " --set train.exit_interval=3 ", "first-half");
  ASSERT_EQ(first.loss.size(), 3u) << first.run.out;
  const auto [resumed, resumed_logged] = deepseek_run(1, "--set checkpoint.load=" + ck + " ", "resumed");
  ASSERT_EQ(resumed.loss.size(), kIters - 3) << resumed.run.out;
  for (int64_t it = 4; it <= static_cast<int64_t>(kIters); ++it) {
    EXPECT_EQ(resumed.loss.at(it), whole.loss.at(it)) << "iteration " << it;
    EXPECT_EQ(resumed.norm.at(it), whole.norm.at(it)) << "iteration " << it;
  }
  for (const char* layout : {"tensor_model_parallel_size", "pipeline_model_parallel_size"}) {
    const std::string to = ck + "-" + layout;
    const dtk_test::Result convert =
        dtk_test::run_dtk("checkpoint convert " + ck + "/iter_0000003 " + to + " --" + layout + " 2", 120);
    ASSERT_EQ(convert.code, 0) << convert.out;
    const auto [converted, converted_logged] = deepseek_run(
        2, "--set checkpoint.load=" + to + " --set distributed." + layout + "=2 ", std::string("converted-") + layout);
    ASSERT_EQ(converted.loss.size(), kIters - 3) << converted.run.out;
    for (int64_t it = 4; it <= static_cast<int64_t>(kIters); ++it)
      EXPECT_NEAR(converted.loss.at(it), whole.loss.at(it), 1e-5 * whole.loss.at(it)) << layout << " at " << it;
  }
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
      {"--set model.moe_token_dispatcher=alltoall",
       "option 'moe_token_dispatcher' does nothing without num_experts > 0"},
      {"--set model.num_experts=4 --set model.moe_token_dispatcher=flex",
       "option 'moe_token_dispatcher' expects one of allgather|alltoall, got 'flex'"},
      {"--set model.num_experts=4 --set model.moe_token_dispatcher=alltoall --set model.moe_shared_expert_overlap=true",
       "option 'moe_shared_expert_overlap' overlaps the shared expert: it needs moe_shared_expert_intermediate_size > "
       "0"},
      {"--set model.num_experts=4 --set model.moe_shared_expert_intermediate_size=64 "
       "--set model.moe_shared_expert_overlap=true",
       "option 'moe_shared_expert_overlap' overlaps the shared expert with the alltoall dispatcher's exchange: it "
       "needs moe_token_dispatcher=alltoall"},
      {"--set model.num_experts=4 --set model.moe_router_topk=5",
       "option 'moe_router_topk' must be in [1, num_experts = 4], got 5"},
      {"--set model.num_experts=4 --set model.moe_aux_loss_coeff=-1",
       "option 'moe_aux_loss_coeff' must be finite and >= 0"},
      {"--set model.num_experts=4 --set model.moe_layer_freq=0", "option 'moe_layer_freq' must be >= 1, got 0"},
      {"--set model.num_experts=4 --set model.moe_router_topk=1",
       "moe_router_topk=1 needs moe_router_pre_softmax=true"},
      {"--set model.num_experts=4 --set model.domino_chunks=2 --set distributed.tensor_model_parallel_size=1",
       "domino_chunks > 1 runs dense MLPs only"},
      {"--set model.num_experts=4 --set 'model.moe_layer_freq=[1]*3'",
       "option 'moe_layer_freq' lists 3 layers, the model has 2 (num_layers)"},
      {"--set model.num_experts=4 --set 'model.moe_layer_freq=[1]*2+[x]'",
       "option 'moe_layer_freq': 'x' in a list is not 0 or 1 (in '[1]*2+[x]'"},
      {"--set model.num_experts=4 --set model.moe_router_score_function=sigmoid --set "
       "model.moe_router_pre_softmax=true",
       "moe_router_pre_softmax acts on softmax scores only"},
      {"--set model.num_experts=6 --set model.moe_router_num_groups=4 --set model.moe_router_group_topk=1",
       "num_experts 6 is not divisible by moe_router_num_groups 4"},
      {"--set model.num_experts=4 --set model.moe_router_num_groups=2 --set model.moe_router_group_topk=3",
       "option 'moe_router_group_topk' (3) must be <= moe_router_num_groups (2)"},
      {"--set model.num_experts=4 --set model.moe_router_num_groups=2",
       "group-limited routing needs both moe_router_num_groups and moe_router_group_topk >= 1"},
      {"--set model.num_experts=4 --set model.moe_shared_expert_gate=true",
       "option 'moe_shared_expert_gate' gates the shared expert"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=none --set model.moe_aux_loss_coeff=0.1",
       "moe_aux_loss_coeff weighs no loss with moe_router_load_balancing_type=none"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=aux_loss,global_aux_loss "
       "--set model.moe_aux_loss_coeff=0.01",
       "option 'moe_aux_loss_coeff' gives 1 coefficient(s) for the 2 load-balancing type(s)"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=sink",
       "option 'moe_router_load_balancing_type': 'sink' is not one of aux_loss, seq_aux_loss, global_aux_loss"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=sinkhorn --set "
       "model.moe_aux_loss_coeff=0.01",
       "moe_aux_loss_coeff must be 0 with moe_router_load_balancing_type=sinkhorn"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=sinkhorn "
       "--set model.moe_router_score_function=sigmoid",
       "option 'moe_router_score_function' does nothing with moe_router_load_balancing_type=sinkhorn"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=quantile_balancing "
       "--set model.moe_router_score_function=sigmoid --set model.moe_router_enable_expert_bias=true",
       "moe_router_enable_expert_bias does nothing with moe_router_load_balancing_type=quantile_balancing"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=quantile_balancing "
       "--set model.moe_router_topk=4",
       "quantile_balancing needs moe_router_topk < num_experts"},
      {"--set model.num_experts=3 --set model.moe_router_load_balancing_type=quantile_balancing",
       "quantile_balancing puts micro_batch_size x seq_length x moe_router_topk = 1024 choices equally on "
       "num_experts = 3 experts"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=quantile_balancing "
       "--set train.micro_batch_size=1 --set train.global_batch_size=1 --set train.curriculum_schedule=fixed_discrete "
       "--set train.curriculum_min_difficulty=15 --set train.curriculum_discrete_difficulty=15,64 "
       "--set train.curriculum_discrete_max_step=1",
       "forward: quantile_balancing needs a micro-batch's tokens times moe_router_topk to be a multiple of 4 "
       "(num_experts): 15 tokens times 2 is not (a train.curriculum_schedule's shorter sequences"},
      {"--set model.num_experts=4 --set model.moe_router_quantile_balancing_ema=0.5",
       "option 'moe_router_quantile_balancing_ema' does nothing without "
       "moe_router_load_balancing_type=quantile_balancing"},
      {"--set model.num_experts=4 --set model.moe_router_load_balancing_type=quantile_balancing "
       "--set model.moe_router_quantile_balancing_ema=1.5",
       "option 'moe_router_quantile_balancing_ema' must be in [0, 1], got 1.5"},
      {"--set model.moe_router_load_balancing_type=seq_aux_loss",
       "option 'moe_router_load_balancing_type' does nothing without num_experts > 0"},
      {"--set model.moe_shared_expert_intermediate_size=64",
       "option 'moe_shared_expert_intermediate_size' does nothing without num_experts > 0"},
      {"--set model.num_experts=4 --set model.moe_router_pre_softmax=true --set "
       "model.moe_router_enable_expert_bias=true",
       "moe_router_enable_expert_bias needs moe_router_score_function=sigmoid or sqrtsoftplus"},
      {"--set model.num_experts=4 --set model.moe_router_bias_update_rate=0.01",
       "option 'moe_router_bias_update_rate' does nothing without moe_router_enable_expert_bias=true"},
      {"--set model.num_experts=4 --set model.moe_pad_expert_input_to_capacity=true",
       "option 'moe_pad_expert_input_to_capacity' pads to a capacity: it needs moe_expert_capacity_factor > 0"},
      {"--set model.num_experts=4 --set model.moe_expert_capacity_factor=-0.5",
       "option 'moe_expert_capacity_factor' must be in [0, 1e6] (0 = dropless), got -0.5"},
      {"--set model.num_experts=4 --set model.moe_input_jitter_eps=1",
       "option 'moe_input_jitter_eps' must be in [0, 1) (0 = no jitter), got 1"},
      {"--set model.moe_input_jitter_eps=0.01", "option 'moe_input_jitter_eps' does nothing without num_experts > 0"},
      {"--set model.moe_gate=deepspeed", "option 'moe_gate' does nothing without num_experts > 0"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_router_topk=3 "
       "--set model.moe_top2_2nd_expert_sampling=false",
       "option 'moe_top2_2nd_expert_sampling' acts only with moe_router_topk=2"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_z_loss_coeff=0.01",
       "option 'moe_z_loss_coeff' is Megatron-LM's router's: moe_gate=deepspeed has DeepSpeed's gate"},
      {"--set model.num_experts=4 --set model.moe_min_capacity=4",
       "option 'moe_min_capacity' is DeepSpeed's gate's: it acts only with moe_gate=deepspeed"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_min_capacity=4",
       "option 'moe_min_capacity' does nothing without moe_expert_capacity_factor > 0"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_expert_capacity_factor=1 "
       "--set model.moe_eval_capacity_factor=-1",
       "option 'moe_eval_capacity_factor' must be in [0, 1e6] (0 = moe_expert_capacity_factor), got -1"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_router_topk=1 "
       "--set model.moe_top2_2nd_expert_sampling=false",
       "option 'moe_top2_2nd_expert_sampling' acts only with moe_router_topk=2"},
      {"--set model.moe_layer_num_experts=2,4", "option 'moe_layer_num_experts' does nothing without num_experts > 0"},
      {"--set model.num_experts=4 --set model.moe_layer_num_experts=2,4",
       "option 'moe_layer_num_experts' is DeepSpeed's gate's: it acts only with moe_gate=deepspeed"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_layer_num_experts=2,4,4",
       "option 'moe_layer_num_experts' lists 3 counts, the model has 2 MoE layers (moe_layer_freq): give one per MoE "
       "layer"},
      {"--set model.num_experts=8 --set model.moe_gate=deepspeed --set model.moe_layer_num_experts=2,4",
       "option 'num_experts' must be the largest count of moe_layer_num_experts, 4, got 8"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_layer_num_experts=1,4",
       "option 'moe_layer_num_experts' gives layer 1 (1-based) 1 experts: a layer of one expert is a dense layer; "
       "leave it out of moe_layer_freq"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_layer_num_experts=2,4 "
       "--set model.moe_router_topk=3",
       "option 'moe_layer_num_experts' gives layer 1 (1-based) 2 experts, fewer than moe_router_topk = 3"},
      {"--set model.num_experts=4 --set model.moe_gate=deepspeed --set model.moe_layer_num_experts=2,x",
       "option 'moe_layer_num_experts': 'x' is not a positive expert count"},
  };
  for (const auto& [args, line] : cases) {
    const dtk_test::Result r = dtk_test::run_dtk(base + args, 120);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.out.find("dtk: error: "), std::string::npos) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(line), std::string::npos) << args << "\n" << r.out;
  }
}

// ---------------------------------------------------------------------------------------------
// Expert parallelism (Megatron-LM's --expert-model-parallel-size).

namespace {

const std::string kEp2 = "--set distributed.expert_model_parallel_size=2 ";

// A run resumed after iteration 3 against the uninterrupted one: bit for bit (tol 0), or within
// tol (another layout: the reductions run in another order).
void expect_resumed(const dtk_test::Curve& resumed, const dtk_test::Curve& whole, const std::string& what,
                    double tol = 0) {
  ASSERT_EQ(resumed.loss.size(), kIters - 3) << what << "\n" << resumed.run.out;
  for (int64_t it = 4; it <= static_cast<int64_t>(kIters); ++it) {
    EXPECT_NEAR(resumed.loss.at(it), whole.loss.at(it), tol * std::abs(whole.loss.at(it))) << what << " at " << it;
    EXPECT_NEAR(resumed.norm.at(it), whole.norm.at(it), tol * std::abs(whole.norm.at(it))) << what << " at " << it;
  }
}

// The "N = ... parameters a token runs (of the whole model's ...)" pair of a run's start-up line.
std::pair<long long, long long> active_and_whole(const std::string& out) {
  std::smatch m;
  const std::regex re("N = ([0-9]+) parameters a token runs \\(of the whole model's ([0-9]+)");
  if (!std::regex_search(out, m, re)) return {-1, -1};
  return {std::stoll(m[1]), std::stoll(m[2])};
}

}  // namespace

// The experts split over the data-parallel ranks, every rank's tokens all-gathered to them and the
// outputs reduce-scattered back, their gradients summed over the ranks holding the same experts and
// their norm over the expert-parallel group: the same training as every expert on every rank, for
// gpt (biased experts: their bias table gathered) and DeepSeek-style llama, with TP, SP and PP, and
// with more data-parallel ranks than expert-parallel ones (the expert-data-parallel reduction).
TEST(Moe, ExpertParallelEqualsOneProcess) {
  const dtk_test::Curve one = curve_of("gpt", 1, "", "ep-one");
  ASSERT_EQ(one.run.code, 0) << one.run.out;
  const dtk_test::Curve ep2 = curve_of("gpt", 2, kEp2, "ep2");
  expect_same_curve(one, ep2, kIters, "gpt EP 2");
  EXPECT_NE(ep2.run.out.find("model parallel rank (0, 0), expert-parallel rank 1 of 2: "), std::string::npos)
      << ep2.run.out;
  // Each rank holds half the experts; the FLOPs still count the whole model's.
  EXPECT_EQ(active_and_whole(ep2.run.out), active_and_whole(one.run.out)) << ep2.run.out;
  EXPECT_NE(active_and_whole(one.run.out).first, -1) << one.run.out;
  expect_same_curve(one,
                    curve_of("gpt", 4,
                             kEp2 + "--set distributed.tensor_model_parallel_size=2 "
                                    "--set distributed.sequence_parallel=true ",
                             "ep2-sp2"),
                    kIters, "gpt EP 2 x TP 2 with sequence parallelism");
  expect_same_curve(one, curve_of("gpt", 4, kEp2 + "--set distributed.pipeline_model_parallel_size=2 ", "ep2-pp2"),
                    kIters, "gpt EP 2 x PP 2");
  // Four data-parallel ranks of one micro-batch of 2 each (the losses per micro-batch of 2).
  const std::string small = "--set train.micro_batch_size=2 ";
  const dtk_test::Curve one_small = curve_of("gpt", 1, small, "ep-one-mb2");
  ASSERT_EQ(one_small.run.code, 0) << one_small.run.out;
  expect_same_curve(one_small, curve_of("gpt", 4, small + kEp2, "dp4-ep2"), kIters,
                    "gpt DP 4 x EP 2 (expert-data-parallel 2)");
  expect_same_curve(one_small, curve_of("gpt", 4, small + "--set distributed.expert_model_parallel_size=4 ", "dp4-ep4"),
                    kIters, "gpt EP 4");
  // The parameter norm (the experts' squares summed over the expert-parallel group) and ddp's
  // overlap_param_gather (the dense buckets split across the step, the experts' reduced whole).
  const std::string norms = "--set logging.log_params_norm=true ";
  const auto [one_norms, one_norms_logged] = run_logged("gpt", 1, norms, "ep-one-params-norm");
  const auto [ep_norms, ep_norms_logged] =
      run_logged("gpt", 2, kEp2 + norms + "--set strategy.overlap_param_gather=true ", "ep2-params-norm");
  expect_same_curve(one_norms, ep_norms, kIters, "gpt EP 2 with overlap_param_gather");
  ASSERT_EQ(one_norms_logged.at("params-norm").size(), kIters);
  for (const auto& [it, v] : one_norms_logged.at("params-norm"))
    EXPECT_NEAR(ep_norms_logged.at("params-norm").at(it), v, 1e-5 * v) << "params norm at " << it;
  const auto [deepseek, deepseek_logged] = deepseek_run(1, "", "ep-one");
  ASSERT_EQ(deepseek.loss.size(), kIters) << deepseek.run.out;
  const auto [deepseek_ep2, deepseek_ep2_logged] = deepseek_run(2, kEp2, "ep2");
  expect_same_curve(deepseek, deepseek_ep2, kIters, "DeepSeek-style llama EP 2");
  for (const auto& [it, v] : deepseek_logged.at("seq_load_balancing_loss"))
    EXPECT_NEAR(deepseek_ep2_logged.at("seq_load_balancing_loss").at(it), v, 1e-5 * std::abs(v)) << "at " << it;
}

// ZeRO under expert parallelism (Megatron's --use-distributed-optimizer with
// --expert-model-parallel-size, as its Mixtral script runs): the experts partitioned over the
// ranks holding them, the dense parameters over the data-parallel group; every stage equals one
// process, with two and with four data-parallel ranks (expert-data-parallel 1 and 2).
TEST(Moe, ExpertParallelUnderZeroEqualsOneProcess) {
  const std::string zero = "--strategy zero ";
  const dtk_test::Curve one = curve_of("gpt", 1, "", "zero-ep-one");
  ASSERT_EQ(one.run.code, 0) << one.run.out;
  const dtk_test::Curve stage1 =
      curve_of("gpt", 2, kEp2 + zero + "--set strategy.stage=1 --set strategy.overlap_comm=true ", "zero1-ep2");
  expect_same_curve(one, stage1, kIters, "gpt EP 2 under zero stage 1 with overlap_comm");
  EXPECT_NE(stage1.run.out.find("routed experts over the expert-data-parallel group (1 rank)"), std::string::npos)
      << stage1.run.out;
  expect_same_curve(one, curve_of("gpt", 2, kEp2 + zero + "--set strategy.stage=2 ", "zero2-ep2"), kIters,
                    "gpt EP 2 under zero stage 2");
  expect_same_curve(one, curve_of("gpt", 2, kEp2 + zero + "--set strategy.stage=3 ", "zero3-ep2"), kIters,
                    "gpt EP 2 under zero stage 3 (built partitioned)");
  const std::string small = "--set train.micro_batch_size=2 ";
  const dtk_test::Curve one_small = curve_of("gpt", 1, small, "zero-ep-one-mb2");
  ASSERT_EQ(one_small.run.code, 0) << one_small.run.out;
  for (const char* stage : {"1", "3"})
    expect_same_curve(one_small,
                      curve_of("gpt", 4, small + kEp2 + zero + "--set strategy.stage=" + stage + " ",
                               std::string("zero") + stage + "-dp4-ep2"),
                      kIters, std::string("gpt DP 4 x EP 2 under zero stage ") + stage);
  // Offload: stage 2 with the optimizer in host memory, stage 3 with the optimizer state and the
  // parameters on disk (each rank's swap files; the experts' chunks among them).
  const std::string swap = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-zero-ep-swap");
  const std::pair<std::string, std::string> offloaded[] = {
      {"--set strategy.stage=2 --set strategy.offload_optimizer=cpu ", "stage 2, optimizer on the host"},
      {"--set strategy.stage=3 --set strategy.offload_optimizer=nvme --set strategy.offload_param=nvme "
       "--set strategy.nvme_buffer_mb=1 --set strategy.nvme_path=" +
           swap + " ",
       "stage 3, optimizer and parameters on disk"}};
  for (const auto& [args, what] : offloaded)
    expect_same_curve(one_small, curve_of("gpt", 4, small + kEp2 + zero + args, "zero-offload-dp4-ep2-" + what), kIters,
                      "gpt DP 4 x EP 2 under zero " + what);
  // overlap_param_gather (the experts' gathers over their own group) and the parameter norm.
  const std::string norms = "--set logging.log_params_norm=true ";
  const auto [one_norms, one_norms_logged] = run_logged("gpt", 1, small + norms, "zero-ep-one-params-norm");
  const auto [ep_norms, ep_norms_logged] = run_logged(
      "gpt", 4, small + kEp2 + zero + norms + "--set strategy.overlap_param_gather=true ", "zero1-ep2-params-norm");
  expect_same_curve(one_norms, ep_norms, kIters, "gpt DP 4 x EP 2 under zero with overlap_param_gather");
  ASSERT_EQ(one_norms_logged.at("params-norm").size(), kIters);
  for (const auto& [it, v] : one_norms_logged.at("params-norm"))
    EXPECT_NEAR(ep_norms_logged.at("params-norm").at(it), v, 1e-5 * v) << "params norm at " << it;
  const auto [deepseek, deepseek_logged] = deepseek_run(1, "", "zero-ep-one");
  ASSERT_EQ(deepseek.loss.size(), kIters) << deepseek.run.out;
  expect_same_curve(deepseek, deepseek_run(2, kEp2 + zero + "--set strategy.stage=2 ", "zero2-ep2").first, kIters,
                    "DeepSeek-style llama EP 2 under zero stage 2");
}

// ZeRO under expert parallelism inside a model-parallel group (Megatron's Mixtral and DeepSeek
// scripts run --use-distributed-optimizer with EP beside TP and PP): the experts' shards and the
// dense ones are taken per tensor-parallel and pipeline rank, the gradient norm and the parameter
// norm sum over both model-parallel groups and the expert-parallel one. Each equals one process.
TEST(Moe, ExpertParallelUnderZeroWithTensorAndPipelineParallelEqualsOneProcess) {
  const std::string zero = "--strategy zero ";
  const std::string norms = "--set logging.log_params_norm=true ";
  const auto [one, one_logged] = run_logged("gpt", 1, norms, "zero-mp-one");
  ASSERT_EQ(one.loss.size(), kIters) << one.run.out;
  struct Split {
    std::string args, name, what;
  };
  const Split splits[] = {
      {"--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true "
       "--set strategy.stage=1 --set strategy.overlap_comm=true ",
       "ep2-sp2-zero1", "EP 2 x TP 2 with sequence parallelism under zero stage 1"},
      {"--set distributed.tensor_model_parallel_size=2 --set strategy.stage=3 ", "ep2-tp2-zero3",
       "EP 2 x TP 2 under zero stage 3"},
      // (Stage 1 alone under pipeline stages, as DeepSpeed; the tied embedding sharded alike on
      // the first and the last stage.)
      {"--set distributed.pipeline_model_parallel_size=2 --set strategy.stage=1 "
       "--set strategy.overlap_param_gather=true ",
       "ep2-pp2-zero1", "EP 2 x PP 2 under zero stage 1 with overlap_param_gather"},
  };
  for (const auto& [args, name, what] : splits) {
    const auto [split, split_logged] = run_logged("gpt", 4, kEp2 + zero + norms + args, "zero-" + name);
    expect_same_curve(one, split, kIters, "gpt " + what);
    ASSERT_EQ(split_logged.count("params-norm"), 1u) << split.run.out;
    for (const auto& [it, v] : one_logged.at("params-norm"))
      EXPECT_NEAR(split_logged.at("params-norm").at(it), v, 1e-5 * v) << what << ": params norm at " << it;
  }
}

// A zero run under expert parallelism saves each data-parallel rank's shards in its expert-parallel
// rank's directory; it resumes exactly, at another data-parallel size, and under ddp.
TEST(Moe, ExpertParallelZeroCheckpointsReshard) {
  const std::string ck = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-zero-ep-checkpoint");
  const std::string zero = "--strategy zero --set strategy.stage=1 --set train.micro_batch_size=2 ";
  const dtk_test::Curve whole = curve_of("gpt", 4, kEp2 + zero, "zero-dp4-ep2-uninterrupted");
  ASSERT_EQ(whole.loss.size(), kIters) << whole.run.out;
  const dtk_test::Curve first = curve_of(
      "gpt", 4, kEp2 + zero + "--set checkpoint.save=" + ck + " --set train.exit_interval=3 ", "zero-dp4-ep2-first");
  ASSERT_EQ(first.loss.size(), 3u) << first.run.out;
  for (const char* file : {"mp_rank_00_000/optim_dp_rank_002.pt", "mp_rank_00_001/optim_dp_rank_003.pt"})
    EXPECT_TRUE(std::filesystem::is_regular_file(ck + "/iter_0000003/" + file)) << file;
  expect_resumed(curve_of("gpt", 4, kEp2 + zero + "--set checkpoint.load=" + ck + " ", "zero-ep2-resumed"), whole,
                 "zero DP 4 x EP 2 resumed");
  const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + ck, 120);
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  // Two data-parallel ranks (two micro-batches each), and ddp: the state re-assembled from the
  // four files in two directories; the same training within rounding.
  const std::pair<std::string, std::string> others[] = {
      {kEp2 + zero, "zero at DP 2"},
      {kEp2 + "--set train.micro_batch_size=2 ", "ddp at DP 2"},
  };
  // And the other way: a ddp checkpoint (each expert-parallel rank's whole state in its main file)
  // resumed under zero at DP 4.
  const std::string ddp_ck = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-ddp-ep-checkpoint");
  const dtk_test::Curve ddp_first = curve_of(
      "gpt", 4,
      kEp2 + "--set train.micro_batch_size=2 --set checkpoint.save=" + ddp_ck + " --set train.exit_interval=3 ",
      "ddp-dp4-ep2-first");
  ASSERT_EQ(ddp_first.loss.size(), 3u) << ddp_first.run.out;
  expect_resumed(curve_of("gpt", 4, kEp2 + zero + "--set checkpoint.load=" + ddp_ck + " ", "ddp-into-zero-dp4-ep2"),
                 whole, "ddp checkpoint into zero", 1e-5);
  for (const auto& [args, what] : others)
    expect_resumed(curve_of("gpt", 2, args + "--set checkpoint.load=" + ck + " ", "zero-ep2-" + what), whole, what,
                   1e-5);
  // dtk checkpoint convert to expert-parallel size 1: each rank's shards, read from both
  // directories, consolidated with every expert in one directory; ddp at DP 4 goes on as before.
  const std::string one_dir = ck + "-ep1";
  const dtk_test::Result convert =
      dtk_test::run_dtk("checkpoint convert " + ck + " " + one_dir + " --expert_model_parallel_size 1", 120);
  ASSERT_EQ(convert.code, 0) << convert.out;
  EXPECT_NE(convert.out.find("expert-parallel size 2 to 1"), std::string::npos) << convert.out;
  EXPECT_NE(convert.out.find("(4 data-parallel shards per rank) is consolidated"), std::string::npos) << convert.out;
  expect_resumed(
      curve_of("gpt", 4, "--set train.micro_batch_size=2 --set checkpoint.load=" + one_dir + " ", "zero-ep2-to-ep1"),
      whole, "zero EP 2 converted to EP 1, under ddp", 1e-5);
}

// Each expert-parallel rank saves its own experts (Megatron's mp_rank_TT_EEE directories): a run
// stopped after iteration 3 and resumed goes on exactly as the uninterrupted one; a run of another
// expert-parallel size refuses the checkpoint in one line naming dtk checkpoint convert, which
// re-splits the experts: to one directory (a plain DP 2 run), to EP 2 x TP 2 and back, and to
// pipeline stages the run goes on within rounding, and back to EP 2 bit for bit. generate and a
// Mixtral export read the EP 2 checkpoint as it is, equal to the converted one.
TEST(Moe, ExpertParallelCheckpointsResumeAndConvertToAnotherSplit) {
  const std::string ck = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-ep-checkpoint");
  const dtk_test::Curve whole = curve_of("gpt", 2, kEp2, "ep2-uninterrupted");
  ASSERT_EQ(whole.loss.size(), kIters) << whole.run.out;
  const dtk_test::Curve first =
      curve_of("gpt", 2, kEp2 + "--set checkpoint.save=" + ck + " --set train.exit_interval=3 ", "ep2-first-half");
  ASSERT_EQ(first.loss.size(), 3u) << first.run.out;
  for (const char* dir : {"mp_rank_00_000", "mp_rank_00_001"})
    EXPECT_TRUE(std::filesystem::is_regular_file(ck + "/iter_0000003/" + dir + "/model_optim_rng.pt")) << dir;
  expect_resumed(curve_of("gpt", 2, kEp2 + "--set checkpoint.load=" + ck + " ", "ep2-resumed"), whole, "EP 2 resumed");
  const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + ck, 120);
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  EXPECT_NE(inspect.out.find("of which expert-parallel 2"), std::string::npos) << inspect.out;
  const dtk_test::Result other =
      dtk_test::run_dtk("launch --nproc_per_node 2 " + train("gpt") + "--set checkpoint.load=" + ck, 300);
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.out.find("dtk: error: "), std::string::npos) << other.out;
  EXPECT_NE(other.out.find("was saved with expert-parallel size 2, this run has 1"), std::string::npos) << other.out;
  EXPECT_NE(
      other.out.find("dtk checkpoint convert SRC DST --expert_model_parallel_size 1 --tensor_model_parallel_size 1 "
                     "--pipeline_model_parallel_size 1 re-splits them for this run's sizes"),
      std::string::npos)
      << other.out;
  auto convert = [&](const std::string& from, const std::string& to, const std::string& flags) {
    const dtk_test::Result r = dtk_test::run_dtk("checkpoint convert " + from + " " + to + " " + flags, 120);
    EXPECT_EQ(r.code, 0) << flags << "\n" << r.out;
    return r;
  };
  const std::string ep1 = ck + "-ep1";
  const dtk_test::Result to_one = convert(ck + "/iter_0000003", ep1, "--expert_model_parallel_size 1");
  EXPECT_NE(to_one.out.find("expert-parallel size 2 to 1"), std::string::npos) << to_one.out;
  EXPECT_TRUE(std::filesystem::is_regular_file(ep1 + "/iter_0000003/mp_rank_00/model_optim_rng.pt"));
  expect_resumed(curve_of("gpt", 2, "--set checkpoint.load=" + ep1 + " ", "ep2-to-ep1"), whole,
                 "EP 2 converted to EP 1 (DP 2)", 1e-5);
  // Back to EP 2: the same files' values, so the same run bit for bit.
  const std::string back = ck + "-back";
  convert(ep1, back, "--expert_model_parallel_size 2");
  expect_resumed(curve_of("gpt", 2, kEp2 + "--set checkpoint.load=" + back + " ", "ep1-back-to-ep2"), whole,
                 "EP 2 converted to EP 1 and back");
  // A size that does not divide the experts: one line before any rank's tensors are gathered,
  // nothing written.
  const dtk_test::Result three =
      dtk_test::run_dtk("checkpoint convert " + ck + " " + ck + "-ep3 --expert_model_parallel_size 3", 120);
  EXPECT_NE(three.code, 0);
  EXPECT_NE(three.out.find("dtk: error: "), std::string::npos) << three.out;
  EXPECT_NE(three.out.find("checkpoint convert: --expert_model_parallel_size 3: it does not divide the model's 4 "
                           "experts (num_experts)"),
            std::string::npos)
      << three.out;
  EXPECT_FALSE(std::filesystem::exists(ck + "-ep3/iter_0000003"));
  // The same expert-parallel size with pipeline stages: other directories, refused in one line.
  const dtk_test::Result staged =
      dtk_test::run_dtk("launch --nproc_per_node 4 " + train("gpt") + kEp2 +
                            "--set distributed.pipeline_model_parallel_size=2 --set checkpoint.load=" + ck,
                        300);
  EXPECT_NE(staged.code, 0);
  EXPECT_NE(staged.out.find("it was saved with expert parallelism and another tensor- or pipeline-parallel layout"),
            std::string::npos)
      << staged.out;
  EXPECT_NE(staged.out.find("--tensor_model_parallel_size 1 --pipeline_model_parallel_size 2 makes one for it"),
            std::string::npos)
      << staged.out;
  // EP 2 x TP 2 (four directories, each half of two experts), from there (old ranks of both sizes
  // above 0) back to one directory, and EP 2 x PP 2: each resumes within rounding.
  struct Conversion {
    std::string from, to, flags;
    int nproc;
    std::string layout, what;
  };
  const std::string tp2 = ck + "-ep2-tp2";
  const Conversion conversions[] = {
      {ep1, tp2, "--expert_model_parallel_size 2 --tensor_model_parallel_size 2", 4,
       kEp2 + "--set distributed.tensor_model_parallel_size=2 ", "EP 1 converted to EP 2 x TP 2"},
      {tp2, tp2 + "-to-one", "--expert_model_parallel_size 1 --tensor_model_parallel_size 1", 2, "",
       "EP 2 x TP 2 converted to EP 1"},
      {ck, ck + "-pp2", "--pipeline_model_parallel_size 2", 4,
       kEp2 + "--set distributed.pipeline_model_parallel_size=2 ", "EP 2 converted to EP 2 x PP 2"}};
  for (const Conversion& c : conversions) {
    convert(c.from, c.to, c.flags);
    expect_resumed(curve_of("gpt", c.nproc, c.layout + "--set checkpoint.load=" + c.to + " ", c.to.substr(ck.size())),
                   whole, c.what, 1e-5);
  }
  // Commands that read the whole model join every expert-parallel rank's directory: generate prints
  // what it prints from the checkpoint converted to one directory; gpt's experts have no Hugging
  // Face GPT-2 form (one line), a Mixtral-style llama trained at EP 2 exports the same file as
  // its checkpoint converted to EP 1.
  const std::string prompt =
      " --prompt 1 --tokenizer_type NullTokenizer --vocab_size 255 --max_new_tokens 8 --temperature 0 --threads 1";
  auto tokens = [&](const std::string& launch, const std::string& load) {  // the line of ids, from "1 "
    const dtk_test::Result r = dtk_test::run_dtk(launch + "generate --load " + load + prompt, 120);
    EXPECT_EQ(r.code, 0) << r.out;
    const size_t at = r.out.rfind("\n1 ");
    return at == std::string::npos ? r.out : r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
  };
  const std::string one_dir = tokens("", ep1);
  EXPECT_GT(std::count(one_dir.begin(), one_dir.end(), ' '), 7) << one_dir;
  EXPECT_EQ(tokens("", ck), one_dir) << "EP 2 checkpoint";
  EXPECT_EQ(tokens("launch --nproc_per_node 2 ", tp2), one_dir) << "EP 2 x TP 2 checkpoint at TP 2";
  const dtk_test::Result gpt_export = dtk_test::run_dtk("export hf " + ck + " " + ck + "-hf --vocab_file " + ck +
                                                            "/latest_checkpointed_iteration.txt --merge_file " + ck +
                                                            "/latest_checkpointed_iteration.txt",
                                                        120);
  EXPECT_NE(gpt_export.code, 0);
  EXPECT_NE(gpt_export.out.find("dtk: error: "), std::string::npos) << gpt_export.out;
  EXPECT_NE(gpt_export.out.find("the gpt model has mixture-of-experts layers"), std::string::npos) << gpt_export.out;
  const std::string llama = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-ep-llama-checkpoint");
  const dtk_test::Curve llama_run =
      curve_of("llama", 2, kEp2 + "--set checkpoint.save=" + llama + " --set train.exit_interval=3 ", "ep2-llama-save");
  ASSERT_EQ(llama_run.loss.size(), 3u) << llama_run.run.out;
  convert(llama, llama + "-ep1", "--expert_model_parallel_size 1");
  for (const std::string& from : {llama, llama + "-ep1"}) {
    const dtk_test::Result exported = dtk_test::run_dtk("export hf " + from + " " + from + "-hf", 120);
    ASSERT_EQ(exported.code, 0) << exported.out;
    EXPECT_NE(exported.out.find("MixtralForCausalLM"), std::string::npos) << exported.out;
  }
  const std::string direct = dtk_test_hf::read(llama + "-hf/model.safetensors");
  EXPECT_GT(direct.size(), 100000u);
  EXPECT_TRUE(direct == dtk_test_hf::read(llama + "-ep1-hf/model.safetensors"));
}

TEST(Moe, ExpertParallelBadInputsAreOneLine) {
  const std::pair<std::string, std::string> cases[] = {
      {"--set distributed.expert_model_parallel_size=3",
       "the data-parallel size 2 is not divisible by distributed.expert_model_parallel_size 3"},
      {"--set distributed.expert_model_parallel_size=-1", "distributed.expert_model_parallel_size must be at least 1"},
      {kEp2 + "--set model.num_experts=3", "num_experts 3 is not divisible by the expert-parallel size"},
      {kEp2 + "--set model.moe_gate=deepspeed --set model.moe_z_loss_coeff=0 --set model.moe_layer_num_experts=4,3,4,4",
       "option 'moe_layer_num_experts' gives layer 2 (1-based) 3 experts: the expert-parallel size "
       "(distributed.expert_model_parallel_size) 2 must divide every layer's count"},
  };
  for (const auto& [args, line] : cases) {
    const dtk_test::Result r = dtk_test::run_dtk("launch --nproc_per_node 2 " + train("gpt") + args, 300);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.out.find("dtk: error: "), std::string::npos) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(line), std::string::npos) << args << "\n" << r.out;
  }
  // A dense model has no experts to split.
  const dtk_test::Result dense =
      dtk_test::run_dtk("launch --nproc_per_node 2 train --config " + std::string(DTK_SOURCE_DIR) +
                            "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set train.train_iters=2 --set "
                            "lr.lr_warmup_iters=1 "
                            "--set train.micro_batch_size=4 " +
                            kEp2,
                        300);
  EXPECT_NE(dense.code, 0);
  EXPECT_NE(dense.out.find("splits the experts of mixture-of-experts layers, and model 'gpt' has none"),
            std::string::npos)
      << dense.out;
}

// Token dropping (capacity factor 0.5: of a micro-batch's 64 tokens x 2 choices each of the 4
// experts keeps 16): a router call is one micro-batch's tokens, so DP 2, TP 2 (padded too), PP 2
// and EP 2 (padded and not) equal one process; padding to capacity equals not padding, in one
// process and under sequence parallelism (each TP rank's 32 tokens one router call, 8 kept per
// expert).
TEST(Moe, TokenDroppingEqualsOneProcessAndPaddingChangesNothing) {
  const std::string dropping = "--set model.moe_expert_capacity_factor=0.5 ";
  const std::string pad = "--set model.moe_pad_expert_input_to_capacity=true ";
  const std::string sp = "--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true ";
  const dtk_test::Curve one = curve_of("gpt", 1, dropping, "drop-one");
  ASSERT_EQ(one.run.code, 0) << one.run.out;
  expect_same_curve(one, curve_of("gpt", 1, dropping + pad, "drop-one-pad"), kIters, "padded to capacity");
  for (const auto& [name, args] : {std::pair<const char*, std::string>{"dp2", ""},
                                   {"tp2", "--set distributed.tensor_model_parallel_size=2 "},
                                   {"pp2", "--set distributed.pipeline_model_parallel_size=2 "},
                                   {"tp2-pad", "--set distributed.tensor_model_parallel_size=2 " + pad},
                                   {"ep2", kEp2},
                                   {"ep2-pad", kEp2 + pad}})
    expect_same_curve(one, curve_of("gpt", 2, dropping + args, std::string("drop-") + name), kIters,
                      std::string("token dropping, ") + name);
  const dtk_test::Curve sp2 = curve_of("gpt", 2, dropping + sp, "drop-sp2");
  ASSERT_EQ(sp2.run.code, 0) << sp2.run.out;
  expect_same_curve(sp2, curve_of("gpt", 2, dropping + sp + pad, "drop-sp2-pad"), kIters,
                    "token dropping under sequence parallelism, padded");
  // The guard: dropping changes the training, and a smaller capacity per call changes it again.
  const dtk_test::Curve dropless = curve_of("gpt", 1, "", "drop-none");
  ASSERT_EQ(dropless.loss.size(), kIters) << dropless.run.out;
  EXPECT_GT(std::abs(one.loss.at(2) - dropless.loss.at(2)), 1e-4 * dropless.loss.at(2));
  EXPECT_GT(std::abs(one.loss.at(2) - sp2.loss.at(2)), 1e-5 * sp2.loss.at(2));
}

namespace {

// The expert-parallel traffic line's figures (MB): all-to-all, all-gather, reduce-scatter, total.
std::vector<double> expert_traffic(const std::string& out) {
  static const std::regex line(
      "expert-parallel traffic sent per iteration \\(MB\\) \\| all-to-all: ([0-9.]+) \\| all-gather: ([0-9.]+) "
      "\\| reduce-scatter: ([0-9.]+) \\| total: ([0-9.]+)");
  std::smatch m;
  if (!std::regex_search(out, m, line)) return {};
  return {std::stod(m[1]), std::stod(m[2]), std::stod(m[3]), std::stod(m[4])};
}

// The progress line's expert-parallel comm figures (ms): in flight, exposed.
std::vector<double> expert_comm_timing(const std::string& out) {
  static const std::regex field("expert-parallel comm \\(ms\\) in flight: ([0-9.]+) \\| exposed: ([0-9.]+) \\|");
  std::smatch m;
  if (!std::regex_search(out, m, field)) return {};
  return {std::stod(m[1]), std::stod(m[2])};
}

}  // namespace

// Megatron's alltoall token dispatcher (model.moe_token_dispatcher=alltoall): each choice's row goes
// to its expert's rank only, and its output back. The same training as one process (so as the
// allgather dispatcher): dropless under EP 2, EP 2 x TP 2 with sequence parallelism, EP 2 x PP 2
// and EP 4; with a capacity that drops, and padded to it, under EP 2 (and EP 2 x SP 2 against the
// allgather dispatcher, whose SP capacity is per rank); DeepSeek-V3's routing with
// its gated shared expert (llama) under EP 2 and EP 2 x SP 2. At EP 4, top-2 of 4 experts, a rank sends its
// choices' rows (2 per token, 3/4 of them away) where the allgather dispatcher sends its rows to
// all 3 other ranks and reduce-scatters as much back: half the expert-parallel traffic.
TEST(Moe, AllToAllDispatcherEqualsOneProcess) {
  const std::string a2a = "--set model.moe_token_dispatcher=alltoall ";
  const std::string sp = "--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true ";
  const dtk_test::Curve one = curve_of("gpt", 1, "", "a2a-one");
  ASSERT_EQ(one.run.code, 0) << one.run.out;
  expect_same_curve(one, curve_of("gpt", 2, kEp2 + a2a, "a2a-ep2"), kIters, "gpt EP 2, alltoall");
  // Under sequence parallelism each TP rank sends its own rows (Megatron's), with an ungated shared
  // expert beside: half the expert-parallel traffic of the allgather dispatcher at EP 2 (which sends
  // the region's rows and receives as much back), where sending the region's rows would be as much.
  const std::string shared = "--set model.moe_shared_expert_intermediate_size=64 ";
  const dtk_test::Curve one_shared = curve_of("gpt", 1, shared, "a2a-one-shared");
  ASSERT_EQ(one_shared.run.code, 0) << one_shared.run.out;
  const dtk_test::Curve sp_sent = curve_of("gpt", 4, shared + kEp2 + a2a + sp, "a2a-ep2-sp2");
  expect_same_curve(one_shared, sp_sent, kIters, "gpt EP 2 x TP 2 with sequence parallelism, alltoall");
  const dtk_test::Curve sp_gathered = curve_of("gpt", 4, shared + kEp2 + sp, "a2a-ep2-sp2-allgather");
  expect_same_curve(one_shared, sp_gathered, kIters, "gpt EP 2 x TP 2 with sequence parallelism, allgather");
  const std::vector<double> sp_a2a = expert_traffic(sp_sent.run.out), sp_ag = expert_traffic(sp_gathered.run.out);
  ASSERT_EQ(sp_a2a.size(), 4u) << sp_sent.run.out;
  ASSERT_EQ(sp_ag.size(), 4u) << sp_gathered.run.out;
  EXPECT_GT(sp_a2a[0], 0.0) << sp_sent.run.out;
  EXPECT_LT(sp_a2a[3], 0.7 * sp_ag[3]) << "alltoall " << sp_a2a[3] << " MB, allgather " << sp_ag[3] << " MB";
  // The shared expert's forward while the rows travel (moe_shared_expert_overlap): the same
  // arithmetic, so the same bits as without.
  const std::string overlap = "--set model.moe_shared_expert_overlap=true ";
  const dtk_test::Curve overlapped = curve_of("gpt", 4, shared + kEp2 + a2a + sp + overlap, "a2a-ep2-sp2-overlap");
  expect_same_curve(sp_sent, overlapped, kIters, "the shared expert overlapped, EP 2 x TP 2 with SP", 0.0);
  // The shared expert ran while the forward's exchanges were in flight: the thread waited for less
  // than their time (a synchronous exchange is exposed for all of it).
  const std::vector<double> waited = expert_comm_timing(sp_sent.run.out),
                            overlap_waited = expert_comm_timing(overlapped.run.out);
  ASSERT_EQ(waited.size(), 2u) << sp_sent.run.out;
  ASSERT_EQ(overlap_waited.size(), 2u) << overlapped.run.out;
  EXPECT_EQ(waited[1], waited[0]) << sp_sent.run.out;
  EXPECT_GT(overlap_waited[0], 0.0) << overlapped.run.out;
  EXPECT_LT(overlap_waited[1], overlap_waited[0]) << overlapped.run.out;
  // Tensor parallelism without sequence parallelism: every TP rank sends the same whole rows.
  expect_same_curve(one,
                    curve_of("gpt", 4, kEp2 + a2a + "--set distributed.tensor_model_parallel_size=2 ", "a2a-ep2-tp2"),
                    kIters, "gpt EP 2 x TP 2 without sequence parallelism, alltoall");
  // bf16 rows through the exchanges and the uneven TP gathers: one process's bf16 curve up to bf16
  // rounding (the grad norm within 1%; a dtype slip fails the run, a wrong row moves the losses more).
  const std::string bf16 = "--set train.params_dtype=bf16 ";
  const dtk_test::Curve one_bf16 = curve_of("gpt", 1, bf16, "a2a-one-bf16");
  ASSERT_EQ(one_bf16.run.code, 0) << one_bf16.run.out;
  expect_same_curve(one_bf16, curve_of("gpt", 4, bf16 + kEp2 + a2a + sp, "a2a-ep2-sp2-bf16"), kIters,
                    "gpt bf16 EP 2 x TP 2 with sequence parallelism, alltoall", 1e-2);
  expect_same_curve(one,
                    curve_of("gpt", 4, kEp2 + a2a + "--set distributed.pipeline_model_parallel_size=2 ", "a2a-ep2-pp2"),
                    kIters, "gpt EP 2 x PP 2, alltoall");
  const std::string ep4 = "--set train.micro_batch_size=2 --set distributed.expert_model_parallel_size=4 ";
  const dtk_test::Curve one_small = curve_of("gpt", 1, "--set train.micro_batch_size=2 ", "a2a-one-mb2");
  ASSERT_EQ(one_small.run.code, 0) << one_small.run.out;
  const dtk_test::Curve all_to_all = curve_of("gpt", 4, ep4 + a2a, "a2a-ep4");
  expect_same_curve(one_small, all_to_all, kIters, "gpt EP 4, alltoall");
  const dtk_test::Curve all_gather = curve_of("gpt", 4, ep4, "a2a-ep4-allgather");
  expect_same_curve(one_small, all_gather, kIters, "gpt EP 4, allgather");
  const std::vector<double> sent = expert_traffic(all_to_all.run.out), gathered = expert_traffic(all_gather.run.out);
  ASSERT_EQ(sent.size(), 4u) << all_to_all.run.out;
  ASSERT_EQ(gathered.size(), 4u) << all_gather.run.out;
  EXPECT_GT(sent[0], 0.0) << all_to_all.run.out;
  // (The outputs come back by all-to-all: only the expert biases' table reduce-scatters its gradient.)
  EXPECT_LT(sent[2], 0.01) << all_to_all.run.out;
  EXPECT_EQ(gathered[0], 0.0) << all_gather.run.out;
  EXPECT_LT(sent[3], 0.7 * gathered[3]) << "alltoall " << sent[3] << " MB, allgather " << gathered[3] << " MB";
  // The progress line times the exchanges on the expert-parallel group.
  const std::vector<double> timed = expert_comm_timing(all_to_all.run.out);
  ASSERT_EQ(timed.size(), 2u) << all_to_all.run.out;
  EXPECT_GT(timed[0], 0.0) << all_to_all.run.out;
  EXPECT_LE(timed[1], timed[0]) << all_to_all.run.out;
  // Dropping, and padded to capacity (every rank sends every expert its capacity's rows).
  const std::string dropping = "--set model.moe_expert_capacity_factor=0.5 ";
  const dtk_test::Curve drop_one = curve_of("gpt", 1, dropping, "a2a-drop-one");
  ASSERT_EQ(drop_one.run.code, 0) << drop_one.run.out;
  expect_same_curve(drop_one, curve_of("gpt", 2, dropping + kEp2 + a2a, "a2a-drop-ep2"), kIters,
                    "token dropping, EP 2, alltoall");
  const std::string pad = "--set model.moe_pad_expert_input_to_capacity=true ";
  expect_same_curve(drop_one, curve_of("gpt", 2, dropping + kEp2 + a2a + pad, "a2a-drop-pad-ep2"), kIters,
                    "token dropping padded to capacity, EP 2, alltoall");
  // Under sequence parallelism a rank's capacity is its own rows' (the padding per rank: the TP
  // group's rows meet in the region): as the allgather dispatcher's run.
  const dtk_test::Curve drop_sp = curve_of("gpt", 4, dropping + kEp2 + sp, "a2a-drop-sp2");
  ASSERT_EQ(drop_sp.run.code, 0) << drop_sp.run.out;
  expect_same_curve(drop_sp, curve_of("gpt", 4, dropping + kEp2 + sp + a2a + pad, "a2a-drop-pad-sp2"), kIters,
                    "token dropping padded to capacity, EP 2 x TP 2 with sequence parallelism, alltoall");
  const auto deepseek = deepseek_run(1, "", "a2a-one").first;
  ASSERT_EQ(deepseek.loss.size(), kIters) << deepseek.run.out;
  const dtk_test::Curve deepseek_ep2 = deepseek_run(2, kEp2 + a2a, "a2a-ep2").first;
  expect_same_curve(deepseek, deepseek_ep2, kIters, "DeepSeek-style llama EP 2, alltoall");
  expect_same_curve(
      deepseek_ep2,
      deepseek_run(2, kEp2 + a2a + "--set model.moe_shared_expert_overlap=true ", "a2a-ep2-overlap").first, kIters,
      "DeepSeek-style llama EP 2, its gated shared expert overlapped", 0.0);
  expect_same_curve(deepseek, deepseek_run(4, kEp2 + a2a + sp, "a2a-ep2-sp2").first, kIters,
                    "DeepSeek-style llama EP 2 x TP 2 with sequence parallelism, alltoall");
}

// DeepSpeed's gate (moe_gate=deepspeed, as Megatron-DeepSpeed's MoE maps) in whole runs, with a
// capacity that drops: top-2 without sampling (no noise) equals one process under DP, TP, SP, PP
// and EP; with its Gumbel noise and top-1's random token selection (drawn like the input jitter),
// under TP, SP and full recomputation; DeepSpeed's residual MoE under TP, SP and EP. The logged
// load-balancing loss is DeepSpeed's l_aux, the same however split; the gate changes the training
// against Megatron's router.
TEST(Moe, DeepSpeedGateEqualsOneProcessHoweverSplit) {
  const std::string gate =
      "--set model.moe_gate=deepspeed --set model.moe_z_loss_coeff=0 --set model.moe_expert_capacity_factor=0.5 "
      "--set model.moe_min_capacity=4 ";
  const std::string argmax = "--set model.moe_top2_2nd_expert_sampling=false ";
  const auto [one, one_logged] = run_logged("gpt", 1, gate + argmax, "ds-gate-one");
  ASSERT_EQ(one.loss.size(), kIters) << one.run.out;
  const std::map<int64_t, float>& balance = one_logged.at("load_balancing_loss");
  ASSERT_EQ(balance.size(), kIters) << one.run.out;
  EXPECT_GT(balance.at(1), 0.9);  // E * sum_e mean(g) * share: about 1 from near-uniform gates, not 0 or E
  for (const auto& [name, split] : kSplits) {
    const auto [run, logged] = run_logged("gpt", 2, gate + argmax + split, std::string("ds-gate-") + name);
    expect_same_curve(one, run, kIters, std::string("DeepSpeed's gate, top-2 argmax, ") + name);
    for (const auto& [it, value] : balance)
      EXPECT_NEAR(logged.at("load_balancing_loss").at(it), value, 1e-5 * value) << name << " iteration " << it;
  }
  expect_same_curve(one, curve_of("gpt", 2, gate + argmax + kEp2, "ds-gate-ep2"), kIters,
                    "DeepSpeed's gate, top-2 argmax, EP 2");
  expect_same_curve(
      one, curve_of("gpt", 2, gate + argmax + kEp2 + "--set model.moe_token_dispatcher=alltoall ", "ds-gate-ep2-a2a"),
      kIters, "DeepSpeed's gate, top-2 argmax, EP 2, alltoall");
  // topkgating (k > 2) draws nothing either: every split equals one process.
  const std::string top3 = gate + "--set model.moe_router_topk=3 ";
  const dtk_test::Curve three = curve_of("gpt", 1, top3, "ds-gate-top3-one");
  ASSERT_EQ(three.loss.size(), kIters) << three.run.out;
  for (const auto& [name, split] : kSplits)
    expect_same_curve(three, curve_of("gpt", 2, top3 + split, std::string("ds-gate-top3-") + name), kIters,
                      std::string("DeepSpeed's gate, top-3, ") + name);
  expect_same_curve(three, curve_of("gpt", 2, top3 + kEp2, "ds-gate-top3-ep2"), kIters,
                    "DeepSpeed's gate, top-3, EP 2");
  EXPECT_GT(std::abs(three.loss.at(2) - one.loss.at(2)), 1e-5 * one.loss.at(2));
  // DeepSpeed's residual MoE (a dense MLP beside the experts, mixed per token), gpt and llama.
  const std::string residual = gate + argmax + "--set model.moe_residual=true ";
  for (const std::string model : {"gpt", "llama"}) {
    const dtk_test::Curve mixed = curve_of(model, 1, residual, "ds-gate-residual-one");
    ASSERT_EQ(mixed.loss.size(), kIters) << mixed.run.out;
    for (const auto& [name, split] :
         {std::pair<const char*, std::string>{"tp2", kSplits[1].second}, {"sp2", kSplits[2].second}, {"ep2", kEp2}})
      expect_same_curve(mixed, curve_of(model, 2, residual + split, std::string("ds-gate-residual-") + name), kIters,
                        model + ", DeepSpeed's residual MoE, " + name);
    if (model == "gpt") {
      EXPECT_GT(std::abs(mixed.loss.at(2) - one.loss.at(2)), 1e-5 * one.loss.at(2));
      // Under EP 2 x SP 2 the alltoall dispatcher's own-rows path mixes the residual MLP in.
      expect_same_curve(
          mixed,
          curve_of(model, 4, residual + kEp2 + kSplits[2].second + "--set model.moe_token_dispatcher=alltoall ",
                   "ds-gate-residual-ep2-sp2-a2a"),
          kIters, "gpt, DeepSpeed's residual MoE, EP 2 x SP 2, alltoall");
    }
  }
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  const std::string sp2 = tp2 + "--set distributed.sequence_parallel=true ";
  const std::string full = "--set model.recompute_activations=full ";
  for (const std::string& noisy : {std::string(), std::string("--set model.moe_router_topk=1 ")}) {
    const std::string what = noisy.empty() ? "top-2 sampled" : "top-1 random selection";
    const dtk_test::Curve base = curve_of("gpt", 1, gate + noisy, "ds-gate-noisy-one" + noisy);
    ASSERT_EQ(base.loss.size(), kIters) << base.run.out;
    for (const auto& [nproc, split] : {std::pair<int, std::string>{2, tp2}, {2, sp2}, {1, full}})
      expect_same_curve(base, curve_of("gpt", nproc, gate + noisy + split, "ds-gate-noisy" + noisy + split), kIters,
                        "DeepSpeed's gate, " + what + ", " + split);
    // The guard: these runs differ from top-2 argmax's (that the draws matter: DeepSpeedGateIsDeepSpeedsTopKGate).
    EXPECT_GT(std::abs(base.loss.at(kIters) - one.loss.at(kIters)), 1e-5 * one.loss.at(kIters)) << what;
  }
  const dtk_test::Curve megatron = curve_of("gpt", 1, "--set model.moe_expert_capacity_factor=0.5 ", "ds-gate-none");
  ASSERT_EQ(megatron.loss.size(), kIters) << megatron.run.out;
  EXPECT_GT(std::abs(megatron.loss.at(2) - one.loss.at(2)), 1e-5 * one.loss.at(2));
}

// A DeepSpeed-gate model (no router bias, no second expert bias) under EP 2: with top-1's random
// token selection (its draws from the checkpointed generator) it resumes bit for bit; with top-2
// argmax (no noise: a converted checkpoint starts the new layout's own generators, as dropout's)
// converted to EP 1 it resumes as the uninterrupted run.
TEST(Moe, DeepSpeedGateResumesAndConverts) {
  const std::string gate =
      "--set model.moe_gate=deepspeed --set model.moe_z_loss_coeff=0 --set model.moe_expert_capacity_factor=0.5 ";
  for (const std::string& routing : {std::string("--set model.moe_router_topk=1 "),
                                     std::string("--set model.moe_top2_2nd_expert_sampling=false ")}) {
    const bool noisy = routing.find("topk=1") != std::string::npos;
    const std::string tag = noisy ? "ds-gate-top1" : "ds-gate-top2";
    const std::string ck = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-" + tag + "-checkpoint");
    const dtk_test::Curve whole = curve_of("gpt", 2, gate + routing + kEp2, tag + "-uninterrupted");
    ASSERT_EQ(whole.loss.size(), kIters) << whole.run.out;
    const dtk_test::Curve first =
        curve_of("gpt", 2, gate + routing + kEp2 + "--set checkpoint.save=" + ck + " --set train.exit_interval=3 ",
                 tag + "-first");
    ASSERT_EQ(first.loss.size(), 3u) << first.run.out;
    if (noisy) {
      expect_resumed(curve_of("gpt", 2, gate + routing + kEp2 + "--set checkpoint.load=" + ck + " ", tag + "-resumed"),
                     whole, "DeepSpeed's gate, top-1, EP 2 resumed");
      continue;
    }
    const dtk_test::Result convert = dtk_test::run_dtk(
        "checkpoint convert " + ck + "/iter_0000003 " + ck + "-ep1 --expert_model_parallel_size 1", 120);
    ASSERT_EQ(convert.code, 0) << convert.out;
    expect_resumed(curve_of("gpt", 2, gate + routing + "--set checkpoint.load=" + ck + "-ep1 ", tag + "-to-ep1"), whole,
                   "DeepSpeed's gate, top-2, EP 2 converted to EP 1", 1e-5);
  }
}

// DeepSpeed's pyramid MoE (PR-MoE; Megatron-DeepSpeed's --num-experts list): each MoE layer has its
// own count, here 2, 4, 4 and 8 of which a token runs 2. The whole model's parameters and those a
// token runs (the FLOPs' N) count each layer's experts, against the uniform model of 8 by hand; the
// pyramid equals one process under DP, TP, SP, PP and EP; converted from EP 2 to EP 1 it resumes as
// the uninterrupted run, and EP 4, which does not divide the first layer's 2, is refused.
TEST(Moe, PyramidMoeLayersHaveTheirOwnExperts) {
  const std::string gate =
      "--set model.moe_gate=deepspeed --set model.moe_z_loss_coeff=0 --set model.moe_expert_capacity_factor=0.5 "
      "--set model.moe_top2_2nd_expert_sampling=false --set model.num_experts=8 ";
  const std::string pyramid = gate + "--set model.moe_layer_num_experts=2,4,4,8 ";
  const dtk_test::Curve one = curve_of("gpt", 1, pyramid, "pyramid-one");
  ASSERT_EQ(one.loss.size(), kIters) << one.run.out;
  const dtk_test::Curve uniform = curve_of("gpt", 1, gate, "pyramid-uniform");
  ASSERT_EQ(uniform.loss.size(), kIters) << uniform.run.out;
  // gpt-tiny's hidden 64 and ffn 256: an expert behind DeepSpeed's gate holds 2 x 64 x 256 weights
  // and its first bias; the router one row of 64 per expert.
  const long long expert = 2LL * 64 * 256 + 256, row = 64;
  const auto [active, whole] = active_and_whole(one.run.out);
  const auto [uniform_active, uniform_whole] = active_and_whole(uniform.run.out);
  ASSERT_NE(active, -1) << one.run.out;
  EXPECT_EQ(uniform_whole - whole, (6 + 4 + 4 + 0) * (expert + row)) << one.run.out;
  EXPECT_EQ(whole - active, (0 + 2 + 2 + 6) * expert) << one.run.out;
  EXPECT_EQ(uniform_whole - uniform_active, 4 * 6 * expert) << uniform.run.out;
  EXPECT_GT(std::abs(one.loss.at(2) - uniform.loss.at(2)), 1e-5 * uniform.loss.at(2));
  for (const auto& [name, split] : kSplits) {
    const dtk_test::Curve run = curve_of("gpt", 2, pyramid + split, std::string("pyramid-") + name);
    expect_same_curve(one, run, kIters, std::string("pyramid MoE, ") + name);
    EXPECT_EQ(active_and_whole(run.run.out), active_and_whole(one.run.out)) << name << "\n" << run.run.out;
  }
  const dtk_test::Curve ep2 = curve_of("gpt", 2, pyramid + kEp2, "pyramid-ep2");
  expect_same_curve(one, ep2, kIters, "pyramid MoE, EP 2");
  EXPECT_EQ(active_and_whole(ep2.run.out), active_and_whole(one.run.out)) << ep2.run.out;
  // llama (SwiGLU experts) with DeepSpeed's residual MoE: PR-MoE's both halves, under EP 2.
  const std::string residual = pyramid + "--set model.moe_residual=true ";
  expect_same_curve(curve_of("llama", 1, residual, "pyramid-residual-one"),
                    curve_of("llama", 2, residual + kEp2, "pyramid-residual-ep2"), kIters,
                    "llama pyramid residual MoE, EP 2");

  const std::string ck = dtk_test::fresh_dir(DTK_TEST_TMP, "moe-pyramid-checkpoint");
  const dtk_test::Curve first = curve_of(
      "gpt", 2, pyramid + kEp2 + "--set checkpoint.save=" + ck + " --set train.exit_interval=3 ", "pyramid-first");
  ASSERT_EQ(first.loss.size(), 3u) << first.run.out;
  const dtk_test::Result convert = dtk_test::run_dtk(
      "checkpoint convert " + ck + "/iter_0000003 " + ck + "-ep1 --expert_model_parallel_size 1", 120);
  ASSERT_EQ(convert.code, 0) << convert.out;
  expect_resumed(curve_of("gpt", 2, pyramid + "--set checkpoint.load=" + ck + "-ep1 ", "pyramid-to-ep1"), ep2,
                 "pyramid MoE, EP 2 converted to EP 1", 1e-5);
  const dtk_test::Result four = dtk_test::run_dtk(
      "checkpoint convert " + ck + "/iter_0000003 " + ck + "-ep4 --expert_model_parallel_size 4", 120);
  EXPECT_NE(four.code, 0);
  EXPECT_NE(four.out.find("dtk: error: checkpoint convert: --expert_model_parallel_size 4: it does not divide the 2 "
                          "experts of the layer of "),
            std::string::npos)
      << four.out;
}
