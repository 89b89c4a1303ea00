// Tests of the "gpt" model and "causal_lm" step plugins as shipped: the .so files are loaded by
// the host's PluginHost and called only through the C ABI (dtk_model_api / dtk_step_api).
// The reference is an independent GPT written below with plain ATen ops on the plugin's weights.
#include <dtk/core/components/components.hpp>
#include <dtk/core/components/services.hpp>
#include <dtk/host/plugin_host.hpp>
#include <dtk/model.hpp>

#include "gpt_harness.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>

namespace {

using dtk::TensorList;
using dtk_test_gpt::check;
using dtk_test_gpt::Ctx;
using dtk_test_gpt::GPT;
using dtk_test_gpt::make_ctx;
using dtk_test_gpt::Opts;
using dtk_test_gpt::plugins;

// ---------------------------------------------------------------------------------------------
// Loading and driving the plugins through the ABI
// ---------------------------------------------------------------------------------------------

class Step {
 public:
  explicit Step(const Opts& user)
      : opts_(dtk::host::resolve_options(*plugins().step, user)), api_(plugins().step->api_as<dtk_step_api>()) {
    dtk_build_context b = make_ctx(opts_.get(), Ctx{});
    check(api_->create(&b, &step_));
  }
  ~Step() { api_->destroy(step_); }
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  // Returns the loss; *lm_loss receives the "lm loss" metric.
  at::Tensor forward(GPT& model, const at::Tensor& text, double* lm_loss) {
    TensorList batch{{"text", text}};
    dtk::MapView view(batch);
    std::vector<std::pair<std::string, double>> metrics;
    dtk_metric_sink sink{sizeof(sink), &metrics, [](void* ctx, const char* name, double v) {
                           static_cast<std::vector<std::pair<std::string, double>>*>(ctx)->emplace_back(name, v);
                         },
                         nullptr};  // no put_tensor: the step reads its tensor metrics itself (an older host)
    dtk_step_forward_args args{dtk_step_forward_args_STRUCT_SIZE, model.ref(), view.get(), &sink, nullptr};
    check(api_->forward_step(step_, &args));
    dtk_tensor* loss = args.loss;
    dtk::TensorHandle owned(loss);
    for (auto& kv : metrics)
      if (kv.first == "lm loss") *lm_loss = kv.second;
    return dtk::unwrap(loss);
  }

 private:
  dtk::host::OptionValues opts_;
  const dtk_step_api* api_;
  dtk_step* step_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// The reference GPT (Megatron GPTModel math with plain ATen ops, [b, s, h] layout)
// ---------------------------------------------------------------------------------------------

struct Shape {
  int64_t layers, hidden, heads, ffn, seq, vocab;  // vocab = the padded (weight) size
  bool tied;
};

at::Tensor ref_logits(std::map<std::string, at::Tensor>& P, const Shape& S, const at::Tensor& tokens,
                      const at::Tensor& pos, const at::Tensor& mask /*[b|1,1,s,s] bool or undefined*/) {
  const int64_t b = tokens.size(0), s = tokens.size(1), hn = S.hidden / S.heads;
  auto ln = [&](const at::Tensor& x, const std::string& n) {
    return at::layer_norm(x, {S.hidden}, P[n + ".weight"], P[n + ".bias"], 1e-5);
  };
  at::Tensor h = at::embedding(P["language_model.embedding.word_embeddings.weight"], tokens) +
                 at::embedding(P["language_model.embedding.position_embeddings.weight"], pos);
  at::Tensor masked = mask.defined() ? mask : at::ones({s, s}, at::kBool).triu(1).view({1, 1, s, s});
  for (int64_t l = 0; l < S.layers; ++l) {
    const std::string L = "language_model.encoder.layers." + std::to_string(l) + ".";
    at::Tensor x = ln(h, L + "input_layernorm");
    at::Tensor qkv = at::matmul(x, P[L + "self_attention.query_key_value.weight"].t()) +
                     P[L + "self_attention.query_key_value.bias"];
    qkv = qkv.view({b, s, S.heads, 3, hn});  // per head: [q | k | v]
    at::Tensor q = qkv.select(3, 0).permute({0, 2, 1, 3});
    at::Tensor k = qkv.select(3, 1).permute({0, 2, 1, 3});
    at::Tensor v = qkv.select(3, 2).permute({0, 2, 1, 3});
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(hn));
    scores = scores.masked_fill(masked, -std::numeric_limits<float>::infinity());
    at::Tensor ctx = at::matmul(at::softmax(scores, -1), v).permute({0, 2, 1, 3}).reshape({b, s, S.hidden});
    h = h + at::matmul(ctx, P[L + "self_attention.dense.weight"].t()) + P[L + "self_attention.dense.bias"];
    at::Tensor y = ln(h, L + "post_attention_layernorm");
    y = at::gelu(at::matmul(y, P[L + "mlp.dense_h_to_4h.weight"].t()) + P[L + "mlp.dense_h_to_4h.bias"]);
    h = h + at::matmul(y, P[L + "mlp.dense_4h_to_h.weight"].t()) + P[L + "mlp.dense_4h_to_h.bias"];
  }
  h = ln(h, "language_model.encoder.final_layernorm");
  const at::Tensor& out =
      S.tied ? P["language_model.embedding.word_embeddings.weight"] : P["language_model.output_layer.weight"];
  return at::matmul(h, out.t());
}

at::Tensor ref_token_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}), labels.reshape({-1}), {}, at::Reduction::None)
      .view(labels.sizes());
}

// Megatron get_ltor_masks_and_position_ids, written independently (loops over python-like
// indices) for the reference.
struct LtorOut {
  at::Tensor mask;  // [b, 1, s, s] bool, true = masked, or undefined for plain causal
  at::Tensor loss_mask, pos;
};
LtorOut ref_ltor(const at::Tensor& tokens, int64_t eod, bool reset_pos, bool reset_attn, bool eod_mask) {
  const int64_t b = tokens.size(0), s = tokens.size(1);
  LtorOut o;
  o.loss_mask = at::ones({b, s}, at::kFloat);
  o.pos = at::arange(s, at::kLong).repeat({b, 1});
  at::Tensor att = at::ones({b, s, s}, at::kFloat).tril();
  for (int64_t i = 0; i < b; ++i) {
    int64_t prev = 0;
    for (int64_t j = 0; j < s; ++j) {
      if (tokens[i][j].item<int64_t>() != eod) continue;
      if (eod_mask) o.loss_mask[i][j] = 0.0;
      if (reset_attn) att[i].narrow(0, j + 1, s - j - 1).narrow(1, 0, j + 1).zero_();
      if (reset_pos) {
        o.pos[i].narrow(0, j + 1, s - j - 1).sub_(j + 1 - prev);
        prev = j + 1;
      }
    }
  }
  if (reset_attn) o.mask = (att < 0.5).unsqueeze(1);
  return o;
}

Opts model_opts(const Shape& S, int64_t raw_vocab, const Opts& extra = {}) {
  Opts o{{"num_layers", std::to_string(S.layers)},
         {"hidden_size", std::to_string(S.hidden)},
         {"num_attention_heads", std::to_string(S.heads)},
         {"ffn_hidden_size", std::to_string(S.ffn)},
         {"seq_length", std::to_string(S.seq)},
         {"vocab_size", std::to_string(raw_vocab)},
         {"make_vocab_size_divisible_by", "8"},
         {"hidden_dropout", "0"},
         {"attention_dropout", "0"},
         // A wide init so activations are O(1): the reference comparison then sees every
         // nonlinearity (GeLU flavour, softmax scale, LayerNorm eps) at full strength.
         {"init_method_std", "0.25"},
         {"untie_embeddings_and_output_weights", S.tied ? "false" : "true"}};
  for (auto& kv : extra) o[kv.first] = kv.second;
  return o;
}

