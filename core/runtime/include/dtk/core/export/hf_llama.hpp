// dtk/core/export/hf_llama.hpp — a llama-model checkpoint as a Hugging Face LlamaForCausalLM
// folder, and back.
//
// `dtk export hf CHECKPOINT OUT` of a llama checkpoint writes config.json (LlamaConfig; the
// unpadded vocabulary; rope_scaling {rope_type: llama3, ...} or null), model.safetensors under
// Hugging Face's names and, when the run names its tokenizer, its files. Re-layouts:
// tensor-parallel partitions are concatenated first; the fused query_key_value rows, laid out per
// key/value group as [q of the group's heads | k | v] (the llama plugin's, Megatron's), become
// q_proj, k_proj and v_proj; gate and up are separate weights already; the padded vocabulary rows
// are dropped. No q/k permutation: the plugin's rotary is the non-interleaved rotate_half
// convention, which is Hugging Face's (tests/model/hf_llama_test.cpp runs HF's forward on the
// export to show it).
//
// A llama with per-head query/key norms (qk_layernorm, no biases) is written as Qwen3ForCausalLM
// (model_type qwen3: q_norm and k_norm, head_dim = kv_channels), one with biases on the
// query/key/value projection alone (add_qkv_bias) as Qwen2ForCausalLM (model_type qwen2), and a
// plain one with head_dim = kv_channels (LlamaConfig.head_dim: transformers before head_dim
// existed read hidden_size / num_attention_heads); import reads all three back. A plain llama
// with a sliding window in every layer (window_size W,0) is written as MistralForCausalLM
// (model_type mistral: Llama's names, sliding_window W + 1), and a Mixtral's window the same way;
// on Qwen2's or Qwen3's attention a window is use_sliding_window, sliding_window W + 1 and
// max_window_layers (full-attention layers first, then windowed). Other windows are refused.
//
// A llama with mixture-of-experts layers is written by its attention: a plain one as
// MixtralForCausalLM (model_type mixtral; each layer's router as block_sparse_moe.gate and expert
// e's gate, up and down projections as block_sparse_moe.experts.<e>.w1, w3 and w2), one with
// query/key norms as Qwen3MoeForCausalLM (qwen3_moe) and one with q/k/v biases alone as
// Qwen2MoeForCausalLM (qwen2_moe); the Qwen blocks name the router mlp.gate and expert e's
// projections mlp.experts.<e>.gate_proj, up_proj and down_proj. Mixtral's block is a softmax
// router whose top-k weights are renormalised (the llama model's default,
// moe_router_pre_softmax=false) over SwiGLU experts without biases in every layer. Qwen's blocks
// take either softmax (norm_topk_prob: renormalised or not) and dense layers among the sparse
// ones (mlp_only_layers; which layers have experts is read from the checkpoint's routers), and
// Qwen2-MoE's block always adds a shared expert gated by sigmoid(x g) (shared_expert,
// shared_expert_gate). What a block cannot hold (sigmoid scores, groups, a scaling factor, the
// expert bias, biases, llama3 rope scaling, Mixtral's shared expert or dense layers, Qwen2-MoE
// without its gated shared expert, Qwen3-MoE with one) is refused naming the option; a capacity
// factor is written (one line says Hugging Face runs the experts dropless). Import reads all
// three back into those options.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dtk/core/export/hf_gpt2.hpp"  // HfExportReport, the safetensors folder conventions

