// A llama-model checkpoint as a Hugging Face LlamaForCausalLM folder, and back: see
// dtk/core/export/hf_llama.hpp.
#include "dtk/core/export/hf_llama.hpp"

#include <nlohmann/json.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <vector>

#include "dtk/comma_list.hpp"
#include "dtk/core/checkpoint/checkpoint_convert.hpp"
#include "dtk/host/error.hpp"
#include "dtk/layers/layer_pattern.hpp"
#include "hf_common.hpp"

namespace dtk::core {

namespace fs = std::filesystem;
using host::HostError;

namespace {

const std::string& option(const std::map<std::string, std::string>& o, const char* name) {
  auto it = o.find(name);
  if (it == o.end()) throw HostError(std::string("export hf: the llama model has no option '") + name + "'");
  return it->second;
}
int64_t option_int(const std::map<std::string, std::string>& o, const char* name) { return std::stoll(option(o, name)); }
double option_float(const std::map<std::string, std::string>& o, const char* name) { return std::stod(option(o, name)); }

// An option of a checkpoint that may predate it (`fallback` then).
std::string option_or(const std::map<std::string, std::string>& o, const char* name, const char* fallback) {
  auto it = o.find(name);
  return it == o.end() ? fallback : it->second;
}

// Megatron's per-layer list of 0 and 1 ("[1,0,1]", the llama model's moe_layer_freq and
// window_attn_skip_freq): 1 where `on(layer)`.
template <typename On>
std::string layer_list(int64_t layers, On on) {
  std::string list;
  for (int64_t l = 0; l < layers; ++l) list += std::string(l ? "," : "") + (on(l) ? "1" : "0");
  return "[" + list + "]";
}

// The experts of a llama with MoE layers, when the sparse block its attention's architecture
// exports as (Mixtral's, Qwen2-MoE's or Qwen3-MoE's: LlamaShape::architecture) can hold them;
// refuses, naming the option, what it cannot.
void read_experts(const std::map<std::string, std::string>& o, LlamaShape& s) {
  s.experts = option_int(o, "num_experts");  // (architecture() names the block from here on)
  const std::string arch = s.architecture();
  auto refuse = [&](const char* name, const std::string& why) {
    throw HostError(std::string("export hf: option '") + name + "' is " + option_or(o, name, "") +
                    ": a llama with experts" +
                    (s.qk_norm                      ? " and query/key norms"
                     : arch == "MixtralForCausalLM" ? ""
                                                    : " and query/key/value biases") +
                    " exports as " + arch + ", " + why);
  };
  const auto nonzero = [&](const char* name) { return std::stod(option_or(o, name, "0")) != 0.0; };
  const auto on = [&](const char* name) { return hf::option_true(option_or(o, name, "false")); };
  if (option_or(o, "moe_router_score_function", "softmax") != "softmax")
    refuse("moe_router_score_function", "whose router is a softmax");
  if (nonzero("moe_router_num_groups")) refuse("moe_router_num_groups", "whose routing is not group-limited");
  if (nonzero("moe_router_topk_scaling_factor"))
    refuse("moe_router_topk_scaling_factor", "whose top-k weights are not scaled");
  if (on("moe_router_enable_expert_bias")) refuse("moe_router_enable_expert_bias", "whose router has no expert bias");
  if (const std::string type = option_or(o, "moe_router_load_balancing_type", "aux_loss");
      type == "sinkhorn" || type == "quantile_balancing")
    refuse("moe_router_load_balancing_type", "whose router takes the top-k of its softmax (no " + type + " choice)");
  if (hf::option_true(option(o, "add_bias_linear"))) refuse("add_bias_linear", "which has no biases");
  if (on("moe_residual")) refuse("moe_residual", "which has no residual MLP mixed with its experts (DeepSpeed's)");
  for (const std::string& count : comma_items(option_or(o, "moe_layer_num_experts", "")))
    if (!count.empty() && count != option(o, "num_experts"))
      refuse("moe_layer_num_experts", "whose sparse blocks all have num_experts experts (not DeepSpeed's pyramid MoE)");
  // Older transformers build these models' rotary embedding without its rope_scaling.
  if (s.llama3) refuse("rope_scaling", "whose rotary embedding is read without rope_scaling by older transformers");
  s.shared_ffn = std::stoll(option_or(o, "moe_shared_expert_intermediate_size", "0"));
  s.shared_gate = s.shared_ffn > 0 && on("moe_shared_expert_gate");
  s.pre_softmax = on("moe_router_pre_softmax");
  // DeepSpeed's gate: top-1 weighs its expert by the softmax over all experts (the pre-softmax
  // weights), top-2 and top-k over their choices (the softmax of their logits, as the default
  // router); its capacity and its sampled second expert are training's, as a capacity factor is.
  const bool deepspeed_top1 =
      option_or(o, "moe_gate", "megatron") == "deepspeed" && option_int(o, "moe_router_topk") == 1;
  if (deepspeed_top1) s.pre_softmax = true;
  if (arch == "MixtralForCausalLM") {
    if (option_or(o, "moe_layer_freq", "1") != "1") refuse("moe_layer_freq", "whose every layer is a sparse block");
    if (deepspeed_top1)
      refuse("moe_gate",
             "whose top-k weights are renormalised (DeepSpeed's top-1 weighs its expert by the softmax "
             "over all experts)");
    if (s.pre_softmax)
      refuse("moe_router_pre_softmax", "whose top-k weights are renormalised (the softmax of the top-k logits)");
    if (s.shared_ffn > 0)
      refuse("moe_shared_expert_intermediate_size",
             "which has no shared expert (with add_qkv_bias and moe_shared_expert_gate it is a Qwen2MoeForCausalLM)");
  } else if (arch == "Qwen3MoeForCausalLM") {
    if (s.shared_ffn > 0) refuse("moe_shared_expert_intermediate_size", "which has no shared expert");
  } else if (s.shared_ffn == 0) {
    refuse("moe_shared_expert_intermediate_size", "whose every sparse block has a shared expert");
  } else if (!s.shared_gate) {
    refuse("moe_shared_expert_gate", "whose shared expert's output is gated by sigmoid(x g)");
  }
  s.capacity_factor = std::stod(option_or(o, "moe_expert_capacity_factor", "0"));
  s.topk = option_int(o, "moe_router_topk");
  s.moe_ffn = std::stoll(option_or(o, "moe_ffn_hidden_size", "0"));
  if (s.moe_ffn == 0) s.moe_ffn = s.ffn;
  if (arch == "MixtralForCausalLM") s.ffn = s.moe_ffn;  // (no dense MLP: intermediate_size is the experts')
}

// Which layers the window covers, from window_attn_skip_freq (empty: every layer; an integer N:
// all but every N-th, counting from 1; a list: the 1s), as the llama model reads it.
// (The plugin refused a bad one at training: only an edited checkpoint gets here with one.)
std::vector<bool> window_layers_of(const std::map<std::string, std::string>& o, int64_t layers) {
  const std::string text = option_or(o, "window_attn_skip_freq", "");
  if (text.empty()) return {};
  dtk::layers::LayerPattern p;
  try {
    p = dtk::layers::parse_layer_pattern(text);
  } catch (const std::exception& e) {
    throw HostError("export hf: option 'window_attn_skip_freq' is " + text + ": " + e.what());
  }
  if (p.flags.empty() ? p.every < 1 : static_cast<int64_t>(p.flags.size()) != layers)
    throw HostError("export hf: option 'window_attn_skip_freq' is " + text +
                    ": not an integer >= 1 nor one 0/1 per "
                    "layer of the " +
                    std::to_string(layers));
  std::vector<bool> windowed(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l)
    windowed[static_cast<size_t>(l)] = p.flags.empty() ? (l + 1) % p.every != 0 : p.flags.at(static_cast<size_t>(l));
  return windowed;
}

// A window of `window` earlier tokens over the layers `windowed` flags (empty: every layer), in
// LlamaShape's one form for each case: no layer windowed is no window, every layer an empty list.
void set_window(LlamaShape& s, int64_t window, std::vector<bool> windowed) {
  const auto any = [&](bool v) { return std::find(windowed.begin(), windowed.end(), v) != windowed.end(); };
  if (!windowed.empty() && !any(true)) window = -1;
  if (window < 0 || !any(false)) windowed.clear();
  s.window = window, s.window_layers = std::move(windowed);
}

// The sliding window (hf::window_of) where a Hugging Face config can hold it: Mistral's and
// Mixtral's sliding_window in every layer (no biases, no llama3 rope scaling), or Qwen2's and
// Qwen3's in the layers from max_window_layers on (full attention first, then windowed).
void read_window(const std::map<std::string, std::string>& o, LlamaShape& s) {
  const int64_t window = hf::window_of(option_or(o, "window_size", ""));
  if (window < 0) return;
  set_window(s, window, window_layers_of(o, s.layers));
  if (s.window < 0) return;                   // (every layer keeps full attention)
  const std::string arch = s.architecture();  // (with the window: Mistral's unless the layers say otherwise)
  const bool mistral = arch == "MistralForCausalLM" || arch == "MixtralForCausalLM";
  const bool qwen = arch == "Qwen2ForCausalLM" || arch == "Qwen3ForCausalLM";
  auto refuse = [&](const char* name, const std::string& why) {
    throw HostError(std::string("export hf: option '") + name + "' is " + option_or(o, name, "") +
                    ": a llama with a sliding window exports as " +
                    (mistral ? std::string("MistralForCausalLM or MixtralForCausalLM") : arch) + ", " + why);
  };
  if (!mistral && !qwen)  // (Qwen's MoE models: transformers' versions window different layers of them)
    refuse("window_size",
           "whose windowed layers transformers' versions disagree on; DTK writes a window as Mistral's, "
           "Mixtral's, Qwen2's or Qwen3's");
  if (arch == "MistralForCausalLM" && s.bias) refuse("add_bias_linear", "whose projections have no biases");
  if (mistral && !s.window_layers.empty())
    refuse("window_attn_skip_freq",
           "whose window is in every layer (with query/key/value biases or query/key norms it would be "
           "Qwen2's or Qwen3's, which keep full attention in the first max_window_layers layers)");
  if (mistral && s.llama3)
    refuse("rope_scaling", "whose rotary embedding is read without rope_scaling by older transformers");
  const int64_t full = s.full_attention_layers();
  for (int64_t l = full; l < s.layers; ++l)
    if (!s.windowed(l))
      refuse("window_attn_skip_freq",
             "whose layers keep full attention up to max_window_layers and are windowed after it (layer " +
                 std::to_string(l) + " would keep full attention after windowed layer " + std::to_string(full) + ")");
}

}  // namespace

LlamaShape llama_shape(const std::map<std::string, std::string>& o, int64_t run_seq_length) {
  LlamaShape s;
  s.layers = option_int(o, "num_layers");
  s.hidden = option_int(o, "hidden_size");
  s.heads = option_int(o, "num_attention_heads");
  s.groups = option_int(o, "num_query_groups");
  if (s.groups == 0) s.groups = s.heads;
  s.ffn = option_int(o, "ffn_hidden_size");
  if (s.ffn == 0) s.ffn = (4 * s.hidden * 2 / 3) / 64 * 64;  // the plugin's default (Megatron's with --swiglu)
  s.vocab = option_int(o, "vocab_size");
  s.positions = option_int(o, "seq_length");
  if (s.positions == 0) s.positions = run_seq_length;
  s.eps = option_float(o, "layernorm_epsilon");
  s.rope_theta = option_float(o, "rotary_base");
  s.attention_dropout = option_float(o, "attention_dropout");
  s.init_std = option_float(o, "init_method_std");
  s.untie = hf::option_true(option(o, "untie_embeddings_and_output_weights"));
  s.norm_1p = hf::option_true(option_or(o, "apply_layernorm_1p", "false"));  // (absent in older checkpoints)
  s.bias = hf::option_true(option(o, "add_bias_linear"));
  s.llama3 = option(o, "rope_scaling") == "llama3";
  s.rope_factor = option_float(o, "rope_scaling_factor");
  s.rope_low = option_float(o, "rope_low_freq_factor");
  s.rope_high = option_float(o, "rope_high_freq_factor");
  s.rope_original = option_int(o, "rope_original_max_positions");
  // (kv_channels, add_qkv_bias and qk_layernorm are absent in older checkpoints: their defaults.)
  s.head_dim = std::stoll(option_or(o, "kv_channels", "0"));
  if (s.head_dim == 0) s.head_dim = s.hidden / s.heads;
  s.qkv_bias = hf::option_true(option_or(o, "add_qkv_bias", "false"));
  s.qk_norm = hf::option_true(option_or(o, "qk_layernorm", "false"));
  // Qwen2's rotary in transformers from before its rope refactor reads no rope_scaling.
  if (s.qkv_bias && !s.bias && !s.qk_norm && option(o, "rope_scaling") == "llama3")
    throw HostError(
        "export hf: option 'rope_scaling' is llama3: a llama with query/key/value biases alone exports as "
        "Qwen2ForCausalLM, whose rotary embedding older transformers build without rope_scaling");
  if (s.qk_norm && (s.bias || s.qkv_bias))
    throw HostError(std::string("export hf: option '") + (s.bias ? "add_bias_linear" : "add_qkv_bias") +
                    "' is true: a llama with query/key norms exports as Qwen3ForCausalLM, whose attention biases "
                    "cover o_proj too and whose MLP has none");
  if (option_float(o, "rotary_percent") != 1.0)
    throw HostError("export hf: option 'rotary_percent' is " + option(o, "rotary_percent") +
                    "; Hugging Face's LlamaForCausalLM rotates every channel of a head (rotary_percent 1)");
  // A checkpoint from before mixture of experts has no num_experts: dense.
  if (option_or(o, "num_experts", "0") != "0") read_experts(o, s);
  read_window(o, s);
  return s;
}

std::string LlamaShape::architecture() const {
  if (qk_norm) return has_experts() ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM";
  if (qkv_bias && !bias) return has_experts() ? "Qwen2MoeForCausalLM" : "Qwen2ForCausalLM";
  if (has_experts()) return "MixtralForCausalLM";
  return window >= 0 ? "MistralForCausalLM" : "LlamaForCausalLM";
}

std::string LlamaShape::model_type() const {
  if (qk_norm) return has_experts() ? "qwen3_moe" : "qwen3";
  if (qkv_bias && !bias) return has_experts() ? "qwen2_moe" : "qwen2";
  if (has_experts()) return "mixtral";
  return window >= 0 ? "mistral" : "llama";
}

int64_t LlamaShape::dense_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers; ++l) n += sparse(l) ? 0 : 1;
  return n;
}

