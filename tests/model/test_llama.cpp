// Tests of the "llama" model plugin as shipped (loaded by the host, driven through the C ABI),
// against an independent Llama written below with plain ATen ops on the plugin's weights: RMSNorm
// from its formula, rotary embeddings as a rotation of channel pairs (j, j + d/2) by the angle
// position / base^(2j/d) computed in double, grouped-query attention by indexing each query head's
// key/value group, SwiGLU, and the cross entropy of ATen.
#include <dtk/model.hpp>

#include "gpt_harness.hpp"
#include "rope_scaling.hpp"  // plugins/models/llama: plain C++, compiled into this test too

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

namespace {

using dtk::TensorList;
using dtk_test_gpt::Ctx;
using dtk_test_gpt::GPT;
using dtk_test_gpt::graph_has;
using dtk_test_gpt::Opts;
using dtk_test_gpt::plugins;

struct Shape {
  int64_t layers, hidden, heads, groups, ffn, seq, vocab;  // vocab = the padded size
  double rotary_percent;
  bool bias = false;  // add_bias_linear
  std::vector<double> inv_freq = {};  // the rotary frequencies when not 1 / base^(2j/d) (rope scaling)
  int64_t kv_channels = 0;            // a head's width; 0: hidden / heads
  bool qkv_bias = false;              // add_qkv_bias (Qwen2)
  bool qk_norm = false;               // qk_layernorm (Qwen3)
  // Sliding-window attention: the window W (-1: none) and the 1-based period of full layers (0: none).
  int64_t window = -1, full_every = 0;
  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden / heads; }
  bool windowed(int64_t layer) const { return window >= 0 && (full_every == 0 || (layer + 1) % full_every != 0); }
};

Opts llama_opts(const Shape& S) {
  return {{"num_layers", std::to_string(S.layers)},
          {"hidden_size", std::to_string(S.hidden)},
          {"num_attention_heads", std::to_string(S.heads)},
          {"num_query_groups", std::to_string(S.groups)},
          {"ffn_hidden_size", std::to_string(S.ffn)},
          {"seq_length", std::to_string(S.seq)},
          {"vocab_size", std::to_string(S.vocab)},
          {"make_vocab_size_divisible_by", "8"},
          {"rotary_percent", std::to_string(S.rotary_percent)},
          {"add_bias_linear", S.bias ? "true" : "false"},
          {"kv_channels", std::to_string(S.kv_channels)},
          {"add_qkv_bias", S.qkv_bias ? "true" : "false"},
          {"qk_layernorm", S.qk_norm ? "true" : "false"},
          {"window_size", S.window >= 0 ? std::to_string(S.window) + ",0" : ""},
          {"window_attn_skip_freq", S.full_every > 0 ? std::to_string(S.full_every) : ""},
          // Not the Xavier-like default scale: large enough weights that attention is not uniform.
          {"init_method_std", "0.2"}};
}

GPT make_llama(const Shape& S, const Ctx& c = {}) { return GPT(llama_opts(S), c, plugins().llama); }

at::Tensor random_ids(int64_t b, int64_t s, int64_t vocab, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randint(vocab, {b, s}, g, at::TensorOptions().dtype(at::kLong));
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(1.0, want.abs().max().item<double>());
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what << ": max abs error " << err << " (scale " << scale << ")";
}

// Two training steps of a model without recomputation (base) and with it (rec): the same loss and
// gradients, and `blocks` recomputed checkpoints in rec's graph (none in base's).
void expect_recompute_matches(const Shape& S, const Opts& base, const Opts& rec, int64_t blocks,
                              const std::string& what) {
  GPT a(base, Ctx{}, plugins().llama), b(rec, Ctx{}, plugins().llama);
  a.train(true);
  b.train(true);
  at::Tensor tokens = random_ids(2, S.seq, S.vocab, 9), labels = random_ids(2, S.seq, S.vocab, 10);
  TensorList in{{"tokens", tokens}, {"labels", labels}};
  for (int it = 0; it < 2; ++it) {
    a.zero_grad();
    b.zero_grad();
    at::Tensor la = dtk::get(a.forward(in), "loss").mean(), lb = dtk::get(b.forward(in), "loss").mean();
    EXPECT_EQ(graph_has(la, "Recomputed"), 0) << what;
    EXPECT_EQ(graph_has(lb, "Recomputed"), blocks) << what;
    la.backward();
    lb.backward();
    expect_close(lb.detach(), la.detach(), 1e-6, "loss, " + what);
    auto pa = a.param_map(), pb = b.param_map();
    for (auto& kv : pa) expect_close(pb[kv.first].grad(), kv.second.grad(), 1e-6, "grad " + kv.first + ", " + what);
  }
}

// The reference: [b, s, h] layout, fp32 except the rotary angles (double, then rounded).
at::Tensor ref_rms(const at::Tensor& x, const at::Tensor& w) {
  return x / (x * x).mean({-1}, true).add(1e-5).sqrt() * w;
}

// x [b, s, n, d]: channel j < rot/2 pairs with j + rot/2; channels >= rot are untouched.
at::Tensor ref_rotate(const at::Tensor& x, const at::Tensor& pos, int64_t rot, const std::vector<double>& inv_freq = {}) {
  const int64_t half = rot / 2;
  at::Tensor out = x.clone();
  for (int64_t j = 0; j < half; ++j) {
    const double inv = inv_freq.empty()
                           ? 1.0 / std::pow(10000.0, 2.0 * static_cast<double>(j) / static_cast<double>(rot))
                           : inv_freq.at(static_cast<size_t>(j));
    at::Tensor angle = (pos.to(at::kDouble) * inv).unsqueeze(-1);  // [b, s, 1]
    at::Tensor c = angle.cos().to(at::kFloat), s = angle.sin().to(at::kFloat);
    at::Tensor a = x.select(-1, j), b = x.select(-1, j + half);
    out.select(-1, j).copy_(a * c - b * s);
    out.select(-1, j + half).copy_(b * c + a * s);
  }
  return out;
}

