// `dtk export hf` / `dtk import hf` of the llama model as Hugging Face's LlamaForCausalLM. The
// folder is read back with the test's own safetensors reader (hf_reader.hpp) and run through
// LlamaForCausalLM's forward written here from Hugging Face's names and math (LlamaRMSNorm,
// rotate_half rotary with HF's inv_freq and its llama3 scaling in fp32 tensor ops, repeat_kv for
// grouped-query attention, SwiGLU down(silu(gate) * up); with experts MixtralSparseMoeBlock or
// Qwen's: the softmax over all experts in fp32, its top-k renormalised or not, w2(silu(w1 x) * w3 x)
// per expert, Qwen2-MoE's gated shared expert): its
// logits and loss must equal the llama plugin's own on the checkpoint. Export -> import gives back every parameter bit
// for bit (tied and untied, from TP1 and TP2); the import reads Hugging Face's sharded index; bad folders are one error
// line each.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "../common/run_dtk.hpp"
#include "dtk/core/export/hf_llama.hpp"
#include "gpt_harness.hpp"
#include "hf_reader.hpp"

namespace fs = std::filesystem;

namespace {

using dtk_test_gpt::GPT;
using namespace dtk_test_hf;
using Tensors = std::map<std::string, at::Tensor>;

// A SwiGLU MLP, down(silu(gate x) * up x), under Mixtral's expert names (w1, w3, w2) or
// Llama's and Qwen's (gate_proj, up_proj, down_proj).
at::Tensor swiglu(const Tensors& P, const std::string& mlp, const at::Tensor& x, bool mixtral) {
  auto w = [&](const char* mixtral_name, const char* name) {
    return P.at(mlp + (mixtral ? mixtral_name : name) + ".weight");
  };
  return at::linear(at::silu(at::linear(x, w("w1", "gate_proj"))) * at::linear(x, w("w3", "up_proj")),
                    w("w2", "down_proj"));
}

// A sparse block on x [b, s, h] as transformers' MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock and
// Qwen3MoeSparseMoeBlock compute it: router logits, their softmax over all experts in fp32, the
// top-k weights (renormalised: Mixtral's always, Qwen's with norm_topk_prob); every expert runs on
// every token and adds its output times the token's weight for it (zero where the token did not
// choose it); Qwen2-MoE adds its shared expert times sigmoid(x shared_expert_gate).
at::Tensor sparse_block(const Tensors& P, const std::string& block, const at::Tensor& x, int64_t experts, int64_t topk,
                        bool mixtral, bool renormalise, bool shared) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const at::Tensor probs = at::softmax(at::linear(rows, P.at(block + "gate.weight")), -1, at::kFloat);
  auto [weights, chosen] = probs.topk(topk, -1);
  if (renormalise) weights = weights / weights.sum(-1, true);
  at::Tensor out = at::zeros_like(rows);
  for (int64_t e = 0; e < experts; ++e) {
    const at::Tensor weight = (weights * chosen.eq(e)).sum(-1, true);
    out = out + weight * swiglu(P, block + "experts." + std::to_string(e) + ".", rows, mixtral);
  }
  if (shared)
    out = out + at::sigmoid(at::linear(rows, P.at(block + "shared_expert_gate.weight"))) *
                    swiglu(P, block + "shared_expert.", rows, false);
  return out.view(x.sizes());
}

// A list of integers in config.json ("mlp_only_layers": [0, 3]); empty when absent.
std::vector<int64_t> json_int_list(const std::string& json, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + key + R"re("\s*:\s*\[([^\]]*)\])re"))) return {};
  std::vector<int64_t> out;
  std::stringstream items(m[1].str());
  for (std::string item; std::getline(items, item, ',');)
    if (item.find_first_not_of(' ') != std::string::npos) out.push_back(std::stoll(item));
  return out;
}

// A list of strings in config.json ("layer_types": ["full_attention", ...]); empty when absent.
std::vector<std::string> json_string_list(const std::string& json, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + key + R"re("\s*:\s*\[([^\]]*)\])re"))) return {};
  const std::string items = m[1].str();
  const std::regex quoted("\"([^\"]*)\"");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(items.begin(), items.end(), quoted); it != std::sregex_iterator(); ++it)
    out.push_back((*it)[1].str());
  return out;
}

// LlamaForCausalLM's (or MistralForCausalLM's, MixtralForCausalLM's, Qwen2ForCausalLM's,
// Qwen3ForCausalLM's and their MoE forms') forward (eval) from config.json and the folder's
// tensors; Mistral's and Mixtral's sliding_window masks the keys that far back or further in every layer, Qwen2's
// and Qwen3's (with use_sliding_window) in the layers layer_types calls sliding_attention or, without
// layer_types, in those from max_window_layers on. Which projections have
// biases is each architecture's: Llama's attention_bias (q, k, v, o) and mlp_bias; Qwen2's q, k
// and v (Qwen2-MoE's unless qkv_bias is false); Qwen3's attention_bias. Qwen3 RMS-normalises each
// query and key head (q_norm, k_norm) before rotary. A head is head_dim wide where config.json
// says, else hidden_size / num_attention_heads. Qwen's MoE layer l is sparse unless it is in
// mlp_only_layers or l + 1 is not a multiple of decoder_sparse_step.
at::Tensor hf_llama_logits(const Tensors& P, const std::string& config, const at::Tensor& tokens) {
  auto integer = [&](const char* key) { return std::stoll(json_value(config, key)); };
  const std::string type = json_value(config, "model_type"), head_dim = json_value(config, "head_dim");
  const int64_t layers = integer("num_hidden_layers"), heads = integer("num_attention_heads");
  const int64_t kv_heads = integer("num_key_value_heads"), hidden = integer("hidden_size");
  const int64_t hd = head_dim.empty() || head_dim == "null" ? hidden / heads : std::stoll(head_dim);
  const double eps = std::stod(json_value(config, "rms_norm_eps")), theta = std::stod(json_value(config, "rope_theta"));
  const bool attention_bias = json_value(config, "attention_bias") == "true";
  const bool qwen2 = type == "qwen2" || type == "qwen2_moe", mixtral = type == "mixtral";
  const bool qkv_bias =
      type == "qwen2" || (type == "qwen2_moe" && json_value(config, "qkv_bias") != "false") || attention_bias;
  const bool o_bias = !qwen2 && attention_bias;
  const bool mlp_bias = type == "llama" && json_value(config, "mlp_bias") == "true";
  const bool qk_norm = type == "qwen3" || type == "qwen3_moe";
  const std::string experts_text = json_value(config, mixtral ? "num_local_experts" : "num_experts");
  const int64_t experts = experts_text.empty() ? 0 : std::stoll(experts_text);
  const int64_t topk = experts > 0 ? integer("num_experts_per_tok") : 0;
  const bool renormalise = mixtral || json_value(config, "norm_topk_prob") == "true";
  const std::vector<int64_t> dense_layers = json_int_list(config, "mlp_only_layers");
  const std::string step_text = json_value(config, "decoder_sparse_step");
  const int64_t sparse_step = step_text.empty() ? 1 : std::stoll(step_text);
  auto sparse = [&](int64_t l) {
    return experts > 0 && std::find(dense_layers.begin(), dense_layers.end(), l) == dense_layers.end() &&
           (l + 1) % sparse_step == 0;
  };
  const int64_t b = tokens.size(0), s = tokens.size(1);
  // LlamaRotaryEmbedding: inv_freq in fp32, then _compute_llama3_parameters' tensor ops.
  at::Tensor inv_freq = 1.0 / at::pow(theta, at::arange(0, hd, 2, at::kLong).to(at::kFloat) / static_cast<double>(hd));
  if (json_value(config, "rope_type") == "llama3") {
    const double factor = std::stod(json_value(config, "factor")), low = std::stod(json_value(config, "low_freq_factor"));
    const double high = std::stod(json_value(config, "high_freq_factor"));
    const double old_len = std::stod(json_value(config, "original_max_position_embeddings"));
    const double low_wl = old_len / low, high_wl = old_len / high;
    const at::Tensor wavelen = 2 * M_PI / inv_freq;
    const at::Tensor llama = at::where(wavelen > low_wl, inv_freq / factor, inv_freq);
    const at::Tensor smooth = (old_len / wavelen - low) / (high - low);
    const at::Tensor smoothed = (1 - smooth) * llama / factor + smooth * llama;
    const at::Tensor medium = (wavelen < high_wl).logical_not().logical_and((wavelen > low_wl).logical_not());
    inv_freq = at::where(medium, smoothed, llama);
  }
  const at::Tensor freqs = at::outer(at::arange(s, at::kLong).to(at::kFloat), inv_freq);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos(), sin = emb.sin();  // [s, hd], broadcast over [b, heads, s, hd]
  auto rotate_half = [](const at::Tensor& x) {
    const int64_t half = x.size(-1) / 2;
    return at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
  };
  auto rms = [&](const at::Tensor& x, const std::string& name) {
    return P.at(name) * (x * at::rsqrt(x.pow(2).mean(-1, true) + eps));
  };
  auto linear = [&](const at::Tensor& x, const std::string& name, bool bias) {
    return at::linear(x, P.at(name + ".weight"), bias ? P.at(name + ".bias") : at::Tensor());
  };
  auto repeat_kv = [&](const at::Tensor& x) {  // [b, kv, s, hd] -> [b, heads, s, hd]
    return x.unsqueeze(2).expand({b, kv_heads, heads / kv_heads, s, hd}).reshape({b, heads, s, hd});
  };
  at::Tensor x = at::embedding(P.at("model.embed_tokens.weight"), tokens);
  const at::Tensor future = at::ones({s, s}, at::kBool).triu(1);
  // A sliding window: query q sees the keys k with q - k < sliding_window, in every layer of
  // Mistral and Mixtral, in Qwen's windowed layers (Qwen2Config's and Qwen3Config's layer_types).
  const std::string window = json_value(config, "sliding_window"),
                    first_windowed = json_value(config, "max_window_layers");
  const bool has_window = !window.empty() && window != "null";
  const bool qwen_window = (type == "qwen2" || type == "qwen3") && json_value(config, "use_sliding_window") == "true";
  const std::vector<std::string> layer_types = json_string_list(config, "layer_types");
  auto windowed = [&](int64_t l) {
    if (!has_window) return false;
    if (type == "mistral" || mixtral) return true;
    if (!qwen_window) return false;
    if (!layer_types.empty()) return layer_types.at(static_cast<size_t>(l)) == "sliding_attention";
    return l >= (first_windowed.empty() ? 28 : std::stoll(first_windowed));
  };
  at::Tensor window_future = future;
  if (has_window) {
    const at::Tensor q_idx = at::arange(s, at::kLong).unsqueeze(1), k_idx = at::arange(s, at::kLong).unsqueeze(0);
    window_future = future.logical_or(q_idx - k_idx >= static_cast<int64_t>(std::stoll(window)));
  }
  for (int64_t l = 0; l < layers; ++l) {
    const std::string L = "model.layers." + std::to_string(l) + ".";
    const at::Tensor h = rms(x, L + "input_layernorm.weight");
    at::Tensor q = linear(h, L + "self_attn.q_proj", qkv_bias).view({b, s, heads, hd});
    at::Tensor k = linear(h, L + "self_attn.k_proj", qkv_bias).view({b, s, kv_heads, hd});
    if (qk_norm) q = rms(q, L + "self_attn.q_norm.weight"), k = rms(k, L + "self_attn.k_norm.weight");
    q = q.transpose(1, 2), k = k.transpose(1, 2);
    const at::Tensor v = linear(h, L + "self_attn.v_proj", qkv_bias).view({b, s, kv_heads, hd}).transpose(1, 2);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    at::Tensor scores = at::matmul(q, repeat_kv(k).transpose(2, 3)) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(windowed(l) ? window_future : future, -std::numeric_limits<float>::infinity());
    const at::Tensor ctx = at::matmul(at::softmax(scores, -1), repeat_kv(v)).transpose(1, 2).reshape({b, s, heads * hd});
    x = x + linear(ctx, L + "self_attn.o_proj", o_bias);
    const at::Tensor m = rms(x, L + "post_attention_layernorm.weight");
    if (sparse(l)) {
      x = x + sparse_block(P, L + (mixtral ? "block_sparse_moe." : "mlp."), m, experts, topk, mixtral, renormalise,
                           type == "qwen2_moe");
      continue;
    }
    x = x + linear(at::silu(linear(m, L + "mlp.gate_proj", mlp_bias)) * linear(m, L + "mlp.up_proj", mlp_bias),
                   L + "mlp.down_proj", mlp_bias);
  }
  x = rms(x, "model.norm.weight");
  const bool tied = json_value(config, "tie_word_embeddings") == "true";
  return at::linear(x, tied ? P.at("model.embed_tokens.weight") : P.at("lm_head.weight"));
}