int64_t LlamaShape::full_attention_layers() const {
  int64_t l = 0;
  while (l < layers && !windowed(l)) ++l;
  return l;
}

bool llama_model_type(const std::string& model_type) {
  return model_type == "llama" || model_type == "mistral" || model_type == "mixtral" || model_type == "qwen2" ||
         model_type == "qwen3" || model_type == "qwen2_moe" || model_type == "qwen3_moe";
}

namespace {

const std::string kLm = "language_model.", kEnc = "language_model.encoder.";
std::string layer_prefix(int64_t l) { return kEnc + "layers." + std::to_string(l) + "."; }
std::string hf_layer(int64_t l) { return "model.layers." + std::to_string(l) + "."; }

// One layer's sparse block as (our name, Hugging Face's name, shape) for export and import alike
// (`m`: the layer's prefix, `hf`: Hugging Face's): Mixtral's block_sparse_moe.gate and
// experts.<e>.w1 (gate), w3 (up) and w2 (down); Qwen's mlp.gate and experts.<e>.gate_proj, up_proj
// and down_proj, with Qwen2-MoE's shared_expert and shared_expert_gate.
struct NamedShape {
  std::string ours, theirs;
  std::vector<int64_t> shape;
};
std::vector<NamedShape> sparse_block_names(const LlamaShape& s, const std::string& m, const std::string& hf) {
  const bool mixtral = s.model_type() == "mixtral";
  const std::string block = hf + (mixtral ? "block_sparse_moe." : "mlp.");
  std::vector<NamedShape> names{{m + "mlp.router.weight", block + "gate.weight", {s.experts, s.hidden}}};
  auto add_swiglu = [&](const std::string& ours, const std::string& theirs, int64_t ffn) {
    names.push_back({ours + "gate.weight", theirs + (mixtral ? "w1" : "gate_proj") + ".weight", {ffn, s.hidden}});
    names.push_back({ours + "up.weight", theirs + (mixtral ? "w3" : "up_proj") + ".weight", {ffn, s.hidden}});
    names.push_back(
        {ours + "dense_4h_to_h.weight", theirs + (mixtral ? "w2" : "down_proj") + ".weight", {s.hidden, ffn}});
  };
  for (int64_t e = 0; e < s.experts; ++e)
    add_swiglu(m + "mlp.experts." + std::to_string(e) + ".", block + "experts." + std::to_string(e) + ".", s.moe_ffn);
  if (s.shared_ffn > 0) {
    add_swiglu(m + "mlp.shared_experts.", block + "shared_expert.", s.shared_ffn);
    names.push_back({m + "mlp.shared_experts.gate_weight", block + "shared_expert_gate.weight", {1, s.hidden}});
  }
  return names;
}

// The model's tensors under LlamaForCausalLM's names (contiguous), the padding rows dropped.
hf::NamedTensors hf_tensors(const hf::RankTensors& ranks, const LlamaShape& s, const std::map<std::string, int>& dims,
                            int64_t* padding_rows) {
  auto whole = [&](const std::string& name) { return hf::whole_tensor(ranks, dims, name); };
  auto gain = [&](const std::string& name) { return hf::norm_gain(whole(name), s.norm_1p); };
  const int64_t h = s.hidden, hd = s.head_dim, per = s.heads / s.groups;
  hf::NamedTensors out;
  const at::Tensor embed = whole(kLm + "embedding.word_embeddings.weight");
  if (embed.dim() != 2 || embed.size(0) < s.vocab || embed.size(1) != h)
    throw HostError("export hf: word embeddings are [" + std::to_string(embed.size(0)) + ", " +
                    std::to_string(embed.dim() > 1 ? embed.size(1) : 0) + "], expected at least [" +
                    std::to_string(s.vocab) + ", " + std::to_string(h) + "]");
  *padding_rows = embed.size(0) - s.vocab;
  out.emplace_back("model.embed_tokens.weight", embed.narrow(0, 0, s.vocab));
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string m = layer_prefix(l), hf = hf_layer(l);
    out.emplace_back(hf + "input_layernorm.weight", gain(m + "input_norm.weight"));
    // The llama plugin's rows, group by group: [q of the group's `per` heads | k | v], hd each.
    const std::string qkv = m + "self_attention.query_key_value.";
    const at::Tensor w = whole(qkv + "weight");
    hf::expect_shape(qkv + "weight", w, {(s.heads + 2 * s.groups) * hd, h});
    const at::Tensor wg = w.view({s.groups, per + 2, hd, h});
    out.emplace_back(hf + "self_attn.q_proj.weight", wg.narrow(1, 0, per).reshape({s.heads * hd, h}));
    out.emplace_back(hf + "self_attn.k_proj.weight", wg.select(1, per).reshape({s.groups * hd, h}));
    out.emplace_back(hf + "self_attn.v_proj.weight", wg.select(1, per + 1).reshape({s.groups * hd, h}));
    if (s.bias || s.qkv_bias) {
      const at::Tensor bg = whole(qkv + "bias").view({s.groups, per + 2, hd});
      out.emplace_back(hf + "self_attn.q_proj.bias", bg.narrow(1, 0, per).reshape({s.heads * hd}));
      out.emplace_back(hf + "self_attn.k_proj.bias", bg.select(1, per).reshape({s.groups * hd}));
      out.emplace_back(hf + "self_attn.v_proj.bias", bg.select(1, per + 1).reshape({s.groups * hd}));
    }
    if (s.qk_norm) {  // Qwen3RMSNorm over each head's channels, as the plugin's q_layernorm / k_layernorm
      out.emplace_back(hf + "self_attn.q_norm.weight", gain(m + "self_attention.q_layernorm.weight"));
      out.emplace_back(hf + "self_attn.k_norm.weight", gain(m + "self_attention.k_layernorm.weight"));
    }
    out.emplace_back(hf + "self_attn.o_proj.weight", whole(m + "self_attention.dense.weight"));
    if (s.bias) out.emplace_back(hf + "self_attn.o_proj.bias", whole(m + "self_attention.dense.bias"));
    out.emplace_back(hf + "post_attention_layernorm.weight", gain(m + "post_attention_norm.weight"));
    if (s.sparse(l)) {
      for (const NamedShape& n : sparse_block_names(s, m, hf)) {
        const at::Tensor t = whole(n.ours);
        hf::expect_shape(n.ours, t, n.shape);
        out.emplace_back(n.theirs, t);
      }
      continue;
    }
    const at::Tensor gate = whole(m + "mlp.gate.weight");
    hf::expect_shape(m + "mlp.gate.weight", gate, {s.ffn, h});
    out.emplace_back(hf + "mlp.gate_proj.weight", gate);
    out.emplace_back(hf + "mlp.up_proj.weight", whole(m + "mlp.up.weight"));
    out.emplace_back(hf + "mlp.down_proj.weight", whole(m + "mlp.dense_4h_to_h.weight"));
    if (s.bias) {
      out.emplace_back(hf + "mlp.gate_proj.bias", whole(m + "mlp.gate.bias"));
      out.emplace_back(hf + "mlp.up_proj.bias", whole(m + "mlp.up.bias"));
      out.emplace_back(hf + "mlp.down_proj.bias", whole(m + "mlp.dense_4h_to_h.bias"));
    }
  }
  out.emplace_back("model.norm.weight", gain(kEnc + "final_norm.weight"));
  if (s.untie) out.emplace_back("lm_head.weight", whole(kLm + "output_layer.weight").narrow(0, 0, s.vocab));
  for (auto& [name, t] : out) t = t.contiguous();
  return out;
}