at::Tensor ref_logits(std::map<std::string, at::Tensor>& P, const Shape& S, const at::Tensor& tokens,
                      const at::Tensor& pos) {
  const int64_t b = tokens.size(0), s = tokens.size(1), hd = S.head_dim(), per = S.heads / S.groups;
  const int64_t rot = static_cast<int64_t>(static_cast<double>(hd) * S.rotary_percent);
  at::Tensor h = at::embedding(P["language_model.embedding.word_embeddings.weight"], tokens);
  const at::Tensor causal = at::ones({s, s}, at::kBool).triu(1);
  // Query head i reads key/value group i / per.
  // x W^T (+ b where the model has biases).
  auto lin = [&](const at::Tensor& x, const std::string& name) {
    at::Tensor y = at::matmul(x, P[name + ".weight"].t());
    return P.count(name + ".bias") ? y + P[name + ".bias"] : y;
  };
  const at::Tensor group_of_head = at::arange(S.heads, at::kLong).div(per, "floor");
  for (int64_t l = 0; l < S.layers; ++l) {
    const std::string L = "language_model.encoder.layers." + std::to_string(l) + ".";
    at::Tensor mixed =
        lin(ref_rms(h, P[L + "input_norm.weight"]), L + "self_attention.query_key_value").view({b, s, S.groups, per + 2, hd});
    at::Tensor q = mixed.narrow(3, 0, per).reshape({b, s, S.heads, hd}), k = mixed.select(3, per);
    if (S.qk_norm) {  // each head RMS-normalised over its own channels, then rotated
      q = ref_rms(q, P[L + "self_attention.q_layernorm.weight"]);
      k = ref_rms(k, P[L + "self_attention.k_layernorm.weight"]);
    }
    q = ref_rotate(q, pos, rot, S.inv_freq);
    k = ref_rotate(k, pos, rot, S.inv_freq).index_select(2, group_of_head);
    at::Tensor v = mixed.select(3, per + 1).index_select(2, group_of_head);
    q = q.permute({0, 2, 1, 3}), k = k.permute({0, 2, 1, 3}), v = v.permute({0, 2, 1, 3});
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(hd));
    // Query i sees keys i - W .. i in a windowed layer, every earlier one otherwise.
    const at::Tensor rows = at::arange(s, at::kLong).unsqueeze(1), cols = at::arange(s, at::kLong).unsqueeze(0);
    const at::Tensor masked = S.windowed(l) ? causal.logical_or(cols < rows - S.window) : causal;
    scores = scores.masked_fill(masked, -std::numeric_limits<float>::infinity());
    at::Tensor ctx = at::matmul(at::softmax(scores, -1), v).permute({0, 2, 1, 3}).reshape({b, s, S.heads * hd});
    h = h + lin(ctx, L + "self_attention.dense");
    at::Tensor y = ref_rms(h, P[L + "post_attention_norm.weight"]);
    at::Tensor g = lin(y, L + "mlp.gate"), u = lin(y, L + "mlp.up");
    h = h + lin(g * at::sigmoid(g) * u, L + "mlp.dense_4h_to_h");
  }
  h = ref_rms(h, P["language_model.encoder.final_norm.weight"]);
  return at::matmul(h, P["language_model.output_layer.weight"].t());
}

at::Tensor ref_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}), labels.reshape({-1}), {}, at::Reduction::None)
      .view(labels.sizes());
}

// Multi-head (groups = heads), grouped-query and multi-query attention; full and partial rotary;
// with biases (Megatron's default layers); Qwen2's (query/key/value biases alone) and Qwen3's
// (per-head query/key norms, heads wider than hidden / heads) layers; sliding-window attention
// (each token sees itself and the 2 before it) in every layer, and in all but every 2nd.
const Shape kShapes[] = {
    {2, 32, 4, 4, 48, 8, 64, 1.0},
    {2, 32, 4, 2, 48, 8, 64, 1.0},
    {1, 32, 4, 1, 40, 8, 64, 0.5},
    {1, 32, 4, 2, 48, 8, 64, 1.0, true},
    {2, 32, 4, 2, 48, 8, 64, 1.0, false, {}, 0, /*qkv_bias=*/true},
    {2, 32, 4, 2, 48, 8, 64, 0.5, false, {}, /*kv_channels=*/16, false, /*qk_norm=*/true},
    {2, 32, 4, 2, 48, 8, 64, 1.0, false, {}, 0, false, false, /*window=*/2},
    {3, 32, 4, 2, 48, 8, 64, 1.0, false, {}, 0, false, false, /*window=*/2, /*full_every=*/2},
};

}  // namespace