// Leaf copies of the model's weights for the autograd reference.
std::map<std::string, at::Tensor> leaf_copy(std::map<std::string, at::Tensor>& P) {
  std::map<std::string, at::Tensor> out;
  for (auto& kv : P) out[kv.first] = kv.second.detach().clone().set_requires_grad(true);
  return out;
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double atol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(diff, atol) << what << ": max abs difference " << diff;
}

at::Tensor random_text(int64_t b, int64_t s_plus_1, int64_t vocab, uint64_t seed) {
  at::Generator g = at::detail::getDefaultCPUGenerator().clone();
  g.set_current_seed(seed);
  return at::randint(vocab, {b, s_plus_1}, g, at::kLong);
}

const Shape kShapes[] = {
    {1, 32, 4, 128, 8, 64, true},    // ffn = 4h
    {2, 48, 3, 100, 16, 80, false},  // odd ffn, untied
    {3, 64, 8, 256, 12, 128, true},  // head dim 8
    {2, 24, 2, 96, 5, 40, false},    // tiny odd seq
};

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

TEST(GptModel, LogitsAndLossMatchReference) {
  for (const Shape& S : kShapes) {
    GPT model(model_opts(S, S.vocab - 3));  // padded back up to S.vocab (multiple of 8)
    ASSERT_EQ(model.info().vocab_size, S.vocab);
    model.train(false);
    auto P = model.param_map();
    at::Tensor text = random_text(3, S.seq + 1, S.vocab - 3, 7 + S.layers);
    at::Tensor tokens = text.narrow(1, 0, S.seq).contiguous(), labels = text.narrow(1, 1, S.seq).contiguous();
    at::Tensor pos = at::arange(S.seq, at::kLong).repeat({3, 1});
    at::NoGradGuard ng;
    at::Tensor expect = ref_logits(P, S, tokens, pos, {});
    auto out = model.forward({{"tokens", tokens}, {"position_ids", pos}});
    expect_close(dtk::get(out, "logits"), expect, 1e-5, "logits L=" + std::to_string(S.layers));
    auto lout = model.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}});
    expect_close(dtk::get(lout, "loss"), ref_token_loss(expect, labels), 1e-5, "loss");
    // An explicit all-causal mask gives the same result as none (plain vs fused path).
    at::Tensor causal = at::ones({S.seq, S.seq}, at::kBool).triu(1).view({1, 1, S.seq, S.seq});
    auto mout = model.forward({{"tokens", tokens}, {"position_ids", pos}, {"attention_mask", causal}});
    expect_close(dtk::get(mout, "logits"), expect, 1e-5, "logits with explicit causal mask");
  }
}

// Megatron's --apply-layernorm-1p: every LayerNorm weight starts at 0 and the norm multiplies by
// 1 + w; with random w the logits are the reference's with 1 + w as the norm weights.
TEST(GptModel, ZeroCentredNormWeightsMultiplyByOnePlusW) {
  const Shape& S = kShapes[1];
  GPT model(model_opts(S, S.vocab, {{"apply_layernorm_1p", "true"}}));
  model.train(false);
  auto P = model.param_map();
  std::vector<std::string> norms;
  for (auto& kv : P)
    if (kv.first.find("layernorm.weight") != std::string::npos) norms.push_back(kv.first);
  ASSERT_EQ(norms.size(), 2u * static_cast<size_t>(S.layers) + 1u);
  at::Generator g = at::detail::getDefaultCPUGenerator().clone();
  g.set_current_seed(5);
  at::NoGradGuard ng;
  for (const std::string& n : norms) {
    EXPECT_EQ(P[n].abs().max().item<double>(), 0.0) << n << " starts at 0";
    P[n].copy_(at::randn(P[n].sizes(), g) * 0.3);
  }
  std::map<std::string, at::Tensor> gains = P;
  for (const std::string& n : norms) gains[n] = P[n] + 1;
  at::Tensor tokens = random_text(3, S.seq, S.vocab, 13);
  at::Tensor pos = at::arange(S.seq, at::kLong).repeat({3, 1});
  expect_close(dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits"),
               ref_logits(gains, S, tokens, pos, {}), 1e-5, "logits with 1 + w");
}

struct MaskCase {
  bool reset_pos, reset_attn, eod_mask;
};

TEST(GptModel, StepLossAndGradientsMatchReferenceForEveryMaskOption) {
  const MaskCase cases[] = {
      {false, false, false}, {true, false, false}, {false, true, false}, {false, false, true}, {true, true, true}};
  const int64_t eod = 5;
  int n = 0;
  for (const MaskCase& mc : cases) {
    const Shape& S = kShapes[n++ % 2];
    GPT model(model_opts(S, S.vocab));
    Step step({{"reset_position_ids", mc.reset_pos ? "true" : "false"},
               {"reset_attention_mask", mc.reset_attn ? "true" : "false"},
               {"eod_mask_loss", mc.eod_mask ? "true" : "false"},
               {"eod_token", std::to_string(eod)}});
    at::Tensor text = random_text(3, S.seq + 1, S.vocab, 11);
    // Plant end-of-document tokens (including position 0 and the last input position).
    text[0][3] = eod, text[0][7] = eod, text[1][0] = eod, text[2][S.seq - 1] = eod, text[1][S.seq] = eod;
    double lm = 0;
    at::Tensor loss = step.forward(model, text, &lm);
    loss.backward();

    auto P = model.param_map();
    auto R = leaf_copy(P);
    at::Tensor tokens = text.narrow(1, 0, S.seq), labels = text.narrow(1, 1, S.seq);
    LtorOut lt = ref_ltor(tokens, eod, mc.reset_pos, mc.reset_attn, mc.eod_mask);
    at::Tensor tl = ref_token_loss(ref_logits(R, S, tokens, lt.pos, lt.mask), labels);
    at::Tensor ref = (tl * lt.loss_mask).sum() / lt.loss_mask.sum();
    ref.backward();
    const std::string what = "reset_pos=" + std::to_string(mc.reset_pos) +
                             " reset_attn=" + std::to_string(mc.reset_attn) +
                             " eod_mask=" + std::to_string(mc.eod_mask);
    expect_close(loss.detach(), ref.detach(), 1e-5, "loss " + what);
    EXPECT_NEAR(lm, ref.item<double>(), 1e-5) << what;
    for (auto& kv : P) {
      ASSERT_TRUE(kv.second.grad().defined()) << kv.first;
      expect_close(kv.second.grad(), R[kv.first].grad(), 1e-5, "grad " + kv.first + " " + what);
    }
  }
}