// The test's own safetensors writer (F32 unless `dtype` says otherwise for one tensor).
void write_safetensors(const std::string& path, const Tensors& tensors, const std::string& odd_name = "",
                       const std::string& odd_dtype = "") {
  std::string header = "{", data;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.contiguous();
    std::string shape;
    for (int64_t d : c.sizes()) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    const size_t begin = data.size();
    data.append(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel() * 4));
    header += (header.size() > 1 ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" +
              (name == odd_name ? odd_dtype : "F32") + "\",\"shape\":[" + shape + "],\"data_offsets\":[" +
              std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  header += "}";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << bytes << header << data;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

const std::string kVocab = std::string(DTK_VOCAB_DIR) + "/encoder.json", kMerges = std::string(DTK_VOCAB_DIR) + "/vocab.bpe";
// llama-tiny (2 layers, hidden 64, 4 heads in 2 key/value groups, ffn 192, GPT-2's vocabulary),
// dropout off, on random tokens.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/llama-tiny.pbtxt --dataset synthetic --set train.train_iters=3 "
                           "--set lr.lr_warmup_iters=1 --set checkpoint.save_interval=3 "
                           "--threads 1 ";
const int64_t kVocabSize = 50257;

dtk_test_gpt::Opts tiny_opts(const std::map<std::string, std::string>& extra) {
  dtk_test_gpt::Opts o = {{"num_layers", "2"}, {"hidden_size", "64"}, {"num_attention_heads", "4"},
                          {"num_query_groups", "2"}, {"ffn_hidden_size", "192"}, {"vocab_size", "50257"}};
  for (const auto& [k, v] : extra) o[k] = v;
  return o;
}

// The llama plugin's resolved options for llama-tiny's shape (2 layers, hidden 64, 4 heads in 2
// key/value groups, ffn 192), dense, as a checkpoint records them: llama_shape's input.
std::map<std::string, std::string> tiny_llama_options() {
  return {
      {"num_layers", "2"},           {"hidden_size", "64"},          {"num_attention_heads", "4"},
      {"num_query_groups", "2"},     {"ffn_hidden_size", "192"},     {"vocab_size", "50257"},
      {"seq_length", "64"},          {"layernorm_epsilon", "1e-5"},  {"rotary_base", "10000"},
      {"attention_dropout", "0"},    {"init_method_std", "0.02"},    {"untie_embeddings_and_output_weights", "true"},
      {"add_bias_linear", "false"},  {"rope_scaling", "none"},       {"rope_scaling_factor", "8"},
      {"rope_low_freq_factor", "1"}, {"rope_high_freq_factor", "4"}, {"rope_original_max_positions", "8192"},
      {"rotary_percent", "1"}};
}

Tensors checkpoint_at(const std::string& save_dir, const char* iter) {
  return checkpoint_model(save_dir + "/" + iter + "/mp_rank_00/model_optim_rng.pt");
}

// Every parameter of `b` equals `a`'s bit for bit (the vocabulary rows that exist: the padding
// rows are the model's own in `a`, zeros after an import); rng states aside.
void expect_same_parameters(const Tensors& a, const Tensors& b, const std::string& what) {
  int compared = 0;
  for (const auto& [name, t] : a) {
    if (name.rfind("rng.", 0) == 0) continue;
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    at::Tensor x = t, y = b.at(name);
    if (name.find("word_embeddings") != std::string::npos || name.find("output_layer") != std::string::npos) {
      ASSERT_EQ(x.sizes(), y.sizes()) << name;
      EXPECT_TRUE(at::equal(y.narrow(0, kVocabSize, y.size(0) - kVocabSize), at::zeros_like(y.narrow(0, kVocabSize, y.size(0) - kVocabSize))));
      x = x.narrow(0, 0, kVocabSize), y = y.narrow(0, 0, kVocabSize);
    }
    EXPECT_TRUE(at::equal(x, y)) << what << ": " << name;
    ++compared;
  }
  EXPECT_GT(compared, 10) << what;
}

// The llama plugin's logits and per-token loss on a checkpoint's weights, and HF's on the export.
void expect_hf_forward_matches(const Tensors& saved, const dtk_test_gpt::Opts& opts, const std::string& hf_dir,
                               const std::string& what) {
  dtk_test_gpt::Ctx ctx;
  ctx.seq_length = 64;
  GPT model(tiny_opts(opts), ctx, dtk_test_gpt::plugins().llama);
  model.state_load(dtk::TensorList(saved.begin(), saved.end()));
  model.train(false);
  const at::Tensor tokens = at::randint(0, kVocabSize, {2, 64}, at::kLong);
  const at::Tensor labels = at::randint(0, kVocabSize, {2, 64}, at::kLong);
  const at::Tensor pos = at::arange(64, at::kLong).repeat({2, 1});
  at::NoGradGuard no_grad;
  const at::Tensor ours = dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits").narrow(-1, 0, kVocabSize);
  const at::Tensor our_loss = dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}}), "loss");
  const std::string config = read(hf_dir + "/config.json");
  const Tensors hf = read_safetensors(hf_dir + "/model.safetensors");
  const at::Tensor theirs = hf_llama_logits(hf, config, tokens);
  ASSERT_EQ(ours.sizes(), theirs.sizes()) << what;
  const double diff = (ours - theirs).abs().max().item<double>(), scale = theirs.abs().max().item<double>();
  std::printf("%s: max |logit difference| %.3g (largest logit %.3g) over %lld logits\n", what.c_str(), diff, scale,
              static_cast<long long>(ours.numel()));
  EXPECT_LT(diff, 1e-5 * std::max(1.0, scale)) << what;
  // The loss: Hugging Face's cross entropy over its logits, with the softmax also over the
  // checkpoint's vocabulary padding columns, which the llama plugin's (Megatron's) loss includes
  // and the export drops (their weights are the model's own: a small but real part of the mass).
  const at::Tensor full = dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}}), "logits");
  const at::Tensor padding = full.narrow(-1, kVocabSize, full.size(-1) - kVocabSize);
  const at::Tensor their_loss =
      at::logsumexp(at::cat({theirs, padding}, -1), -1) - theirs.gather(-1, labels.unsqueeze(-1)).squeeze(-1);
  EXPECT_LT(((our_loss - their_loss).abs() / their_loss.abs()).max().item<double>(), 1e-5) << what;
  const at::Tensor hf_only =
      at::cross_entropy_loss(theirs.reshape({-1, kVocabSize}), labels.reshape({-1}), {}, at::Reduction::None).view({2, 64});
  std::printf("%s: loss relative difference %.3g (Hugging Face's own loss, without the %lld padding columns: %.3g)\n",
              what.c_str(), ((our_loss - their_loss).abs() / their_loss.abs()).max().item<double>(),
              static_cast<long long>(padding.size(-1)), ((our_loss - hf_only).abs() / hf_only.abs()).max().item<double>());

  // A wrong layout would not pass: k and v swapped, or q/k permuted to the interleaved rotary
  // convention (pairs (2j, 2j+1), as Meta's original checkpoints) change the logits.
  Tensors swapped = hf, interleaved = hf;
  const int64_t hd = std::stoll(json_value(config, "head_dim"));
  for (int64_t l = 0; l < 2; ++l) {
    const std::string L = "model.layers." + std::to_string(l) + ".self_attn.";
    std::swap(swapped[L + "k_proj.weight"], swapped[L + "v_proj.weight"]);
    for (const char* p : {"q_proj.weight", "k_proj.weight"}) {
      at::Tensor& w = interleaved[L + p];
      w = w.view({-1, 2, hd / 2, 64}).transpose(1, 2).reshape({-1, 64});
    }
  }
  EXPECT_GT((hf_llama_logits(swapped, config, tokens) - theirs).abs().max().item<double>(), 1e-3) << what;
  EXPECT_GT((hf_llama_logits(interleaved, config, tokens) - theirs).abs().max().item<double>(), 1e-3) << what;
}

}  // namespace

