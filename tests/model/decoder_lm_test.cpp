// Tests of the SDK's decoder-LM base (dtk/layers/decoder_lm.hpp) through the third model built on
// it, the model template's template_tiny_decoder (sdk/templates/model/tiny_decoder.cpp), loaded
// by the host and driven through the C ABI: its loss and gradients against an independent
// forward written below with plain ATen ops on the plugin's weights (word + position embedding,
// pre-RMSNorm attention and squared-ReLU MLP, final RMSNorm, logits from the tied or untied
// weight, ATen's cross entropy); the stage split, layer numbering and tied weight of a pipeline;
// parameter names and flags; modules; full recompute.
#include <dtk/model.hpp>

#include "gpt_harness.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

namespace {

using dtk_test_gpt::Ctx;
using dtk_test_gpt::GPT;
using dtk_test_gpt::Opts;
using dtk_test_gpt::plugins;

const dtk::host::Plugin* tiny() {
  static const dtk::host::Plugin* p =
      &plugins().host.load_file(std::string(DTK_MODEL_TEST_PLUGIN_DIR) + "/dtk_test_plugin_tiny_decoder.so");
  return p;
}

constexpr int64_t kLayers = 2, kHidden = 32, kHeads = 4, kSeq = 8, kVocab = 100, kPadded = 128;

Opts tiny_opts(bool untie = false, const char* recompute = "none") {
  return {{"num_layers", std::to_string(kLayers)},
          {"hidden_size", std::to_string(kHidden)},
          {"num_attention_heads", std::to_string(kHeads)},
          {"vocab_size", std::to_string(kVocab)},
          {"untie_embeddings_and_output_weights", untie ? "true" : "false"},
          {"recompute_activations", recompute}};
}

at::Tensor rms(const at::Tensor& x, const at::Tensor& w) { return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-5) * w; }

// The per-token loss [b, s] of the whole model from its named weights.
at::Tensor ref_loss(std::map<std::string, at::Tensor>& P, const at::Tensor& tokens, const at::Tensor& labels,
                    bool untie) {
  const int64_t b = tokens.size(0), s = tokens.size(1), hd = kHidden / kHeads;
  at::Tensor pos = at::arange(s, at::kLong).unsqueeze(0).expand({b, s});
  at::Tensor x = at::embedding(P["language_model.embedding.word_embeddings.weight"], tokens) +
                 at::embedding(P["language_model.embedding.position_embeddings.weight"], pos);
  const at::Tensor future = at::ones({s, s}, at::kBool).triu(1);
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string p = "language_model.encoder.layers." + std::to_string(l) + ".";
    at::Tensor qkv = at::matmul(rms(x, P[p + "input_norm.weight"]), P[p + "self_attention.query_key_value.weight"].t());
    qkv = qkv.view({b, s, kHeads, 3, hd});
    at::Tensor q = qkv.select(3, 0).transpose(1, 2), k = qkv.select(3, 1).transpose(1, 2), v = qkv.select(3, 2).transpose(1, 2);
    at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(hd));
    at::Tensor context = at::matmul(at::softmax(scores.masked_fill(future, -10000.0), -1), v);
    at::Tensor h = x + at::matmul(context.transpose(1, 2).reshape({b, s, kHidden}), P[p + "self_attention.dense.weight"].t());
    at::Tensor inner = at::relu(at::matmul(rms(h, P[p + "post_attention_norm.weight"]), P[p + "mlp.dense_h_to_4h.weight"].t()));
    x = h + at::matmul(inner * inner, P[p + "mlp.dense_4h_to_h.weight"].t());
  }
  const std::string out = untie ? "language_model.output_layer.weight" : "language_model.embedding.word_embeddings.weight";
  at::Tensor logits = at::matmul(rms(x, P["language_model.encoder.final_norm.weight"]), P[out].t());
  return at::cross_entropy_loss(logits.reshape({-1, kPadded}), labels.reshape({-1}), {}, at::Reduction::None).view({b, s});
}

at::Tensor ids(int64_t b, int64_t s, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randint(kVocab, {b, s}, g, at::TensorOptions().dtype(at::kLong));
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  EXPECT_LE(err, tol * std::max(1.0, want.abs().max().item<double>())) << what << ": max abs error " << err;
}

Ctx ctx(int32_t pp_rank = 0, int32_t pp_size = 1) {
  Ctx c;
  c.seq_length = kSeq;
  c.pp_rank = pp_rank, c.pp_size = pp_size;
  return c;
}