// The fused output layer (lm_head.hpp: gradients computed in forward, chunk by chunk) equals
// Megatron's logits + vocab-parallel cross entropy for any incoming per-token gradient: uniform
// (the mean), with masked tokens (its correction path), and arbitrary; at any chunk size; in
// evaluation; tied and untied; with the host row passes and with the LibTorch ops a GPU runs.
TEST(GptModel, FusedOutputLayerEqualsTheLogitsPathForAnyLossGradient) {
  for (const Shape& S : {kShapes[0], kShapes[1]}) {
    for (const auto& [chunk, impl] :
         {std::pair{"1", "host"}, {"5", "host"}, {"0", "auto"}, {"1", "ops"}, {"5", "ops"}, {"0", "ops"}}) {
      GPT fused(model_opts(S, S.vocab, {{"lm_head_chunk_tokens", chunk}, {"cross_entropy_impl", impl}}));
      GPT plain(model_opts(S, S.vocab, {{"fused_lm_head", "false"}}));
      at::Tensor text = random_text(3, S.seq + 1, S.vocab, 21);
      const TensorList in{{"tokens", text.narrow(1, 0, S.seq)}, {"labels", text.narrow(1, 1, S.seq)}};
      at::Generator g = at::detail::getDefaultCPUGenerator().clone();
      g.set_current_seed(5);
      at::Tensor masked = at::ones({3, S.seq}) / (3.0 * S.seq);
      masked[0][2] = 0, masked[2][S.seq - 1] = 0, masked[1][0] = 0;
      const std::pair<const char*, at::Tensor> grads[] = {
          {"uniform", at::full({3, S.seq}, 0.25)}, {"masked", masked}, {"random", at::randn({3, S.seq}, g)}};
      for (const auto& [what, grad] : grads) {
        const std::string where = std::string(what) + " chunk " + chunk + " " + impl + (S.tied ? " tied" : " untied");
        fused.zero_grad(), plain.zero_grad();
        at::Tensor a = dtk::get(fused.forward(in), "loss"), b = dtk::get(plain.forward(in), "loss");
        expect_close(a, b, 1e-5, "loss " + where);
        a.backward(grad), b.backward(grad);
        auto pa = fused.param_map(), pb = plain.param_map();
        for (auto& [name, t] : pa) {  // relative to the gradient's size (random ones are O(10))
          const double scale = 1.0 + pb[name].grad().abs().max().item<double>();
          expect_close(t.grad(), pb[name].grad(), 1e-5 * scale, "grad " + name + " " + where);
        }
      }
      fused.train(false), plain.train(false);
      at::NoGradGuard no_grad;
      expect_close(dtk::get(fused.forward(in), "loss"), dtk::get(plain.forward(in), "loss"), 1e-5, "eval");
    }
  }
  // Its gradients are computed once: a second backward is a clear error, not wrong numbers.
  const Shape& S = kShapes[0];
  GPT fused(model_opts(S, S.vocab));
  at::Tensor text = random_text(2, S.seq + 1, S.vocab, 3);
  at::Tensor loss = dtk::get(fused.forward({{"tokens", text.narrow(1, 0, S.seq)}, {"labels", text.narrow(1, 1, S.seq)}}),
                             "loss").sum();
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
    ADD_FAILURE() << "a second backward through the fused output layer ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the fused output layer's backward ran twice"), std::string::npos)
        << e.what();
  }
}

TEST(GptModel, CausalMaskLeaksNothing) {
  const Shape S{2, 32, 4, 128, 12, 64, true};
  GPT model(model_opts(S, S.vocab));
  model.train(false);
  at::NoGradGuard ng;
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 3);
  at::Tensor base = dtk::get(model.forward({{"tokens", tokens}}), "logits");
  for (int64_t t : {1, 5, 11}) {
    at::Tensor changed = tokens.clone();
    changed.narrow(1, t, S.seq - t).add_(17).remainder_(S.vocab);
    at::Tensor out = dtk::get(model.forward({{"tokens", changed}}), "logits");
    expect_close(out.narrow(1, 0, t), base.narrow(1, 0, t), 1e-6, "prefix before " + std::to_string(t));
    EXPECT_GT((out.narrow(1, t, 1) - base.narrow(1, t, 1)).abs().max().item<double>(), 1e-4);
  }
}

// Megatron's sliding-window attention (window_size W,0): each token sees itself and the W tokens
// before it. The windowed model is the reference given the causal mask with the keys before each
// window masked too (logits), and the plain model given that mask (loss and gradients); a token
// changes nothing more than W positions per layer after it; generation through the key/value cache
// equals the full forward.
TEST(GptModel, SlidingWindowIsTheReferenceWithTheWindowMasked) {
  const Shape S = kShapes[1];  // 2 layers, 16 positions
  const int64_t W = 3, s = S.seq;
  GPT windowed(model_opts(S, S.vocab, {{"window_size", std::to_string(W) + ",0"}}));
  GPT plain(model_opts(S, S.vocab));
  auto P = windowed.param_map(), Q = plain.param_map();
  {
    at::NoGradGuard ng;
    for (auto& [name, t] : Q) t.copy_(P.at(name));
  }
  windowed.train(true), plain.train(true);  // dropout 0: deterministic
  const at::Tensor text = random_text(2, s + 1, S.vocab, 5);
  const at::Tensor tokens = text.narrow(1, 0, s).contiguous(), labels = text.narrow(1, 1, s).contiguous();
  const at::Tensor pos = at::arange(s, at::kLong).repeat({2, 1});
  const at::Tensor rows = at::arange(s, at::kLong).unsqueeze(1), cols = at::arange(s, at::kLong).unsqueeze(0);
  const at::Tensor mask = (cols > rows).logical_or(cols < rows - W).view({1, 1, s, s});
  {
    at::NoGradGuard ng;
    const at::Tensor logits = dtk::get(windowed.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits");
    expect_close(logits, ref_logits(P, S, tokens, pos, mask), 1e-5, "windowed logits");
    const at::Tensor unwindowed = dtk::get(plain.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits");
    EXPECT_GT((logits - unwindowed).abs().max().item<double>(), 1e-3) << "the window masks nothing";
    // Token 0 reaches W positions further per layer: positions up to 2W, none after.
    at::Tensor changed = tokens.clone();
    changed.select(1, 0).add_(17).remainder_(S.vocab);
    const at::Tensor moved = dtk::get(windowed.forward({{"tokens", changed}, {"position_ids", pos}}), "logits");
    expect_close(moved.narrow(1, 2 * W + 1, s - 2 * W - 1), logits.narrow(1, 2 * W + 1, s - 2 * W - 1), 1e-6,
                 "beyond two windows");
    EXPECT_GT((moved.select(1, 2 * W) - logits.select(1, 2 * W)).abs().max().item<double>(), 1e-5);
  }
  const at::Tensor loss =
      dtk::get(windowed.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}}), "loss");
  const at::Tensor want = dtk::get(
      plain.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}, {"attention_mask", mask}}), "loss");
  expect_close(loss.detach(), want.detach(), 1e-6, "windowed loss");
  loss.mean().backward();
  want.mean().backward();
  for (auto& [name, t] : P) expect_close(t.grad(), Q.at(name).grad(), 1e-6, "gradient of " + name);

  // Generation: 10 prompt tokens fill the cache, then 2 more one at a time.
  windowed.train(false);
  at::NoGradGuard ng;
  const at::Tensor full = dtk::get(windowed.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits");
  auto causal = [](int64_t n, int64_t total) {
    return at::ones({n, total}, at::kBool).triu(total - n + 1).view({1, 1, n, total}).expand({2, 1, n, total});
  };
  TensorList out = windowed.forward({{"tokens", tokens.narrow(1, 0, 10)},
                                     {"position_ids", pos.narrow(1, 0, 10)},
                                     {"attention_mask", causal(10, 10).contiguous()},
                                     {"kv_cache_length", at::scalar_tensor(int64_t{0}, at::kLong)},
                                     {"kv_cache_capacity", at::scalar_tensor(int64_t{16}, at::kLong)}});
  expect_close(dtk::get(out, "logits").squeeze(1), full.select(1, 9), 1e-5, "logits at the prompt's end");
  for (int64_t t = 10; t < 12; ++t) {
    TensorList in{{"tokens", tokens.narrow(1, t, 1)},
                  {"position_ids", pos.narrow(1, t, 1)},
                  {"attention_mask", causal(1, t + 1).contiguous()},
                  {"kv_cache_length", at::scalar_tensor(t, at::kLong)}};
    for (auto& kv : out)
      if (kv.first.rfind("kv_cache.", 0) == 0) in.push_back(kv);
    out = windowed.forward(in);
    expect_close(dtk::get(out, "logits").squeeze(1), full.select(1, t), 1e-5, "logits at " + std::to_string(t));
  }
}

