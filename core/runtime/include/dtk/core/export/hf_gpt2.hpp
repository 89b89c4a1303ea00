// dtk/core/export/hf_gpt2.hpp — a gpt-model checkpoint as a Hugging Face GPT2LMHeadModel folder.
//
// `dtk export hf CHECKPOINT OUT` writes, with no Python and no pickle:
//   config.json         GPT2Config: n_layer, n_embd, n_head, n_inner, n_positions, vocab_size (the
//                       unpadded vocabulary), layer_norm_epsilon, activation_function ("gelu": the
//                       gpt model's MLP uses the exact erf GELU, not GPT-2's tanh "gelu_new"),
//                       dropouts, tie_word_embeddings, torch_dtype
//   model.safetensors   every tensor under Hugging Face's names: 8-byte little-endian header length,
//                       the JSON header (dtype, shape, data_offsets per tensor), the raw data
//   vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json, generation_config.json
//
// Re-layouts (Megatron -> HF): tensor-parallel partitions are concatenated first (column-parallel
// and vocab-parallel along dim 0, row-parallel along dim 1); the fused query_key_value rows,
// grouped per head as [q_h, k_h, v_h] in Megatron, become c_attn's [q | k | v] columns; every
// linear weight is transposed into HF's Conv1D [in, out]; the padded vocabulary rows are dropped;
// the output layer is tied to wte unless the model was trained untied (then lm_head.weight).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtk::core {

struct Gpt2Shape {
  int64_t layers = 0, hidden = 0, heads = 0, ffn = 0, vocab = 0, positions = 0;
  double eps = 1e-5, hidden_dropout = 0, attention_dropout = 0, init_std = 0.02;
  bool untie = false;
  bool openai_gelu = false;  // "gelu_new" (tanh) rather than "gelu" (erf)
  bool norm_1p = false;      // apply_layernorm_1p: norm weights saved as w, Hugging Face's are 1 + w
};

// From the gpt model plugin's resolved options (defaults included) and the run's seq_length.
Gpt2Shape gpt2_shape(const std::map<std::string, std::string>& options, int64_t run_seq_length);

struct HfExportReport {
  int64_t tensors = 0;
  double megabytes = 0;
  std::string dtype;  // "float32", "bfloat16", ...
  int64_t padding_rows = 0;  // vocabulary padding rows dropped (llama)
  std::string tokenizer;     // the tokenizer files written, in words ("" = none; llama)
};

// Exports iteration directory `iter_dir` (every file read checked against its SHA256SUMS when
// `verify`) to `out_dir`,
// which must not exist or be empty; it appears whole or not at all (written to a temporary
// sibling, then renamed). `vocab_file` / `merge_file`: the GPT-2 BPE files (encoder.json,
// vocab.bpe) copied as vocab.json / merges.txt. Errors: one line naming the file or tensor.
// `dims`: each parameter's tensor-parallel partition dimension, from the model plugin
// (checkpoint_convert.hpp partition_dims): the ranks' pieces are merged along it.
HfExportReport export_hf_gpt2(const std::string& iter_dir, const Gpt2Shape& shape, const std::string& out_dir,
                              const std::string& vocab_file, const std::string& merge_file,
                              const std::map<std::string, int>& dims, bool verify);

// `dtk import hf HF_DIR SAVE_DIR`, the reverse: a GPT2LMHeadModel folder (config.json,
// model.safetensors) as the gpt model's tensors under Megatron's names (unpadded vocabulary: the
// caller pads to the model's size) and the model options that give that shape.
struct HfImport {
  Gpt2Shape shape;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> model_options;  // for --set model.<key>=<value>
};
HfImport import_hf_gpt2(const std::string& hf_dir);

}  // namespace dtk::core