namespace dtk::core {

struct LlamaShape {
  int64_t layers = 0, hidden = 0, heads = 0, groups = 0, ffn = 0, vocab = 0, positions = 0;
  double eps = 1e-5, rope_theta = 10000, attention_dropout = 0, init_std = 0.02;
  bool untie = true, bias = false;  // bias: add_bias_linear = HF's attention_bias and mlp_bias
  int64_t head_dim = 0;             // kv_channels (HF's head_dim); set from the options or config.json
  bool qkv_bias = false;            // add_qkv_bias: biases on q_proj, k_proj, v_proj only (Qwen2)
  bool qk_norm = false;             // qk_layernorm: q_norm and k_norm per head (Qwen3)
  bool norm_1p = false;             // apply_layernorm_1p: norm weights saved as w, Hugging Face's are 1 + w
  // window_size W,0: each token sees itself and the W before it (Hugging Face's sliding_window
  // W + 1); -1: none. window_layers: per layer, whether it is windowed (the llama model's
  // window_attn_skip_freq list, Qwen's layer_types); empty: every layer (Mistral's and Mixtral's
  // only form).
  int64_t window = -1;
  std::vector<bool> window_layers;
  bool windowed(int64_t layer) const {
    return window >= 0 && (window_layers.empty() || window_layers.at(static_cast<size_t>(layer)));
  }
  // The layers before the first windowed one (Qwen's max_window_layers); `layers` without a window.
  int64_t full_attention_layers() const;
  // rope_scaling=llama3 and its parameters (the llama plugin's rope_* options).
  bool llama3 = false;
  double rope_factor = 8, rope_low = 1, rope_high = 4;
  int64_t rope_original = 8192;
  // Experts (0: dense): `experts` SwiGLU experts of inner size moe_ffn, `topk` per token; a dense
  // layer's MLP keeps ffn (a Mixtral has none: ffn = moe_ffn). pre_softmax: the top-k of the
  // softmax, not renormalised (Hugging Face's norm_topk_prob false). A shared expert of inner size
  // shared_ffn (0: none), its output times sigmoid(x g) with shared_gate. sparse_layers: per layer,
  // whether it has experts (empty: every layer; export reads it from the checkpoint's routers).
  int64_t experts = 0, topk = 0, moe_ffn = 0, shared_ffn = 0;
  bool pre_softmax = false, shared_gate = false;
  std::vector<bool> sparse_layers;
  double capacity_factor = 0;  // > 0: trained with token dropping (Hugging Face runs the experts dropless)
  bool has_experts() const { return experts > 0; }
  bool sparse(int64_t layer) const {
    return has_experts() && (sparse_layers.empty() || sparse_layers.at(static_cast<size_t>(layer)));
  }
  int64_t dense_layers() const;
  // The Hugging Face architecture that holds this shape: with q/k norms Qwen3ForCausalLM (with
  // experts Qwen3MoeForCausalLM), with q/k/v biases only Qwen2ForCausalLM (Qwen2MoeForCausalLM),
  // with experts MixtralForCausalLM, with a sliding window (and none of those) MistralForCausalLM, else
  // LlamaForCausalLM; model_type() is its config.json name.
  std::string architecture() const;
  std::string model_type() const;
};

// From the llama model plugin's resolved options and the run's seq_length (HF's
// max_position_embeddings). What LlamaForCausalLM cannot represent is refused naming the option
// (rotary_percent != 1).
LlamaShape llama_shape(const std::map<std::string, std::string>& options, int64_t run_seq_length);

// The run's tokenizer, from the checkpoint's recorded config or the command's flags:
// model_file (a SentencePiece model -> tokenizer.model; a .json or a folder with one ->
// tokenizer.json), else vocab_file + merge_file (GPT-2 BPE -> vocab.json, merges.txt).
struct TokenizerFiles {
  std::string type, model_file, vocab_file, merge_file;
  // From the loaded tokenizer (dtk::text): its BOS / EOS ids and spellings (-1 / "" unknown),
  // and a tokenizer_config.json that came with a tokenizer.json (copied as is).
  int64_t bos = -1, eos = -1;
  std::string bos_text, eos_text, config_file;
  // A tokenizer.json made from a tokenizer whose files are not one (TikTokenizer's vocabulary):
  // written as the folder's tokenizer.json instead of a copy of model_file.
  std::string made_tokenizer_json;
};

// As export_hf_gpt2 (hf_gpt2.hpp): checksums verified when `verify`, OUT refused unless absent or empty, the
// folder published whole or not at all. report.tokenizer says which tokenizer files were written
// ("" = none); report.padding_rows how many vocabulary rows were dropped. shape.sparse_layers is
// filled in from the checkpoint (the layers that have a router).
HfExportReport export_hf_llama(const std::string& iter_dir, LlamaShape& shape, const std::string& out_dir,
                               const TokenizerFiles& tokenizer, const std::map<std::string, int>& dims, bool verify);

// config.json's model_type ("" when it has none).
std::string hf_model_type(const std::string& hf_dir);
// Whether the llama model imports a folder of this model_type (llama, mistral, mixtral, qwen2,
// qwen3, qwen2_moe, qwen3_moe).
bool llama_model_type(const std::string& model_type);

// `dtk import hf` of a LlamaForCausalLM folder (config.json and model.safetensors, or
// model.safetensors.index.json and its shards): the tensors under the llama model's names
// (unpadded vocabulary) and the model options that build that shape.
struct HfLlamaImport {
  LlamaShape shape;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> model_options;
};
HfLlamaImport import_hf_llama(const std::string& hf_dir);

}  // namespace dtk::core