TEST(LlamaModel, LogitsLossAndGradientsMatchReference) {
  for (const Shape& S : kShapes) {
    const std::string what =
        "groups=" + std::to_string(S.groups) + " rotary=" + std::to_string(S.rotary_percent) +
        " kv_channels=" + std::to_string(S.head_dim()) + (S.qkv_bias ? " qkv bias" : "") +
        (S.qk_norm ? " qk norm" : "") +
        (S.window >= 0 ? " window " + std::to_string(S.window) + "," + std::to_string(S.full_every) : "");
    GPT model = make_llama(S);
    ASSERT_EQ(model.info().vocab_size, S.vocab);
    ASSERT_EQ(model.info().kv_channels, S.head_dim());
    model.train(true);  // dropout is 0 by default: training is deterministic
    auto P = model.param_map();
    EXPECT_EQ(P.count("language_model.encoder.layers.0.self_attention.q_layernorm.weight"), S.qk_norm ? 1u : 0u);
    EXPECT_EQ(P.count("language_model.encoder.layers.0.self_attention.query_key_value.bias"),
              S.bias || S.qkv_bias ? 1u : 0u);
    EXPECT_EQ(P.count("language_model.encoder.layers.0.self_attention.dense.bias"), S.bias ? 1u : 0u);
    if (S.qk_norm || S.qkv_bias) {  // weights away from their initial ones and zeros, so that each one counts
      at::NoGradGuard ng;
      at::Generator g = at::detail::createCPUGenerator(5);
      for (auto& [name, t] : P)
        if (name.find("layernorm") != std::string::npos || name.find("query_key_value.bias") != std::string::npos)
          t.add_(at::randn(t.sizes(), g) * 0.5);
    }
    at::Tensor tokens = random_ids(3, S.seq, S.vocab, 7 + S.groups), labels = random_ids(3, S.seq, S.vocab, 9);
    at::Tensor pos = at::arange(S.seq, at::kLong).repeat({3, 1});
    {
      at::NoGradGuard ng;
      at::Tensor expect = ref_logits(P, S, tokens, pos);
      expect_close(dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits"), expect, 1e-5,
                   "logits " + what);
    }
    // Loss (the fused output layer) and every parameter's gradient.
    at::Tensor loss = dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}}), "loss");
    std::map<std::string, at::Tensor> R;
    for (auto& kv : P) R[kv.first] = kv.second.detach().clone().requires_grad_(true);
    at::Tensor want = ref_loss(ref_logits(R, S, tokens, pos), labels);
    expect_close(loss.detach(), want.detach(), 1e-5, "loss " + what);
    loss.mean().backward();
    want.mean().backward();
    for (auto& kv : P) {
      ASSERT_TRUE(kv.second.grad().defined()) << kv.first << " has no gradient (" << what << ")";
      expect_close(kv.second.grad(), R[kv.first].grad(), 1e-5, "gradient of " + kv.first + " " + what);
    }
  }
}

// Megatron's --apply-layernorm-1p: every RMSNorm weight starts at 0 and the norm multiplies by
// 1 + w. With random w, the model is the reference with 1 + w as its norm weights, forward and
// backward (the gradient of w is the reference's of 1 + w).
TEST(LlamaModel, ZeroCentredNormWeightsMultiplyByOnePlusW) {
  // Llama's norms, and Qwen3's query/key norms with them.
  for (const Shape& S : {kShapes[1], kShapes[5]}) {
    Opts o = llama_opts(S);
    o["apply_layernorm_1p"] = "true";
    GPT model(o, Ctx{}, plugins().llama);
    model.train(true);
    auto P = model.param_map();
    std::vector<std::string> norms;
    for (auto& kv : P)
      if (kv.first.find("norm.weight") != std::string::npos) norms.push_back(kv.first);
    ASSERT_EQ(norms.size(), (S.qk_norm ? 4u : 2u) * static_cast<size_t>(S.layers) + 1u);  // q/k norms too
    at::Generator g = at::detail::createCPUGenerator(5);
    {
      at::NoGradGuard ng;
      for (const std::string& n : norms) {
        EXPECT_EQ(P[n].abs().max().item<double>(), 0.0) << n << " starts at 0";
        P[n].copy_(at::randn(P[n].sizes(), g) * 0.3);
      }
    }
    at::Tensor tokens = random_ids(3, S.seq, S.vocab, 11), labels = random_ids(3, S.seq, S.vocab, 12);
    at::Tensor pos = at::arange(S.seq, at::kLong).repeat({3, 1});
    at::Tensor loss = dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}}), "loss");
    std::map<std::string, at::Tensor> R;
    for (auto& kv : P) R[kv.first] = kv.second.detach().clone().requires_grad_(true);
    std::map<std::string, at::Tensor> gains = R;
    for (const std::string& n : norms) gains[n] = R[n] + 1;
    at::Tensor want = ref_loss(ref_logits(gains, S, tokens, pos), labels);
    expect_close(loss.detach(), want.detach(), 1e-5, "loss with 1 + w");
    loss.mean().backward();
    want.mean().backward();
    for (auto& kv : P) expect_close(kv.second.grad(), R[kv.first].grad(), 1e-5, "gradient of " + kv.first);
  }
}

TEST(LlamaModel, RotaryPositionsBeyondTheTrainingLengthAreExact) {
  // Trained for 8 positions; evaluated at 32..39 and with reset positions, in an order that
  // grows the rotary table and then reads rows it made earlier.
  const Shape S = kShapes[1];
  GPT model = make_llama(S);
  auto P = model.param_map();
  at::NoGradGuard ng;
  at::Tensor tokens = random_ids(2, S.seq, S.vocab, 5);
  for (int64_t start : {0, 32, 1000, 3}) {
    at::Tensor pos = at::arange(start, start + S.seq, at::kLong).repeat({2, 1});
    expect_close(dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits"),
                 ref_logits(P, S, tokens, pos), 1e-5, "positions from " + std::to_string(start));
  }
  // Positions restart inside a sequence (Megatron's --reset-position-ids).
  at::Tensor pos = at::cat({at::arange(5, at::kLong), at::arange(3, at::kLong)}).repeat({2, 1});
  expect_close(dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits"),
               ref_logits(P, S, tokens, pos), 1e-5, "reset positions");
}