std::string rope_scaling_json(const LlamaShape& s) {
  if (!s.llama3) return "null";
  return "{\"rope_type\": \"llama3\", \"factor\": " + hf::number(s.rope_factor) +
         ", \"low_freq_factor\": " + hf::number(s.rope_low) + ", \"high_freq_factor\": " + hf::number(s.rope_high) +
         ", \"original_max_position_embeddings\": " + std::to_string(s.rope_original) + "}";
}

// bos/eos ids where the tokenizer says them: GPT-2's <|endoftext|>, Llama's SentencePiece <s> </s>.
std::pair<int64_t, int64_t> special_ids(const LlamaShape& s, const TokenizerFiles& t) {
  if (t.eos >= 0) return {t.bos >= 0 ? t.bos : t.eos, t.eos};
  if (t.type == "Llama2Tokenizer") return {1, 2};
  if ((t.type.empty() || t.type == "GPT2BPETokenizer") && s.vocab == 50257) return {50256, 50256};
  return {-1, -1};
}

std::string config_json(const LlamaShape& s, const std::string& dtype, const TokenizerFiles& t) {
  const auto [bos, eos] = special_ids(s, t);
  const char* bias = s.bias ? "true" : "false";
  std::ostringstream c;
  c << "{\n"
    << "  \"architectures\": [\"" << s.architecture() << "\"],\n"
    << "  \"model_type\": \"" << s.model_type() << "\",\n"
    << "  \"vocab_size\": " << s.vocab << ",\n"
    << "  \"hidden_size\": " << s.hidden << ",\n"
    << "  \"intermediate_size\": " << s.ffn << ",\n"
    << "  \"num_hidden_layers\": " << s.layers << ",\n"
    << "  \"num_attention_heads\": " << s.heads << ",\n"
    << "  \"num_key_value_heads\": " << s.groups << ",\n"
    << "  \"head_dim\": " << s.head_dim << ",\n"
    << "  \"hidden_act\": \"silu\",\n"
    << "  \"max_position_embeddings\": " << s.positions << ",\n"
    << "  \"rms_norm_eps\": " << hf::number(s.eps) << ",\n"
    << "  \"rope_theta\": " << hf::number(s.rope_theta) << ",\n"
    << "  \"rope_scaling\": " << rope_scaling_json(s) << ",\n";
  if (s.model_type() == "mixtral")  // (no biases: refused above)
    c << "  \"num_local_experts\": " << s.experts << ",\n"
      << "  \"num_experts_per_tok\": " << s.topk << ",\n"
      << "  \"output_router_logits\": false,\n"
      << "  \"sliding_window\": " << (s.window >= 0 ? std::to_string(s.window + 1) : "null") << ",\n";
  else if (s.model_type() == "mistral")  // (no biases: refused above)
    c << "  \"sliding_window\": " << s.window + 1 << ",\n";
  else if (s.model_type() == "llama")
    c << "  \"attention_bias\": " << bias << ",\n"
      << "  \"mlp_bias\": " << bias << ",\n";
  else  // Qwen2's q/k/v biases are its architecture's; Qwen3's attention_bias would add o_proj's
    c << (s.qk_norm ? "  \"attention_bias\": false,\n" : "")
      << "  \"use_sliding_window\": " << (s.window >= 0 ? "true" : "false") << ",\n"
      << "  \"sliding_window\": " << (s.window >= 0 ? std::to_string(s.window + 1) : "null") << ",\n"
      << "  \"max_window_layers\": " << s.full_attention_layers() << ",\n";
  if (s.has_experts() && s.model_type() != "mixtral") {  // Qwen's sparse blocks
    std::string dense;                                   // the layers without experts
    for (int64_t l = 0; l < s.layers; ++l)
      if (!s.sparse(l)) dense += (dense.empty() ? "" : ", ") + std::to_string(l);
    c << "  \"num_experts\": " << s.experts << ",\n"
      << "  \"num_experts_per_tok\": " << s.topk << ",\n"
      << "  \"moe_intermediate_size\": " << s.moe_ffn << ",\n"
      << "  \"norm_topk_prob\": " << (s.pre_softmax ? "false" : "true") << ",\n"
      << "  \"decoder_sparse_step\": 1,\n"
      << "  \"mlp_only_layers\": [" << dense << "],\n"
      << "  \"output_router_logits\": false,\n";
    if (s.shared_ffn > 0)  // Qwen2-MoE (its q/k/v biases: qkv_bias, a key older transformers do not read)
      c << "  \"shared_expert_intermediate_size\": " << s.shared_ffn << ",\n"
        << "  \"qkv_bias\": true,\n";
  }
  c << "  \"attention_dropout\": " << hf::number(s.attention_dropout) << ",\n"
    << "  \"initializer_range\": " << hf::number(s.init_std) << ",\n"
    << "  \"tie_word_embeddings\": " << (s.untie ? "false" : "true") << ",\n";
  if (bos >= 0) c << "  \"bos_token_id\": " << bos << ",\n  \"eos_token_id\": " << eos << ",\n";
  c << "  \"torch_dtype\": \"" << dtype << "\",\n"
    << "  \"use_cache\": true\n"
    << "}\n";
  return c.str();
}