TEST(HfLlama, ExportMatchesHuggingFacesForwardAndImportsBitForBit) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_llama");
  const dtk_test::Result trained = dtk_test::run_dtk(kTrain + "--set checkpoint.save=" + dir + "/ck");
  ASSERT_EQ(trained.code, 0) << trained.out;
  const dtk_test::Result exported = dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/hf");
  ASSERT_EQ(exported.code, 0) << exported.out;
  EXPECT_NE(exported.out.find("exported iteration 3 of " + dir + "/ck to " + dir +
                              "/hf: LlamaForCausalLM, 2 layers, hidden 64, 4 heads, 2 key/value heads, ffn 192, vocab "
                              "50257, 64 positions"),
            std::string::npos)
      << exported.out;
  EXPECT_NE(exported.out.find("dropped 47 vocabulary padding rows: token ids 50257 and above are not in the export"),
            std::string::npos)
      << exported.out;
  EXPECT_NE(exported.out.find("no tokenizer files written"), std::string::npos) << exported.out;
  const std::string config = read(dir + "/hf/config.json");
  EXPECT_EQ(json_value(config, "model_type"), "llama");
  EXPECT_EQ(json_value(config, "vocab_size"), "50257");  // unpadded
  EXPECT_EQ(json_value(config, "num_key_value_heads"), "2");
  EXPECT_EQ(json_value(config, "intermediate_size"), "192");
  EXPECT_EQ(json_value(config, "tie_word_embeddings"), "false");
  EXPECT_EQ(json_value(config, "rope_scaling"), "null");
  EXPECT_EQ(json_value(config, "hidden_act"), "silu");
  EXPECT_EQ(json_value(config, "eos_token_id"), "50256");
  const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
  EXPECT_EQ(hf.size(), 1u + 2 * 9 + 2);  // embed_tokens, 9 per layer, norm, lm_head
  EXPECT_EQ(hf.at("model.layers.0.self_attn.q_proj.weight").sizes(), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(hf.at("model.layers.0.self_attn.k_proj.weight").sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(hf.at("lm_head.weight").sizes(), (std::vector<int64_t>{kVocabSize, 64}));

  const Tensors saved = checkpoint_at(dir + "/ck", "iter_0000003");
  expect_hf_forward_matches(saved, {}, dir + "/hf", "untied");

  // Back: every parameter as it was, and the run fine-tunes from it.
  const dtk_test::Result imported = dtk_test::run_dtk("import hf " + dir + "/hf " + dir + "/imp");
  ASSERT_EQ(imported.code, 0) << imported.out;
  EXPECT_NE(imported.out.find("llama model, 2 layers, hidden 64, 4 heads, 2 key/value heads"), std::string::npos)
      << imported.out;
  EXPECT_NE(imported.out.find("--set model.num_query_groups=2"), std::string::npos) << imported.out;
  expect_same_parameters(saved, checkpoint_at(dir + "/imp", "iter_0000000"), "untied round trip");
  const dtk_test::Result tuned = dtk_test::run_dtk(kTrain + "--set checkpoint.load=" + dir +
                                                   "/imp --set checkpoint.finetune=true --set train.train_iters=1 --set lr.lr_warmup_iters=0 "
                                                   "--set checkpoint.save=" + dir + "/tuned");
  EXPECT_EQ(tuned.code, 0) << tuned.out;

  // With GPT-2's tokenizer files named by the flags.
  const dtk_test::Result with_tok = dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/hf_tok --vocab_file " +
                                                      kVocab + " --merge_file " + kMerges);
  ASSERT_EQ(with_tok.code, 0) << with_tok.out;
  EXPECT_NE(with_tok.out.find("config.json and the GPT-2 tokenizer files"), std::string::npos) << with_tok.out;
  EXPECT_EQ(read(dir + "/hf_tok/vocab.json"), read(kVocab));
  EXPECT_TRUE(fs::is_regular_file(dir + "/hf_tok/tokenizer_config.json"));
}

// Tied embeddings and Llama 3.1's rope scaling (wavelengths around rope_original_max_positions
// 1000: head dim 16 has frequencies in all three of its branches).
TEST(HfLlama, TiedAndLlama3RopeScalingRoundTrip) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_llama_tied");
  const std::map<std::string, std::string> opts = {{"untie_embeddings_and_output_weights", "false"},
                                                   {"rope_scaling", "llama3"},
                                                   {"rope_original_max_positions", "1000"},
                                                   {"rope_scaling_factor", "16"}};
  std::string sets;
  for (const auto& [k, v] : opts) sets += "--set model." + k + "=" + v + " ";
  ASSERT_EQ(dtk_test::run_dtk(kTrain + sets + "--set checkpoint.save=" + dir + "/ck").code, 0);
  const dtk_test::Result exported = dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/hf");
  ASSERT_EQ(exported.code, 0) << exported.out;
  EXPECT_NE(exported.out.find("rope theta 10000, llama3 rope scaling"), std::string::npos) << exported.out;
  const std::string config = read(dir + "/hf/config.json");
  EXPECT_EQ(json_value(config, "tie_word_embeddings"), "true");
  EXPECT_EQ(json_value(config, "rope_type"), "llama3");
  EXPECT_EQ(json_value(config, "factor"), "16");
  EXPECT_EQ(json_value(config, "original_max_position_embeddings"), "1000");
  EXPECT_EQ(read_safetensors(dir + "/hf/model.safetensors").count("lm_head.weight"), 0u);
  const Tensors saved = checkpoint_at(dir + "/ck", "iter_0000003");
  expect_hf_forward_matches(saved, opts, dir + "/hf", "tied, llama3 rope scaling");
  // The scaling matters: HF's forward without it differs.
  {
    std::string plain = config;
    plain.replace(plain.find("\"rope_type\": \"llama3\""), 21, "\"rope_type\": \"default\"");
    const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
    const at::Tensor tokens = at::randint(0, kVocabSize, {1, 64}, at::kLong);
    EXPECT_GT((hf_llama_logits(hf, plain, tokens) - hf_llama_logits(hf, config, tokens)).abs().max().item<double>(), 1e-4);
  }
  const dtk_test::Result imported = dtk_test::run_dtk("import hf " + dir + "/hf " + dir + "/imp");
  ASSERT_EQ(imported.code, 0) << imported.out;
  EXPECT_NE(imported.out.find("--set model.rope_original_max_positions=1000"), std::string::npos) << imported.out;
  EXPECT_NE(imported.out.find("--set model.untie_embeddings_and_output_weights=false"), std::string::npos) << imported.out;
  expect_same_parameters(saved, checkpoint_at(dir + "/imp", "iter_0000000"), "tied round trip");
}

namespace {

// `dtk import hf` of the export in dir/hf: it prints the shape (`printed`) and a --set for each
// of `opts` (quoted where a shell would read the value otherwise), gives back every parameter of
// `saved` bit for bit, and a run fine-tunes from it with the model options `sets`.
void expect_import_round_trip(const std::string& dir, const Tensors& saved, const std::string& printed,
                              const std::map<std::string, std::string>& opts, const std::string& sets,
                              const std::string& what) {
  const dtk_test::Result imported = dtk_test::run_dtk("import hf " + dir + "/hf " + dir + "/imp");
  ASSERT_EQ(imported.code, 0) << imported.out;
  EXPECT_NE(imported.out.find("llama model, 2 layers, hidden 64, 4 heads, 2 key/value heads, " + printed),
            std::string::npos)
      << imported.out;
  for (const auto& [k, value] : opts) {
    const std::string set = "model." + k + "=" + value;
    const std::string shown = value.find('[') == std::string::npos ? set : "'" + set + "'";
    EXPECT_NE(imported.out.find("--set " + shown), std::string::npos) << imported.out;
  }
  expect_same_parameters(saved, checkpoint_at(dir + "/imp", "iter_0000000"), what + " round trip");
  const dtk_test::Result tuned = dtk_test::run_dtk(kTrain + "--set checkpoint.load=" + dir + "/imp " + sets +
                                                   "--set checkpoint.finetune=true --set train.train_iters=1 "
                                                   "--set lr.lr_warmup_iters=0 --set checkpoint.save=" +
                                                   dir + "/tuned");
  EXPECT_EQ(tuned.code, 0) << tuned.out;
}

// The --set flags of the model options `opts`, quoted.
std::string model_sets(const std::map<std::string, std::string>& opts) {
  std::string sets;
  for (const auto& [k, value] : opts) sets += "--set 'model." + k + "=" + value + "' ";
  return sets;
}

// llama-tiny trained with the model flags `sets` into dir/ck, exported to dir/hf (`exported`):
// the export's line names `architecture` and the shape after the key/value heads (`shape`).
void train_and_export(const std::string& dir, const std::string& sets, const std::string& architecture,
                      const std::string& shape, dtk_test::Result& exported) {
  const dtk_test::Result trained = dtk_test::run_dtk(kTrain + sets + "--set checkpoint.save=" + dir + "/ck");
  ASSERT_EQ(trained.code, 0) << trained.out;
  exported = dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/hf");
  ASSERT_EQ(exported.code, 0) << exported.out;
  EXPECT_NE(exported.out.find(": " + architecture + ", 2 layers, hidden 64, 4 heads, 2 key/value heads, " + shape),
            std::string::npos)
      << exported.out;
}

// The export in `hf_dir` with `from` in its config.json replaced by `to`, copied to `folder`: its
// import is one error line holding `needle`, and writes nothing.
void expect_import_refused(const std::string& hf_dir, const std::string& folder, const std::string& from,
                           const std::string& to, const std::string& needle) {
  fs::create_directories(folder);
  fs::copy_file(hf_dir + "/model.safetensors", folder + "/model.safetensors", fs::copy_options::overwrite_existing);
  std::string config = read(hf_dir + "/config.json");
  ASSERT_NE(config.find(from), std::string::npos) << from;
  config.replace(config.find(from), from.size(), to);
  write_text(folder + "/config.json", config);
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + folder + " " + folder + "_x"), needle);
  EXPECT_FALSE(fs::exists(folder + "_x"));
}

