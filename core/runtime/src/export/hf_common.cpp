// What the Hugging Face exports and imports share: see hf_common.hpp.
#include "hf_common.hpp"

#include <ATen/ops/empty.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "../checkpoint/checkpoint_io.hpp"
#include "dtk/core/checkpoint/checkpoint_convert.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core::hf {

namespace fs = std::filesystem;
using host::HostError;

std::string number(double v) {
  char buf[32];
  if (v == static_cast<double>(static_cast<int64_t>(v)) && std::abs(v) < 1e15) {  // 500000, not 5e+05
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
    return buf;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

const char* torch_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return "float32";
  }
}

namespace {

const char* safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kDouble: return "F64";
    default: throw HostError(std::string("export hf: tensors of type ") + c10::toString(t) + " are not exported");
  }
}

at::ScalarType from_safetensors_dtype(const std::string& d, const std::string& file, const std::string& name) {
  if (d == "F32") return at::kFloat;
  if (d == "BF16") return at::kBFloat16;
  if (d == "F16") return at::kHalf;
  if (d == "F64") return at::kDouble;
  throw HostError("import hf: " + file + ": tensor '" + name + "' has dtype " + d + " (F32, BF16, F16, F64 are read)");
}

nlohmann::json parse_json_file(const std::string& file, const std::string& missing_hint) {
  std::ifstream in(file);
  if (!in) throw HostError("import hf: cannot read " + file + missing_hint);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw HostError("import hf: " + file + " is not JSON: " + ckpt::first_line(e.what()));
  }
  // Every JSON file of a Hugging Face folder is an object (its keys are what is read).
  if (!j.is_object()) throw HostError("import hf: " + file + " holds a JSON " + j.type_name() + ", not an object");
  return j;
}

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors) {
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

namespace {
struct SafetensorsEntry {
  std::string name;
  at::ScalarType type = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t start = 0, bytes = 0;  // within the buffer after the header
};

// As the format requires: the tensors' byte ranges tile the buffer after the header, with no
// overlap (two tensors reading the same bytes), no gap and nothing after the last one (a file
// truncated and re-padded, or two files concatenated).
void require_exact_cover(const std::string& file, const std::vector<SafetensorsEntry>& entries, uint64_t buffer_bytes) {
  std::vector<const SafetensorsEntry*> by_start;
  for (const auto& e : entries)
    if (e.bytes > 0) by_start.push_back(&e);  // an empty tensor covers nothing
  // Stable: tensors at the same offset are named in the header's order.
  std::stable_sort(by_start.begin(), by_start.end(), [](const auto* a, const auto* b) { return a->start < b->start; });
  uint64_t end = 0;
  std::string previous;
  for (const SafetensorsEntry* e : by_start) {
    if (e->start < end)
      throw HostError("import hf: " + file + ": tensors '" + previous + "' and '" + e->name + "' overlap in the file");
    if (e->start > end)
      throw HostError("import hf: " + file + ": " + std::to_string(e->start - end) + " byte(s) before tensor '" +
                      e->name + "' belong to no tensor");
    end = e->start + e->bytes;
    previous = e->name;
  }
  if (end != buffer_bytes)
    throw HostError("import hf: " + file + ": " + std::to_string(buffer_bytes - end) +
                    " byte(s) after the last tensor belong to no tensor (a damaged or concatenated file?)");
}

// One header entry, checked field by field so that a message names what is wrong, and its size
// against the buffer: a shape whose product overflows or exceeds the file is a damaged header, not
// a request for memory.
SafetensorsEntry safetensors_entry(const std::string& file, const std::string& name, const nlohmann::json& e,
                                   uint64_t buffer_bytes) {
  auto fail = [&](const std::string& what) {
    return HostError("import hf: " + file + ": tensor '" + name + "' " + what);
  };
  if (!e.is_object()) throw fail(std::string("is a JSON ") + e.type_name() + ", not {dtype, shape, data_offsets}");
  if (!e.contains("dtype") || !e["dtype"].is_string()) throw fail("has no 'dtype' string");
  for (const char* field : {"shape", "data_offsets"}) {
    if (!e.contains(field) || !e[field].is_array()) throw fail(std::string("has no '") + field + "' array");
    for (const auto& v : e[field])
      if (!v.is_number_unsigned())
        throw HostError("import hf: " + file + ": tensor '" + name + "': '" + field +
                        "' holds something other than non-negative integers");
  }
  SafetensorsEntry out;
  out.name = name;
  out.type = from_safetensors_dtype(e["dtype"].get<std::string>(), file, name);
  for (const auto& v : e["shape"]) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) throw fail("has a shape larger than the file");
    out.shape.push_back(v.get<int64_t>());
  }
  const bool empty = std::find(out.shape.begin(), out.shape.end(), 0) != out.shape.end();
  uint64_t bytes = empty ? 0 : c10::elementSize(out.type);
  for (const int64_t d : out.shape) {
    if (empty) break;
    if (bytes > buffer_bytes / static_cast<uint64_t>(d)) throw fail("has a shape larger than the file");
    bytes *= static_cast<uint64_t>(d);
  }
  const auto& offsets = e["data_offsets"];
  if (offsets.size() != 2 || offsets[1].get<uint64_t>() < offsets[0].get<uint64_t>() ||
      offsets[1].get<uint64_t>() - offsets[0].get<uint64_t>() != bytes || offsets[1].get<uint64_t>() > buffer_bytes)
    throw fail("has data_offsets that do not fit its shape or the file");
  out.start = offsets[0].get<uint64_t>();
  out.bytes = bytes;
  return out;
}
}  // namespace

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
  if (!header.is_object())
    throw HostError("import hf: " + file + ": the header is a JSON " + std::string(header.type_name()) +
                    ", not an object of tensors (not a safetensors file?)");
  const size_t base = 8 + n;
  const uint64_t buffer_bytes = data.size() - base;
  // First the whole header against the buffer, then the reads: nothing is allocated for a header
  // that does not describe its file.
  std::vector<SafetensorsEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      // The format's metadata is a map of strings (null: none); anything else is a damaged or
      // foreign header.
      bool strings = it.value().is_object() || it.value().is_null();
      if (it.value().is_object())
        for (const auto& v : it.value()) strings = strings && v.is_string();
      if (!strings)
        throw HostError("import hf: " + file +
                        ": '__metadata__' is not an object of strings (not a safetensors file?)");
      continue;
    }
    entries.push_back(safetensors_entry(file, it.key(), it.value(), buffer_bytes));
  }
  require_exact_cover(file, entries, buffer_bytes);
  std::map<std::string, at::Tensor> out;
  for (const SafetensorsEntry& e : entries) {
    at::Tensor t = at::empty(e.shape, e.type);
    std::memcpy(t.data_ptr(), data.data() + base + e.start, e.bytes);
    // A NaN or infinity in a weight trains nothing but NaNs: refused here, named, not at step 1.
    if (at::isFloatingType(e.type) && t.numel() > 0 && !at::isfinite(t).all().item<bool>()) {
      const int64_t bad = t.numel() - at::isfinite(t).sum().item<int64_t>();
      throw HostError("import hf: " + file + ": tensor '" + e.name + "' holds " + std::to_string(bad) +
                      " NaN or infinite value(s)");
    }
    out[e.name] = t;
  }
  return out;
}

