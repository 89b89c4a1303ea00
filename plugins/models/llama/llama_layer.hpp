// llama_layer.hpp — one Llama transformer layer as Megatron-LM builds it for Llama 2
// (--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
// --group-query-attention), tensor-parallel with the SDK's building blocks (dtk/layers).
//
//   x + dropout(dense(attention(rope(q), rope(k), v)))    q, k, v from one fused projection of RMSNorm(x)
//   h + dropout(down(silu(gate(RMSNorm(h))) * up(RMSNorm(h))))
//
// With add_bias_linear the projections have biases as Megatron's default GPT layers do (the
// row-parallel ones added once, after the all-reduce); with add_qkv_bias only the query/key/value
// projection has them (Qwen2). With qk_layernorm each query and key head is RMS-normalised over
// its kv_channels channels before it rotates, one weight shared by the heads (Qwen3, Megatron's
// --qk-layernorm); a tensor-parallel rank sees only its heads, so those weights' gradients are
// partial sums the host adds over the group (dtk_param_info.sequence_parallel). kv_channels sets
// the head width apart from hidden / heads (Qwen3's heads are wider).
// Grouped-query attention: `groups` key/value heads, each shared by heads / groups query heads.
// The fused query_key_value weight is laid out group by group, as Megatron's
// ([q of the group's heads | k | v] per group), so a contiguous split of its rows over the
// tensor-parallel ranks hands each rank whole groups (groups % tp == 0).
// The MLP's gate and up projections are two column-parallel weights rather than Megatron's one
// [2 x ffn] weight: each then splits along its rows like any other column-parallel weight, so a
// checkpoint converts between tensor-parallel sizes with the generic rule.
//
// Domino (dtk/layers/domino.hpp) schedules the layer through DominoLayer: stage 0 projects q, k, v
// (one column projection), rotates them by the chunk's positions and attends; stage 1 takes gate
// and up as two column projections of one input (one input-gradient all-reduce).
#pragma once

#include <dtk/layers/activations.hpp>
#include <dtk/layers/decoder_lm.hpp>
#include <dtk/layers/domino.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/moe.hpp>
#include <dtk/layers/norms.hpp>
#include <dtk/layers/rotary.hpp>
#include <dtk/layers/tensor_parallel.hpp>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rope_scaling.hpp"

namespace dtk::llama {

using namespace dtk::layers;

// The shared decoder options (dtk/layers/decoder_lm.hpp) and Llama's own.
struct Config : DecoderConfig {
  int64_t groups = 0;
  double rotary_base = 10000.0, rotary_percent = 1.0;
  RopeScaling rope_scaling;  // Llama 3.1's frequency scaling (rope_scaling.hpp), off by default
  bool bias = false;  // biases on every projection (Megatron's default; Llama has none: --disable-bias-linear)
  bool qkv_bias = false;      // biases on the query/key/value projection only (Qwen2; Megatron's --add-qkv-bias)
  bool qk_layernorm = false;  // RMSNorm of each query and key head before rotary (Qwen3; Megatron's --qk-layernorm)
  // Channels of each head that rotate (Megatron's rotary_percent), even.
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim()) * rotary_percent); }
};

// RMSNorm in fp32 (Megatron's RMSNorm: x / sqrt(mean(x^2) + eps), cast back, times the weight):
// the SDK's, one fused kernel each way on a GPU; after the attention's residual add, the SDK's add
// and norm in one.
using dtk::layers::add_rms_norm;
using dtk::layers::rms_norm;

// SwiGLU's silu(gate) * up: the SDK's (the same ops on the CPU, one kernel each way on a GPU).
using dtk::layers::swiglu;

// Rotary position embeddings (Megatron's RotaryEmbedding, non-interleaved: the first and second
// halves of the rotated channels pair up). The cos/sin table covers the positions seen so far
// and grows on demand, so evaluation past the training length is correct. With llama3 scaling the
// inverse frequencies are rescaled once (rope_scaling.hpp) before the angles are formed.
class Rotary {
 public:
  Rotary(int64_t rotary_dim, double base, const RopeScaling& scaling = {})
      : dim_(rotary_dim), base_(base), scaling_(scaling) {}
  // x [b, s, n, head_dim], positions [b, s] int64: the first rotary_dim channels rotated by
  // position, the rest unchanged. Computed in fp32, returned in x's dtype (DTK's kernel on a GPU
  // unless `kernels` leaves it out).
  at::Tensor apply(const at::Tensor& x, const at::Tensor& positions, const FusedKernels& kernels) const;