// The body of TensorParallelCheckpointRoundTrips for one model.
void expect_tensor_parallel_round_trip(const std::string& dir, const std::string& frozen) {
  ASSERT_EQ(dtk_test::run_dtk(frozen + "--set checkpoint.save=" + dir + "/tp1").code, 0);
  const dtk_test::Result tp2 = dtk_test::run_dtk("launch --nproc_per_node 2 " + frozen +
                                                 "--set distributed.tensor_model_parallel_size=2 --set checkpoint.save=" +
                                                 dir + "/tp2");
  ASSERT_EQ(tp2.code, 0) << tp2.out;
  ASSERT_TRUE(fs::exists(dir + "/tp2/iter_0000003/mp_rank_01"));
  for (const char* tp : {"tp1", "tp2"}) {
    const dtk_test::Result r = dtk_test::run_dtk("export hf " + dir + "/" + tp + " " + dir + "/hf_" + tp);
    ASSERT_EQ(r.code, 0) << r.out;
  }
  const Tensors a = read_safetensors(dir + "/hf_tp1/model.safetensors");
  const Tensors b = read_safetensors(dir + "/hf_tp2/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(at::equal(t, b.at(name))) << name;
  }
  ASSERT_EQ(dtk_test::run_dtk("import hf " + dir + "/hf_tp2 " + dir + "/imp").code, 0);
  expect_same_parameters(checkpoint_at(dir + "/tp1", "iter_0000003"), checkpoint_at(dir + "/imp", "iter_0000000"),
                         "TP2 round trip");
}

}  // namespace

// A TP2 checkpoint (lr 0: Megatron's initialisation makes it the TP1 one cut in pieces) exports
// the TP1 checkpoint's tensors, and its import is the TP1 checkpoint bit for bit; for Llama's
// layers and Qwen3's (the query/key norms replicated over the ranks, the wider heads cut by group).
TEST(HfLlama, TensorParallelCheckpointRoundTrips) {
  for (const std::string qwen3 : {"", "--set model.qk_layernorm=true --set model.kv_channels=32 "}) {
    SCOPED_TRACE(qwen3.empty() ? "llama" : "qwen3");
    const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, qwen3.empty() ? "hf_llama_tp" : "hf_qwen3_tp");
    expect_tensor_parallel_round_trip(dir, kTrain + qwen3 + "--set lr.lr=0 --set lr.min_lr=0 ");
  }
}

// Hugging Face's Qwen2 (biases on q_proj, k_proj and v_proj alone: add_qkv_bias) and Qwen3
// (q_norm and k_norm on each head before rotary, head_dim 32 over hidden 64 / 4 heads:
// qk_layernorm, kv_channels) from llama checkpoints: Hugging Face's forward on the export equals
// the plugin's, the layers' extras matter to it, and import gives back every parameter bit for bit.
TEST(HfLlama, Qwen2AndQwen3ExportMatchHuggingFacesForwardAndImportBitForBit) {
  struct Variant {
    std::string name;
    std::map<std::string, std::string> opts;
    std::string architecture, imported;
  };
  const Variant variants[] = {
      {"qwen2", {{"add_qkv_bias", "true"}}, "Qwen2ForCausalLM", "ffn 192, query/key/value biases, vocab 50257"},
      {"qwen3",
       {{"qk_layernorm", "true"}, {"kv_channels", "32"}},
       "Qwen3ForCausalLM",
       "ffn 192, heads of 32 channels, query/key norms, vocab 50257"}};
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_" + v.name);
    const std::string sets = model_sets(v.opts);
    dtk_test::Result exported;
    ASSERT_NO_FATAL_FAILURE(train_and_export(dir, sets, v.architecture, v.imported, exported));
    const std::string config = read(dir + "/hf/config.json");
    EXPECT_EQ(json_value(config, "model_type"), v.name);
    EXPECT_EQ(json_value(config, "head_dim"), v.name == "qwen3" ? "32" : "16");
    EXPECT_EQ(json_value(config, "use_sliding_window"), "false");
    const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
    const std::string attn = "model.layers.1.self_attn.";
    EXPECT_EQ(hf.count(attn + "q_proj.bias") + hf.count(attn + "k_proj.bias") + hf.count(attn + "v_proj.bias"),
              v.name == "qwen2" ? 3u : 0u);
    EXPECT_EQ(hf.count(attn + "o_proj.bias") + hf.count("model.layers.1.mlp.up_proj.bias"), 0u);
    EXPECT_EQ(hf.count(attn + "q_norm.weight") + hf.count(attn + "k_norm.weight"), v.name == "qwen3" ? 2u : 0u);
    if (v.name == "qwen3") {
      EXPECT_EQ(hf.at(attn + "q_proj.weight").sizes(), (std::vector<int64_t>{4 * 32, 64}));
      EXPECT_EQ(hf.at(attn + "k_norm.weight").sizes(), (std::vector<int64_t>{32}));
      EXPECT_EQ(hf.at(attn + "o_proj.weight").sizes(), (std::vector<int64_t>{64, 4 * 32}));
    }
    const Tensors saved = checkpoint_at(dir + "/ck", "iter_0000003");
    expect_hf_forward_matches(saved, v.opts, dir + "/hf", v.name);
    // Read as a plain Llama (no q/k/v biases, no q/k norms), the same tensors give other logits.
    std::string as_llama = config;
    as_llama.replace(as_llama.find("\"model_type\": \"" + v.name + "\""), 21, "\"model_type\": \"llama\"");
    const at::Tensor tokens = at::randint(0, kVocabSize, {1, 64}, at::kLong);
    EXPECT_GT((hf_llama_logits(hf, as_llama, tokens) - hf_llama_logits(hf, config, tokens)).abs().max().item<double>(),
              1e-4);

    expect_import_round_trip(dir, saved, v.imported, v.opts, sets, v.name);

    // What the architecture cannot hold, one line each.
    const std::string bad = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_" + v.name + "_bad");
    if (v.name == "qwen3") {
      expect_import_refused(dir + "/hf", bad + "/biased", "\"attention_bias\": false", "\"attention_bias\": true",
                            "attention_bias is true: Qwen3's biases would be on o_proj too");
      ASSERT_EQ(dtk_test::run_dtk(kTrain + sets +
                                  "--set model.add_qkv_bias=true --set train.train_iters=1 "
                                  "--set lr.lr_warmup_iters=0 --set checkpoint.save_interval=1 "
                                  "--set checkpoint.save=" +
                                  bad + "/ck")
                    .code,
                0);
      dtk_test::expect_one_line_error(
          dtk_test::run_dtk("export hf " + bad + "/ck " + bad + "/x"),
          "option 'add_qkv_bias' is true: a llama with query/key norms exports as Qwen3ForCausalLM");
    }
    EXPECT_FALSE(fs::exists(bad + "/x"));
  }
}