TEST(LlamaModel, TensorParallelShardsAreSlicesOfTheFullWeights) {
  // Whole key/value groups per rank: the fused QKV rows of groups [r * g/2, (r + 1) * g/2).
  const Shape S = kShapes[1];
  GPT full = make_llama(S);
  auto F = full.param_map();
  for (int32_t r = 0; r < 2; ++r) {
    GPT shard = make_llama(S, Ctx{DTK_DTYPE_FLOAT32, r, 2, 16, 1234});
    for (auto& p : shard.params()) {
      at::Tensor expect = F[p.name];
      if (p.info.partition_dim >= 0) {
        const int64_t n = expect.size(p.info.partition_dim) / 2;
        expect = expect.narrow(p.info.partition_dim, r * n, n);
      }
      EXPECT_TRUE(at::equal(p.tensor, expect)) << p.name << " rank " << r;
    }
  }
}

TEST(LlamaModel, PipelineStagesComposeToTheFullModel) {
  const Shape S{4, 32, 4, 2, 48, 8, 64, 1.0};
  Ctx c0, c1;
  c0.pp_size = c1.pp_size = 2;
  c1.pp_rank = 1;
  GPT full = make_llama(S), first = make_llama(S, c0), last = make_llama(S, c1);
  at::NoGradGuard ng;
  at::Tensor tokens = random_ids(2, S.seq, S.vocab, 12);
  at::Tensor mid = dtk::get(first.forward({{"tokens", tokens}}), "hidden_states");
  EXPECT_TRUE(at::equal(dtk::get(last.forward({{"hidden_states", mid}}), "logits"),
                        dtk::get(full.forward({{"tokens", tokens}}), "logits")));
  EXPECT_EQ(first.params().size() + last.params().size(), full.params().size());
}

TEST(LlamaModel, StateRoundTripAndSeededDropout) {
  const Shape S = kShapes[1];
  Opts o = llama_opts(S);
  o["hidden_dropout"] = "0.1";
  o["attention_dropout"] = "0.1";
  GPT a(o, Ctx{}, plugins().llama), b(o, Ctx{DTK_DTYPE_FLOAT32, 0, 1, 16, 99}, plugins().llama);
  at::Tensor tokens = random_ids(2, S.seq, S.vocab, 3);
  a.train(true);
  b.train(true);
  a.forward({{"tokens", tokens}});  // advance a's dropout streams before saving
  b.state_load(a.state_save());     // b now has a's weights and generator states
  at::Tensor la = dtk::get(a.forward({{"tokens", tokens}}), "logits");
  at::Tensor lb = dtk::get(b.forward({{"tokens", tokens}}), "logits");
  EXPECT_TRUE(at::equal(la, lb));
  // Dropout is on in training and draws new masks each call; off in evaluation.
  EXPECT_FALSE(at::equal(la, dtk::get(a.forward({{"tokens", tokens}}), "logits")));
  a.train(false);
  at::NoGradGuard ng;
  EXPECT_TRUE(at::equal(dtk::get(a.forward({{"tokens", tokens}}), "logits"),
                        dtk::get(a.forward({{"tokens", tokens}}), "logits")));
}

// Full activation recomputation (dtk::layers::recompute): the same loss and gradients as keeping
// the activations, with dropout on (the rerun draws the forward's masks) and twice in a row (the
// generators stay in step).
TEST(LlamaModel, FullRecomputeMatchesNoRecompute) {
  // Full and selective (core attention: Qwen3's query/key norms are inside the recomputed block).
  for (const auto& [S, kind] :
       {std::pair{kShapes[1], "full"}, std::pair{kShapes[5], "full"}, std::pair{kShapes[1], "selective"},
        std::pair{kShapes[5], "selective"}, std::pair{kShapes[6], "selective"}}) {
    for (const char* p : {"0", "0.2"}) {
      const std::string what = std::string(kind) + (S.qk_norm ? " qk norm" : "") + ", dropout " + p;
      Opts base = llama_opts(S);
      base["hidden_dropout"] = p;
      base["attention_dropout"] = p;
      Opts rec = base;
      rec["recompute_activations"] = kind;
      EXPECT_EQ(GPT(rec, Ctx{}, plugins().llama).info().recompute, std::string(kind) == "full" ? 1 : 0);
      expect_recompute_matches(S, base, rec, S.layers, what);  // one recomputed block per layer
    }
  }
}

