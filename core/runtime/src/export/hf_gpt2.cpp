// A gpt-model checkpoint as a Hugging Face GPT2LMHeadModel folder: see dtk/core/export/hf_gpt2.hpp.
#include "dtk/core/export/hf_gpt2.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "../checkpoint/checkpoint_io.hpp"
#include "dtk/core/checkpoint/checkpoint_convert.hpp"
#include "dtk/host/error.hpp"

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

const char* safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kDouble: return "F64";
    default: throw HostError(std::string("export hf: tensors of type ") + c10::toString(t) + " are not exported");
  }
}

const char* torch_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return "float32";
  }
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// safetensors: u64 LE header length, the JSON header (padded with spaces to 8 bytes), the data.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    header += "," + json_string(name) + ":{\"dtype\":\"" + safetensors_dtype(t.scalar_type()) + "\",\"shape\":[";
    for (int64_t d = 0; d < t.dim(); ++d) header += (d ? "," : "") + std::to_string(t.size(d));
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string data;
  data.reserve(8 + header.size() + static_cast<size_t>(offset));
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) data += static_cast<char>((n >> (8 * i)) & 0xff);  // little-endian
  data += header;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.contiguous();
    data.append(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel() * c.element_size()));
  }
  ckpt::write_file_synced(path, data.data(), data.size());
}

void write_text(const std::string& path, const std::string& text) { ckpt::write_file_synced(path, text.data(), text.size()); }

std::string read_whole(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw HostError(std::string("export hf: cannot read ") + what + " " + path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.empty()) throw HostError(std::string("export hf: ") + what + " " + path + " is empty");
  return text;
}

// The shortest text that reads back as the same double (1e-05, not 1.0000000000000001e-05).
std::string number(double v) {
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

}  // namespace

Gpt2Shape gpt2_shape(const std::map<std::string, std::string>& o, int64_t run_seq_length) {
  Gpt2Shape s;
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
  s.untie = untie != o.end() && untie->second == "true";
  auto openai = o.find("openai_gelu");
  s.openai_gelu = openai != o.end() && openai->second == "true";
  return s;
}