std::map<std::string, at::Tensor> read_hf_weights(const std::string& hf_dir) {
  const std::string single = (fs::path(hf_dir) / "model.safetensors").string();
  const std::string index = (fs::path(hf_dir) / "model.safetensors.index.json").string();
  std::error_code ec;
  if (fs::exists(single, ec) || !fs::exists(index, ec)) return read_safetensors(single);
  const nlohmann::json j = parse_json_file(index, "");
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw HostError("import hf: " + index + " has no 'weight_map' object");
  std::map<std::string, std::set<std::string>> by_file;  // shard -> the tensors the index puts there
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) throw HostError("import hf: " + index + ": weight_map['" + it.key() + "'] is not a file name");
    const std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
      throw HostError("import hf: " + index + ": weight_map['" + it.key() + "'] names '" + shard + "', not a file of the folder");
    by_file[shard].insert(it.key());
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& [shard, names] : by_file) {
    const std::string file = (fs::path(hf_dir) / shard).string();
    std::map<std::string, at::Tensor> part = read_safetensors(file);
    for (const std::string& name : names) {
      auto t = part.find(name);
      if (t == part.end()) throw HostError("import hf: " + index + " puts '" + name + "' in " + shard + ", which lacks it");
      out[name] = t->second;
    }
  }
  return out;
}

std::string json_string_or(const nlohmann::json& j, const char* key, const std::string& fallback, const std::string& file) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_string())
    throw HostError("import hf: " + file + ": '" + key + "' is a JSON " + j[key].type_name() + ", not a string");
  return j[key].get<std::string>();
}

bool json_bool_or(const nlohmann::json& j, const char* key, bool fallback, const std::string& file) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean())
    throw HostError("import hf: " + file + ": '" + key + "' is a JSON " + j[key].type_name() + ", not true or false");
  return j[key].get<bool>();
}