// The tokenizer's files for the folder; `*written` says which, in words ("" = none).
std::vector<std::pair<std::string, std::string>> tokenizer_files(const LlamaShape& s, const TokenizerFiles& t,
                                                                 std::string* written) {
  const std::string max_length = std::to_string(s.positions);
  // A tokenizer.json with no tokenizer_config.json of its own gets one naming its BOS and EOS.
  const auto fast_tokenizer = [&](std::string tokenizer_json) -> std::vector<std::pair<std::string, std::string>> {
    std::string special;
    if (!t.bos_text.empty()) special += ",\n  \"bos_token\": " + nlohmann::json(t.bos_text).dump();
    if (!t.eos_text.empty()) special += ",\n  \"eos_token\": " + nlohmann::json(t.eos_text).dump();
    return {{"tokenizer.json", std::move(tokenizer_json)},
            {"tokenizer_config.json",
             "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n  \"model_max_length\": " + max_length + special +
                 "\n}\n"}};
  };
  if (!t.made_tokenizer_json.empty()) {
    *written = "tokenizer.json (made from the " + t.type + " vocabulary)";
    return fast_tokenizer(t.made_tokenizer_json);
  }
  if (!t.model_file.empty()) {
    std::error_code ec;
    std::string file = t.model_file;
    if (fs::is_directory(file, ec)) file = (fs::path(file) / "tokenizer.json").string();
    const std::string bytes = hf::read_whole(file, "the tokenizer (tokenizer.model_file)");
    if (fs::path(file).extension() == ".json") {
      *written = "tokenizer.json";
      if (!t.config_file.empty())
        return {{"tokenizer.json", bytes},
                {"tokenizer_config.json", hf::read_whole(t.config_file, "the tokenizer's tokenizer_config.json")}};
      return fast_tokenizer(bytes);
    }
    *written = "tokenizer.model (SentencePiece)";
    return {{"tokenizer.model", bytes},
            {"tokenizer_config.json",
             "{\n  \"tokenizer_class\": \"LlamaTokenizer\",\n  \"model_max_length\": " + max_length +
                 ",\n  \"bos_token\": \"<s>\",\n  \"eos_token\": \"</s>\",\n  \"unk_token\": \"<unk>\",\n"
                 "  \"add_bos_token\": true,\n  \"add_eos_token\": false\n}\n"}};
  }
  if (!t.vocab_file.empty() && !t.merge_file.empty()) {
    *written = "the GPT-2 tokenizer files";
    return hf::gpt2_tokenizer_files(hf::read_whole(t.vocab_file, "the GPT-2 vocabulary (tokenizer.vocab_file)"),
                                    hf::read_whole(t.merge_file, "the GPT-2 merges (tokenizer.merge_file)"), s.positions);
  }
  written->clear();
  return {};
}

}  // namespace