namespace {

using RankTensors = std::vector<std::map<std::string, at::Tensor>>;

// Every tensor-parallel rank's model tensors, verified against SHA256SUMS (rank 0's file says how
// many ranks there are).
RankTensors read_rank_models(const std::string& iter_dir) {
  const ckpt::Checksums sums = ckpt::read_checksums(iter_dir);
  RankTensors ranks;
  int64_t tp_size = 1;
  for (int64_t tp = 0; tp < tp_size; ++tp) {
    const std::string relative = ckpt::mp_rank_dir(static_cast<int>(tp)) + "/" + ckpt::kModelFile;
    const std::string file = (fs::path(iter_dir) / relative).string();
    const auto d = ckpt::read_pickled_dict(file, tp > 0 ? " (the checkpoint is tensor-parallel)" : "", &sums, relative);
    if (tp == 0) {
      auto it = d.find(c10::IValue(std::string("tensor_model_parallel_size")));
      if (it != d.end() && it->value().isInt()) tp_size = std::max<int64_t>(1, it->value().toInt());
    }
    auto model = d.find(c10::IValue(std::string("model")));
    if (model == d.end() || !model->value().isGenericDict()) throw HostError("checkpoint " + file + " has no 'model' dict");
    std::map<std::string, at::Tensor> m;
    for (const auto& kv : model->value().toGenericDict())
      if (kv.key().isString() && kv.value().isTensor()) m[kv.key().toStringRef()] = kv.value().toTensor();
    ranks.push_back(std::move(m));
  }
  return ranks;
}

// The whole tensor `name`, joined from the tensor-parallel ranks along the dimension the model
// plugin lists for it.
at::Tensor whole_tensor(const RankTensors& ranks, const std::map<std::string, int>& dims, const std::string& name) {
  auto d = dims.find(name);
  if (d == dims.end() && ranks.size() > 1)
    throw HostError("export hf: the model plugin does not list '" + name +
                    "' as a parameter, so how its tensor-parallel pieces join is unknown");
  return merge_partitions(ranks, name, d == dims.end() ? -1 : d->second, "export hf");
}

void expect_shape(const std::string& name, const at::Tensor& t, const std::vector<int64_t>& want) {
  if (t.sizes().vec() != want) {
    std::string w = "[", g = "[";
    for (size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + std::to_string(want[i]);
    for (int64_t i = 0; i < t.dim(); ++i) g += (i ? ", " : "") + std::to_string(t.size(i));
    throw HostError("export hf: tensor '" + name + "' is " + g + "], the model's options say " + w +
                    "] (was the checkpoint written by another configuration?)");
  }
}

// The model's tensors under Hugging Face's GPT2LMHeadModel names and layouts (contiguous).
std::vector<std::pair<std::string, at::Tensor>> hf_tensors(const RankTensors& ranks, const Gpt2Shape& shape,
                                                           const std::map<std::string, int>& dims) {
  auto whole = [&](const std::string& name) { return whole_tensor(ranks, dims, name); };
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
  expect_shape("position_embeddings", wpe, {shape.positions, h});
  out.emplace_back("transformer.wpe.weight", wpe);
  for (int64_t l = 0; l < shape.layers; ++l) {
    const std::string m = enc + "layers." + std::to_string(l) + ".", hf = "transformer.h." + std::to_string(l) + ".";
    out.emplace_back(hf + "ln_1.weight", whole(m + "input_layernorm.weight"));
    out.emplace_back(hf + "ln_1.bias", whole(m + "input_layernorm.bias"));
    // Megatron's rows [head][q|k|v][hn] -> HF's columns [q|k|v][head][hn], as Conv1D [in, out].
    at::Tensor qkv_w = whole(m + "self_attention.query_key_value.weight");
    at::Tensor qkv_b = whole(m + "self_attention.query_key_value.bias");
    expect_shape(m + "self_attention.query_key_value.weight", qkv_w, {3 * h, h});
    out.emplace_back(hf + "attn.c_attn.weight", qkv_w.view({np, 3, hn, h}).transpose(0, 1).reshape({3 * h, h}).t());
    out.emplace_back(hf + "attn.c_attn.bias", qkv_b.view({np, 3, hn}).transpose(0, 1).reshape({3 * h}));
    out.emplace_back(hf + "attn.c_proj.weight", whole(m + "self_attention.dense.weight").t());
    out.emplace_back(hf + "attn.c_proj.bias", whole(m + "self_attention.dense.bias"));
    out.emplace_back(hf + "ln_2.weight", whole(m + "post_attention_layernorm.weight"));
    out.emplace_back(hf + "ln_2.bias", whole(m + "post_attention_layernorm.bias"));
    at::Tensor fc = whole(m + "mlp.dense_h_to_4h.weight");
    expect_shape(m + "mlp.dense_h_to_4h.weight", fc, {shape.ffn, h});
    out.emplace_back(hf + "mlp.c_fc.weight", fc.t());
    out.emplace_back(hf + "mlp.c_fc.bias", whole(m + "mlp.dense_h_to_4h.bias"));
    out.emplace_back(hf + "mlp.c_proj.weight", whole(m + "mlp.dense_4h_to_h.weight").t());
    out.emplace_back(hf + "mlp.c_proj.bias", whole(m + "mlp.dense_4h_to_h.bias"));
  }
  out.emplace_back("transformer.ln_f.weight", whole(enc + "final_layernorm.weight"));
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
         << "  \"layer_norm_epsilon\": " << number(shape.eps) << ",\n"
         << "  \"resid_pdrop\": " << number(shape.hidden_dropout) << ",\n"
         << "  \"embd_pdrop\": " << number(shape.hidden_dropout) << ",\n"
         << "  \"attn_pdrop\": " << number(shape.attention_dropout) << ",\n"
         << "  \"initializer_range\": " << number(shape.init_std) << ",\n"
         << "  \"scale_attn_weights\": true,\n"
         << "  \"tie_word_embeddings\": " << (shape.untie ? "false" : "true") << ",\n"
         << (gpt2_vocab ? "  \"bos_token_id\": 50256,\n  \"eos_token_id\": 50256,\n" : "") << "  \"torch_dtype\": \""
         << dtype << "\",\n"
         << "  \"use_cache\": true\n"
         << "}\n";
  return config.str();
}

// The folder's files: everything into a temporary sibling, then one rename, so the folder appears
// whole or not at all.
void write_hf_folder(const std::string& out_dir, const std::vector<std::pair<std::string, at::Tensor>>& out,
                     const std::string& config, const std::string& vocab, const std::string& merges,
                     const Gpt2Shape& shape) {
  const bool gpt2_vocab = shape.vocab == 50257;
  const std::string special = "\"<|endoftext|>\"";
  const std::string tokenizer_config = "{\n  \"tokenizer_class\": \"GPT2Tokenizer\",\n  \"model_max_length\": " +
                                       std::to_string(shape.positions) + ",\n  \"add_prefix_space\": false,\n" +
                                       "  \"bos_token\": " + special + ",\n  \"eos_token\": " + special +
                                       ",\n  \"unk_token\": " + special + "\n}\n";
  const std::string special_map =
      "{\n  \"bos_token\": " + special + ",\n  \"eos_token\": " + special + ",\n  \"unk_token\": " + special + "\n}\n";
  std::error_code ec;
  fs::path target = fs::path(out_dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  const std::string tmp = target.string() + ".tmp-" + ckpt::temp_owner(::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw HostError("export hf: cannot create " + tmp + ": " + ec.message());
  try {
    write_safetensors((fs::path(tmp) / "model.safetensors").string(), out);
    write_text((fs::path(tmp) / "config.json").string(), config);
    if (gpt2_vocab)
      write_text((fs::path(tmp) / "generation_config.json").string(),
                 "{\n  \"bos_token_id\": 50256,\n  \"eos_token_id\": 50256\n}\n");
    write_text((fs::path(tmp) / "vocab.json").string(), vocab);
    write_text((fs::path(tmp) / "merges.txt").string(), merges);
    write_text((fs::path(tmp) / "tokenizer_config.json").string(), tokenizer_config);
    write_text((fs::path(tmp) / "special_tokens_map.json").string(), special_map);
    ckpt::fsync_path(tmp, true);
    if (fs::exists(target, ec)) fs::remove(target, ec);  // empty (checked by the caller)
    fs::rename(tmp, target, ec);
    if (ec) throw HostError("export hf: rename " + tmp + " -> " + target.string() + " failed: " + ec.message());
  } catch (...) {
    std::error_code rm;
    fs::remove_all(tmp, rm);
    throw;
  }
}

}  // namespace

HfExportReport export_hf_gpt2(const std::string& iter_dir, const Gpt2Shape& shape, const std::string& out_dir,
                              const std::string& vocab_file, const std::string& merge_file,
                              const std::map<std::string, int>& dims) {
  std::error_code ec;
  if (fs::exists(out_dir, ec) && !(fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)))
    throw HostError("export hf: " + out_dir + " exists and is not an empty directory");
  const std::string vocab = read_whole(vocab_file, "the GPT-2 vocabulary (--vocab_file)");
  const std::string merges = read_whole(merge_file, "the GPT-2 merges (--merge_file)");

  if (ckpt::first_rank_dir(iter_dir) != ckpt::mp_rank_dir(0))
    throw HostError("export hf: checkpoint " + iter_dir + " was saved with pipeline stages (" +
                    ckpt::first_rank_dir(iter_dir) +
                    "): export needs the whole model in one stage (dtk checkpoint convert SRC DST "
                    "--pipeline_model_parallel_size 1 makes one)");
  const std::vector<std::pair<std::string, at::Tensor>> out = hf_tensors(read_rank_models(iter_dir), shape, dims);

  HfExportReport report;
  report.dtype = torch_dtype(out.front().second.scalar_type());  // the word embeddings'
  report.tensors = static_cast<int64_t>(out.size());
  write_hf_folder(out_dir, out, hf_config_json(shape, report.dtype), vocab, merges, shape);
  for (const auto& [name, t] : out) report.megabytes += static_cast<double>(t.numel() * t.element_size()) / 1e6;
  return report;
}

namespace {

at::ScalarType from_safetensors_dtype(const std::string& d, const std::string& file, const std::string& name) {
  if (d == "F32") return at::kFloat;
  if (d == "BF16") return at::kBFloat16;
  if (d == "F16") return at::kHalf;
  if (d == "F64") return at::kDouble;
  throw HostError("import hf: " + file + ": tensor '" + name + "' has dtype " + d + " (F32, BF16, F16, F64 are read)");
}

// model.safetensors: name -> tensor (copied out of the file).
std::map<std::string, at::Tensor> read_safetensors(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw HostError("import hf: cannot read " + file);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (data.size() < 8) throw HostError("import hf: " + file + " is too short for a safetensors file");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(data[static_cast<size_t>(i)]);
  if (n > data.size() - 8) throw HostError("import hf: " + file + ": header length " + std::to_string(n) + " exceeds the file");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(data.substr(8, n));
  } catch (const std::exception& e) {
    throw HostError("import hf: " + file + ": the header is not JSON: " + ckpt::first_line(e.what()));
  }
  const size_t base = 8 + n;
  std::map<std::string, at::Tensor> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto& e = it.value();
    try {
      const at::ScalarType type = from_safetensors_dtype(e.at("dtype").get<std::string>(), file, it.key());
      const auto shape = e.at("shape").get<std::vector<int64_t>>();
      const auto offsets = e.at("data_offsets").get<std::vector<uint64_t>>();
      at::Tensor t = at::empty(shape, type);
      const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
      if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] - offsets[0] != bytes ||
          base + offsets[1] > data.size())
        throw HostError("import hf: " + file + ": tensor '" + it.key() + "' has data_offsets that do not fit its shape or the file");
      std::memcpy(t.data_ptr(), data.data() + base + offsets[0], bytes);
      out[it.key()] = t;
    } catch (const nlohmann::json::exception& x) {
      throw HostError("import hf: " + file + ": tensor '" + it.key() + "': " + ckpt::first_line(x.what()));
    }
  }
  return out;
}

