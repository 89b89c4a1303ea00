// Tests of the "llama" model plugin as shipped (loaded by the host, driven through the C ABI),
// against an independent Llama written below with plain ATen ops on the plugin's weights: RMSNorm
// from its formula, rotary embeddings as a rotation of channel pairs (j, j + d/2) by the angle
// position / base^(2j/d) computed in double, grouped-query attention by indexing each query head's
// key/value group, SwiGLU, and the cross entropy of ATen.
#include <dtk/model.hpp>

#include "gpt_harness.hpp"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>

#include <set>

#include <cmath>
#include <map>
#include <string>

namespace {

using dtk::TensorList;
using dtk_test_gpt::Ctx;
using dtk_test_gpt::GPT;
using dtk_test_gpt::Opts;
using dtk_test_gpt::plugins;

struct Shape {
  int64_t layers, hidden, heads, groups, ffn, seq, vocab;  // vocab = the padded size
  double rotary_percent;
  bool bias = false;  // add_bias_linear
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

// The reference: [b, s, h] layout, fp32 except the rotary angles (double, then rounded).
at::Tensor ref_rms(const at::Tensor& x, const at::Tensor& w) {
  return x / (x * x).mean({-1}, true).add(1e-5).sqrt() * w;
}

// x [b, s, n, d]: channel j < rot/2 pairs with j + rot/2; channels >= rot are untouched.
at::Tensor ref_rotate(const at::Tensor& x, const at::Tensor& pos, int64_t rot) {
  const int64_t half = rot / 2;
  at::Tensor out = x.clone();
  for (int64_t j = 0; j < half; ++j) {
    const double inv = 1.0 / std::pow(10000.0, 2.0 * static_cast<double>(j) / static_cast<double>(rot));
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
  const int64_t b = tokens.size(0), s = tokens.size(1), hd = S.hidden / S.heads, per = S.heads / S.groups;
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
    at::Tensor q = ref_rotate(mixed.narrow(3, 0, per).reshape({b, s, S.heads, hd}), pos, rot);
    at::Tensor k = ref_rotate(mixed.select(3, per), pos, rot).index_select(2, group_of_head);
    at::Tensor v = mixed.select(3, per + 1).index_select(2, group_of_head);
    q = q.permute({0, 2, 1, 3}), k = k.permute({0, 2, 1, 3}), v = v.permute({0, 2, 1, 3});
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
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
// with biases (Megatron's default layers).
const Shape kShapes[] = {
    {2, 32, 4, 4, 48, 8, 64, 1.0},
    {2, 32, 4, 2, 48, 8, 64, 1.0},
    {1, 32, 4, 1, 40, 8, 64, 0.5},
    {1, 32, 4, 2, 48, 8, 64, 1.0, true},
};

}  // namespace

TEST(LlamaModel, LogitsLossAndGradientsMatchReference) {
  for (const Shape& S : kShapes) {
    const std::string what = "groups=" + std::to_string(S.groups) + " rotary=" + std::to_string(S.rotary_percent);
    GPT model = make_llama(S);
    ASSERT_EQ(model.info().vocab_size, S.vocab);
    model.train(true);  // dropout is 0 by default: training is deterministic
    auto P = model.param_map();
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

// How many nodes of t's autograd graph have `name` in their name.
int64_t graph_has(const at::Tensor& t, const std::string& name) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  int64_t n = 0;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (node->name().find(name) != std::string::npos) ++n;
    for (const auto& e : node->next_edges()) todo.push_back(e.function.get());
  }
  return n;
}

// Full activation recomputation (dtk::layers::recompute): the same loss and gradients as keeping
// the activations, with dropout on (the rerun draws the forward's masks) and twice in a row (the
// generators stay in step).
TEST(LlamaModel, FullRecomputeMatchesNoRecompute) {
  const Shape S = kShapes[1];
  for (const char* p : {"0", "0.2"}) {
    Opts base = llama_opts(S);
    base["hidden_dropout"] = p;
    base["attention_dropout"] = p;
    Opts rec = base;
    rec["recompute_activations"] = "full";
    GPT a(base, Ctx{}, plugins().llama), b(rec, Ctx{}, plugins().llama);
    EXPECT_EQ(b.info().recompute, 1);
    a.train(true);
    b.train(true);
    at::Tensor tokens = random_ids(2, S.seq, S.vocab, 9), labels = random_ids(2, S.seq, S.vocab, 10);
    TensorList in{{"tokens", tokens}, {"labels", labels}};
    for (int it = 0; it < 2; ++it) {
      a.zero_grad();
      b.zero_grad();
      at::Tensor la = dtk::get(a.forward(in), "loss").mean(), lb = dtk::get(b.forward(in), "loss").mean();
      EXPECT_EQ(graph_has(la, "Recomputed"), 0);
      EXPECT_EQ(graph_has(lb, "Recomputed"), S.layers);  // one recomputed block per layer
      la.backward();
      lb.backward();
      expect_close(lb.detach(), la.detach(), 1e-6, std::string("loss, dropout ") + p);
      auto pa = a.param_map(), pb = b.param_map();
      for (auto& kv : pa)
        expect_close(pb[kv.first].grad(), kv.second.grad(), 1e-6, std::string("grad ") + kv.first + " dropout " + p);
    }
  }
}

TEST(LlamaModel, GenerationCacheEqualsTheFullForward) {
  const Shape S = kShapes[1];
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