// A llama with experts and Qwen's attention as Qwen2MoeForCausalLM (q/k/v biases, a gated shared
// expert of inner size 128, the top-k of the softmax not renormalised, layer 0 dense) and
// Qwen3MoeForCausalLM (query/key norms, wider heads, renormalised weights, every layer sparse):
// Hugging Face's forward on the export equals the plugin's, import gives back every parameter and
// the options that build it, and what the blocks cannot hold is refused in one line.
TEST(HfLlama, QwenMoeExportMatchesHuggingFacesForwardAndImportsBitForBit) {
  struct Variant {
    std::string name;
    std::map<std::string, std::string> opts;
    std::string architecture, extras;
  };
  const std::map<std::string, std::string> experts = {
      {"num_experts", "4"}, {"moe_router_topk", "2"}, {"moe_ffn_hidden_size", "96"}};
  auto with = [&](std::map<std::string, std::string> o) {
    o.insert(experts.begin(), experts.end());
    return o;
  };
  const Variant variants[] = {
      {"qwen2_moe",
       with({{"add_qkv_bias", "true"},
             {"moe_shared_expert_intermediate_size", "128"},
             {"moe_shared_expert_gate", "true"},
             {"moe_router_pre_softmax", "true"},
             {"moe_layer_freq", "[0,1]"}}),
       "Qwen2MoeForCausalLM",
       "ffn 192, query/key/value biases, 4 experts of ffn 96 (2 per token, weights not renormalised), a gated "
       "shared expert of ffn 128, 1 dense layer, vocab 50257"},
      {"qwen3_moe", with({{"qk_layernorm", "true"}, {"kv_channels", "32"}}), "Qwen3MoeForCausalLM",
       "ffn 192, heads of 32 channels, query/key norms, 4 experts of ffn 96 (2 per token), vocab 50257"}};
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const bool qwen2 = v.name == "qwen2_moe";
    const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_" + v.name);
    const std::string sets = model_sets(v.opts);
    dtk_test::Result exported;
    ASSERT_NO_FATAL_FAILURE(train_and_export(dir, sets, v.architecture, v.extras, exported));
    const std::string config = read(dir + "/hf/config.json");
    EXPECT_EQ(json_value(config, "model_type"), v.name);
    EXPECT_EQ(json_value(config, "num_experts"), "4");
    EXPECT_EQ(json_value(config, "num_experts_per_tok"), "2");
    EXPECT_EQ(json_value(config, "moe_intermediate_size"), "96");
    EXPECT_EQ(json_value(config, "intermediate_size"), "192");
    EXPECT_EQ(json_value(config, "norm_topk_prob"), qwen2 ? "false" : "true");
    EXPECT_EQ(json_int_list(config, "mlp_only_layers"), qwen2 ? std::vector<int64_t>{0} : std::vector<int64_t>{});
    EXPECT_EQ(json_value(config, "shared_expert_intermediate_size"), qwen2 ? "128" : "");
    const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
    // embed_tokens, norm, lm_head; per layer 2 norms, attention (q, k, v, o; Qwen2's 3 biases,
    // Qwen3's 2 norms) and its MLP: dense 3, sparse a router and 4 x 3 (+ Qwen2's shared 3 + gate).
    EXPECT_EQ(hf.size(), qwen2 ? 3u + 2 * 9 + 3 + (1 + 12 + 4) : 3u + 2 * (8 + 13));
    const std::string block = "model.layers.1.mlp.";
    EXPECT_EQ(hf.at(block + "gate.weight").sizes(), (std::vector<int64_t>{4, 64}));
    EXPECT_EQ(hf.at(block + "experts.3.down_proj.weight").sizes(), (std::vector<int64_t>{64, 96}));
    if (qwen2) {
      EXPECT_EQ(hf.at("model.layers.0.mlp.gate_proj.weight").sizes(), (std::vector<int64_t>{192, 64}));
      EXPECT_EQ(hf.at(block + "shared_expert.up_proj.weight").sizes(), (std::vector<int64_t>{128, 64}));
      EXPECT_EQ(hf.at(block + "shared_expert_gate.weight").sizes(), (std::vector<int64_t>{1, 64}));
    }
    const Tensors saved = checkpoint_at(dir + "/ck", "iter_0000003");
    expect_hf_forward_matches(saved, v.opts, dir + "/hf", v.name);
    // The guard: the other norm_topk_prob gives other logits.
    std::string flipped = config;
    const std::string norm = std::string("\"norm_topk_prob\": ") + (qwen2 ? "false" : "true");
    flipped.replace(flipped.find(norm), norm.size(), std::string("\"norm_topk_prob\": ") + (qwen2 ? "true" : "false"));
    const at::Tensor tokens = at::randint(0, kVocabSize, {1, 64}, at::kLong);
    EXPECT_GT((hf_llama_logits(hf, flipped, tokens) - hf_llama_logits(hf, config, tokens)).abs().max().item<double>(),
              1e-4);

    // Back: every parameter, and the options that build the model again.
    expect_import_round_trip(dir, saved, v.extras, v.opts, sets, v.name);

    // What the blocks cannot hold, one line each.
    const std::string bad = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_" + v.name + "_bad");
    const std::string dense = qwen2 ? "\"mlp_only_layers\": [0]" : "\"mlp_only_layers\": []";
    expect_import_refused(dir + "/hf", bad + "/all-dense", dense, "\"mlp_only_layers\": [0, 1]",
                          "no layer has experts (mlp_only_layers and decoder_sparse_step)");
    expect_import_refused(dir + "/hf", bad + "/out-of-range", dense, "\"mlp_only_layers\": [2]",
                          "mlp_only_layers holds 2, not a layer number in [0, num_hidden_layers)");
    expect_import_refused(dir + "/hf", bad + "/windowed", "\"use_sliding_window\": false",
                          "\"use_sliding_window\": true",
                          "use_sliding_window is true: transformers' versions disagree on which layers of a Qwen MoE");
    if (qwen2) {
      expect_import_refused(dir + "/hf", bad + "/unshared", "\"shared_expert_intermediate_size\": 128",
                            "\"shared_expert_intermediate_size\": 0",
                            "shared_expert_intermediate_size 0: the llama model's Qwen2-MoE block has a shared expert");
      expect_import_refused(dir + "/hf", bad + "/unbiased", "\"qkv_bias\": true", "\"qkv_bias\": false",
                            "qkv_bias is false: the llama model's Qwen2-MoE block comes with q/k/v biases");
    } else {
      // transformers 5's Qwen3MoeConfig may save the expert count under its attribute_map's name.
      std::string local = config;
      local.replace(local.find("\"num_experts\": 4"), 16, "\"num_local_experts\": 4");
      fs::create_directories(bad + "/local");
      fs::copy_file(dir + "/hf/model.safetensors", bad + "/local/model.safetensors");
      write_text(bad + "/local/config.json", local);
      const dtk_test::Result r = dtk_test::run_dtk("import hf " + bad + "/local " + bad + "/local-imp");
      EXPECT_EQ(r.code, 0) << r.out;
      EXPECT_NE(r.out.find("4 experts of ffn 96 (2 per token)"), std::string::npos) << r.out;
    }
    if (!qwen2)
      expect_import_refused(dir + "/hf", bad + "/one", "\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 1",
                            "num_experts_per_tok 1 with norm_topk_prob: the one weight is always 1");
    EXPECT_FALSE(fs::exists(bad + "/x"));
  }
}

// A llama with a sliding window in every layer (window_size 5,0: each token sees itself and the 5
// before it) as MistralForCausalLM (sliding_window 6): Hugging Face's forward on the export equals
// the plugin's (and without the window it would not), import gives back every parameter and the
// window, and a window Mistral cannot hold is refused at export.
TEST(HfLlama, MistralExportHoldsTheSlidingWindowAndImportsBitForBit) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_mistral");
  const std::string window = "--set model.window_size=5,0 ";
  ASSERT_EQ(dtk_test::run_dtk(kTrain + window + "--set checkpoint.save=" + dir + "/ck").code, 0);
  const dtk_test::Result exported = dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/hf");
  ASSERT_EQ(exported.code, 0) << exported.out;
  EXPECT_NE(exported.out.find(": MistralForCausalLM, 2 layers, hidden 64, 4 heads, 2 key/value heads, ffn 192, a "
                              "sliding window of 5 earlier tokens, vocab 50257"),
            std::string::npos)
      << exported.out;
  const std::string config = read(dir + "/hf/config.json");
  EXPECT_EQ(json_value(config, "model_type"), "mistral");
  EXPECT_EQ(json_value(config, "sliding_window"), "6");
  const Tensors saved = checkpoint_at(dir + "/ck", "iter_0000003");
  expect_hf_forward_matches(saved, {{"window_size", "5,0"}}, dir + "/hf", "mistral");
  std::string unwindowed = config;
  unwindowed.replace(unwindowed.find("\"sliding_window\": 6"), 19, "\"sliding_window\": null");
  const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
  const at::Tensor tokens = at::randint(0, kVocabSize, {1, 64}, at::kLong);
  EXPECT_GT((hf_llama_logits(hf, unwindowed, tokens) - hf_llama_logits(hf, config, tokens)).abs().max().item<double>(),
            1e-4);

  expect_import_round_trip(dir, saved, "ffn 192, a sliding window of 5 earlier tokens, vocab 50257",
                           {{"window_size", "5,0"}}, window, "mistral");
  // MistralConfig's default window (4096) where the key is left out: longer than 64 positions, none.
  std::string defaults = config;
  defaults.replace(defaults.find("\"sliding_window\": 6,"), 21, "");
  defaults.replace(defaults.find("\"max_position_embeddings\": 64"), 29, "\"max_position_embeddings\": 8192");
  fs::create_directories(dir + "/defaults");
  fs::copy_file(dir + "/hf/model.safetensors", dir + "/defaults/model.safetensors");
  write_text(dir + "/defaults/config.json", defaults);
  const dtk_test::Result default_import = dtk_test::run_dtk("import hf " + dir + "/defaults " + dir + "/defaults-imp");
  ASSERT_EQ(default_import.code, 0) << default_import.out;
  EXPECT_NE(default_import.out.find("--set model.window_size=4095,0"), std::string::npos) << default_import.out;

  // Windows Mistral cannot hold, one line each at export.
  const std::pair<std::string, std::string> refused[] = {
      {"--set model.window_attn_skip_freq=2 ",
       "option 'window_attn_skip_freq' is 2: a llama with a sliding window exports as MistralForCausalLM or "
       "MixtralForCausalLM, whose window is in every layer"},
      {"--set model.qk_layernorm=true --set model.num_experts=4 --set model.moe_router_topk=2 ",
       "option 'window_size' is 5,0: a llama with a sliding window exports as Qwen3MoeForCausalLM, whose windowed "
       "layers transformers' versions disagree on"},
  };
  for (const auto& [sets, needle] : refused) {
    const std::string bad = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_mistral_bad");
    ASSERT_EQ(dtk_test::run_dtk(kTrain + window + sets +
                                "--set train.train_iters=1 --set lr.lr_warmup_iters=0 --set checkpoint.save_interval=1 "
                                "--set checkpoint.save=" +
                                bad + "/ck")
                  .code,
              0);
    dtk_test::expect_one_line_error(dtk_test::run_dtk("export hf " + bad + "/ck " + bad + "/x"), needle);
    EXPECT_FALSE(fs::exists(bad + "/x"));
  }
}