bool ends_with(const std::string& name, const std::string& tail) {
  return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

void check_every_tensor_read(const std::map<std::string, at::Tensor>& hf, const std::set<std::string>& read,
                             const std::string& where, bool (*saved_buffer)(const std::string& name)) {
  std::vector<std::string> left;
  for (const auto& [name, tensor] : hf)
    if (read.count(name) == 0 && !saved_buffer(name)) left.push_back(name);
  if (left.empty()) return;
  throw HostError("import hf: " + where + " holds " + std::to_string(left.size()) + " tensor" +
                  (left.size() == 1 ? "" : "s") + " config.json does not describe (first '" + left.front() +
                  "'): do its layers, biases and tied embeddings match the weights?");
}

nlohmann::json read_hf_config(const std::string& hf_dir) {
  return parse_json_file((fs::path(hf_dir) / "config.json").string(),
                         " (a Hugging Face folder has config.json and model.safetensors)");
}

std::string read_whole(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw HostError("export hf: cannot read " + what + " " + path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.empty()) throw HostError("export hf: " + what + " " + path + " is empty");
  return text;
}

RankTensors read_rank_models(const std::string& iter_dir, bool verify) {
  const ckpt::Checksums sums = ckpt::checksums_to_check(iter_dir, verify, "--noverify");
  const ckpt::StageDirs dirs = ckpt::saved_stage_dirs(iter_dir, sums);
  if (dirs.staged)
    throw HostError("export hf: checkpoint " + iter_dir + " was saved with pipeline stages (" +
                    ckpt::first_rank_dir(iter_dir) +
                    "): export needs the whole model in one stage (dtk checkpoint convert SRC DST "
                    "--pipeline_model_parallel_size 1 makes one)");
  RankTensors ranks;
  int64_t tp_size = 1;  // rank 0's file says how many ranks there are
  for (int64_t tp = 0; tp < tp_size; ++tp) {
    // Under expert parallelism every expert-parallel rank's directory, each with its own experts.
    c10::impl::GenericDict first(c10::StringType::get(), c10::AnyType::get());
    const TensorList model = ckpt::read_stage_model(iter_dir, static_cast<int>(tp), dirs.ep, sums, &first,
                                                    tp > 0 ? " (the checkpoint is tensor-parallel)" : "");
    if (tp == 0) {
      auto it = first.find(c10::IValue(std::string("tensor_model_parallel_size")));
      if (it != first.end() && it->value().isInt()) tp_size = std::max<int64_t>(1, it->value().toInt());
    }
    ranks.emplace_back(model.begin(), model.end());
  }
  return ranks;
}

at::Tensor norm_gain(const at::Tensor& w, bool zero_centred) {
  return zero_centred ? (w.to(at::kFloat) + 1).to(w.scalar_type()) : w;
}

int64_t window_of(const std::string& window_size) {
  std::string w;
  for (const char ch : window_size)
    if (std::isdigit(static_cast<unsigned char>(ch)) || ch == '-' || ch == ',') w += ch;
  if (w.empty() || w.rfind("-1,", 0) == 0 || w.find_first_of("0123456789") == std::string::npos) return -1;
  return std::stoll(w.substr(0, w.find(',')));
}

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

void publish_folder(const std::string& out_dir, const NamedTensors& tensors,
                    const std::vector<std::pair<std::string, std::string>>& files) {
  std::error_code ec;
  fs::path target = fs::path(out_dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  const std::string tmp = target.string() + ".tmp-" + ckpt::temp_owner(::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw HostError("export hf: cannot create " + tmp + ": " + ec.message());
  try {
    write_safetensors((fs::path(tmp) / "model.safetensors").string(), tensors);
    for (const auto& [name, text] : files) ckpt::write_file_synced((fs::path(tmp) / name).string(), text.data(), text.size());
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

std::vector<std::pair<std::string, std::string>> gpt2_tokenizer_files(const std::string& vocab,
                                                                      const std::string& merges,
                                                                      int64_t max_length) {
  const std::string special = "\"<|endoftext|>\"";
  const std::string tokenizer_config = "{\n  \"tokenizer_class\": \"GPT2Tokenizer\",\n  \"model_max_length\": " +
                                       std::to_string(max_length) + ",\n  \"add_prefix_space\": false,\n" +
                                       "  \"bos_token\": " + special + ",\n  \"eos_token\": " + special +
                                       ",\n  \"unk_token\": " + special + "\n}\n";
  const std::string special_map =
      "{\n  \"bos_token\": " + special + ",\n  \"eos_token\": " + special + ",\n  \"unk_token\": " + special + "\n}\n";
  return {{"vocab.json", vocab},
          {"merges.txt", merges},
          {"tokenizer_config.json", tokenizer_config},
          {"special_tokens_map.json", special_map}};
}

}  // namespace dtk::core::hf
