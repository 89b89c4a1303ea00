// hf_common.hpp — what the Hugging Face exports and imports share (hf_gpt2.cpp, hf_llama.cpp):
// safetensors written and read by DTK itself, the checkpoint's tensor-parallel pieces merged, a
// folder published whole or not at all, config.json's numbers. Internal to core/runtime.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtk::core::hf {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
// One map of model tensors per tensor-parallel rank.
using RankTensors = std::vector<std::map<std::string, at::Tensor>>;

// The shortest text that reads back as the same double (1e-05, not 1.0000000000000001e-05;
// 500000, not 5e+05).
std::string number(double v);
std::string json_string(const std::string& s);
// config.json's torch_dtype of a tensor type ("float32", "bfloat16", "float16").
const char* torch_dtype(at::ScalarType t);

// safetensors: u64 LE header length, the JSON header (padded with spaces to 8 bytes), the data.
void write_safetensors(const std::string& path, const NamedTensors& tensors);
// name -> tensor (copied out of the file); errors name the file and the tensor ("import hf: ...").
std::map<std::string, at::Tensor> read_safetensors(const std::string& file);
// A folder's weights: model.safetensors, or Hugging Face's sharded model.safetensors.index.json
// (its weight_map's files, each read once; every listed tensor must be in its file).
std::map<std::string, at::Tensor> read_hf_weights(const std::string& hf_dir);
bool ends_with(const std::string& name, const std::string& tail);
// A checkpoint's recorded boolean option as the options layer reads it (true, True or 1).
inline bool option_true(const std::string& v) { return v == "true" || v == "True" || v == "1"; }
// A model's window_size option ("W,0" as the model read it: spaces, parentheses and quotes
// aside) as W, the tokens before each one its window holds; -1 for none ("" or "-1,...").
int64_t window_of(const std::string& window_size);
// Refuses a folder holding tensors the import did not read (`read`: the names it took): config.json
// then describes less than the weights (n_layer too small, biases it does not mention) and the
// rest would be dropped without a word. `saved_buffer` names what Hugging Face saves that is not a
// weight (GPT-2's causal mask, rotary inverse frequencies, a tied lm_head).
void check_every_tensor_read(const std::map<std::string, at::Tensor>& hf, const std::set<std::string>& read,
                             const std::string& where, bool (*saved_buffer)(const std::string& name));
// A folder's config.json, parsed (one-line errors).
nlohmann::json read_hf_config(const std::string& hf_dir);
// config.json's field `key` of the expected type, `fallback` when absent or null; one line naming
// the file and the field when it holds another type (never the JSON library's own message).
std::string json_string_or(const nlohmann::json& j, const char* key, const std::string& fallback, const std::string& file);
bool json_bool_or(const nlohmann::json& j, const char* key, bool fallback, const std::string& file);

// A whole file's bytes; `what` names it in the error ("export hf: cannot read <what> <path>").
std::string read_whole(const std::string& path, const std::string& what);

// Every tensor-parallel rank's model tensors of `iter_dir`, verified against SHA256SUMS when
// `verify`; a pipeline-parallel checkpoint is refused (naming `dtk checkpoint convert`).
RankTensors read_rank_models(const std::string& iter_dir, bool verify);
// The whole tensor `name`, joined from the ranks along the dimension the model plugin lists (dims).
at::Tensor whole_tensor(const RankTensors& ranks, const std::map<std::string, int>& dims, const std::string& name);
// A norm's weight as Hugging Face multiplies by: 1 + w for zero-centred weights (the models'
// apply_layernorm_1p, added in fp32), else w.
at::Tensor norm_gain(const at::Tensor& w, bool zero_centred);
// Refuses a tensor whose shape is not `want`, naming both.
void expect_shape(const std::string& name, const at::Tensor& t, const std::vector<int64_t>& want);

// Writes model.safetensors and `files` (name -> text) into a temporary sibling of `out_dir`, then
// renames it: the folder appears whole or not at all.
void publish_folder(const std::string& out_dir, const NamedTensors& tensors,
                    const std::vector<std::pair<std::string, std::string>>& files);

// GPT-2's BPE tokenizer files for a folder: vocab.json, merges.txt, tokenizer_config.json,
// special_tokens_map.json (<|endoftext|> as bos, eos and unk).
std::vector<std::pair<std::string, std::string>> gpt2_tokenizer_files(const std::string& vocab,
                                                                      const std::string& merges,
                                                                      int64_t max_length);

}  // namespace dtk::core::hf