// Qwen2's and Qwen3's sliding window (use_sliding_window, sliding_window, max_window_layers): a
// qwen2-shaped llama windowed in its last layer only (window_size 5,0 with window_attn_skip_freq
// [0,1]) exports as Qwen2ForCausalLM with max_window_layers 1, a qwen3-shaped one windowed in every
// layer with max_window_layers 0. Hugging Face's forward on each equals the plugin's (and the
// window and the layers it covers matter to it); import gives back every parameter and both
// options, reads layer_types where config.json has it and Qwen2Config's defaults where it has
// neither, and refuses what it cannot read in one line.
TEST(HfLlama, QwenExportHoldsTheSlidingWindowAndImportsBitForBit) {
  struct Variant {
    std::string name;
    std::map<std::string, std::string> opts;
    std::string architecture, printed, first_windowed;
  };
  const Variant variants[] = {
      {"qwen2",
       {{"add_qkv_bias", "true"}, {"window_size", "5,0"}, {"window_attn_skip_freq", "[0,1]"}},
       "Qwen2ForCausalLM",
       "ffn 192, query/key/value biases, a sliding window of 5 earlier tokens in 1 of 2 layers, vocab 50257",
       "1"},
      {"qwen3",
       {{"qk_layernorm", "true"}, {"kv_channels", "32"}, {"window_size", "5,0"}},
       "Qwen3ForCausalLM",
       "ffn 192, heads of 32 channels, query/key norms, a sliding window of 5 earlier tokens, vocab 50257",
       "0"}};
  const at::Tensor tokens = at::randint(0, kVocabSize, {1, 64}, at::kLong);
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_" + v.name + "_window");
    const std::string sets = model_sets(v.opts);
    dtk_test::Result exported;
    ASSERT_NO_FATAL_FAILURE(train_and_export(dir, sets, v.architecture, v.printed, exported));
    EXPECT_NE(exported.out.find("note: transformers 4.53 and later window Qwen's layers as this config says"),
              std::string::npos)
        << exported.out;
    const std::string config = read(dir + "/hf/config.json");
    EXPECT_EQ(json_value(config, "use_sliding_window"), "true");
    EXPECT_EQ(json_value(config, "sliding_window"), "6");
    EXPECT_EQ(json_value(config, "max_window_layers"), v.first_windowed);
    const Tensors saved = checkpoint_at(dir + "/ck", "iter_0000003");
    expect_hf_forward_matches(saved, v.opts, dir + "/hf", v.name);
    // Without the window, and (qwen2) with layer 0 windowed too, Hugging Face's logits differ.
    const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
    const at::Tensor theirs = hf_llama_logits(hf, config, tokens);
    std::string unwindowed = config;
    unwindowed.replace(unwindowed.find("\"use_sliding_window\": true"), 26, "\"use_sliding_window\": false");
    EXPECT_GT((hf_llama_logits(hf, unwindowed, tokens) - theirs).abs().max().item<double>(), 1e-4);
    if (v.name == "qwen2") {
      std::string all = config;
      all.replace(all.find("\"max_window_layers\": 1"), 22, "\"max_window_layers\": 0");
      EXPECT_GT((hf_llama_logits(hf, all, tokens) - theirs).abs().max().item<double>(), 1e-4);
    }
    expect_import_round_trip(dir, saved, v.printed, v.opts, sets, v.name);
    if (v.name != "qwen2") continue;

    // layer_types, where given, says which layers are windowed (here the first, not the last):
    // Hugging Face's forward on it equals the plugin's with window_attn_skip_freq [1,0].
    auto with_config = [&](const std::string& name, const std::string& from, const std::string& to) {
      std::string edited = config;
      edited.replace(edited.find(from), from.size(), to);
      fs::create_directories(dir + "/" + name);
      fs::copy_file(dir + "/hf/model.safetensors", dir + "/" + name + "/model.safetensors");
      write_text(dir + "/" + name + "/config.json", edited);
      return dtk_test::run_dtk("import hf " + dir + "/" + name + " " + dir + "/" + name + "-imp");
    };
    const std::string types = "\"layer_types\": [\"sliding_attention\", \"full_attention\"], \"max_window_layers\": 1";
    const dtk_test::Result typed = with_config("typed", "\"max_window_layers\": 1", types);
    ASSERT_EQ(typed.code, 0) << typed.out;
    EXPECT_NE(typed.out.find("--set 'model.window_attn_skip_freq=[1,0]'"), std::string::npos) << typed.out;
    std::map<std::string, std::string> first = v.opts;
    first["window_attn_skip_freq"] = "[1,0]";
    expect_hf_forward_matches(saved, first, dir + "/typed", "qwen2 layer_types");
    // Qwen2Config's max_window_layers 28 where the key is left out: no layer of two is windowed.
    const dtk_test::Result defaults = with_config("defaults", "\"max_window_layers\": 1,", "");
    ASSERT_EQ(defaults.code, 0) << defaults.out;
    EXPECT_EQ(defaults.out.find("model.window_size"), std::string::npos) << defaults.out;
    EXPECT_EQ(defaults.out.find("sliding window"), std::string::npos) << defaults.out;
    // What Qwen's config cannot say, one line each.
    const std::string bad = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_qwen2_window_bad");
    expect_import_refused(dir + "/hf", bad + "/types", "\"max_window_layers\": 1",
                          "\"layer_types\": [\"sliding_attention\", \"chunked_attention\"]",
                          "layer_types holds \"chunked_attention\", not \"full_attention\" or \"sliding_attention\"");
    expect_import_refused(dir + "/hf", bad + "/short", "\"max_window_layers\": 1",
                          "\"layer_types\": [\"full_attention\"]",
                          "'layer_types' is not a list of num_hidden_layers (2) attention types");
    expect_import_refused(dir + "/hf", bad + "/windowless", "\"use_sliding_window\": true",
                          "\"use_sliding_window\": false, \"layer_types\": [\"full_attention\", \"sliding_attention\"]",
                          "layer_types has sliding_attention layers but there is no window");
    expect_import_refused(dir + "/hf", bad + "/zero", "\"sliding_window\": 6", "\"sliding_window\": 0",
                          "sliding_window 0 must be at least 1 (the token itself)");
  }
}

// Where a config cannot hold a llama's window, export refuses naming the option: Qwen's layers keep
// full attention first and are windowed after max_window_layers, Mistral's and Mixtral's window is in
// every layer, and transformers' versions disagree on which layers of a Qwen MoE model are windowed.
TEST(HfLlama, SlidingWindowExportRefusesWhatTheConfigCannotHold) {
  auto shape = [](std::map<std::string, std::string> extra) {
    std::map<std::string, std::string> o = tiny_llama_options();
    o["window_size"] = "5,0";
    for (const auto& [k, v] : extra) o[k] = v;
    return dtk::core::llama_shape(o, 64);
  };
  const dtk::core::LlamaShape last = shape({{"add_qkv_bias", "true"}, {"window_attn_skip_freq", "[0,1]"}});
  EXPECT_EQ(last.architecture(), "Qwen2ForCausalLM");
  EXPECT_EQ(last.window, 5);
  EXPECT_EQ(last.full_attention_layers(), 1);
  EXPECT_FALSE(last.windowed(0));
  EXPECT_TRUE(last.windowed(1));
  const dtk::core::LlamaShape four =
      shape({{"qk_layernorm", "true"}, {"num_layers", "4"}, {"window_attn_skip_freq", "[0]*2+[1]*2"}});
  EXPECT_EQ(four.full_attention_layers(), 2);
  EXPECT_EQ(shape({{"qk_layernorm", "true"}}).full_attention_layers(), 0);
  const dtk::core::LlamaShape three =
      shape({{"add_qkv_bias", "true"}, {"num_layers", "3"}, {"window_attn_skip_freq", "[0,1,1]"}});
  EXPECT_EQ(three.full_attention_layers(), 1);
  EXPECT_TRUE(three.windowed(1) && three.windowed(2));
  // window_attn_skip_freq 1 keeps full attention in every layer: no window, a plain Llama.
  const dtk::core::LlamaShape none = shape({{"window_attn_skip_freq", "1"}});
  EXPECT_EQ(none.window, -1);
  EXPECT_EQ(none.architecture(), "LlamaForCausalLM");
  EXPECT_EQ(none.full_attention_layers(), 2);
  struct Refusal {
    std::map<std::string, std::string> extra;
    std::string line;
  };
  const Refusal refused[] = {
      {{{"add_qkv_bias", "true"}, {"window_attn_skip_freq", "2"}},
       "option 'window_attn_skip_freq' is 2: a llama with a sliding window exports as Qwen2ForCausalLM, whose "
       "layers keep full attention up to max_window_layers and are windowed after it (layer 1 would keep full "
       "attention after windowed layer 0)"},
      {{{"window_attn_skip_freq", "[0,1]"}},
       "option 'window_attn_skip_freq' is [0,1]: a llama with a sliding window exports as MistralForCausalLM or "
       "MixtralForCausalLM, whose window is in every layer"},
      {{{"qk_layernorm", "true"}, {"num_layers", "3"}, {"window_attn_skip_freq", "[0,1,0]"}},
       "option 'window_attn_skip_freq' is [0,1,0]: a llama with a sliding window exports as Qwen3ForCausalLM, whose "
       "layers keep full attention up to max_window_layers and are windowed after it (layer 2 would keep full "
       "attention after windowed layer 1)"},
      // Patterns the plugin refuses at training (an edited checkpoint's): one line, no crash.
      {{{"window_attn_skip_freq", "0"}},
       "option 'window_attn_skip_freq' is 0: not an integer >= 1 nor one 0/1 per "
       "layer of the 2"},
      {{{"window_attn_skip_freq", "[1,1,0]"}}, "option 'window_attn_skip_freq' is [1,1,0]: not an integer >= 1"},
      {{{"window_attn_skip_freq", "[1,"}}, "option 'window_attn_skip_freq' is [1,: "},
      {{{"add_bias_linear", "true"}},
       "option 'add_bias_linear' is true: a llama with a sliding window exports as MistralForCausalLM or "
       "MixtralForCausalLM, whose projections have no biases"},
      {{{"add_qkv_bias", "true"},
        {"num_experts", "4"},
        {"moe_router_topk", "2"},
        {"moe_shared_expert_intermediate_size", "128"},
        {"moe_shared_expert_gate", "true"}},
       "option 'window_size' is 5,0: a llama with a sliding window exports as Qwen2MoeForCausalLM, whose windowed "
       "layers transformers' versions disagree on"},
  };
  for (const Refusal& r : refused) {
    try {
      shape(r.extra);
      ADD_FAILURE() << r.line << ": exported";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(r.line), std::string::npos) << e.what();
    }
  }
}