TEST(GptModel, DropoutOffIsDeterministicAndSeededDropoutRepeats) {
  const Shape S{2, 32, 4, 128, 16, 64, true};
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 5), labels = random_text(2, S.seq, S.vocab, 6);
  TensorList in{{"tokens", tokens}, {"labels", labels}};
  at::NoGradGuard ng;
  {
    GPT m(model_opts(S, S.vocab));  // dropout 0, training mode
    at::Tensor a = dtk::get(m.forward(in), "loss"), b = dtk::get(m.forward(in), "loss");
    EXPECT_TRUE(at::equal(a, b));
  }
  Opts drop = model_opts(S, S.vocab, {{"hidden_dropout", "0.2"}, {"attention_dropout", "0.2"}});
  GPT m1(drop), m2(drop);
  at::Tensor a1 = dtk::get(m1.forward(in), "loss"), a2 = dtk::get(m1.forward(in), "loss");
  at::Tensor b1 = dtk::get(m2.forward(in), "loss"), b2 = dtk::get(m2.forward(in), "loss");
  EXPECT_TRUE(at::equal(a1, b1));  // same seed, same masks
  EXPECT_TRUE(at::equal(a2, b2));
  EXPECT_FALSE(at::equal(a1, a2));  // dropout is active and advances its generator
  m1.train(false);
  m2.train(false);
  EXPECT_TRUE(at::equal(dtk::get(m1.forward(in), "loss"), dtk::get(m2.forward(in), "loss")));
}

// Dropout semantics against a model without dropout built from the same seed (same weights):
// eval mode must ignore dropout entirely (a model that kept dropping out in eval would differ);
// training mode must apply it.
TEST(GptModel, DropoutIsOffInEvalAndOnInTraining) {
  const Shape S{1, 32, 4, 128, 8, 64, true};
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 15);
  TensorList in{{"tokens", tokens}};
  at::NoGradGuard ng;
  GPT plain(model_opts(S, S.vocab));
  GPT drop(model_opts(S, S.vocab, {{"hidden_dropout", "0.3"}, {"attention_dropout", "0.3"}}));
  plain.train(false);
  drop.train(false);
  const at::Tensor reference = dtk::get(plain.forward(in), "logits");
  EXPECT_TRUE(at::equal(dtk::get(drop.forward(in), "logits"), reference));
  drop.train(true);
  EXPECT_GT((dtk::get(drop.forward(in), "logits") - reference).abs().max().item<double>(), 1e-3);
}

TEST(GptModel, BadLabelsAndMasksAreRefused) {
  const Shape S{1, 32, 4, 128, 8, 64, true};
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 16);
  GPT m(model_opts(S, S.vocab));
  at::NoGradGuard ng;
  auto error = [&](const TensorList& in) {
    try {
      m.forward(in);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  at::Tensor labels = tokens.clone();
  labels[0][3] = -100;  // a common "ignore" id: must not be scored silently
  EXPECT_NE(error({{"tokens", tokens}, {"labels", labels}}).find("labels"), std::string::npos);
  at::Tensor float_mask = at::ones({1, 1, S.seq, S.seq});
  EXPECT_NE(error({{"tokens", tokens}, {"attention_mask", float_mask}}).find("must be a bool tensor"),
            std::string::npos);
}

TEST(GptModel, FullAndSelectiveRecomputeMatchNoRecompute) {
  const Shape S{3, 32, 4, 128, 16, 64, false};
  for (const std::string granularity : {"full", "selective"}) {
    for (const char* p : {"0", "0.2"}) {
      Opts base = model_opts(S, S.vocab, {{"hidden_dropout", p}, {"attention_dropout", p}});
      Opts rec = base;
      rec["recompute_activations"] = granularity;
      GPT a(base), b(rec);
      EXPECT_EQ(b.info().recompute, granularity == "full" ? 1 : 0);
      at::Tensor tokens = random_text(2, S.seq, S.vocab, 9), labels = random_text(2, S.seq, S.vocab, 10);
      TensorList in{{"tokens", tokens}, {"labels", labels}};
      const std::string what = granularity + " recompute, dropout " + p;
      for (int it = 0; it < 2; ++it) {  // twice: generator states must stay in step
        a.zero_grad();
        b.zero_grad();
        at::Tensor la = dtk::get(a.forward(in), "loss").mean(), lb = dtk::get(b.forward(in), "loss").mean();
        la.backward();
        lb.backward();
        expect_close(la.detach(), lb.detach(), 1e-6, "loss, " + what);
        auto pa = a.param_map(), pb = b.param_map();
        for (auto& kv : pa) expect_close(kv.second.grad(), pb[kv.first].grad(), 1e-6, "grad " + kv.first + ", " + what);
      }
    }
  }
}

TEST(GptModel, TinyModelOverfitsOneBatch) {
  const Shape S{2, 64, 4, 256, 16, 32, true};
  GPT model(model_opts(S, S.vocab, {{"make_vocab_size_divisible_by", "1"}}));
  Step step({});
  at::Tensor text = random_text(4, S.seq + 1, S.vocab, 21);
  auto params = model.params();
  // Plain Adam written here (lr 1e-2, betas 0.9/0.999).
  std::vector<at::Tensor> m, v;
  for (auto& p : params) m.push_back(at::zeros_like(p.tensor)), v.push_back(at::zeros_like(p.tensor));
  double lm = 0;
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  for (int it = 1; it <= 150; ++it) {
    model.zero_grad();
    step.forward(model, text, &lm).backward();
    at::NoGradGuard ng;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = params[i].tensor.grad();
      m[i].mul_(b1).add_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      at::Tensor denom = (v[i] / (1 - std::pow(b2, it))).sqrt_().add_(eps);
      params[i].tensor.addcdiv_(m[i], denom, -lr / (1 - std::pow(b1, it)));
    }
    if (lm < 0.05) break;
  }
  EXPECT_LT(lm, 0.1);
}

TEST(GptModel, StateRoundTripIsExact) {
  for (bool tied : {true, false}) {
    const Shape S{2, 32, 4, 128, 8, 64, tied};
    GPT a(model_opts(S, S.vocab), Ctx{DTK_DTYPE_FLOAT32, 0, 1, 16, 1});
    GPT b(model_opts(S, S.vocab), Ctx{DTK_DTYPE_FLOAT32, 0, 1, 16, 2});
    a.train(false);
    b.train(false);
    at::NoGradGuard ng;
    at::Tensor tokens = random_text(2, S.seq, S.vocab, 4);
    at::Tensor la = dtk::get(a.forward({{"tokens", tokens}}), "logits");
    EXPECT_FALSE(at::equal(la, dtk::get(b.forward({{"tokens", tokens}}), "logits")));  // different init
    TensorList state = a.state_save();
    // Every parameter exactly once (the tied embedding is not saved twice), plus the two dropout
    // generator states.
    EXPECT_EQ(state.size(), a.params().size() + 2);
    ASSERT_NE(dtk::find(state, "rng.hidden"), nullptr);
    ASSERT_NE(dtk::find(state, "rng.attention"), nullptr);
    EXPECT_EQ(dtk::find(state, "rng.hidden")->scalar_type(), at::kByte);
    EXPECT_EQ(dtk::find(state, "language_model.output_layer.weight") != nullptr, !tied);
    b.state_load(state);
    EXPECT_TRUE(at::equal(la, dtk::get(b.forward({{"tokens", tokens}}), "logits")));
    // Strict loading names what is missing.
    TensorList partial(state.begin() + 1, state.end());
    try {
      b.state_load(partial);
      ADD_FAILURE() << "strict load of partial state succeeded";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(state[0].first), std::string::npos) << e.what();
    }
  }
}