// Selective recomputation of the modules recompute_modules names (Megatron's --recompute-modules):
// core attention, the dense MLP (gate, up, SwiGLU, down) and the mixture-of-experts MLP (router,
// experts and the load-balancing loss) each one checkpoint per layer; the same loss and gradients
// as keeping the activations, dropout on, twice in a row. A dense layer ignores moe and an MoE
// layer mlp, as Megatron's.
TEST(LlamaModel, RecomputeModulesMatchNoRecompute) {
  const Shape S = kShapes[1];
  const Opts moe = {{"num_experts", "4"},           {"moe_router_topk", "2"},
                    {"moe_ffn_hidden_size", "32"},  {"moe_router_load_balancing_type", "aux_loss"},
                    {"moe_aux_loss_coeff", "0.01"}, {"moe_z_loss_coeff", "0.001"}};
  struct Case {
    const char* modules;
    bool experts;
    int64_t blocks_per_layer;  // recomputed blocks
    int32_t bits;              // dtk_model_info.recompute_modules
  };
  for (const Case& k : {Case{"mlp", false, 1, DTK_RECOMPUTE_MLP},
                        Case{"core_attn,mlp", false, 2, DTK_RECOMPUTE_CORE_ATTENTION | DTK_RECOMPUTE_MLP},
                        Case{"moe", false, 0, DTK_RECOMPUTE_MOE}, Case{"", false, 0, 0},
                        Case{"moe", true, 1, DTK_RECOMPUTE_MOE}, Case{"mlp", true, 0, DTK_RECOMPUTE_MLP},
                        Case{"core_attn moe", true, 2, DTK_RECOMPUTE_CORE_ATTENTION | DTK_RECOMPUTE_MOE}}) {
    for (const char* p : {"0", "0.2"}) {
      const std::string what =
          std::string("modules '") + k.modules + "'" + (k.experts ? ", experts" : "") + ", dropout " + p;
      Opts base = llama_opts(S);
      base["hidden_dropout"] = p;
      base["attention_dropout"] = p;
      if (k.experts) base.insert(moe.begin(), moe.end());
      Opts rec = base;
      rec["recompute_activations"] = "selective";
      rec["recompute_modules"] = k.modules;
      GPT b(rec, Ctx{}, plugins().llama);
      EXPECT_EQ(b.info().recompute_granularity, k.bits != 0 ? 2 : 0) << what;  // none: nothing recomputed
      EXPECT_EQ(b.info().recompute_modules, k.bits) << what;
      expect_recompute_matches(S, base, rec, k.blocks_per_layer * S.layers, what);
    }
  }
  // Megatron's other modules and unknown names are refused, naming them.
  for (const auto& [modules, says] :
       {std::pair{"core_attn,layernorm",
                  "option 'recompute_modules': 'layernorm' is a Megatron module DTK's layers "
                  "do not recompute (they recompute core_attn, mlp and moe)"},
        std::pair{"attn", "option 'recompute_modules': unknown module 'attn' (core_attn, mlp or moe)"}}) {
    Opts o = llama_opts(S);
    o["recompute_activations"] = "selective";
    o["recompute_modules"] = modules;
    try {
      GPT m(o, Ctx{}, plugins().llama);
      ADD_FAILURE() << modules << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
}

TEST(LlamaModel, GenerationCacheEqualsTheFullForward) {
  // Plain grouped-query heads, Qwen3's (query/key norms, heads wider than hidden / heads), and
  // sliding-window layers (the cache's early keys fall out of the window).
  for (const Shape& S : {kShapes[1], kShapes[5], kShapes[7]}) {
    GPT model = make_llama(S);
    model.train(false);
    at::NoGradGuard ng;
    at::Tensor tokens = random_ids(2, 6, S.vocab, 21);
    at::Tensor pos = at::arange(6, at::kLong).repeat({2, 1});
    const at::Tensor full = dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits");
    // The first 4 tokens fill the cache; then 2 more one at a time.
    auto mask_for = [](int64_t n, int64_t total) {
      return at::ones({n, total}, at::kBool).triu(total - n + 1).view({1, 1, n, total}).expand({2, 1, n, total});
    };
    TensorList out = model.forward({{"tokens", tokens.narrow(1, 0, 4)},
                                    {"position_ids", pos.narrow(1, 0, 4)},
                                    {"attention_mask", mask_for(4, 4).contiguous()},
                                    {"kv_cache_length", at::scalar_tensor(int64_t{0}, at::kLong)},
                                    {"kv_cache_capacity", at::scalar_tensor(int64_t{8}, at::kLong)}});
    expect_close(dtk::get(out, "logits").squeeze(1), full.select(1, 3), 1e-5, "logits at the prompt's end");
    for (int64_t t = 4; t < 6; ++t) {
      TensorList in{{"tokens", tokens.narrow(1, t, 1)},
                    {"position_ids", pos.narrow(1, t, 1)},
                    {"attention_mask", mask_for(1, t + 1).contiguous()},
                    {"kv_cache_length", at::scalar_tensor(t, at::kLong)}};
      for (auto& kv : out)
        if (kv.first.rfind("kv_cache.", 0) == 0) in.push_back(kv);
      out = model.forward(in);
      expect_close(dtk::get(out, "logits").squeeze(1), full.select(1, t), 1e-5, "logits at " + std::to_string(t));
    }
  }
}

TEST(LlamaModel, BadOptionsAreRefusedNamingThem) {
  const Shape S = kShapes[1];
  auto refused = [&](Opts o, const Ctx& c, const std::string& needle) {
    try {
      GPT m(o, c, plugins().llama);
      ADD_FAILURE() << "accepted; expected an error holding: " << needle;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Opts o = llama_opts(S);
  o["num_query_groups"] = "3";
  refused(o, Ctx{}, "num_attention_heads 4 is not divisible by num_query_groups 3");
  o = llama_opts(S);
  o["num_query_groups"] = "1";
  refused(o, Ctx{DTK_DTYPE_FLOAT32, 0, 2, 16, 1}, "num_query_groups 1 is not divisible by the tensor-parallel size 2");
  o = llama_opts(S);
  o["rotary_percent"] = "0.3";  // 8 x 0.3 = 2.4 -> 2 channels: fine; 0.2 -> 1 channel: odd
  GPT ok(o, Ctx{}, plugins().llama);
  o["rotary_percent"] = "0.2";
  refused(o, Ctx{}, "must be even");
  o["rotary_percent"] = "1.5";
  refused(o, Ctx{}, "'rotary_percent' must be in (0, 1]");
  o = llama_opts(S);
  o["kv_channels"] = "-2";
  refused(o, Ctx{}, "option 'kv_channels' must be in [0, 2^20] (0: hidden_size / num_attention_heads), got -2");
  o["kv_channels"] = "0";
  o["hidden_size"] = "30";
  refused(o, Ctx{}, "hidden_size 30 is not divisible by num_attention_heads 4");
  o["kv_channels"] = "8";  // as Megatron: heads of their own width need not split hidden_size
  GPT wide(o, Ctx{}, plugins().llama);
  EXPECT_EQ(wide.param_map().at("language_model.encoder.layers.0.self_attention.dense.weight").sizes(),
            (std::vector<int64_t>{30, 32}));
  // Sliding windows: Megatron's W,R with a causal right side, a pattern that fits the layers.
  const std::pair<std::pair<const char*, const char*>, const char*> bad_windows[] = {
      {{"4,2", ""}, "option 'window_size': '4,2' would let each token see the 2 tokens after it"},
      {{"4", ""}, "option 'window_size': '4' is not two integers W,R such as 4095,0"},
      {{"a,0", ""}, "is not two integers"},
      {{"-3,0", ""}, "a side of the window is -1 (unlimited) or at least 0"},
      {{"", "2"}, "option 'window_attn_skip_freq' acts only with window_size"},
      {{"-1,0", "2"}, "option 'window_attn_skip_freq' acts only with window_size"},
      {{"4,0", "0"}, "option 'window_attn_skip_freq' must be >= 1, got 0"},
      {{"4,0", "[1,0,1]"}, "option 'window_attn_skip_freq' lists 3 layers, the model has 2"},
      {{"4,0", "[1,2]"}, "option 'window_attn_skip_freq': '2' in a list is not 0 or 1"},
  };
  for (const auto& [window, needle] : bad_windows) {
    o = llama_opts(S);
    o["window_size"] = window.first, o["window_attn_skip_freq"] = window.second;
    refused(o, Ctx{}, needle);
  }
  o = llama_opts(S);
  o["window_size"] = "(4, -1)";  // Megatron's tuple as its scripts quote it; -1 on the right is causal
  GPT windowed(o, Ctx{}, plugins().llama);
  // Token ids beyond the vocabulary, with the model named.
  GPT model = make_llama(S);
  try {
    model.forward({{"tokens", at::full({1, 4}, S.vocab, at::kLong)}});
    ADD_FAILURE() << "out-of-range tokens accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("llama: 'tokens' holds ids in [64, 64], outside [0, 64)"), std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Domino (dtk/layers/domino.hpp, domino_chunks >= 2): the SDK's chunked schedule on llama's layers
// is plain tensor parallelism's arithmetic. At TP 1 the all-reduces are the identity and what is
// tested is the llama side of the schedule: the fused q/k/v and the two-projection SwiGLU stage,
// rotary positions sliced per chunk, the dropout masks sliced, recompute; tests/domino runs it
// over real processes at TP 2.
// ---------------------------------------------------------------------------------------------

namespace {

void expect_same_step(GPT& a, GPT& b, const TensorList& in, double tol, const std::string& what) {
  a.zero_grad();
  b.zero_grad();
  at::Tensor la = dtk::get(a.forward(in), "loss"), lb = dtk::get(b.forward(in), "loss");
  expect_close(lb.detach(), la.detach(), tol, "per-token loss, " + what);
  la.mean().backward();
  lb.mean().backward();
  auto pa = a.param_map(), pb = b.param_map();
  ASSERT_EQ(pa.size(), pb.size());
  for (auto& kv : pa) {
    ASSERT_TRUE(pb[kv.first].grad().defined()) << "no gradient for " << kv.first << ", " << what;
    expect_close(pb[kv.first].grad(), kv.second.grad(), tol, "grad " + kv.first + ", " + what);
  }
}

}  // namespace

TEST(LlamaDomino, ChunkedScheduleMatchesPlainForEveryChunkCountDropoutAndRecompute) {
  Ctx four;
  four.micro_batch = 4;
  for (const Shape& S : {kShapes[1], kShapes[3]}) {  // grouped-query attention; with biases
    at::Tensor tokens = random_ids(4, S.seq, S.vocab, 21), labels = random_ids(4, S.seq, S.vocab, 22);
    const TensorList in{{"tokens", tokens}, {"labels", labels}};
    for (const char* p : {"0", "0.2"}) {
      for (const char* recompute : {"none", "full"}) {
        for (const char* chunks : {"2", "3", "4"}) {
          const std::string what = std::string("bias ") + (S.bias ? "on" : "off") + ", dropout " + p + ", recompute " +
                                   recompute + ", chunks " + chunks;
          Opts base = llama_opts(S);
          base["hidden_dropout"] = p;
          base["attention_dropout"] = p;
          Opts domino = base;
          domino["recompute_activations"] = recompute;
          domino["domino_chunks"] = chunks;
          GPT a(base, four, plugins().llama), b(domino, four, plugins().llama);
          a.train(true);
          b.train(true);
          for (int it = 0; it < 2; ++it) expect_same_step(a, b, in, 1e-5, what + ", step " + std::to_string(it));
          // The forward schedule alone (evaluation): the loss, and the logits without labels.
          at::NoGradGuard no_grad;
          a.train(false);
          b.train(false);
          expect_close(dtk::get(b.forward(in), "loss"), dtk::get(a.forward(in), "loss"), 1e-5, "eval loss, " + what);
          expect_close(dtk::get(b.forward({{"tokens", tokens}}), "logits"),
                       dtk::get(a.forward({{"tokens", tokens}}), "logits"), 1e-5, "eval logits, " + what);
        }
      }
    }
  }
}

// Rotary positions are per sequence here (Megatron's --reset-position-ids gives each sequence its
// own), so each chunk must rotate by its own rows of position_ids; unequal chunks (2, 2, 1) and a
// per-sequence mask as in gpt's test.
TEST(LlamaDomino, UnequalChunksPerSequencePositionsAndMask) {
  const Shape S = kShapes[1];
  at::Tensor tokens = random_ids(5, S.seq, S.vocab, 23), labels = random_ids(5, S.seq, S.vocab, 24);
  at::Tensor pos = at::arange(S.seq, at::kLong).unsqueeze(0).repeat({5, 1});
  for (int64_t i = 0; i < 5; ++i) pos[i].add_(3 * i).remainder_(S.seq + 2 * i);  // restarts, like reset positions
  at::Tensor mask = at::ones({S.seq, S.seq}, at::kBool).triu(1).view({1, 1, S.seq, S.seq}).repeat({5, 1, 1, 1});
  for (int64_t i = 0; i < 5; ++i) mask[i].narrow(-1, 0, i).fill_(true);
  for (int64_t i = 0; i < 5; ++i) mask[i][0].diagonal().fill_(false);  // every row keeps one position
  const TensorList in{{"tokens", tokens}, {"labels", labels}, {"attention_mask", mask}, {"position_ids", pos}};
  Ctx five;
  five.micro_batch = 5;
  Opts domino = llama_opts(S);
  domino["domino_chunks"] = "3";
  GPT a(llama_opts(S), five, plugins().llama), b(domino, five, plugins().llama);
  expect_same_step(a, b, in, 1e-5, "chunks of 2, 2, 1");
  // The positions matter: other distances between them change the loss (a common shift would
  // not: rotary attention sees only differences).
  at::NoGradGuard no_grad;
  const TensorList spread{{"tokens", tokens}, {"labels", labels}, {"attention_mask", mask}, {"position_ids", pos * 2}};
  const double moved = (dtk::get(b.forward(spread), "loss") - dtk::get(b.forward(in), "loss")).abs().max().item<double>();
  EXPECT_GT(moved, 1e-4) << "doubling every position left the loss unchanged: positions unused";
}

// Pipeline stages with Domino inside each: the first stage (embedding + layers, hidden states
// out) and the last (hidden states in, layers + output layer) give the whole plain model's loss
// and gradients.
TEST(LlamaDomino, PipelineStagesWithDominoComposeToThePlainModel) {
  const Shape S{4, 32, 4, 2, 48, 8, 64, 1.0};
  Ctx whole, c0, c1;
  whole.micro_batch = c0.micro_batch = c1.micro_batch = 2;
  c0.pp_size = c1.pp_size = 2;
  c1.pp_rank = 1;
  Opts domino = llama_opts(S);
  domino["domino_chunks"] = "2";
  GPT full(llama_opts(S), whole, plugins().llama), first(domino, c0, plugins().llama), last(domino, c1, plugins().llama);
  at::Tensor tokens = random_ids(2, S.seq, S.vocab, 25), labels = random_ids(2, S.seq, S.vocab, 26);
  at::Tensor lf = dtk::get(full.forward({{"tokens", tokens}, {"labels", labels}}), "loss").mean();
  at::Tensor mid = dtk::get(first.forward({{"tokens", tokens}}), "hidden_states");
  at::Tensor mid_leaf = mid.detach().requires_grad_(true);
  at::Tensor ll = dtk::get(last.forward({{"hidden_states", mid_leaf}, {"labels", labels}}), "loss").mean();
  expect_close(ll.detach(), lf.detach(), 1e-5, "loss");
  lf.backward();
  ll.backward();
  mid.backward(mid_leaf.grad());  // the pipeline's send of the input gradient to the first stage
  auto pf = full.param_map(), p0 = first.param_map(), p1 = last.param_map();
  for (auto& kv : p0) expect_close(kv.second.grad(), pf[kv.first].grad(), 1e-5, "first stage grad " + kv.first);
  // The last stage's layers are numbered from 0 in its own names; layer i there is layer i + 2.
  for (auto& kv : p1) {
    std::string name = kv.first;
    const std::string prefix = "language_model.encoder.layers.";
    if (name.rfind(prefix, 0) == 0) {
      const size_t dot = name.find('.', prefix.size());
      name = prefix + std::to_string(std::stoi(name.substr(prefix.size(), dot - prefix.size())) + 2) + name.substr(dot);
    }
    ASSERT_TRUE(pf.count(name)) << name;
    expect_close(kv.second.grad(), pf[name].grad(), 1e-5, "last stage grad " + kv.first);
  }
}

TEST(LlamaDomino, BadChunkCountsAreRefusedNamingTheOption) {
  const Shape S = kShapes[1];
  Opts o = llama_opts(S);
  o["domino_chunks"] = "0";
  try {
    GPT m(o, Ctx{}, plugins().llama);
    ADD_FAILURE() << "domino_chunks 0 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("llama: option 'domino_chunks' must be >= 1"), std::string::npos) << e.what();
  }
  o["domino_chunks"] = "3";  // micro-batches of 2
  try {
    GPT m(o, Ctx{}, plugins().llama);
    ADD_FAILURE() << "3 chunks of a micro-batch of 2 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("llama: domino_chunks (3) exceeds the micro-batch size (2)"), std::string::npos)
        << e.what();
  }
}

// Llama 3.1's rope scaling from the published formula (Meta's llama3, Hugging Face's
// _compute_llama3_parameters), computed here in double with plain loops. Returns the scaled
// frequencies of a head of `dim` rotary channels and counts which branch each one took.
static std::vector<double> llama3_formula(int64_t dim, double base, double factor, double low, double high, double original,
                                   int branches[3]) {
  std::vector<double> out;
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double f = 1.0 / std::pow(base, 2.0 * static_cast<double>(i) / static_cast<double>(dim));
    const double wavelen = 2.0 * M_PI / f, low_wl = original / low, high_wl = original / high;
    if (wavelen < high_wl) {
      out.push_back(f), ++branches[0];
    } else if (wavelen > low_wl) {
      out.push_back(f / factor), ++branches[2];
    } else {
      const double smooth = (original / wavelen - low) / (high - low);
      out.push_back((1 - smooth) * f / factor + smooth * f), ++branches[1];
    }
  }
  return out;
}

TEST(LlamaRopeScaling, FrequenciesFollowTheLlama3Formula) {
  // Llama 3.1 8B's settings (head dim 128, base 500000) and a tiny head whose four frequencies
  // fall one kept, one kept, one blended and one divided.
  struct Case {
    int64_t dim;
    double base, factor, low, high;
    int64_t original;
  };
  for (const Case& c : {Case{128, 500000.0, 8, 1, 4, 8192}, Case{8, 10000.0, 8, 1, 4, 1000}, Case{8, 10000.0, 2.5, 2, 3, 1500}}) {
    int branches[3] = {0, 0, 0};
    const std::vector<double> want =
        llama3_formula(c.dim, c.base, c.factor, c.low, c.high, static_cast<double>(c.original), branches);
    EXPECT_GT(branches[0], 0) << c.dim;
    EXPECT_GT(branches[1], 0) << c.dim;
    EXPECT_GT(branches[2], 0) << c.dim;
    std::vector<float> unscaled;
    for (int64_t i = 0; i < c.dim / 2; ++i)
      unscaled.push_back(static_cast<float>(1.0 / std::pow(c.base, 2.0 * static_cast<double>(i) / static_cast<double>(c.dim))));
    dtk::llama::RopeScaling s;
    s.llama3 = true, s.factor = c.factor, s.low_freq_factor = c.low, s.high_freq_factor = c.high;
    s.original_max_positions = c.original;
    EXPECT_EQ(dtk::llama::rope_scaling_problem(s), "");
    const std::vector<float> got = dtk::llama::llama3_inv_freq(unscaled, s);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)  // fp32 frequencies: within a float's rounding
      EXPECT_NEAR(got[i], want[i], 2e-7 * want[i]) << "frequency " << i << " of head dim " << c.dim;
  }
}

TEST(LlamaRopeScaling, ModelRotatesWithTheScaledFrequencies) {
  Shape S = kShapes[1];  // head dim 8: frequencies 1, 0.1, 0.01, 0.001
  Opts opts = llama_opts(S);
  opts["rope_scaling"] = "llama3";
  opts["rope_original_max_positions"] = "1000";  // wavelengths 6.3, 63 kept; 628 blended; 6283 divided
  int branches[3] = {0, 0, 0};
  S.inv_freq = llama3_formula(8, 10000.0, 8, 1, 4, 1000, branches);
  ASSERT_EQ(branches[1], 1);
  GPT scaled(opts, {}, plugins().llama);
  auto P = scaled.param_map();
  at::NoGradGuard ng;
  const at::Tensor tokens = random_ids(2, S.seq, S.vocab, 5);
  for (int64_t start : {0, 3000}) {
    const at::Tensor pos = at::arange(start, start + S.seq, at::kLong).repeat({2, 1});
    expect_close(dtk::get(scaled.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits"),
                 ref_logits(P, S, tokens, pos), 1e-5, "llama3 rope scaling, positions from " + std::to_string(start));
  }
  // rope_scaling=none is the model as it was: the same logits bit for bit as without the option,
  // and those of the unscaled reference; the scaled model's differ.
  opts["rope_scaling"] = "none";
  opts.erase("rope_original_max_positions");  // does nothing without scaling: refused (below)
  GPT plain(opts, {}, plugins().llama);
  GPT before(llama_opts(S), {}, plugins().llama);
  const at::Tensor pos = at::arange(3000, 3000 + S.seq, at::kLong).repeat({2, 1});
  const at::Tensor a = dtk::get(plain.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits");
  EXPECT_TRUE(at::equal(a, dtk::get(before.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits")));
  S.inv_freq.clear();
  expect_close(a, ref_logits(P, S, tokens, pos), 1e-5, "rope_scaling=none");
  EXPECT_GT((a - dtk::get(scaled.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits")).abs().max().item<double>(),
            1e-3);
}

TEST(LlamaRopeScaling, BadOptionsAreOneClearError) {
  const std::pair<std::pair<const char*, const char*>, const char*> cases[] = {
      {{"rope_scaling_factor", "0"}, "option 'rope_scaling_factor' must be positive"},
      {{"rope_low_freq_factor", "4"}, "option 'rope_high_freq_factor' (4) must be greater than 'rope_low_freq_factor'"},
      {{"rope_original_max_positions", "0"}, "option 'rope_original_max_positions' must be positive"},
  };
  for (const auto& [kv, message] : cases) {
    Opts opts = llama_opts(kShapes[1]);
    opts["rope_scaling"] = "llama3";
    opts[kv.first] = kv.second;
    try {
      GPT model(opts, {}, plugins().llama);
      ADD_FAILURE() << kv.first << "=" << kv.second << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

// The scaling's parameters do nothing without rope_scaling=llama3: another value than the default
// is refused, naming what it needs; the default itself (as a checkpoint records it) is accepted.
TEST(LlamaRopeScaling, ParametersWithoutScalingAreRefused) {
  for (const auto& [key, value] : {std::pair{"rope_scaling_factor", "32"},
                                   {"rope_low_freq_factor", "2"},
                                   {"rope_high_freq_factor", "8"},
                                   {"rope_original_max_positions", "1000"}}) {
    Opts opts = llama_opts(kShapes[1]);
    opts[key] = value;
    try {
      GPT model(opts, {}, plugins().llama);
      ADD_FAILURE() << key << "=" << value << " without rope_scaling was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("option ") + key + "=" + value +
                                           " does nothing without rope_scaling=llama3: drop it, or set "
                                           "rope_scaling=llama3"),
                std::string::npos)
          << e.what();
    }
  }
  Opts defaults = llama_opts(kShapes[1]);
  defaults["rope_scaling_factor"] = "8.0", defaults["rope_original_max_positions"] = "8192";
  EXPECT_NO_THROW(GPT(defaults, {}, plugins().llama));
}