// What Qwen's sparse blocks are not is refused at export, naming the option; Mixtral's refusals
// are MixtralExportRefusesWhatItsBlockIsNot's.
TEST(HfLlama, QwenMoeExportRefusesWhatItsBlockIsNot) {
  std::map<std::string, std::string> base = tiny_llama_options();
  base.insert({{"num_experts", "4"},
               {"moe_router_topk", "2"},
               {"moe_ffn_hidden_size", "96"},
               {"moe_shared_expert_intermediate_size", "0"},
               {"moe_shared_expert_gate", "false"}});
  std::map<std::string, std::string> qwen2 = base, qwen3 = base;
  qwen2["add_qkv_bias"] = "true", qwen2["moe_shared_expert_intermediate_size"] = "128";
  qwen2["moe_shared_expert_gate"] = "true", qwen2["moe_router_pre_softmax"] = "true";
  qwen3["qk_layernorm"] = "true", qwen3["moe_layer_freq"] = "[0,1]";
  const dtk::core::LlamaShape two = dtk::core::llama_shape(qwen2, 64), three = dtk::core::llama_shape(qwen3, 64);
  EXPECT_EQ(two.model_type(), "qwen2_moe");
  EXPECT_EQ(two.ffn, 192);
  EXPECT_EQ(two.moe_ffn, 96);
  EXPECT_EQ(two.shared_ffn, 128);
  EXPECT_TRUE(two.shared_gate && two.pre_softmax);
  EXPECT_EQ(three.architecture(), "Qwen3MoeForCausalLM");
  struct Refusal {
    const std::map<std::string, std::string>* base;
    const char *option, *value, *why;
  };
  const Refusal refused[] = {
      {&qwen2, "moe_shared_expert_intermediate_size", "0",
       "exports as Qwen2MoeForCausalLM, whose every sparse block has a shared expert"},
      {&qwen2, "moe_shared_expert_gate", "false",
       "exports as Qwen2MoeForCausalLM, whose shared expert's output is gated by sigmoid(x g)"},
      {&qwen3, "moe_shared_expert_intermediate_size", "64",
       "exports as Qwen3MoeForCausalLM, which has no shared expert"},
      {&qwen3, "moe_router_score_function", "sigmoid", "exports as Qwen3MoeForCausalLM, whose router is a softmax"},
      {&qwen2, "moe_router_topk_scaling_factor", "2.5",
       "exports as Qwen2MoeForCausalLM, whose top-k weights are not scaled"},
  };
  for (const Refusal& r : refused) {
    std::map<std::string, std::string> o = *r.base;
    o[r.option] = r.value;
    try {
      dtk::core::llama_shape(o, 64);
      ADD_FAILURE() << r.option << "=" << r.value << " exported";
    } catch (const std::exception& e) {
      const std::string line = e.what();
      EXPECT_NE(line.find(std::string("option '") + r.option + "' is " + r.value + ": a llama with experts and "),
                std::string::npos)
          << line;
      EXPECT_NE(line.find(r.why), std::string::npos) << line;
    }
  }
}

// Hugging Face's sharded layout (model.safetensors.index.json and its shards) imports as the
// single file does; bad folders are one error line naming what is wrong.
TEST(HfLlama, ShardedIndexImportsAndBadFoldersAreOneLine) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_llama_shards");
  ASSERT_EQ(dtk_test::run_dtk(kTrain + "--set train.train_iters=1 --set lr.lr_warmup_iters=0 --set checkpoint.save_interval=1 "
                                       "--set checkpoint.save=" + dir + "/ck").code, 0);
  ASSERT_EQ(dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/hf").code, 0);
  const std::string config = read(dir + "/hf/config.json");
  const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
  // Two shards: layer 0 and the embedding in one, the rest in the other.
  auto shard_folder = [&](const std::string& name, const std::string& cfg, const Tensors& tensors,
                          const std::string& odd_name = "", const std::string& odd_dtype = "") {
    const std::string d = dir + "/" + name;
    fs::create_directories(d);
    write_text(d + "/config.json", cfg);
    Tensors first, second;
    std::string map;
    for (const auto& [n, t] : tensors) {
      const bool one = n.find("layers.0.") != std::string::npos || n == "model.embed_tokens.weight";
      (one ? first : second)[n] = t;
      map += (map.empty() ? "" : ",\n    ") + std::string("\"") + n + "\": \"model-0000" + (one ? "1" : "2") +
             "-of-00002.safetensors\"";
    }
    write_safetensors(d + "/model-00001-of-00002.safetensors", first, odd_name, odd_dtype);
    write_safetensors(d + "/model-00002-of-00002.safetensors", second, odd_name, odd_dtype);
    write_text(d + "/model.safetensors.index.json", "{\n  \"metadata\": {},\n  \"weight_map\": {\n    " + map + "\n  }\n}\n");
    return d;
  };
  const std::string sharded = shard_folder("sharded", config, hf);
  const dtk_test::Result r = dtk_test::run_dtk("import hf " + sharded + " " + dir + "/imp_sharded");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_parameters(checkpoint_at(dir + "/ck", "iter_0000001"), checkpoint_at(dir + "/imp_sharded", "iter_0000000"),
                         "sharded import");

  Tensors missing = hf;
  missing.erase("model.norm.weight");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + shard_folder("missing", config, missing) + " " + dir + "/x"),
                                  "has no tensor 'model.norm.weight'");
  Tensors wrong = hf;
  wrong["model.layers.1.mlp.up_proj.weight"] = at::zeros({191, 64});
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + shard_folder("wrong", config, wrong) + " " + dir + "/x"),
                                  "tensor 'model.layers.1.mlp.up_proj.weight' is [191, 64], config.json says [192, 64]");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk("import hf " + shard_folder("dtype", config, hf, "model.norm.weight", "I8") + " " + dir + "/x"),
      "tensor 'model.norm.weight' has dtype I8");
  Tensors nan = hf;
  nan["model.layers.0.input_layernorm.weight"] = hf.at("model.layers.0.input_layernorm.weight").clone();
  nan["model.layers.0.input_layernorm.weight"][3] = std::nan("");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + shard_folder("nan", config, nan) + " " + dir + "/x"),
                                  "tensor 'model.layers.0.input_layernorm.weight' holds 1 NaN or infinite value(s)");
  std::string gemma = config;
  gemma.replace(gemma.find("\"model_type\": \"llama\""), 21, "\"model_type\": \"gemma\"");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk("import hf " + shard_folder("gemma", gemma, hf) + " " + dir + "/x"),
      "model_type 'gemma' (dtk imports gpt2 into the gpt model and llama, mistral, mixtral, qwen2, qwen3, "
      "qwen2_moe and qwen3_moe into the llama model)");
  std::string partial = config;
  partial.replace(partial.find("\"rope_scaling\": null"), 20, "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + shard_folder("yarn", partial, hf) + " " + dir + "/x"),
                                  "rope_scaling type 'yarn'");
  EXPECT_FALSE(fs::exists(dir + "/x"));

  // What LlamaForCausalLM cannot hold is refused at export, naming the option.
  ASSERT_EQ(dtk_test::run_dtk(kTrain + "--set train.train_iters=1 --set lr.lr_warmup_iters=0 --set checkpoint.save_interval=1 "
                                       "--set model.rotary_percent=0.5 --set checkpoint.save=" + dir + "/half").code, 0);
  dtk_test::expect_one_line_error(dtk_test::run_dtk("export hf " + dir + "/half " + dir + "/x"),
                                  "option 'rotary_percent' is 0.5");
}