TEST(GptModel, VocabPaddingFollowsMegatron) {
  // Megatron _vocab_size_with_padding: multiple of make_vocab_size_divisible_by x tp_size.
  struct Case {
    int64_t vocab, divisible, tp, expect;
  } cases[] = {{50257, 128, 1, 50304}, {50257, 128, 2, 50432}, {50257, 128, 4, 50688},
               {50304, 128, 1, 50304}, {100, 7, 1, 105},       {64, 1, 1, 64}};
  for (const Case& c : cases) {
    Opts o{{"num_layers", "1"},
           {"hidden_size", "16"},
           {"num_attention_heads", "4"},
           {"seq_length", "8"},
           {"vocab_size", std::to_string(c.vocab)},
           {"make_vocab_size_divisible_by", std::to_string(c.divisible)}};
    GPT m(o, Ctx{DTK_DTYPE_FLOAT32, 0, static_cast<int32_t>(c.tp), 8, 1});
    EXPECT_EQ(m.info().vocab_size, c.expect) << c.vocab << " / " << c.divisible << " x " << c.tp;
    // This rank holds its slice of the padded vocabulary (and of the sharded layers).
    auto P = m.param_map();
    EXPECT_EQ(P["language_model.embedding.word_embeddings.weight"].size(0), c.expect / c.tp);
    EXPECT_EQ(P["language_model.encoder.layers.0.self_attention.query_key_value.weight"].size(0), 48 / c.tp);
    EXPECT_EQ(P["language_model.encoder.layers.0.mlp.dense_4h_to_h.weight"].size(1), 64 / c.tp);
  }
}

TEST(GptModel, TensorParallelShardsAreSlicesOfTheFullWeights) {
  const Shape S{1, 32, 4, 64, 8, 64, true};
  GPT full(model_opts(S, S.vocab));
  auto F = full.param_map();
  for (int32_t r = 0; r < 2; ++r) {
    GPT shard(model_opts(S, S.vocab), Ctx{DTK_DTYPE_FLOAT32, r, 2, 16, 1234});
    for (auto& p : shard.params()) {
      const at::Tensor& f = F[p.name];
      at::Tensor expect = f;
      if (p.info.partition_dim >= 0) {
        const int64_t n = f.size(p.info.partition_dim) / 2;
        expect = f.narrow(p.info.partition_dim, r * n, n);
      }
      EXPECT_TRUE(at::equal(p.tensor, expect)) << p.name << " rank " << r;
    }
  }
}

TEST(GptModel, PipelineStagesComposeToTheFullModel) {
  // pre_process/post_process: stage 0 holds the embedding and the first half of the layers,
  // stage 1 the rest, the final LayerNorm and the (tied or separate) output weights.
  for (bool tied : {true, false}) {
    const Shape S{4, 32, 4, 128, 8, 64, tied};
    Ctx c0, c1;
    c0.pp_size = c1.pp_size = 2;
    c1.pp_rank = 1;
    GPT full(model_opts(S, S.vocab)), first(model_opts(S, S.vocab), c0), last(model_opts(S, S.vocab), c1);
    at::NoGradGuard ng;
    at::Tensor tokens = random_text(2, S.seq, S.vocab, 12);
    TensorList mid = first.forward({{"tokens", tokens}});
    ASSERT_NE(dtk::find(mid, "hidden_states"), nullptr);
    at::Tensor logits = dtk::get(last.forward({{"hidden_states", dtk::get(mid, "hidden_states")}}), "logits");
    EXPECT_TRUE(at::equal(logits, dtk::get(full.forward({{"tokens", tokens}}), "logits")));
    // The embedding lives on stage 0; the last stage keeps Megatron's word_embeddings_for_head
    // only when tied, and the output layer only when untied.
    auto P0 = first.param_map(), P1 = last.param_map();
    EXPECT_EQ(P0.count("language_model.embedding.word_embeddings.weight"), 1u);
    EXPECT_EQ(P0.count("language_model.encoder.final_layernorm.weight"), 0u);
    EXPECT_EQ(P1.count("language_model.embedding.word_embeddings.weight"), 0u);
    EXPECT_EQ(P1.count("word_embeddings_for_head.weight"), tied ? 1u : 0u);
    EXPECT_EQ(P1.count("language_model.output_layer.weight"), tied ? 0u : 1u);
    EXPECT_EQ(P0.size() + P1.size(), full.params().size() + (tied ? 1u : 0u));
  }
}

TEST(GptModel, ParameterInfo) {
  const Shape S{1, 32, 4, 128, 8, 64, true};
  GPT m(model_opts(S, S.vocab));
  for (auto& p : m.params()) {
    const bool is_bias_or_norm =
        p.name.find("bias") != std::string::npos || p.name.find("layernorm") != std::string::npos;
    EXPECT_EQ(p.info.no_weight_decay, is_bias_or_norm ? 1 : 0) << p.name;
    if (p.name.find("word_embeddings") != std::string::npos) {
      EXPECT_EQ(p.info.shared, 1);
      EXPECT_EQ(p.info.partition_dim, 0);
    }
    if (p.name.find("dense_4h_to_h.weight") != std::string::npos || p.name.find("dense.weight") != std::string::npos) {
      EXPECT_EQ(p.info.partition_dim, 1) << p.name;
    }
    if (p.name.find("query_key_value") != std::string::npos) {
      EXPECT_EQ(p.info.partition_dim, 0) << p.name;
    }
  }
  // Scaled init for the output projections: std / sqrt(2 L).
  GPT big(Opts{{"num_layers", "8"},
               {"hidden_size", "256"},
               {"num_attention_heads", "4"},
               {"seq_length", "8"},
               {"vocab_size", "64"}});
  auto P = big.param_map();
  EXPECT_NEAR(P["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"].std().item<double>(), 0.02, 1e-3);
  EXPECT_NEAR(P["language_model.encoder.layers.0.mlp.dense_4h_to_h.weight"].std().item<double>(), 0.02 / 4.0, 3e-4);
  EXPECT_NEAR(P["language_model.encoder.layers.0.self_attention.dense.weight"].std().item<double>(), 0.02 / 4.0, 3e-4);
}

TEST(GptModel, Bf16ParametersRun) {
  const Shape S{2, 32, 4, 128, 16, 64, true};
  GPT f32(model_opts(S, S.vocab));
  GPT bf16(model_opts(S, S.vocab), Ctx{DTK_DTYPE_BFLOAT16, 0, 1, 16, 1234});
  for (auto& p : bf16.params()) EXPECT_EQ(p.tensor.scalar_type(), at::kBFloat16) << p.name;
  Step step({});
  at::Tensor text = random_text(2, S.seq + 1, S.vocab, 8);
  double l32 = 0, l16 = 0;
  step.forward(f32, text, &l32);
  at::Tensor loss = step.forward(bf16, text, &l16);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_NEAR(l16, l32, 0.05);  // same init, bf16 rounding
  loss.backward();
  for (auto& p : bf16.params()) {
    ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
    EXPECT_TRUE(at::isfinite(p.tensor.grad().to(at::kFloat)).all().item<bool>()) << p.name;
  }
}