// config.json of a Hugging Face GPT-2 folder, parsed.
nlohmann::json read_hf_config(const std::string& config_file) {
  std::ifstream in(config_file);
  if (!in)
    throw HostError("import hf: cannot read " + config_file +
                    " (a Hugging Face GPT-2 folder has config.json and model.safetensors)");
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw HostError("import hf: " + config_file + " is not JSON: " + ckpt::first_line(e.what()));
  }
}

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
    return c.contains(key) && c[key].is_number() ? c[key].get<double>() : fallback;
  };
  const std::string type = c.value("model_type", "");
  if (type != "gpt2") throw HostError("import hf: " + config_file + ": model_type '" + type + "'; the gpt model imports gpt2");
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
  s.untie = c.contains("tie_word_embeddings") && c["tie_word_embeddings"].is_boolean() && !c["tie_word_embeddings"].get<bool>();
  const std::string act = c.value("activation_function", "gelu_new");
  if (act == "gelu_new" || act == "gelu_pytorch_tanh")
    s.openai_gelu = true;
  else if (act != "gelu")
    throw HostError("import hf: " + config_file + ": activation_function '" + act +
                    "'; the gpt model has gelu (erf) and gelu_new (tanh, model.openai_gelu)");
  if (c.value("scale_attn_by_inverse_layer_idx", false) || c.value("reorder_and_upcast_attn", false) ||
      !c.value("scale_attn_weights", true))
    throw HostError("import hf: " + config_file + ": another attention scaling than 1/sqrt(head size) is not in the gpt model");
  return s;
}