 private:
  // cos, sin [positions, dim] on `device` (computed on the host in fp32, moved once per growth).
  std::pair<at::Tensor, at::Tensor> table(int64_t positions, const at::Device& device) const;
  // The rows the table has on `device` now (0: none there yet).
  int64_t table_rows(const at::Device& device) const;
  // cos, sin [b, s, 1, dim] of `positions` on `device`. Every layer's queries and keys rotate by
  // the same positions tensor in a forward: gathered once for it, not twice per layer (the
  // table's size needs the largest position, a host read: a synchronisation on a GPU).
  std::pair<at::Tensor, at::Tensor> angles(const at::Tensor& positions, const at::Device& device) const;
  int64_t dim_;
  double base_;
  RopeScaling scaling_;
  mutable std::mutex mu_;
  mutable at::Tensor cos_, sin_;
  mutable std::vector<at::Tensor> retired_;  // outgrown tables (a CUDA graph may still read them)
  struct Gathered {
    at::Tensor positions;  // held, so that its identity cannot pass to another tensor
    int64_t version;
    at::Tensor cos, sin;
  };
  mutable std::mutex gathered_mu_;
  mutable std::deque<Gathered> gathered_;  // the latest few (Domino's chunks have a tensor each)
};

class Layer : public DominoLayer, public DecoderLayer {
 public:
  // Layer `index` (0-based, whole model): an MoE layer where c.moe says so (its MLP is MoeMlp,
  // experts of Llama's SwiGLU MLP: gate, up, dense_4h_to_h).
  Layer(const Config& c, int64_t index, const TPGroup& tp, ParamFactory& f, const Rotary& rotary);
  // x [b, s, h]; positions [b, s]; mask [b or 1, 1, s, s] bool (true = masked) or undefined
  // (causal).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& mask, DropoutRng& rng,
                     bool training) const override;
  // The same, x's branch added in the input norm's kernel and the MLP's branch left to the next
  // norm (DecoderLayer::forward_residual).
  ResidualStream forward_residual(const ResidualStream& x, const at::Tensor& positions, const at::Tensor& mask,
                                  DropoutRng& rng, bool training) const override;
  // Generation: x [b, n, h] at cache positions [length, length + n); `cache` [2, b, groups / tp,
  // capacity, head_dim] holds the rotated keys and the values; mask [b, 1, n, length + n].
  at::Tensor forward_cached(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cache, int64_t length,
                            const at::Tensor& mask) const override;
  at::Tensor empty_kv_cache(int64_t batch, int64_t capacity, const at::TensorOptions& options) const override {
    return at::zeros({2, batch, groups_local_, capacity, c_.head_dim()}, options);
  }
  void add_params(std::vector<Param>& out, const std::string& prefix) const override;
  MoeMlp* moe_mlp() const override { return moe.get(); }
  const DominoLayer* domino() const override { return this; }

  // Domino's pieces of stage 0 (attention) and 1 (MLP) (DominoLayer).
  at::Tensor stage_norm(int stage, const at::Tensor& in) const override;
  std::vector<const ColumnParallelLinear*> stage_columns(int stage) const override;
  const RowParallelLinear& stage_row(int stage) const override { return stage == 0 ? dense : down; }
  at::Tensor stage_partial(int stage, const at::Tensor& projected, const DominoChunk& chunk) const override;
  LayerMasks draw_masks(int64_t batch, int64_t seq, DropoutRng& rng, bool training) const override;

  at::Tensor input_norm, post_attention_norm;
  at::Tensor q_norm, k_norm;  // [kv_channels] each with qk_layernorm, else undefined
  ColumnParallelLinear qkv, gate, up;
  std::unique_ptr<MoeMlp> moe;  // set: an MoE layer (gate, up and down unused)
  RowParallelLinear dense, down;

 private:
  struct QKV {
    at::Tensor q, k, v;  // [b, s, heads / tp, hd], [b, s, groups / tp, hd] x 2
  };
  QKV project(const at::Tensor& x, const at::Tensor& positions) const;
  // q, k (rotated by `positions`) and v of the fused projection `mixed` [b, s, qkv.weight rows].
  QKV split_qkv(const at::Tensor& mixed, const at::Tensor& positions) const;
  // Attention of q [b, s, np, hd] over k, v [b, t, ng, hd] with `mask` [.., s, t] (true = masked;
  // undefined: causal), in a sliding-window layer the keys before the window masked too, and
  // dropout `keep` on the probabilities [b, np, s, t] (undefined: none); returns the context
  // [b, s, np * hd].
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    const DropoutMask& keep) const;
  at::Tensor mlp(const at::Tensor& h, at::Generator* jitter_rng, bool generating, bool training) const;

  const Config& c_;
  const Rotary& rotary_;
  int64_t heads_local_ = 0, groups_local_ = 0;
  int64_t window_ = -1;  // a sliding-window layer's window (DecoderConfig::window), else -1
};

}  // namespace dtk::llama