TEST(GptModel, BadOptionsAreRefusedWithAMessage) {
  try {
    GPT m(Opts{{"num_layers", "1"}, {"hidden_size", "30"}, {"num_attention_heads", "4"}, {"seq_length", "8"}});
    ADD_FAILURE() << "hidden 30 / 4 heads accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads"), std::string::npos) << e.what();
  }
  try {
    GPT m(Opts{{"num_layers", "1"},
               {"hidden_size", "16"},
               {"num_attention_heads", "4"},
               {"seq_length", "8"},
               {"unfused_kernels", "add_norm,gelu"}});
    ADD_FAILURE() << "an unknown kernel name accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "gpt: option 'unfused_kernels': unknown kernel 'gelu' (add_norm, bias_add, rms_norm"),
              std::string::npos)
        << e.what();
  }
  GPT m(Opts{{"num_layers", "1"}, {"hidden_size", "16"}, {"num_attention_heads", "4"}, {"seq_length", "8"}});
  EXPECT_THROW(m.forward({{"tokens", at::zeros({1, 9}, at::kLong)}}), std::runtime_error);  // > max positions
}

// Options that act only with another setting (declared with only_with), given a value other than
// their default where that setting is off, are refused by the host naming what they need (the run
// would ignore them); their defaults, as a checkpoint records every option, are accepted.
TEST(GptModel, OptionsThatWouldDoNothingAreRefused) {
  const Opts base{{"num_layers", "2"}, {"hidden_size", "16"}, {"num_attention_heads", "4"}, {"seq_length", "8"}};
  const std::vector<std::pair<Opts, std::string>> cases = {
      {{{"fused_lm_head", "false"}, {"lm_head_chunk_tokens", "256"}},
       "model plugin 'gpt': option lm_head_chunk_tokens=256 does nothing without fused_lm_head=true: drop it, or set "
       "fused_lm_head=true"},
      {{{"fused_lm_head", "false"}, {"cross_entropy_impl", "ops"}},
       "option cross_entropy_impl=ops does nothing without fused_lm_head=true"},
      {{{"recompute_method", "block"}},
       "option recompute_method=block does nothing without recompute_activations=full"},
      {{{"recompute_activations", "selective"}, {"recompute_num_layers", "2"}},
       "option recompute_num_layers=2 does nothing without recompute_activations=full"},
  };
  for (const auto& [extra, message] : cases) {
    Opts opts = base;
    for (const auto& kv : extra) opts[kv.first] = kv.second;
    try {
      GPT m(opts);
      ADD_FAILURE() << message << ": accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  Opts defaults = base;
  defaults.insert({{"fused_lm_head", "false"},
                   {"lm_head_chunk_tokens", "0"},
                   {"cross_entropy_impl", "auto"},
                   {"recompute_method", "uniform"},
                   {"recompute_num_layers", "1"}});
  EXPECT_NO_THROW(GPT{defaults});
  Opts full = base;
  full.insert({{"recompute_activations", "full"}, {"recompute_method", "block"}, {"recompute_num_layers", "2"}});
  EXPECT_NO_THROW(GPT{full});
}

// ---------------------------------------------------------------------------------------------
// Per-module hooks (ZeRO-3's gather/release points), fired by the plugin through the ABI
// ---------------------------------------------------------------------------------------------

// Records every hook as "F+i" (pre_forward), "F-i" (post_forward), "B+i" (pre_backward) and
// "B-i" (post_backward), as a ZeRO-3 strategy would see them; `fail` makes one hook fail.
struct HookRecorder {
  std::vector<std::string> events;
  std::string fail;
  dtk_module_hooks table{};
  HookRecorder() {
    table.struct_size = dtk_module_hooks_STRUCT_SIZE;
    table.ctx = this;
    table.pre_forward = [](void* c, int32_t i) { return static_cast<HookRecorder*>(c)->add("F+", i); };
    table.post_forward = [](void* c, int32_t i) { return static_cast<HookRecorder*>(c)->add("F-", i); };
    table.pre_backward = [](void* c, int32_t i) { return static_cast<HookRecorder*>(c)->add("B+", i); };
    table.post_backward = [](void* c, int32_t i) { return static_cast<HookRecorder*>(c)->add("B-", i); };
  }
  dtk_status* add(const char* what, int32_t i) {
    const std::string e = what + std::to_string(i);
    events.push_back(e);
    return e == fail ? dtk::host::make_status(DTK_ERR_COMM, "gather timed out") : nullptr;
  }
  std::string joined() const {
    std::string out;
    for (const auto& e : events) out += (out.empty() ? "" : " ") + e;
    return out;
  }
};

TEST(GptModuleHooks, ModulesCoverEveryParameterOnce) {
  const Shape S{2, 32, 4, 128, 8, 64, true};
  GPT m(model_opts(S, S.vocab));
  const auto modules = m.modules();
  ASSERT_EQ(modules.size(), 4u);  // embedding, 2 layers, output layer
  const char* names[] = {"language_model.embedding", "language_model.encoder.layers.0",
                         "language_model.encoder.layers.1", "language_model.output_layer"};
  for (size_t i = 0; i < modules.size(); ++i) {
    EXPECT_EQ(modules[i].index, static_cast<int32_t>(i));
    EXPECT_EQ(modules[i].name, names[i]);
  }
  // Every parameter is owned by one module, which lists it; the tied output layer also reads the
  // word embedding owned by the embedding module.
  for (const auto& p : m.params()) {
    ASSERT_GE(p.info.module_index, 0) << p.name;
    ASSERT_LT(p.info.module_index, 4) << p.name;
    const auto& owner = modules[static_cast<size_t>(p.info.module_index)].params;
    EXPECT_NE(std::find(owner.begin(), owner.end(), p.name), owner.end()) << p.name;
  }
  EXPECT_EQ(modules[0].params.size(), 2u);
  EXPECT_EQ(modules[3].params.back(), "language_model.embedding.word_embeddings.weight");
  EXPECT_EQ(modules[3].params.size(), 3u);  // final LN weight and bias + the tied embedding
}

TEST(GptModuleHooks, FireInOrderInForwardAndBackwardWithoutChangingResults) {
  const Shape S{2, 32, 4, 128, 8, 64, true};
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 31), labels = random_text(2, S.seq, S.vocab, 32);
  TensorList in{{"tokens", tokens}, {"labels", labels}};
  GPT plain(model_opts(S, S.vocab)), hooked(model_opts(S, S.vocab));
  HookRecorder rec;
  hooked.set_hooks(&rec.table);
  at::Tensor lp = dtk::get(plain.forward(in), "loss").mean();
  at::Tensor lh = dtk::get(hooked.forward(in), "loss").mean();
  EXPECT_EQ(rec.joined(), "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3");
  lp.backward();
  lh.backward();
  EXPECT_EQ(rec.joined(),
            "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 "
            "B+3 B-3 B+2 B-2 B+1 B-1 B+0 B-0");
  EXPECT_TRUE(at::equal(lp, lh));
  auto gp = plain.param_map(), gh = hooked.param_map();
  for (auto& kv : gp) EXPECT_TRUE(at::equal(kv.second.grad(), gh[kv.first].grad())) << kv.first;

  // Without an autograd graph only the forward hooks fire; removed hooks fire nothing.
  rec.events.clear();
  {
    at::NoGradGuard ng;
    hooked.forward(in);
  }
  EXPECT_EQ(rec.joined(), "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3");
  rec.events.clear();
  hooked.set_hooks(nullptr);
  hooked.forward(in);
  EXPECT_TRUE(rec.events.empty());
}

TEST(GptModuleHooks, FullRecomputeRefiresForwardHooksBeforeEachLayersBackward) {
  const Shape S{2, 32, 4, 128, 8, 64, false};
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 33), labels = random_text(2, S.seq, S.vocab, 34);
  GPT m(model_opts(S, S.vocab, {{"recompute_activations", "full"}}));
  HookRecorder rec;
  m.set_hooks(&rec.table);
  dtk::get(m.forward({{"tokens", tokens}, {"labels", labels}}), "loss").mean().backward();
  EXPECT_EQ(rec.joined(),
            "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 "
            "B+3 B-3 F+2 F-2 B+2 B-2 F+1 F-1 B+1 B-1 B+0 B-0");
}