HfExportReport export_hf_llama(const std::string& iter_dir, LlamaShape& shape, const std::string& out_dir,
                               const TokenizerFiles& tokenizer, const std::map<std::string, int>& dims, bool verify) {
  require_new_or_empty_folder(out_dir, "export hf");
  HfExportReport report;
  std::vector<std::pair<std::string, std::string>> files = tokenizer_files(shape, tokenizer, &report.tokenizer);
  const hf::RankTensors ranks = hf::read_rank_models(iter_dir, verify);
  if (shape.has_experts()) {  // the layers with a router (moe_layer_freq's, as the plugin built them)
    shape.sparse_layers.clear();
    for (int64_t l = 0; l < shape.layers; ++l)
      shape.sparse_layers.push_back(ranks.front().count(layer_prefix(l) + "mlp.router.weight") > 0);
  }
  const hf::NamedTensors out = hf_tensors(ranks, shape, dims, &report.padding_rows);
  report.dtype = hf::torch_dtype(out.front().second.scalar_type());  // the word embeddings'
  report.tensors = static_cast<int64_t>(out.size());
  files.emplace_back("config.json", config_json(shape, report.dtype, tokenizer));
  const auto [bos, eos] = special_ids(shape, tokenizer);
  if (bos >= 0)
    files.emplace_back("generation_config.json", "{\n  \"bos_token_id\": " + std::to_string(bos) +
                                                     ",\n  \"eos_token_id\": " + std::to_string(eos) + "\n}\n");
  hf::publish_folder(out_dir, out, files);
  for (const auto& [name, t] : out) report.megabytes += static_cast<double>(t.numel() * t.element_size()) / 1e6;
  return report;
}

std::string hf_model_type(const std::string& hf_dir) {
  const nlohmann::json c = hf::read_hf_config(hf_dir);
  return c.is_object() && c.contains("model_type") && c["model_type"].is_string() ? c["model_type"].get<std::string>()
                                                                                  : "";
}

namespace {

// Qwen2-MoE's or Qwen3-MoE's sparse blocks from config.json (their config classes' defaults for
// keys left out): the experts, the renormalisation of the top-k weights (norm_topk_prob), which
// layers have experts (layer l unless it is in mlp_only_layers or (l + 1) is not a multiple of
// decoder_sparse_step) and Qwen2-MoE's gated shared expert.
void read_qwen_experts(const nlohmann::json& c, const std::string& config_file, LlamaShape& s) {
  const bool qwen2 = c["model_type"] == "qwen2_moe";
  auto refuse = [&](const std::string& what) { throw HostError("import hf: " + config_file + ": " + what); };
  auto integer = [&](const char* key, int64_t fallback) -> int64_t {
    if (!c.contains(key) || c[key].is_null()) return fallback;
    if (!c[key].is_number_integer()) refuse(std::string("'") + key + "' is not an integer");
    return c[key].get<int64_t>();
  };
  // (transformers 5's Qwen3MoeConfig may save num_experts as num_local_experts, its attribute_map's name.)
  s.experts = integer(c.contains("num_experts") ? "num_experts" : "num_local_experts", qwen2 ? 60 : 128);
  s.topk = integer("num_experts_per_tok", qwen2 ? 4 : 8);
  s.moe_ffn = integer("moe_intermediate_size", qwen2 ? 1408 : 768);
  s.pre_softmax = !hf::json_bool_or(c, "norm_topk_prob", false, config_file);
  if (s.experts < 1 || s.topk < 1 || s.topk > s.experts || s.moe_ffn < 1)
    refuse("num_experts " + std::to_string(s.experts) + ", num_experts_per_tok " + std::to_string(s.topk) +
           " and moe_intermediate_size " + std::to_string(s.moe_ffn) +
           ": each token needs 1 to num_experts experts of a positive inner size");
  if (s.topk == 1 && !s.pre_softmax)
    refuse("num_experts_per_tok 1 with norm_topk_prob: the one weight is always 1 and the router would not learn");
  const int64_t step = integer("decoder_sparse_step", 1);
  if (step < 1) refuse("decoder_sparse_step " + std::to_string(step) + " must be at least 1");
  std::vector<bool> dense(static_cast<size_t>(s.layers), false);
  if (c.contains("mlp_only_layers") && !c["mlp_only_layers"].is_null()) {
    if (!c["mlp_only_layers"].is_array()) refuse("'mlp_only_layers' is not a list of layer numbers");
    for (const auto& l : c["mlp_only_layers"]) {
      if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= s.layers)
        refuse("mlp_only_layers holds " + l.dump() + ", not a layer number in [0, num_hidden_layers)");
      dense[l.get<size_t>()] = true;
    }
  }
  s.sparse_layers.clear();
  for (int64_t l = 0; l < s.layers; ++l)
    s.sparse_layers.push_back(!dense[static_cast<size_t>(l)] && (l + 1) % step == 0);
  if (s.dense_layers() == s.layers) refuse("no layer has experts (mlp_only_layers and decoder_sparse_step)");
  if (qwen2) {
    s.shared_ffn = integer("shared_expert_intermediate_size", 5632), s.shared_gate = true;
    if (s.shared_ffn < 1)
      refuse("shared_expert_intermediate_size " + std::to_string(s.shared_ffn) +
             ": the llama model's Qwen2-MoE block has a shared expert of a positive inner size");
  }
}