// A llama with experts as MixtralForCausalLM: 4 experts of inner size 96, 2 per token, in both
// layers. Hugging Face's forward on the export equals the plugin's, import gives back every
// parameter, and what the other side cannot hold is refused in one line.
TEST(HfLlama, MixtralExportMatchesHuggingFacesForwardAndImportsBitForBit) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_mixtral");
  const std::string moe =
      "--set model.num_experts=4 --set model.moe_router_topk=2 --set model.moe_ffn_hidden_size=96 "
      "--set model.moe_aux_loss_coeff=0.01 ";
  const dtk_test::Result trained = dtk_test::run_dtk(kTrain + moe + "--set checkpoint.save=" + dir + "/ck");
  ASSERT_EQ(trained.code, 0) << trained.out;
  const dtk_test::Result exported = dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/hf");
  ASSERT_EQ(exported.code, 0) << exported.out;
  EXPECT_NE(exported.out.find("/hf: MixtralForCausalLM, 2 layers, hidden 64, 4 heads, 2 key/value heads, ffn 96, 4 "
                              "experts (2 per token), vocab 50257"),
            std::string::npos)
      << exported.out;
  const std::string config = read(dir + "/hf/config.json");
  EXPECT_EQ(json_value(config, "model_type"), "mixtral");
  EXPECT_EQ(json_value(config, "num_local_experts"), "4");
  EXPECT_EQ(json_value(config, "num_experts_per_tok"), "2");
  EXPECT_EQ(json_value(config, "intermediate_size"), "96");
  EXPECT_EQ(json_value(config, "sliding_window"), "null");
  const Tensors hf = read_safetensors(dir + "/hf/model.safetensors");
  EXPECT_EQ(hf.size(), 1u + 2 * (7 + 4 * 3) + 2);  // embed_tokens; norms, attention, router, experts; norm, lm_head
  EXPECT_EQ(hf.at("model.layers.1.block_sparse_moe.gate.weight").sizes(), (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(hf.at("model.layers.1.block_sparse_moe.experts.3.w2.weight").sizes(), (std::vector<int64_t>{64, 96}));

  const Tensors saved = checkpoint_at(dir + "/ck", "iter_0000003");
  expect_hf_forward_matches(saved, {{"num_experts", "4"}, {"moe_router_topk", "2"}, {"moe_ffn_hidden_size", "96"}},
                            dir + "/hf", "mixtral");
  // The guard: the experts' gate (w1) and up (w3) projections swapped change the logits.
  Tensors swapped = hf;
  for (int64_t e = 0; e < 4; ++e) {
    const std::string E = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    std::swap(swapped[E + "w1.weight"], swapped[E + "w3.weight"]);
  }
  const at::Tensor tokens = at::randint(0, kVocabSize, {1, 16}, at::kLong);
  EXPECT_GT((hf_llama_logits(swapped, config, tokens) - hf_llama_logits(hf, config, tokens)).abs().max().item<double>(),
            1e-4);

  // Back: every parameter as it was, and the run fine-tunes from it with the options it prints.
  const dtk_test::Result imported = dtk_test::run_dtk("import hf " + dir + "/hf " + dir + "/imp");
  ASSERT_EQ(imported.code, 0) << imported.out;
  EXPECT_NE(imported.out.find("ffn 96, 4 experts (2 per token), vocab 50257"), std::string::npos) << imported.out;
  EXPECT_NE(imported.out.find("--set model.num_experts=4"), std::string::npos) << imported.out;
  EXPECT_NE(imported.out.find("--set model.moe_router_topk=2"), std::string::npos) << imported.out;
  expect_same_parameters(saved, checkpoint_at(dir + "/imp", "iter_0000000"), "mixtral round trip");
  const dtk_test::Result tuned =
      dtk_test::run_dtk(kTrain +
                        "--set model.num_experts=4 --set model.moe_router_topk=2 --set model.ffn_hidden_size=96 "
                        "--set checkpoint.load=" +
                        dir +
                        "/imp --set checkpoint.finetune=true --set train.train_iters=1 "
                        "--set lr.lr_warmup_iters=0 --set checkpoint.save=" +
                        dir + "/tuned");
  EXPECT_EQ(tuned.code, 0) << tuned.out;

  const auto import_with = [&](const std::string& name, const std::string& cfg) {
    const std::string d = dir + "/" + name;
    fs::create_directories(d);
    fs::copy_file(dir + "/hf/model.safetensors", d + "/model.safetensors");
    write_text(d + "/config.json", cfg);
    return dtk_test::run_dtk("import hf " + d + " " + d + "-imp");
  };
  // A sliding window shorter than the positions is the llama model's window_size (each token sees
  // the 16 up to itself: 15 before it); one of 0 tokens is refused.
  std::string windowed = config;
  windowed.replace(windowed.find("\"sliding_window\": null"), 22, "\"sliding_window\": 16");
  const dtk_test::Result windowed_import = import_with("windowed", windowed);
  ASSERT_EQ(windowed_import.code, 0) << windowed_import.out;
  EXPECT_NE(windowed_import.out.find("--set model.window_size=15,0"), std::string::npos) << windowed_import.out;
  expect_import_refused(dir + "/hf", dir + "/unwindowed", "\"sliding_window\": null", "\"sliding_window\": 0",
                        "sliding_window 0 must be at least 1 (the token itself)");
  // transformers jitters the experts' input too; the llama model's jitter is the router's alone.
  expect_import_refused(dir + "/hf", dir + "/jittered", "\"output_router_logits\": false",
                        "\"output_router_logits\": false, \"router_jitter_noise\": 0.01",
                        "router_jitter_noise is not 0: transformers multiplies the experts' input by the noise too");
  // transformers 5's rope_parameters carry the theta; keys left out are MixtralConfig's defaults.
  std::string v5 = config;
  v5.replace(v5.find("\"rope_theta\": 10000"), 19,
             "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500}");
  const dtk_test::Result v5_import = import_with("v5", v5);
  ASSERT_EQ(v5_import.code, 0) << v5_import.out;
  EXPECT_NE(v5_import.out.find("rope theta 500"), std::string::npos) << v5_import.out;
  std::string defaults = config;
  defaults.replace(defaults.find("\"rope_theta\": 10000,"), 20, "");
  defaults.replace(defaults.find("\"rms_norm_eps\": 1e-05,"), 22, "");
  const dtk_test::Result default_import = import_with("defaults", defaults);
  ASSERT_EQ(default_import.code, 0) << default_import.out;
  EXPECT_NE(default_import.out.find("rope theta 1e+06"), std::string::npos) << default_import.out;
  EXPECT_NE(default_import.out.find("--set model.layernorm_epsilon=1e-05"), std::string::npos) << default_import.out;

  // A model trained dropping tokens exports, saying that Hugging Face routes every token.
  ASSERT_EQ(dtk_test::run_dtk(kTrain + moe +
                              "--set model.moe_expert_capacity_factor=1.5 --set train.train_iters=1 "
                              "--set lr.lr_warmup_iters=0 --set checkpoint.save_interval=1 --set checkpoint.save=" +
                              dir + "/dropping")
                .code,
            0);
  const dtk_test::Result dropping = dtk_test::run_dtk("export hf " + dir + "/dropping " + dir + "/dropping-hf");
  ASSERT_EQ(dropping.code, 0) << dropping.out;
  EXPECT_NE(dropping.out.find("trained dropping tokens over its experts' capacity (moe_expert_capacity_factor 1.5); "
                              "Hugging Face's MixtralForCausalLM routes every token (dropless)"),
            std::string::npos)
      << dropping.out;
}

// What Mixtral's sparse block is not is refused at export, naming the option (any spelling of
// true the options layer reads); an older checkpoint without the MoE options is dense.
TEST(HfLlama, MixtralExportRefusesWhatItsBlockIsNot) {
  std::map<std::string, std::string> base = tiny_llama_options();
  base.insert({{"num_experts", "4"}, {"moe_router_topk", "2"}, {"moe_ffn_hidden_size", "96"}});
  const dtk::core::LlamaShape shape = dtk::core::llama_shape(base, 64);
  EXPECT_EQ(shape.experts, 4);
  EXPECT_EQ(shape.topk, 2);
  EXPECT_EQ(shape.ffn, 96);
  std::map<std::string, std::string> dense = base;
  dense.erase("num_experts");
  EXPECT_FALSE(dtk::core::llama_shape(dense, 64).has_experts());
  const std::pair<std::pair<const char*, const char*>, const char*> refused[] = {
      {{"moe_layer_freq", "2"}, "whose every layer is a sparse block"},
      {{"moe_router_score_function", "sigmoid"}, "whose router is a softmax"},
      {{"moe_router_score_function", "sqrtsoftplus"}, "whose router is a softmax"},
      {{"moe_router_pre_softmax", "1"}, "whose top-k weights are renormalised"},
      {{"moe_router_pre_softmax", "True"}, "whose top-k weights are renormalised"},
      {{"moe_router_num_groups", "2"}, "whose routing is not group-limited"},
      {{"moe_router_topk_scaling_factor", "2.5"}, "whose top-k weights are not scaled"},
      {{"moe_shared_expert_intermediate_size", "64"}, "which has no shared expert"},
      {{"moe_router_enable_expert_bias", "true"}, "whose router has no expert bias"},
      {{"moe_router_load_balancing_type", "sinkhorn"}, "whose router takes the top-k of its softmax (no sinkhorn"},
      {{"moe_router_load_balancing_type", "quantile_balancing"},
       "whose router takes the top-k of its softmax (no quantile_balancing choice)"},
      {{"add_bias_linear", "1"}, "which has no biases"},
      {{"rope_scaling", "llama3"}, "whose rotary embedding is read without rope_scaling"},
  };
  for (const auto& [option, why] : refused) {
    std::map<std::string, std::string> o = base;
    o[option.first] = option.second;
    try {
      dtk::core::llama_shape(o, 64);
      ADD_FAILURE() << option.first << "=" << option.second << " exported";
    } catch (const std::exception& e) {
      const std::string line = e.what();
      EXPECT_NE(line.find(std::string("option '") + option.first + "' is " + option.second +
                          ": a llama with experts exports as MixtralForCausalLM, " + why),
                std::string::npos)
          << line;
    }
  }
  // DeepSpeed's gate: top-2 renormalises over its two as Mixtral does; top-1 weighs its expert by
  // the softmax over all experts, which Mixtral's block does not.
  std::map<std::string, std::string> deepspeed = base;
  deepspeed["moe_gate"] = "deepspeed";
  EXPECT_FALSE(dtk::core::llama_shape(deepspeed, 64).pre_softmax);
  deepspeed["moe_residual"] = "true";
  EXPECT_THROW(dtk::core::llama_shape(deepspeed, 64), std::exception);
  deepspeed.erase("moe_residual");
  deepspeed["moe_layer_num_experts"] = "";  // (what a checkpoint without a pyramid records)
  EXPECT_NO_THROW(dtk::core::llama_shape(deepspeed, 64));
  deepspeed["moe_layer_num_experts"] = deepspeed["num_experts"] + "," + deepspeed["num_experts"];  // equal counts
  EXPECT_NO_THROW(dtk::core::llama_shape(deepspeed, 64));
  deepspeed["moe_layer_num_experts"] = "2,4";
  try {
    dtk::core::llama_shape(deepspeed, 64);
    ADD_FAILURE() << "a pyramid MoE exported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("option 'moe_layer_num_experts' is 2,4: a llama with experts exports as "
                                         "MixtralForCausalLM, whose sparse blocks all have num_experts experts"),
              std::string::npos)
        << e.what();
  }
  deepspeed.erase("moe_layer_num_experts");
  deepspeed["moe_router_topk"] = "1";
  try {
    dtk::core::llama_shape(deepspeed, 64);
    ADD_FAILURE() << "DeepSpeed's top-1 exported as Mixtral";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("option 'moe_gate' is deepspeed: a llama with experts exports as "
                                         "MixtralForCausalLM, whose top-k weights are renormalised"),
              std::string::npos)
        << e.what();
  }
}
