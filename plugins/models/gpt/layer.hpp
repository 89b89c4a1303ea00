// layer.hpp — one GPT transformer layer (Megatron ParallelTransformerLayer: pre-LayerNorm,
// causal self-attention, GeLU MLP) and the pieces the plain and the Domino schedules share.
//
// A layer is two stages, each  out = in + dropout(RowParallel(f(ColumnParallel(LN(in)))) + bias):
//   stage 0 (attention)  LN1 -> QKV (column) -> core attention -> dense (row)
//   stage 1 (MLP)        LN2 -> fc1 (column) -> GeLU -> fc2 (row)
// Plain tensor parallelism runs a stage on the whole micro-batch and waits for the row-parallel
// all-reduce inside it (Layer::forward). Domino (dtk/layers/domino.hpp) runs the same stage
// pieces on batch chunks through the DominoLayer interface: stage_partial() stops before the
// all-reduce, the schedule adds the bias, dropout and residual after it.
//
// Dropout draws from the model's two generators exactly as Megatron's RNG tracker does: hidden
// and embedding dropout from the DEFAULT stream, attention dropout from the TENSOR_PARALLEL
// stream (dropout.hpp: one seed per mask). draw_masks() draws a layer's three masks for the whole
// micro-batch in the order the plain layer draws them, so a chunked schedule that slices them
// uses the very same masks.
#pragma once

#include <dtk/layers/activations.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/layers/decoder_lm.hpp>
#include <dtk/layers/domino.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/moe.hpp>
#include <dtk/layers/norms.hpp>
#include <dtk/layers/tensor_parallel.hpp>
#include <dtk/module_hooks.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace dtk::gpt {

// The SDK's tensor-parallel layers, cross entropy and dropout (dtk/layers), shared with llama.
using namespace dtk::layers;

// The shared decoder options (dtk/layers/decoder_lm.hpp; max_pos: the learned position table)
// and GPT's own.
struct Config : DecoderConfig {
  bool openai_gelu = false;  // GELU's tanh approximation (GPT-2's gelu_new) instead of the exact erf form
};

// The MLP's activation: exact GELU, or its tanh approximation with openai_gelu (Megatron's
// --openai-gelu; Hugging Face's "gelu_new"). The plain layer's dense_h_to_4h and GELU are the
// SDK's column_linear_gelu (the same ops on the CPU, bias + GELU in one kernel on a GPU).
at::Tensor gelu(const at::Tensor& x, const Config& c);
using dtk::layers::column_linear_gelu;

// LayerNorm computed in fp32 (Megatron's fused LayerNorm), output in the input's dtype: the SDK's;
// after the attention's residual add, the SDK's add and norm in one (one kernel each way on a GPU),
// with the row-parallel product's bias and the branch's dropout where that kernel takes them.
using dtk::layers::add_bias_dropout_layer_norm;
using dtk::layers::add_layer_norm;
using dtk::layers::dropout_mask;
using dtk::layers::layer_norm;
using dtk::layers::layer_norm_takes_branch_bias;

class Layer : public DominoLayer, public DecoderLayer {
 public:
  // Layer `index` (0-based, whole model): an MoE layer where c.moe says so (its MLP is MoeMlp,
  // experts of GPT's MLP: dense_h_to_4h, GELU, dense_4h_to_h).
  Layer(const Config& c, int64_t index, const TPGroup& tp, ParamFactory& f);

  // Plain tensor parallelism: x [b, s, h]; mask [b or 1, 1, s, s] bool (true = masked) or
  // undefined (causal). Positions enter through the embedding only (unused here).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& mask, DropoutRng& rng,
                     bool training) const override;
  // The same, x's branch added in the first LayerNorm's kernel and the MLP's branch left to the
  // next norm (DecoderLayer::forward_residual).
  ResidualStream forward_residual(const ResidualStream& x, const at::Tensor& positions, const at::Tensor& mask,
                                  DropoutRng& rng, bool training) const override;
  const DominoLayer* domino() const override { return this; }

  // Domino's pieces of stage 0 (attention) or 1 (MLP) (DominoLayer).
  at::Tensor stage_norm(int stage, const at::Tensor& in) const override;
  std::vector<const ColumnParallelLinear*> stage_columns(int stage) const override {
    return {stage == 0 ? &qkv : &fc1};
  }
  const RowParallelLinear& stage_row(int stage) const override { return stage == 0 ? dense : fc2; }
  at::Tensor stage_partial(int stage, const at::Tensor& projected, const DominoChunk& chunk) const override;

  // Inference with a key/value cache (generation): x [b, n, h] are the tokens at cache positions
  // [length, length + n); `cache` [2, b, heads / tp, capacity, head_dim] receives their keys and
  // values there, and the attention runs over positions [0, length + n) with `mask` [b, 1, n,
  // length + n] (true = masked). No dropout. The same arithmetic as forward() on the whole
  // sequence (Megatron's CoreAttention, scale before the product).
  at::Tensor forward_cached(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cache, int64_t length,
                            const at::Tensor& mask) const override;
  at::Tensor empty_kv_cache(int64_t batch, int64_t capacity, const at::TensorOptions& options) const override {
    return at::zeros({2, batch, heads_local_, capacity, head_dim_}, options);
  }

  // The masks of a whole micro-batch of `batch` sequences of `seq` tokens.
  LayerMasks draw_masks(int64_t batch, int64_t seq, DropoutRng& rng, bool training) const override;

  void add_params(std::vector<Param>& out, const std::string& prefix) const override;
  MoeMlp* moe_mlp() const override { return moe.get(); }

  at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;
  ColumnParallelLinear qkv, fc1;
  RowParallelLinear dense, fc2;
  std::unique_ptr<MoeMlp> moe;  // set: an MoE layer (fc1 and fc2 unused)

 private:
  // Core attention on the fused QKV projection [b, s, np * 3 * hn] -> context [b, s, np * hn];
  // probs_keep(shape) gives the attention dropout's mask for the probabilities [b, np, s, s]
  // (undefined: no dropout), called once.
  template <class KeepFn>
  at::Tensor core_attention(const at::Tensor& mixed, const at::Tensor& mask, KeepFn&& probs_keep) const;
  // q, k, v [b, s, np, hn]: views of the fused projection [b, s, np * 3 * hn].
  std::vector<at::Tensor> split_qkv(const at::Tensor& projected) const;
  // Whether core attention on `projected` (no mask) runs DTK's GPU kernel when dropout is on.
  bool fused_attention_takes(const at::Tensor& projected) const;
  at::Tensor causal_mask(int64_t s, at::Device device) const;
  // The MoE layer's MLP branch on the normed stream (biases included, before dropout); its
  // router's input jitter (if any) draws from jitter_rng (none when generating).
  at::Tensor moe_branch(const at::Tensor& normed, at::Generator* jitter_rng, bool generating, bool training) const;
  // The plain layer's MLP branch (dense or MoE) before its dropout, recomputed in backward where
  // recompute_modules says; `unbiased`: a dense one without dense_4h_to_h's bias.
  at::Tensor mlp_branch(const at::Tensor& normed, DropoutRng& rng, bool training, bool unbiased = false) const;

  const Config& c_;
  TPGroup tp_;
  int64_t heads_local_ = 0, head_dim_ = 0;
  int64_t window_ = -1;  // a sliding-window layer's window (DecoderConfig::window), else -1
  mutable std::mutex mask_mu_;
  mutable std::map<int64_t, at::Tensor> mask_cache_;
};

}  // namespace dtk::gpt