// Qwen2's and Qwen3's sliding window as Qwen2Config and Qwen3Config read it: with
// use_sliding_window, sliding_window (4096 when left out; null: none) in the layers layer_types
// calls "sliding_attention", or, without layer_types, in those from max_window_layers (28 when
// left out) on; each token sees the sliding_window tokens up to itself. A Qwen MoE model's window
// is refused (transformers' versions disagree on which of its layers are windowed), as are
// sliding_attention layers without a window (transformers cannot build their mask).
void read_qwen_window(const nlohmann::json& c, const std::string& config_file, LlamaShape& s) {
  auto refuse = [&](const std::string& what) { throw HostError("import hf: " + config_file + ": " + what); };
  auto integer = [&](const char* key, int64_t fallback) -> int64_t {
    if (!c.contains(key) || c[key].is_null()) return fallback;
    if (!c[key].is_number_integer()) refuse(std::string("'") + key + "' is not an integer");
    return c[key].get<int64_t>();
  };
  std::vector<bool> sliding;  // per layer, from layer_types where given
  if (c.contains("layer_types") && !c["layer_types"].is_null()) {
    const nlohmann::json& types = c["layer_types"];
    if (!types.is_array() || types.size() != static_cast<size_t>(s.layers))
      refuse("'layer_types' is not a list of num_hidden_layers (" + std::to_string(s.layers) + ") attention types");
    for (const nlohmann::json& t : types) {
      if (t != "full_attention" && t != "sliding_attention")
        refuse("layer_types holds " + t.dump() + ", not \"full_attention\" or \"sliding_attention\"");
      sliding.push_back(t == "sliding_attention");
    }
  }
  const bool use = hf::json_bool_or(c, "use_sliding_window", false, config_file);
  const bool no_window = !use || (c.contains("sliding_window") && c["sliding_window"].is_null());  // (None)
  if (no_window && std::find(sliding.begin(), sliding.end(), true) != sliding.end())
    refuse(
        "layer_types has sliding_attention layers but there is no window (use_sliding_window false or "
        "sliding_window null): transformers cannot build their mask");
  if (!use) return;
  const std::string type = hf::json_string_or(c, "model_type", "", config_file);
  if (type == "qwen2_moe" || type == "qwen3_moe")
    refuse(
        "use_sliding_window is true: transformers' versions disagree on which layers of a Qwen MoE model are "
        "windowed; DTK reads Qwen's window from Qwen2 and Qwen3 configs");
  if (no_window) return;
  const int64_t window = integer("sliding_window", 4096);
  if (window < 1) refuse("sliding_window " + std::to_string(window) + " must be at least 1 (the token itself)");
  if (window >= s.positions) return;  // (a window holding every position changes nothing)
  if (sliding.empty()) {
    const int64_t full = integer("max_window_layers", 28);
    for (int64_t l = 0; l < s.layers; ++l) sliding.push_back(l >= full);
  }
  set_window(s, window - 1, std::move(sliding));
}