TEST(DecoderLM, LossAndGradientsMatchReferenceTiedAndUntied) {
  for (bool untie : {false, true}) {
    GPT model(tiny_opts(untie), ctx(), tiny());
    EXPECT_EQ(model.info().vocab_size, kPadded);
    EXPECT_EQ(model.info().tied_embeddings, untie ? 0 : 1);
    auto P = model.param_map();
    EXPECT_EQ(P.count("language_model.output_layer.weight"), untie ? 1u : 0u);
    std::map<std::string, at::Tensor> R;
    for (auto& kv : P) R[kv.first] = kv.second.detach().clone().requires_grad_(true);
    const at::Tensor tokens = ids(2, kSeq, 3), labels = ids(2, kSeq, 4);
    at::Tensor loss = dtk::get(model.forward({{"tokens", tokens}, {"labels", labels}}), "loss");
    at::Tensor want = ref_loss(R, tokens, labels, untie);
    expect_close(loss.detach(), want.detach(), 1e-5, untie ? "loss, untied" : "loss, tied");
    loss.mean().backward();
    want.mean().backward();
    for (auto& kv : P) {
      ASSERT_TRUE(kv.second.grad().defined()) << kv.first;
      expect_close(kv.second.grad(), R[kv.first].grad(), 1e-5, "gradient of " + kv.first);
    }
  }
}

TEST(DecoderLM, PipelineStagesAreTheWholeModelCutWithGlobalLayerSeeds) {
  GPT whole(tiny_opts(), ctx(), tiny()), first(tiny_opts(), ctx(0, 2), tiny()), last(tiny_opts(), ctx(1, 2), tiny());
  auto W = whole.param_map();
  // Local numbering on each stage, weights seeded by the global index; the tied embedding is
  // shared on the first stage and copied as word_embeddings_for_head on the last.
  for (auto& p : first.params()) {
    ASSERT_TRUE(W.count(p.name)) << p.name;
    EXPECT_TRUE(at::equal(p.tensor, W[p.name])) << p.name;
    EXPECT_EQ(p.info.shared, p.name == "language_model.embedding.word_embeddings.weight" ? 1 : 0) << p.name;
  }
  std::vector<std::string> names;
  for (auto& p : last.params()) {
    names.push_back(p.name);
    std::string in_whole = p.name;
    const std::string local = "language_model.encoder.layers.0.";
    if (in_whole.rfind(local, 0) == 0) in_whole = "language_model.encoder.layers.1." + in_whole.substr(local.size());
    if (in_whole == "word_embeddings_for_head.weight") in_whole = "language_model.embedding.word_embeddings.weight";
    ASSERT_TRUE(W.count(in_whole)) << p.name;
    EXPECT_TRUE(at::equal(p.tensor, W[in_whole])) << p.name;
  }
  EXPECT_EQ(names.front(), "word_embeddings_for_head.weight");
  EXPECT_EQ(names.back(), "language_model.encoder.final_norm.weight");
  // Modules in forward order: embedding, layers, output layer (which reads the tied embedding).
  auto modules = whole.modules();
  ASSERT_EQ(modules.size(), 4u);
  EXPECT_EQ(modules[0].name, "language_model.embedding");
  EXPECT_EQ(modules[2].name, "language_model.encoder.layers.1");
  EXPECT_EQ(modules[3].params.back(), "language_model.embedding.word_embeddings.weight");

  at::NoGradGuard ng;
  const at::Tensor tokens = ids(2, kSeq, 5), labels = ids(2, kSeq, 6);
  at::Tensor mid = dtk::get(first.forward({{"tokens", tokens}}), "hidden_states");
  EXPECT_TRUE(at::equal(dtk::get(last.forward({{"hidden_states", mid}, {"labels", labels}}), "loss"),
                        dtk::get(whole.forward({{"tokens", tokens}, {"labels", labels}}), "loss")));
}

TEST(DecoderLM, FullRecomputeGivesTheSameLossAndGradients) {
  GPT plain(tiny_opts(), ctx(), tiny()), recomputed(tiny_opts(false, "full"), ctx(), tiny());
  EXPECT_EQ(recomputed.info().recompute, 1);
  const at::Tensor tokens = ids(2, kSeq, 7), labels = ids(2, kSeq, 8);
  at::Tensor a = dtk::get(plain.forward({{"tokens", tokens}, {"labels", labels}}), "loss");
  at::Tensor b = dtk::get(recomputed.forward({{"tokens", tokens}, {"labels", labels}}), "loss");
  EXPECT_TRUE(at::equal(a, b));
  a.mean().backward();
  b.mean().backward();
  auto R = recomputed.param_map();
  for (auto& kv : plain.param_map()) EXPECT_TRUE(at::equal(kv.second.grad(), R[kv.first].grad())) << kv.first;
}

TEST(DecoderLM, WhatTheLayersDoNotImplementIsRefusedWithAMessage) {
  GPT model(tiny_opts(), ctx(), tiny());
  const at::Tensor tokens = ids(1, 2, 9);
  try {
    model.forward({{"tokens", tokens}, {"position_ids", at::arange(2, at::kLong).unsqueeze(0)},
                   {"attention_mask", at::zeros({1, 1, 2, 2}, at::kBool)}, {"kv_cache_length", at::scalar_tensor(0, at::kLong)},
                   {"kv_cache_capacity", at::scalar_tensor(4, at::kLong)}});
    ADD_FAILURE() << "generation accepted by layers without forward_cached";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("key/value cache"), std::string::npos) << e.what();
  }
  try {
    model.forward({{"tokens", at::zeros({1, kSeq + 1}, at::kLong)}});
    ADD_FAILURE() << "more tokens than position embeddings accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("template_tiny_decoder: sequence of 9 tokens exceeds max_position_embeddings 8"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