// The Hugging Face tensors under the gpt model's (Megatron's) names and layouts, contiguous.
std::vector<std::pair<std::string, at::Tensor>> megatron_tensors(const std::map<std::string, at::Tensor>& hf,
                                                                 const Gpt2Shape& s, const std::string& weights) {
  // Saved from GPT2LMHeadModel ("transformer.h.0...") or from GPT2Model ("h.0..."): both read.
  auto get = [&](const std::string& name, std::vector<int64_t> shape) {
    auto it = hf.find("transformer." + name);
    if (it == hf.end()) it = hf.find(name);
    if (it == hf.end()) throw HostError("import hf: " + weights + " has no tensor '" + name + "'");
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
  }
  for (auto& [name, x] : t) x = x.contiguous();
  return t;
}

}  // namespace

HfImport import_hf_gpt2(const std::string& hf_dir) {
  const std::string config_file = (fs::path(hf_dir) / "config.json").string();
  const std::string weights = (fs::path(hf_dir) / "model.safetensors").string();
  HfImport r;
  r.shape = shape_from_config(read_hf_config(config_file), config_file);
  const Gpt2Shape& s = r.shape;
  r.tensors = megatron_tensors(read_safetensors(weights), s, weights);
  auto text = [](double v) { return number(v); };
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