// The shape from config.json; what the llama model cannot be is refused naming the key.
LlamaShape shape_from_config(const nlohmann::json& c, const std::string& config_file) {
  LlamaShape s;
  auto present = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto integer = [&](const char* key, int64_t fallback, bool required) -> int64_t {
    if (!present(key)) {
      if (required) throw HostError(std::string("import hf: ") + config_file + " has no '" + key + "'");
      return fallback;
    }
    if (!c[key].is_number_integer()) throw HostError(std::string("import hf: ") + config_file + ": '" + key + "' is not an integer");
    return c[key].get<int64_t>();
  };
  auto real = [&](const char* key, double fallback) {
    if (!present(key)) return fallback;
    if (!c[key].is_number()) throw HostError(std::string("import hf: ") + config_file + ": '" + key + "' is not a number");
    return c[key].get<double>();
  };
  auto boolean = [&](const char* key, bool fallback) {
    if (!present(key)) return fallback;
    if (!c[key].is_boolean()) throw HostError(std::string("import hf: ") + config_file + ": '" + key + "' is not true or false");
    return c[key].get<bool>();
  };
  auto refuse = [&](const std::string& what) { throw HostError("import hf: " + config_file + ": " + what); };
  // What a key left out means: transformers' LlamaConfig, MistralConfig, MixtralConfig,
  // Qwen2Config, Qwen3Config, Qwen2MoeConfig or Qwen3MoeConfig defaults.
  const std::string type = hf::json_string_or(c, "model_type", "", config_file);
  const bool mistral = type == "mistral" || type == "mixtral";  // (Mixtral: Mistral's attention with experts)
  const bool mixtral = type == "mixtral", qwen2 = type == "qwen2" || type == "qwen2_moe";
  const bool qwen3 = type == "qwen3" || type == "qwen3_moe", qwen = qwen2 || qwen3;
  const bool qwen_moe = type == "qwen2_moe" || type == "qwen3_moe";
  s.layers = integer("num_hidden_layers", 0, true), s.hidden = integer("hidden_size", 0, true);
  s.heads = integer("num_attention_heads", 0, true);
  // (A Qwen MoE whose every layer has experts has no use for intermediate_size.)
  s.ffn = integer("intermediate_size", type == "qwen2_moe" ? 5632 : 6144, !qwen_moe);
  s.vocab = integer("vocab_size", 0, true);
  const int64_t default_groups = mistral ? 8 : type == "qwen2_moe" ? 16 : type == "qwen3_moe" ? 4 : qwen ? 32 : s.heads;
  s.groups = integer("num_key_value_heads", default_groups, false);
  s.positions = integer("max_position_embeddings", mistral ? 4096 * 32 : qwen ? 32768 : 2048, false);
  if (s.layers <= 0 || s.hidden <= 0 || s.heads <= 0 || s.ffn <= 0 || s.vocab <= 0 || s.groups <= 0 || s.positions <= 0)
    refuse("num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size "
           "and max_position_embeddings must be positive");
  if (s.heads % s.groups != 0) refuse("num_key_value_heads must divide num_attention_heads");
  // A head's width: head_dim where given (Qwen3Config's default 128), else hidden_size / heads.
  s.head_dim = integer("head_dim", type == "qwen3" ? 128 : 0, false);
  if (s.head_dim == 0) {
    if (s.hidden % s.heads != 0) refuse("num_attention_heads must divide hidden_size (config.json has no head_dim)");
    s.head_dim = s.hidden / s.heads;
  }
  if (s.head_dim <= 0 || s.head_dim % 2 != 0)
    refuse("head_dim " + std::to_string(s.head_dim) + " must be positive and even (rotary pairs its channels)");
  if (qwen_moe) read_qwen_experts(c, config_file, s);
  if (mixtral) {
    s.experts = integer("num_local_experts", 8, false), s.topk = integer("num_experts_per_tok", 2, false);
    s.moe_ffn = s.ffn;
    if (s.experts < 1 || s.topk < 2 || s.topk > s.experts)
      refuse("num_local_experts " + std::to_string(s.experts) + " and num_experts_per_tok " + std::to_string(s.topk) +
             ": the llama model routes each token to 2 or more of its experts with Mixtral's renormalised weights "
             "(one expert's weight would be 1 and the router would not learn)");
    if (real("router_jitter_noise", 0.0) != 0.0)
      refuse(
          "router_jitter_noise is not 0: transformers multiplies the experts' input by the noise too, the llama "
          "model's moe_input_jitter_eps (Megatron's) only the router's");
  }
  if (mistral) {
    // Each token sees the sliding_window tokens up to itself: the llama model's window_size
    // sliding_window - 1, 0 (MistralConfig's default 4096 when the key is left out, null: none;
    // a window holding every position changes nothing).
    const int64_t window = c.contains("sliding_window") ? integer("sliding_window", 0, false)
                           : type == "mistral"          ? 4096
                                                        : 0;
    if (present("sliding_window") && window < 1)
      refuse("sliding_window " + std::to_string(window) + " must be at least 1 (the token itself)");
    if (window > 0 && window < s.positions) s.window = window - 1;
  }
  const std::string act = hf::json_string_or(c, "hidden_act", "silu", config_file);
  if (act != "silu") refuse("hidden_act '" + act + "'; the llama model's MLP is SwiGLU (silu)");
  if (qwen) read_qwen_window(c, config_file, s);
  s.eps = real("rms_norm_eps", mixtral ? 1e-5 : 1e-6);
  s.rope_theta = real("rope_theta", mixtral ? 1e6 : 10000.0);
  s.attention_dropout = real("attention_dropout", 0.0);
  s.init_std = real("initializer_range", 0.02);
  s.untie = !boolean("tie_word_embeddings", false);
  if (qwen2) {
    // Qwen2Attention's q/k/v projections have biases, o_proj and the MLP none. (Qwen2MoeConfig's
    // qkv_bias, newer than the model, can turn them off: the llama model's Qwen2-MoE block is the
    // one with them, without them its shape would be Mixtral's, which has no shared expert.)
    s.qkv_bias = true;
    if (type == "qwen2_moe" && !boolean("qkv_bias", true))
      refuse("qkv_bias is false: the llama model's Qwen2-MoE block comes with q/k/v biases (add_qkv_bias)");
  } else if (qwen3) {
    s.qk_norm = true;
    if (boolean("attention_bias", false))
      refuse(
          "attention_bias is true: Qwen3's biases would be on o_proj too, and the llama model's query/key-norm "
          "heads take biases on q_proj, k_proj and v_proj alone (add_qkv_bias) or on every projection");
  } else {
    const bool attention_bias = boolean("attention_bias", false), mlp_bias = boolean("mlp_bias", false);
    if (attention_bias != mlp_bias)
      refuse(std::string("attention_bias ") + (attention_bias ? "true" : "false") + " and mlp_bias " +
             (mlp_bias ? "true" : "false") + " differ; the llama model has one option for both (add_bias_linear)");
    s.bias = attention_bias;
  }
  // transformers 5 writes the rotary's theta and scaling as rope_parameters; earlier versions
  // rope_theta and rope_scaling.
  const std::string rope_key = present("rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (present(rope_key.c_str())) {
    const nlohmann::json& r = c[rope_key];
    if (!r.is_object()) refuse("'" + rope_key + "' is not an object");
    if (r.contains("rope_theta") && !r["rope_theta"].is_null()) {
      if (!r["rope_theta"].is_number()) refuse(rope_key + ": 'rope_theta' is not a number");
      s.rope_theta = r["rope_theta"].get<double>();
    }
    const std::string type = r.contains("rope_type") && !r["rope_type"].is_null()
                                 ? hf::json_string_or(r, "rope_type", "", config_file)
                                 : hf::json_string_or(r, "type", "default", config_file);
    if (type == "llama3") {
      s.llama3 = true;
      auto num = [&](const char* key) {
        if (!r.contains(key) || !r[key].is_number()) refuse(rope_key + " has no number '" + key + "'");
        return r[key].get<double>();
      };
      s.rope_factor = num("factor"), s.rope_low = num("low_freq_factor"), s.rope_high = num("high_freq_factor");
      s.rope_original = static_cast<int64_t>(num("original_max_position_embeddings"));
    } else if (type != "default") {
      refuse(rope_key + " type '" + type + "'; the llama model has llama3 rope scaling (and none)");
    }
  }
  return s;
}

// What transformers saves besides a Llama's weights: older saves' rotary inverse frequencies and,
// tied, the output layer (the word embeddings again).
bool llama_saved_buffer(const std::string& name) {
  return name == "lm_head.weight" || hf::ends_with(name, "rotary_emb.inv_freq");
}

}  // namespace

