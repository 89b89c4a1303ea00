// A gpt-model checkpoint as a Hugging Face GPT2LMHeadModel folder: see dtk/core/export/hf_gpt2.hpp.
#include "dtk/core/export/hf_gpt2.hpp"

#include <ATen/core/Tensor.h>
#include <filesystem>
#include <sstream>
#include <vector>

#include "dtk/core/checkpoint/checkpoint_convert.hpp"
#include "dtk/host/error.hpp"
#include "hf_common.hpp"

namespace dtk::core {

namespace fs = std::filesystem;
using host::HostError;

namespace {

int64_t option_int(const std::map<std::string, std::string>& o, const char* name) {
  auto it = o.find(name);
  if (it == o.end()) throw HostError(std::string("export hf: the gpt model has no option '") + name + "'");
  return std::stoll(it->second);
}
double option_float(const std::map<std::string, std::string>& o, const char* name) {
  auto it = o.find(name);
  if (it == o.end()) throw HostError(std::string("export hf: the gpt model has no option '") + name + "'");
  return std::stod(it->second);
}

}  // namespace

Gpt2Shape gpt2_shape(const std::map<std::string, std::string>& o, int64_t run_seq_length) {
  Gpt2Shape s;
  // A checkpoint from before mixture of experts has no num_experts: dense.
  if (auto experts = o.find("num_experts"); experts != o.end() && experts->second != "0")
    throw HostError("export hf: the gpt model has mixture-of-experts layers (num_experts " + experts->second +
                    "); Hugging Face's GPT2LMHeadModel has dense MLPs only");
  // A sliding window GPT-2's attention cannot hold.
  if (auto window = o.find("window_size"); window != o.end() && hf::window_of(window->second) >= 0)
    throw HostError("export hf: option 'window_size' is " + window->second +
                    ": Hugging Face's GPT2LMHeadModel attends to every earlier token (no sliding window)");
  s.layers = option_int(o, "num_layers");
  s.hidden = option_int(o, "hidden_size");
  s.heads = option_int(o, "num_attention_heads");
  s.ffn = option_int(o, "ffn_hidden_size");
  if (s.ffn == 0) s.ffn = 4 * s.hidden;
  s.vocab = option_int(o, "vocab_size");
  int64_t seq = option_int(o, "seq_length");
  if (seq == 0) seq = run_seq_length;
  s.positions = option_int(o, "max_position_embeddings");
  if (s.positions == 0) s.positions = seq;
  s.eps = option_float(o, "layernorm_epsilon");
  s.hidden_dropout = option_float(o, "hidden_dropout");
  s.attention_dropout = option_float(o, "attention_dropout");
  s.init_std = option_float(o, "init_method_std");
  auto untie = o.find("untie_embeddings_and_output_weights");
  s.untie = untie != o.end() && hf::option_true(untie->second);
  auto openai = o.find("openai_gelu");
  s.openai_gelu = openai != o.end() && hf::option_true(openai->second);
  auto one_p = o.find("apply_layernorm_1p");  // (absent in checkpoints older than the option)
  s.norm_1p = one_p != o.end() && hf::option_true(one_p->second);
  return s;
}

namespace {

using hf::RankTensors;

// The model's tensors under Hugging Face's GPT2LMHeadModel names and layouts (contiguous).
hf::NamedTensors hf_tensors(const RankTensors& ranks, const Gpt2Shape& shape,
                                                           const std::map<std::string, int>& dims) {
  auto whole = [&](const std::string& name) { return hf::whole_tensor(ranks, dims, name); };
  auto gain = [&](const std::string& name) { return hf::norm_gain(whole(name), shape.norm_1p); };
  const int64_t h = shape.hidden, np = shape.heads, hn = shape.hidden / shape.heads;
  std::vector<std::pair<std::string, at::Tensor>> out;
  const std::string lm = "language_model.", enc = "language_model.encoder.";
  at::Tensor wte = whole(lm + "embedding.word_embeddings.weight");
  if (wte.dim() != 2 || wte.size(0) < shape.vocab || wte.size(1) != h)
    throw HostError("export hf: word embeddings are [" + std::to_string(wte.size(0)) + ", " +
                    std::to_string(wte.dim() > 1 ? wte.size(1) : 0) + "], expected at least [" +
                    std::to_string(shape.vocab) + ", " + std::to_string(h) + "]");
  out.emplace_back("transformer.wte.weight", wte.narrow(0, 0, shape.vocab));  // padding rows dropped
  at::Tensor wpe = whole(lm + "embedding.position_embeddings.weight");
  hf::expect_shape("position_embeddings", wpe, {shape.positions, h});
  out.emplace_back("transformer.wpe.weight", wpe);
  for (int64_t l = 0; l < shape.layers; ++l) {
    const std::string m = enc + "layers." + std::to_string(l) + ".", hf = "transformer.h." + std::to_string(l) + ".";
    out.emplace_back(hf + "ln_1.weight", gain(m + "input_layernorm.weight"));
    out.emplace_back(hf + "ln_1.bias", whole(m + "input_layernorm.bias"));
    // Megatron's rows [head][q|k|v][hn] -> HF's columns [q|k|v][head][hn], as Conv1D [in, out].
    at::Tensor qkv_w = whole(m + "self_attention.query_key_value.weight");
    at::Tensor qkv_b = whole(m + "self_attention.query_key_value.bias");
    hf::expect_shape(m + "self_attention.query_key_value.weight", qkv_w, {3 * h, h});
    out.emplace_back(hf + "attn.c_attn.weight", qkv_w.view({np, 3, hn, h}).transpose(0, 1).reshape({3 * h, h}).t());
    out.emplace_back(hf + "attn.c_attn.bias", qkv_b.view({np, 3, hn}).transpose(0, 1).reshape({3 * h}));
    out.emplace_back(hf + "attn.c_proj.weight", whole(m + "self_attention.dense.weight").t());
    out.emplace_back(hf + "attn.c_proj.bias", whole(m + "self_attention.dense.bias"));
    out.emplace_back(hf + "ln_2.weight", gain(m + "post_attention_layernorm.weight"));
    out.emplace_back(hf + "ln_2.bias", whole(m + "post_attention_layernorm.bias"));
    at::Tensor fc = whole(m + "mlp.dense_h_to_4h.weight");
    hf::expect_shape(m + "mlp.dense_h_to_4h.weight", fc, {shape.ffn, h});
    out.emplace_back(hf + "mlp.c_fc.weight", fc.t());
    out.emplace_back(hf + "mlp.c_fc.bias", whole(m + "mlp.dense_h_to_4h.bias"));
    out.emplace_back(hf + "mlp.c_proj.weight", whole(m + "mlp.dense_4h_to_h.weight").t());
    out.emplace_back(hf + "mlp.c_proj.bias", whole(m + "mlp.dense_4h_to_h.bias"));
  }
  out.emplace_back("transformer.ln_f.weight", gain(enc + "final_layernorm.weight"));
  out.emplace_back("transformer.ln_f.bias", whole(enc + "final_layernorm.bias"));
  if (shape.untie) out.emplace_back("lm_head.weight", whole(lm + "output_layer.weight").narrow(0, 0, shape.vocab));
  for (auto& [name, t] : out) t = t.contiguous();
  return out;
}

// config.json of a GPT2LMHeadModel with this shape (GPT-2's token ids only with its vocabulary).
std::string hf_config_json(const Gpt2Shape& shape, const std::string& dtype) {
  const bool gpt2_vocab = shape.vocab == 50257;
  std::ostringstream config;
  config << "{\n"
         << "  \"architectures\": [\"GPT2LMHeadModel\"],\n"
         << "  \"model_type\": \"gpt2\",\n"
         << "  \"vocab_size\": " << shape.vocab << ",\n"
         << "  \"n_positions\": " << shape.positions << ",\n"
         << "  \"n_ctx\": " << shape.positions << ",\n"
         << "  \"n_embd\": " << shape.hidden << ",\n"
         << "  \"n_layer\": " << shape.layers << ",\n"
         << "  \"n_head\": " << shape.heads << ",\n"
         << "  \"n_inner\": " << shape.ffn << ",\n"
         << "  \"activation_function\": \"" << (shape.openai_gelu ? "gelu_new" : "gelu") << "\",\n"
         << "  \"layer_norm_epsilon\": " << hf::number(shape.eps) << ",\n"
         << "  \"resid_pdrop\": " << hf::number(shape.hidden_dropout) << ",\n"
         << "  \"embd_pdrop\": " << hf::number(shape.hidden_dropout) << ",\n"
         << "  \"attn_pdrop\": " << hf::number(shape.attention_dropout) << ",\n"
         << "  \"initializer_range\": " << hf::number(shape.init_std) << ",\n"
         << "  \"scale_attn_weights\": true,\n"
         << "  \"tie_word_embeddings\": " << (shape.untie ? "false" : "true") << ",\n"
         << (gpt2_vocab ? "  \"bos_token_id\": 50256,\n  \"eos_token_id\": 50256,\n" : "") << "  \"torch_dtype\": \""
         << dtype << "\",\n"
         << "  \"use_cache\": true\n"
         << "}\n";
  return config.str();
}

}  // namespace

HfExportReport export_hf_gpt2(const std::string& iter_dir, const Gpt2Shape& shape, const std::string& out_dir,
                              const std::string& vocab_file, const std::string& merge_file,
                              const std::map<std::string, int>& dims, bool verify) {
  require_new_or_empty_folder(out_dir, "export hf");
  const std::string vocab = hf::read_whole(vocab_file, "the GPT-2 vocabulary (--vocab_file)");
  const std::string merges = hf::read_whole(merge_file, "the GPT-2 merges (--merge_file)");
  const hf::NamedTensors out = hf_tensors(hf::read_rank_models(iter_dir, verify), shape, dims);

  HfExportReport report;
  report.dtype = hf::torch_dtype(out.front().second.scalar_type());  // the word embeddings'
  report.tensors = static_cast<int64_t>(out.size());
  std::vector<std::pair<std::string, std::string>> files = {{"config.json", hf_config_json(shape, report.dtype)}};
  if (shape.vocab == 50257)  // GPT-2's token ids only with its vocabulary
    files.emplace_back("generation_config.json", "{\n  \"bos_token_id\": 50256,\n  \"eos_token_id\": 50256\n}\n");
  for (auto& f : hf::gpt2_tokenizer_files(vocab, merges, shape.positions)) files.push_back(std::move(f));
  hf::publish_folder(out_dir, out, files);
  for (const auto& [name, t] : out) report.megabytes += static_cast<double>(t.numel() * t.element_size()) / 1e6;
  return report;
}

namespace {

// The model's shape from config.json; what the gpt model cannot be (another model type,
// activation or attention scaling) is refused.
Gpt2Shape shape_from_config(const nlohmann::json& c, const std::string& config_file) {
  Gpt2Shape s;
  auto integer = [&](const char* key, bool required = true) -> int64_t {
    if (!c.contains(key) || c[key].is_null()) {
      if (required) throw HostError(std::string("import hf: ") + config_file + " has no '" + key + "'");
      return 0;
    }
    if (!c[key].is_number_integer()) throw HostError(std::string("import hf: ") + config_file + ": '" + key + "' is not an integer");
    return c[key].get<int64_t>();
  };
  auto real = [&](const char* key, double fallback) {
    if (!c.contains(key) || c[key].is_null()) return fallback;
    if (!c[key].is_number()) throw HostError(std::string("import hf: ") + config_file + ": '" + key + "' is not a number");
    return c[key].get<double>();
  };
  const std::string type = hf::json_string_or(c, "model_type", "", config_file);
  if (type != "gpt2")
    throw HostError("import hf: " + config_file + ": model_type '" + type +
                    "' (dtk imports gpt2 into the gpt model and llama, mistral, mixtral, qwen2, qwen3, qwen2_moe and "
                    "qwen3_moe into the llama model)");
  s.layers = integer("n_layer"), s.hidden = integer("n_embd"), s.heads = integer("n_head");
  s.vocab = integer("vocab_size"), s.positions = integer("n_positions");
  s.ffn = integer("n_inner", false);
  if (s.ffn == 0) s.ffn = 4 * s.hidden;
  if (s.layers <= 0 || s.hidden <= 0 || s.heads <= 0 || s.hidden % s.heads != 0 || s.vocab <= 0 || s.positions <= 0)
    throw HostError("import hf: " + config_file + ": n_layer, n_embd, n_head (dividing n_embd), vocab_size and n_positions must be positive");
  s.eps = real("layer_norm_epsilon", 1e-5);
  s.hidden_dropout = real("resid_pdrop", 0.1);
  s.attention_dropout = real("attn_pdrop", 0.1);
  s.init_std = real("initializer_range", 0.02);
  s.untie = !hf::json_bool_or(c, "tie_word_embeddings", true, config_file);
  const std::string act = hf::json_string_or(c, "activation_function", "gelu_new", config_file);
  if (act == "gelu_new" || act == "gelu_pytorch_tanh")
    s.openai_gelu = true;
  else if (act != "gelu")
    throw HostError("import hf: " + config_file + ": activation_function '" + act +
                    "'; the gpt model has gelu (erf) and gelu_new (tanh, model.openai_gelu)");
  if (hf::json_bool_or(c, "scale_attn_by_inverse_layer_idx", false, config_file) ||
      hf::json_bool_or(c, "reorder_and_upcast_attn", false, config_file) || !hf::json_bool_or(c, "scale_attn_weights", true, config_file))
    throw HostError("import hf: " + config_file + ": another attention scaling than 1/sqrt(head size) is not in the gpt model");
  return s;
}

// What transformers saves besides GPT-2's weights: each layer's causal mask (attn.bias,
// attn.masked_bias in older saves) and, tied, the output layer (the word embeddings again).
bool gpt2_saved_buffer(const std::string& name) {
  return hf::ends_with(name, ".attn.bias") || hf::ends_with(name, ".attn.masked_bias") || name == "lm_head.weight";
}

// The Hugging Face tensors under the gpt model's (Megatron's) names and layouts, contiguous.
std::vector<std::pair<std::string, at::Tensor>> megatron_tensors(const std::map<std::string, at::Tensor>& hf,
                                                                 const Gpt2Shape& s, const std::string& weights) {
  // Saved from GPT2LMHeadModel ("transformer.h.0...") or from GPT2Model ("h.0..."): both read.
  std::set<std::string> read;
  auto get = [&](const std::string& name, std::vector<int64_t> shape) {
    auto it = hf.find("transformer." + name);
    if (it == hf.end()) it = hf.find(name);
    if (it == hf.end()) throw HostError("import hf: " + weights + " has no tensor '" + name + "'");
    read.insert(it->first);
    if (it->second.sizes().vec() != shape) {
      std::string want, got;
      for (auto d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      for (auto d : it->second.sizes()) got += (got.empty() ? "" : ", ") + std::to_string(d);
      throw HostError("import hf: " + weights + ": tensor '" + it->first + "' is [" + got + "], config.json says [" + want + "]");
    }
    return it->second;
  };
  const int64_t h = s.hidden, np = s.heads, hn = h / np;
  const std::string lm = "language_model.", enc = "language_model.encoder.";
  std::vector<std::pair<std::string, at::Tensor>> t;
  t.emplace_back(lm + "embedding.word_embeddings.weight", get("wte.weight", {s.vocab, h}));
  t.emplace_back(lm + "embedding.position_embeddings.weight", get("wpe.weight", {s.positions, h}));
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string m = enc + "layers." + std::to_string(l) + ".", g = "h." + std::to_string(l) + ".";
    t.emplace_back(m + "input_layernorm.weight", get(g + "ln_1.weight", {h}));
    t.emplace_back(m + "input_layernorm.bias", get(g + "ln_1.bias", {h}));
    // HF's columns [q|k|v][head][hn] -> Megatron's rows [head][q|k|v][hn].
    t.emplace_back(m + "self_attention.query_key_value.weight",
                   get(g + "attn.c_attn.weight", {h, 3 * h}).t().reshape({3, np, hn, h}).transpose(0, 1).reshape({3 * h, h}));
    t.emplace_back(m + "self_attention.query_key_value.bias",
                   get(g + "attn.c_attn.bias", {3 * h}).view({3, np, hn}).transpose(0, 1).reshape({3 * h}));
    t.emplace_back(m + "self_attention.dense.weight", get(g + "attn.c_proj.weight", {h, h}).t());
    t.emplace_back(m + "self_attention.dense.bias", get(g + "attn.c_proj.bias", {h}));
    t.emplace_back(m + "post_attention_layernorm.weight", get(g + "ln_2.weight", {h}));
    t.emplace_back(m + "post_attention_layernorm.bias", get(g + "ln_2.bias", {h}));
    t.emplace_back(m + "mlp.dense_h_to_4h.weight", get(g + "mlp.c_fc.weight", {h, s.ffn}).t());
    t.emplace_back(m + "mlp.dense_h_to_4h.bias", get(g + "mlp.c_fc.bias", {s.ffn}));
    t.emplace_back(m + "mlp.dense_4h_to_h.weight", get(g + "mlp.c_proj.weight", {s.ffn, h}).t());
    t.emplace_back(m + "mlp.dense_4h_to_h.bias", get(g + "mlp.c_proj.bias", {h}));
  }
  t.emplace_back(enc + "final_layernorm.weight", get("ln_f.weight", {h}));
  t.emplace_back(enc + "final_layernorm.bias", get("ln_f.bias", {h}));
  if (s.untie) {
    auto it = hf.find("lm_head.weight");
    if (it == hf.end()) throw HostError("import hf: " + weights + " has no 'lm_head.weight' (config.json: tie_word_embeddings false)");
    t.emplace_back(lm + "output_layer.weight", it->second);
    read.insert(it->first);
  }
  hf::check_every_tensor_read(hf, read, weights, gpt2_saved_buffer);
  for (auto& [name, x] : t) x = x.contiguous();
  return t;
}

}  // namespace

HfImport import_hf_gpt2(const std::string& hf_dir) {
  const std::string config_file = (fs::path(hf_dir) / "config.json").string();
  const std::string weights = (fs::path(hf_dir) / "model.safetensors").string();
  HfImport r;
  r.shape = shape_from_config(hf::read_hf_config(hf_dir), config_file);
  const Gpt2Shape& s = r.shape;
  r.tensors = megatron_tensors(hf::read_hf_weights(hf_dir), s, weights);
  auto text = [](double v) { return hf::number(v); };
  r.model_options = {{"num_layers", std::to_string(s.layers)},
                     {"hidden_size", std::to_string(s.hidden)},
                     {"num_attention_heads", std::to_string(s.heads)},
                     {"ffn_hidden_size", std::to_string(s.ffn)},
                     {"vocab_size", std::to_string(s.vocab)},
                     {"max_position_embeddings", std::to_string(s.positions)},
                     {"layernorm_epsilon", text(s.eps)},
                     {"hidden_dropout", text(s.hidden_dropout)},
                     {"attention_dropout", text(s.attention_dropout)},
                     {"init_method_std", text(s.init_std)},
                     {"openai_gelu", s.openai_gelu ? "true" : "false"},
                     {"untie_embeddings_and_output_weights", s.untie ? "true" : "false"}};
  return r;
}

}  // namespace dtk::core