TEST(GptModuleHooks, AFailingHookFailsTheCallNamingTheModule) {
  const Shape S{1, 32, 4, 128, 8, 64, true};
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 35), labels = random_text(2, S.seq, S.vocab, 36);
  TensorList in{{"tokens", tokens}, {"labels", labels}};
  GPT m(model_opts(S, S.vocab));
  HookRecorder rec;
  m.set_hooks(&rec.table);
  rec.fail = "F+1";
  try {
    m.forward(in);
    ADD_FAILURE() << "a failing pre_forward hook was ignored";
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()), "module 1: pre_forward hook: gather timed out");
  }
  rec.fail = "B+1";
  at::Tensor loss = dtk::get(m.forward(in), "loss").mean();
  try {
    loss.backward();
    ADD_FAILURE() << "a failing pre_backward hook was ignored";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("module 1: pre_backward hook: gather timed out"), std::string::npos)
        << e.what();
  }
}

// The host wires a strategy's hooks into the model (StrategyInstance::setup) and removes them
// before the strategy goes; the strategy here is a plugin that records them, read back through
// its extension.
TEST(GptModuleHooks, HostInstallsTheStrategysHooksAndRemovesThemWithIt) {
  struct HookLog {
    size_t struct_size;
    const char* (*log)(void);
    void (*clear)(void);
  };
  const auto& rec_plugin =
      plugins().host.load_file(std::string(DTK_MODEL_TEST_PLUGIN_DIR) + "/dtk_test_plugin_recording.so");
  const auto* log = static_cast<const HookLog*>(rec_plugin.extension("dtk.ext.test_hook_log.v1"));
  ASSERT_NE(log, nullptr);
  const Shape S{2, 32, 4, 128, 8, 64, true};
  dtk::host::OptionValues model_options(dtk::host::resolve_options(*plugins().gpt, model_opts(S, S.vocab)));
  dtk::host::OptionValues no_options(dtk::host::resolve_options(rec_plugin, {}));
  Ctx run;
  run.seq_length = S.seq;  // the position table covers the run's samples
  dtk::core::ModelInstance model(*plugins().gpt, make_ctx(model_options.get(), run));
  TensorList in{{"tokens", random_text(2, S.seq, S.vocab, 37)}, {"labels", random_text(2, S.seq, S.vocab, 38)}};
  {
    dtk::core::StrategyInstance strategy(rec_plugin, make_ctx(no_options.get(), Ctx{}));
    strategy.setup(model);
    EXPECT_STREQ(log->log(), "modules 4");
    log->clear();
    dtk::get(dtk::ModelHandle(model.ref()).forward(in), "loss").mean().backward();
    EXPECT_STREQ(log->log(), "F+0 F-0 F+1 F-1 F+2 F-2 F+3 F-3 B+3 B-3 B+2 B-2 B+1 B-1 B+0 B-0");
    log->clear();
  }
  dtk::ModelHandle(model.ref()).forward(in);
  EXPECT_STREQ(log->log(), "");  // the strategy is gone, and its hooks with it
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Domino (dtk/layers/domino.hpp): the chunked schedule is plain tensor parallelism's arithmetic. At TP 1 the
// all-reduces are the identity and the schedule, chunking, mask slicing and the hand-ordered
// backward are what is tested; tests/domino runs it over real processes at TP 2.
// ---------------------------------------------------------------------------------------------

TEST(GptDomino, ChunkedScheduleMatchesPlainForEveryChunkCountDropoutAndRecompute) {
  const Shape S{3, 32, 4, 128, 16, 64, false};
  at::Tensor tokens = random_text(4, S.seq, S.vocab, 41), labels = random_text(4, S.seq, S.vocab, 42);
  TensorList in{{"tokens", tokens}, {"labels", labels}};
  for (const char* p : {"0", "0.2"}) {
    for (const char* recompute : {"none", "full"}) {
      for (const char* chunks : {"2", "3", "4"}) {
        const std::string what = std::string("dropout ") + p + ", recompute " + recompute + ", chunks " + chunks;
        Opts base = model_opts(S, S.vocab, {{"hidden_dropout", p}, {"attention_dropout", p}});
        Opts domino = base;
        domino["recompute_activations"] = recompute;
        domino["domino_chunks"] = chunks;
        Ctx four;
        four.micro_batch = 4;
        GPT a(base), b(domino, four);
        for (int it = 0; it < 2; ++it) {  // twice: the generators must stay in step
          a.zero_grad();
          b.zero_grad();
          at::Tensor la = dtk::get(a.forward(in), "loss"), lb = dtk::get(b.forward(in), "loss");
          expect_close(la.detach(), lb.detach(), 1e-5, "per-token loss, " + what);
          la.mean().backward();
          lb.mean().backward();
          auto pa = a.param_map(), pb = b.param_map();
          for (auto& kv : pa) expect_close(kv.second.grad(), pb[kv.first].grad(), 1e-5, "grad " + kv.first + ", " + what);
        }
        at::NoGradGuard no_grad;  // the forward schedule alone (evaluation)
        a.train(false);
        b.train(false);
        expect_close(dtk::get(a.forward(in), "loss"), dtk::get(b.forward(in), "loss"), 1e-5, "eval loss, " + what);
      }
    }
  }
}

// Sliding-window layers in the chunked schedule: each chunk's attention masks the keys before the
// window as the plain schedule does (all but every 2nd layer windowed, dropout on).
TEST(GptDomino, SlidingWindowLayersMatchPlain) {
  const Shape S{3, 32, 4, 128, 16, 64, false};
  at::Tensor tokens = random_text(4, S.seq, S.vocab, 45), labels = random_text(4, S.seq, S.vocab, 46);
  TensorList in{{"tokens", tokens}, {"labels", labels}};
  Opts base = model_opts(S, S.vocab,
                         {{"hidden_dropout", "0.2"},
                          {"attention_dropout", "0.2"},
                          {"window_size", "3,0"},
                          {"window_attn_skip_freq", "2"}});
  Opts domino = base;
  domino["domino_chunks"] = "2";
  Ctx four;
  four.micro_batch = 4;
  GPT a(base), b(domino, four);
  at::Tensor la = dtk::get(a.forward(in), "loss"), lb = dtk::get(b.forward(in), "loss");
  expect_close(la.detach(), lb.detach(), 1e-5, "per-token loss");
  la.mean().backward();
  lb.mean().backward();
  auto pa = a.param_map(), pb = b.param_map();
  for (auto& kv : pa) expect_close(kv.second.grad(), pb[kv.first].grad(), 1e-5, "grad " + kv.first);
}

TEST(GptDomino, ChunksOfUnequalSizeAPerSequenceMaskAndSharedPositionIds) {
  const Shape S{2, 32, 4, 128, 16, 64, true};
  at::Tensor tokens = random_text(5, S.seq, S.vocab, 43), labels = random_text(5, S.seq, S.vocab, 44);
  // A padding-style mask per sequence: sequence i may not attend to its first i positions.
  at::Tensor mask = at::ones({S.seq, S.seq}, at::kBool).triu(1).view({1, 1, S.seq, S.seq}).repeat({5, 1, 1, 1});
  for (int64_t i = 0; i < 5; ++i) mask[i].narrow(-1, 0, i).fill_(true);
  mask.select(-1, 0).select(-1, 0).fill_(false);  // every row keeps one position
  for (int64_t i = 0; i < 5; ++i) mask[i][0].diagonal().fill_(false);
  // Position ids of one row, shared by every sequence (broadcast), in an order that is not the default.
  at::Tensor pos = at::arange(S.seq, at::kLong).flip(0).unsqueeze(0);
  TensorList in{{"tokens", tokens}, {"labels", labels}, {"attention_mask", mask}, {"position_ids", pos}};
  Ctx five;
  five.micro_batch = 5;
  GPT a(model_opts(S, S.vocab)), b(model_opts(S, S.vocab, {{"domino_chunks", "3"}}), five);  // rows 2, 2, 1
  at::Tensor la = dtk::get(a.forward(in), "loss").mean(), lb = dtk::get(b.forward(in), "loss").mean();
  expect_close(la.detach(), lb.detach(), 1e-5, "loss");
  la.backward();
  lb.backward();
  auto pa = a.param_map(), pb = b.param_map();
  for (auto& kv : pa) expect_close(kv.second.grad(), pb[kv.first].grad(), 1e-5, "grad " + kv.first);
}

// Per-layer hooks: a layer's post_forward comes once its last chunk is finished, after the next
// layer (or the output layer) began: two modules live at once; backward mirrors it. Recompute
// refires a module's forward hooks right before its backward, as for plain TP.
TEST(GptDomino, HooksFirePerLayerAroundTheInterleavedChunks) {
  const Shape S{2, 32, 4, 128, 8, 64, true};
  at::Tensor tokens = random_text(2, S.seq, S.vocab, 45), labels = random_text(2, S.seq, S.vocab, 46);
  for (const char* recompute : {"none", "full"}) {
    GPT m(model_opts(S, S.vocab, {{"domino_chunks", "2"}, {"recompute_activations", recompute}}));
    HookRecorder rec;
    m.set_hooks(&rec.table);
    dtk::get(m.forward({{"tokens", tokens}, {"labels", labels}}), "loss").mean().backward();
    // The embedding (module 0) and the output layer (module 3) run per chunk inside the schedule:
    // the embedding's chunks are finished by the first layer, the output layer's chunk c right
    // after the last layer finished chunk c. The embedding is not recomputed.
    const std::string forward = "F+0 F+1 F-0 F+2 F-1 F+3 F-2 F-3 ";
    EXPECT_EQ(rec.joined(), std::string(recompute) == "none"
                                ? forward + "B+3 B+2 B-3 B+1 B-2 B+0 B-1 B-0"
                                : forward + "F+3 F-3 B+3 F+2 F-2 B+2 B-3 F+1 F-1 B+1 B-2 B+0 B-1 B-0")
        << "recompute " << recompute;
  }
}

// recompute_modules mlp (dense_h_to_4h, GELU, dense_4h_to_h) and moe (router and experts, with
// the load-balancing loss) on gpt's layers: one checkpoint per layer, the same loss and gradients
// with dropout on, twice in a row; under per-module hooks (ZeRO-3's) the same hook sequence, the
// rerun inside its layer's backward where the layer's parameters are there. Domino's schedule,
// which runs the MLP in pieces of its own, refuses them.
TEST(GptModel, RecomputeModulesMatchNoRecompute) {
  const Shape S{2, 32, 4, 128, 16, 64, false};
  const Opts moe = {{"num_experts", "4"},
                    {"moe_router_topk", "2"},
                    {"moe_ffn_hidden_size", "64"},
                    {"moe_router_load_balancing_type", "aux_loss"},
                    {"moe_aux_loss_coeff", "0.01"}};
  for (const bool experts : {false, true}) {
    Opts base = model_opts(S, S.vocab, {{"hidden_dropout", "0.2"}, {"attention_dropout", "0.2"}});
    if (experts) base.insert(moe.begin(), moe.end());
    Opts rec = base;
    rec["recompute_activations"] = "selective";
    rec["recompute_modules"] = experts ? "moe" : "mlp";
    const std::string what = rec["recompute_modules"];
    GPT a(base), b(rec);
    EXPECT_EQ(b.info().recompute_modules, experts ? DTK_RECOMPUTE_MOE : DTK_RECOMPUTE_MLP);
    HookRecorder hooks_a, hooks_b;
    a.set_hooks(&hooks_a.table);
    b.set_hooks(&hooks_b.table);
    at::Tensor tokens = random_text(2, S.seq, S.vocab, 9), labels = random_text(2, S.seq, S.vocab, 10);
    TensorList in{{"tokens", tokens}, {"labels", labels}};
    for (int it = 0; it < 2; ++it) {
      a.zero_grad();
      b.zero_grad();
      at::Tensor la = dtk::get(a.forward(in), "loss").mean(), lb = dtk::get(b.forward(in), "loss").mean();
      EXPECT_EQ(dtk_test_gpt::graph_has(la, "Recomputed"), 0) << what;
      EXPECT_EQ(dtk_test_gpt::graph_has(lb, "Recomputed"), S.layers) << what;
      la.backward();
      lb.backward();
      expect_close(la.detach(), lb.detach(), 1e-6, "loss, " + what);
      auto pa = a.param_map(), pb = b.param_map();
      for (auto& kv : pa) expect_close(kv.second.grad(), pb[kv.first].grad(), 1e-6, "grad " + kv.first + ", " + what);
    }
    EXPECT_EQ(hooks_b.joined(), hooks_a.joined()) << what;
  }
  try {
    GPT m(model_opts(S, S.vocab,
                     {{"domino_chunks", "2"}, {"recompute_activations", "selective"}, {"recompute_modules", "mlp"}}));
    ADD_FAILURE() << "recompute_modules mlp accepted with domino_chunks 2";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("recompute_modules mlp: Domino's chunked schedule (domino_chunks > 1) "
                                         "runs the MLP in pieces of its own"),
              std::string::npos)
        << e.what();
  }
  // moe (--moe-layer-recompute's) recomputes nothing in Domino's dense layers: accepted.
  GPT domino(model_opts(
      S, S.vocab,
      {{"domino_chunks", "2"}, {"recompute_activations", "selective"}, {"recompute_modules", "core_attn,moe"}}));
  EXPECT_EQ(domino.info().recompute_modules, DTK_RECOMPUTE_CORE_ATTENTION | DTK_RECOMPUTE_MOE);
}