HfLlamaImport import_hf_llama(const std::string& hf_dir) {
  const std::string config_file = (fs::path(hf_dir) / "config.json").string();
  const nlohmann::json config = hf::read_hf_config(hf_dir);
  const std::string type = hf::json_string_or(config, "model_type", "", config_file);
  if (!llama_model_type(type))
    throw HostError("import hf: " + config_file + ": model_type '" + type +
                    "' is not llama, mistral, mixtral, qwen2, qwen3, qwen2_moe or qwen3_moe");
  HfLlamaImport r;
  r.shape = shape_from_config(config, config_file);
  const LlamaShape& s = r.shape;
  const std::map<std::string, at::Tensor> hf = hf::read_hf_weights(hf_dir);
  std::set<std::string> read;
  auto get = [&](const std::string& name, const std::vector<int64_t>& shape) {
    auto it = hf.find(name);
    if (it == hf.end()) throw HostError("import hf: " + hf_dir + " has no tensor '" + name + "'");
    read.insert(name);
    if (it->second.sizes().vec() != shape) {
      std::string want, got;
      for (auto d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      for (auto d : it->second.sizes()) got += (got.empty() ? "" : ", ") + std::to_string(d);
      throw HostError("import hf: " + hf_dir + ": tensor '" + name + "' is [" + got + "], config.json says [" + want + "]");
    }
    return it->second;
  };
  const int64_t h = s.hidden, hd = s.head_dim, f = s.ffn;
  auto& t = r.tensors;
  t.emplace_back(kLm + "embedding.word_embeddings.weight", get("model.embed_tokens.weight", {s.vocab, h}));
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string m = layer_prefix(l), g = hf_layer(l);
    t.emplace_back(m + "input_norm.weight", get(g + "input_layernorm.weight", {h}));
    // q_proj, k_proj, v_proj -> the fused rows, group by group [q of the group's heads | k | v].
    auto fused = [&](const char* part, std::vector<int64_t> tail) {
      auto dims = [&](int64_t rows) {
        std::vector<int64_t> d{rows};
        d.insert(d.end(), tail.begin(), tail.end());
        return d;
      };
      std::vector<int64_t> grouped{s.groups, -1, hd};
      grouped.insert(grouped.end(), tail.begin(), tail.end());
      const std::string a = g + "self_attn.";
      const at::Tensor q = get(a + "q_proj." + part, dims(s.heads * hd)).reshape(grouped);
      const at::Tensor k = get(a + "k_proj." + part, dims(s.groups * hd)).reshape(grouped);
      const at::Tensor v = get(a + "v_proj." + part, dims(s.groups * hd)).reshape(grouped);
      return at::cat({q, k, v}, 1).reshape(dims((s.heads + 2 * s.groups) * hd));
    };
    t.emplace_back(m + "self_attention.query_key_value.weight", fused("weight", {h}));
    if (s.bias || s.qkv_bias) t.emplace_back(m + "self_attention.query_key_value.bias", fused("bias", {}));
    if (s.qk_norm) {
      t.emplace_back(m + "self_attention.q_layernorm.weight", get(g + "self_attn.q_norm.weight", {hd}));
      t.emplace_back(m + "self_attention.k_layernorm.weight", get(g + "self_attn.k_norm.weight", {hd}));
    }
    t.emplace_back(m + "self_attention.dense.weight", get(g + "self_attn.o_proj.weight", {h, s.heads * hd}));
    if (s.bias) t.emplace_back(m + "self_attention.dense.bias", get(g + "self_attn.o_proj.bias", {h}));
    t.emplace_back(m + "post_attention_norm.weight", get(g + "post_attention_layernorm.weight", {h}));
    if (s.sparse(l)) {  // Mixtral's or Qwen's names (sparse_block_names, the other way)
      for (const NamedShape& n : sparse_block_names(s, m, g)) t.emplace_back(n.ours, get(n.theirs, n.shape));
      continue;
    }
    t.emplace_back(m + "mlp.gate.weight", get(g + "mlp.gate_proj.weight", {f, h}));
    t.emplace_back(m + "mlp.up.weight", get(g + "mlp.up_proj.weight", {f, h}));
    t.emplace_back(m + "mlp.dense_4h_to_h.weight", get(g + "mlp.down_proj.weight", {h, f}));
    if (s.bias) {
      t.emplace_back(m + "mlp.gate.bias", get(g + "mlp.gate_proj.bias", {f}));
      t.emplace_back(m + "mlp.up.bias", get(g + "mlp.up_proj.bias", {f}));
      t.emplace_back(m + "mlp.dense_4h_to_h.bias", get(g + "mlp.down_proj.bias", {h}));
    }
  }
  t.emplace_back(kEnc + "final_norm.weight", get("model.norm.weight", {h}));
  if (s.untie) t.emplace_back(kLm + "output_layer.weight", get("lm_head.weight", {s.vocab, h}));
  hf::check_every_tensor_read(hf, read, hf_dir, llama_saved_buffer);
  for (auto& [name, x] : t) x = x.contiguous();

  auto text = [](double v) { return hf::number(v); };
  r.model_options = {{"num_layers", std::to_string(s.layers)},
                     {"hidden_size", std::to_string(s.hidden)},
                     {"num_attention_heads", std::to_string(s.heads)},
                     {"num_query_groups", std::to_string(s.groups)},
                     {"ffn_hidden_size", std::to_string(s.ffn)},
                     {"vocab_size", std::to_string(s.vocab)},
                     {"layernorm_epsilon", text(s.eps)},
                     {"rotary_base", text(s.rope_theta)},
                     {"attention_dropout", text(s.attention_dropout)},
                     {"hidden_dropout", "0"},
                     {"init_method_std", text(s.init_std)},
                     {"add_bias_linear", s.bias ? "true" : "false"},
                     {"untie_embeddings_and_output_weights", s.untie ? "true" : "false"},
                     {"rope_scaling", s.llama3 ? "llama3" : "none"}};
  if (s.head_dim * s.heads != s.hidden) r.model_options["kv_channels"] = std::to_string(s.head_dim);
  if (s.qkv_bias) r.model_options["add_qkv_bias"] = "true";
  if (s.window >= 0) r.model_options["window_size"] = std::to_string(s.window) + ",0";
  if (!s.window_layers.empty())
    r.model_options["window_attn_skip_freq"] = layer_list(s.layers, [&](int64_t l) { return s.windowed(l); });
  if (s.qk_norm) r.model_options["qk_layernorm"] = "true";
  if (s.has_experts()) {
    r.model_options["num_experts"] = std::to_string(s.experts);
    r.model_options["moe_router_topk"] = std::to_string(s.topk);
    if (s.moe_ffn != s.ffn) r.model_options["moe_ffn_hidden_size"] = std::to_string(s.moe_ffn);
    if (s.pre_softmax) r.model_options["moe_router_pre_softmax"] = "true";
    if (s.shared_ffn > 0) r.model_options["moe_shared_expert_intermediate_size"] = std::to_string(s.shared_ffn);
    if (s.shared_gate) r.model_options["moe_shared_expert_gate"] = "true";
    if (s.dense_layers() > 0)
      r.model_options["moe_layer_freq"] = layer_list(s.layers, [&](int64_t l) { return s.sparse(l); });
  }
  if (s.llama3) {
    r.model_options["rope_scaling_factor"] = text(s.rope_factor);
    r.model_options["rope_low_freq_factor"] = text(s.rope_low);
    r.model_options["rope_high_freq_factor"] = text(s.rope_high);
    r.model_options["rope_original_max_positions"] = std::to_string(s.rope_original);
  }
  return r;
}

}  // namespace dtk::core