TEST(GptDomino, BadChunkCountsAreRefusedNamingTheOption) {
  const Shape S{1, 32, 4, 128, 8, 64, true};
  try {
    GPT m(model_opts(S, S.vocab, {{"domino_chunks", "0"}}));
    ADD_FAILURE() << "domino_chunks 0 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("domino_chunks"), std::string::npos) << e.what();
  }
  try {
    GPT m(model_opts(S, S.vocab, {{"domino_chunks", "3"}}));  // micro-batches of 2
    ADD_FAILURE() << "3 chunks of a micro-batch of 2 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("domino_chunks (3) exceeds the micro-batch size (2)"), std::string::npos)
        << e.what();
  }
  // A forward of fewer sequences than chunks (e.g. a last, short batch) is refused too.
  Ctx four;
  four.micro_batch = 4;
  GPT m(model_opts(S, S.vocab, {{"domino_chunks", "3"}}), four);
  try {
    m.forward({{"tokens", random_text(2, S.seq, S.vocab, 47)}});
    ADD_FAILURE() << "3 chunks of 2 sequences accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("domino_chunks (3) exceeds the micro-batch size (2)"), std::string::npos)
        << e.what();
  }
  // One backward per forward: a second one (retain_graph) is refused with a message.
  GPT two(model_opts(S, S.vocab, {{"domino_chunks", "2"}}));
  at::Tensor loss = dtk::get(two.forward({{"tokens", random_text(2, S.seq, S.vocab, 48)}, {"labels", random_text(2, S.seq, S.vocab, 49)}}), "loss").mean();
  loss.backward({}, /*retain_graph=*/true);
  try {
    loss.backward();
    ADD_FAILURE() << "a second backward through the Domino schedule ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("runs backward once per forward"), std::string::npos) << e.what();
  }
}
