// layer.cpp — see layer.hpp. Megatron: megatron/model/transformer.py (ParallelTransformerLayer,
// ParallelAttention, CoreAttention, ParallelMLP).
#include "layer.hpp"

#include <dtk/layers/recompute.hpp>

#include <cmath>

namespace dtk::gpt {

Layer::Layer(const Config& c, int64_t index, const TPGroup& tp, ParamFactory& f) : c_(c), tp_(tp) {
  const double scaled_std = c.init_std / std::sqrt(2.0 * static_cast<double>(c.num_layers));
  ln1_w = c.norm_1p ? f.zeros({c.hidden}) : f.ones({c.hidden});
  ln1_b = f.zeros({c.hidden});
  qkv = ColumnParallelLinear(c.hidden, 3 * c.hidden, true, c.init_std, tp, f);
  dense = RowParallelLinear(c.hidden, c.hidden, true, scaled_std, tp, f);
  ln2_w = c.norm_1p ? f.zeros({c.hidden}) : f.ones({c.hidden});
  ln2_b = f.zeros({c.hidden});
  if (c.moe.is_moe_layer(index)) {
    MoeConfig m = c.moe.at_layer(index, c.num_layers);
    m.ffn = c.expert_ffn();
    moe = std::make_unique<MoeMlp>(m, c.hidden, std::vector<std::string>{"dense_h_to_4h"}, "dense_4h_to_h", true,
                                   c.init_std, scaled_std, tp, f);
  } else {
    fc1 = ColumnParallelLinear(c.hidden, c.ffn, true, c.init_std, tp, f);
    fc2 = RowParallelLinear(c.ffn, c.hidden, true, scaled_std, tp, f);
  }
  // Under context parallelism's a2a core attention runs whole sequences of 1 / cp of this rank's
  // heads; under all_gather this rank's queries of all of them.
  heads_local_ = c.cp.attention_units(c.heads / tp.size);
  head_dim_ = c.head_dim();
  if (c.windowed(index)) window_ = c.window;
}

at::Tensor gelu(const at::Tensor& x, const Config& c) { return c.openai_gelu ? at::gelu(x, "tanh") : at::gelu(x); }

at::Tensor Layer::moe_branch(const at::Tensor& normed, at::Generator* jitter_rng, bool generating,
                             bool training) const {
  return moe->forward(
      normed, [this](const std::vector<at::Tensor>& projected) { return gelu(projected[0], c_); }, generating,
      jitter_rng, training);
}

at::Tensor Layer::forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& mask, DropoutRng& rng,
                          bool training) const {
  return forward_residual({x, {}}, positions, mask, rng, training).sum();
}

ResidualStream Layer::forward_residual(const ResidualStream& in, const at::Tensor&, const at::Tensor& mask,
                                       DropoutRng& rng, bool training) const {
  const double p = training ? c_.attention_dropout : 0.0;
  // x = the previous layer's stream + its MLP branch (through that branch's bias and dropout),
  // added by the first LayerNorm's kernel.
  const auto [x, normed_in] = in.branch.defined()
                                  ? add_bias_dropout_layer_norm(in.stream, in.branch, in.branch_bias, in.branch_keep,
                                                                c_.norm_gain(ln1_w), ln1_b, c_.eps, c_.kernels)
                                  : std::pair{in.stream, layer_norm(in.stream, c_.norm_gain(ln1_w), ln1_b, c_.eps)};
  // Under context parallelism's a2a: the whole sequence of this rank's share of the heads (under
  // all_gather core attention gathers the keys and values itself).
  const at::Tensor projected = c_.cp.heads_from_sequence(qkv.forward(normed_in), heads_local_ * c_.cp.size);
  // The probabilities' mask is drawn as dropout(probs, p, training, rng.attention) would draw it.
  RecomputedBlock attention = [this, mask, p, training](const at::Tensor& in, DropoutRng& r) {
    return core_attention(in, mask, [&](at::IntArrayRef shape) {
      return training ? draw_keep_mask(shape, p, r.attention) : DropoutMask{};
    });
  };
  // Selective recomputation: DTK's attention kernels (the CPU's causal one, the GPU's with dropout
  // or a window) keep no probabilities by themselves; elsewhere core attention is one checkpoint
  // (Megatron's checkpointed core attention, which it too leaves out for its flash attention).
  const auto own_kernel = [&] {
    if (mask.defined() || c_.cp.gathers_keys()) return false;
    if (window_ < 0 && causal_attention_supported(projected)) return true;
    return (p > 0.0 || window_ >= 0) && fused_attention_takes(projected);
  };
  const at::Tensor context = c_.cp.sequence_from_heads(
      c_.selective_recompute && !own_kernel() ? recompute(projected, rng, attention) : attention(projected, rng),
      heads_local_);
  // Where the add + LayerNorm kernel takes a branch's bias and dropout, the row-parallel products
  // (dense, dense_4h_to_h) leave both to it (Megatron's skip_bias_add and bias-dropout-add): the
  // bias's add, the mask and their gradients cost no pass of their own. The masks are drawn as
  // dropout() would draw them, in the same order: the same bits either way.
  if (layer_norm_takes_branch_bias(x, ln2_w, ln2_b, c_.kernels)) {
    const DropoutMask attention_keep = dropout_mask(x, c_.hidden_dropout, training, rng.hidden, tp_);
    const auto [h, normed] = add_bias_dropout_layer_norm(x, dense.forward_unbiased(context), dense.bias, attention_keep,
                                                         c_.norm_gain(ln2_w), ln2_b, c_.eps, c_.kernels);
    if (moe)
      return {h, mlp_branch(normed, rng, training), {}, dropout_mask(h, c_.hidden_dropout, training, rng.hidden, tp_)};
    return {h, mlp_branch(normed, rng, training, /*unbiased=*/true), fc2.bias,
            dropout_mask(h, c_.hidden_dropout, training, rng.hidden, tp_)};
  }
  // h = x + dropout(attention's output) and its LayerNorm in one (the dropout stays on the branch).
  const auto [h, normed] =
      add_layer_norm(x, dropout(dense.forward(context), c_.hidden_dropout, training, rng.hidden, tp_),
                     c_.norm_gain(ln2_w), ln2_b, c_.eps, c_.kernels);
  return {h, dropout(mlp_branch(normed, rng, training), c_.hidden_dropout, training, rng.hidden, tp_)};
}

// The MLP (dense or mixture of experts) on the second norm's output, before its dropout (and,
// `unbiased`, before dense_4h_to_h's bias); one checkpoint holding only `normed` where
// recompute_modules names the layer's kind (Megatron's checkpointed MLP / MoE layer). It draws
// no dropout; an MoE router's input jitter draws from the block's hidden stream.
at::Tensor Layer::mlp_branch(const at::Tensor& normed, DropoutRng& rng, bool training, bool unbiased) const {
  RecomputedBlock mlp = [this, training, unbiased](const at::Tensor& in, DropoutRng& r) {
    if (moe) return moe_branch(in, &r.hidden, /*generating=*/false, training);
    // dense_h_to_4h and its GELU: on a GPU the bias joins the GELU's kernel (dtk/layers/activations.hpp).
    const at::Tensor activated = column_linear_gelu(fc1, in, c_.openai_gelu, c_.kernels);
    return unbiased ? fc2.forward_unbiased(activated) : fc2.forward(activated);
  };
  return c_.recomputes_mlp(moe != nullptr) ? recompute(normed, rng, mlp) : mlp(normed, rng);
}

at::Tensor Layer::forward_cached(const at::Tensor& x, const at::Tensor&, const at::Tensor& cache, int64_t length,
                                 const at::Tensor& mask) const {
  const int64_t b = x.size(0), n = x.size(1), total = length + n;
  at::Tensor mixed = qkv.forward(layer_norm(x, c_.norm_gain(ln1_w), ln1_b, c_.eps))
                         .view({b, n, heads_local_, 3 * head_dim_})
                         .transpose(1, 2);
  cache[0].narrow(2, length, n).copy_(mixed.narrow(-1, head_dim_, head_dim_));
  cache[1].narrow(2, length, n).copy_(mixed.narrow(-1, 2 * head_dim_, head_dim_));
  const at::Tensor q = mixed.narrow(-1, 0, head_dim_);
  const at::Tensor k = cache[0].narrow(2, 0, total), v = cache[1].narrow(2, 0, total);
  at::Tensor scores = at::matmul(q * (1.0 / std::sqrt(static_cast<double>(head_dim_))), k.transpose(-1, -2));
  const at::Tensor masked = window_ >= 0 ? window_mask(mask, n, total, window_, x.device()) : mask;
  at::Tensor probs = at::softmax(scores.to(at::kFloat).masked_fill(masked, -10000.0), -1).to(x.scalar_type());
  at::Tensor context = at::matmul(probs, v).transpose(1, 2).reshape({b, n, heads_local_ * head_dim_});
  const auto [h, normed] = add_layer_norm(x, dense.forward(context), c_.norm_gain(ln2_w), ln2_b, c_.eps, c_.kernels);
  if (moe) return h + moe_branch(normed, /*jitter_rng=*/nullptr, /*generating=*/true, /*training=*/false);
  return h + fc2.forward(column_linear_gelu(fc1, normed, c_.openai_gelu, c_.kernels));
}

at::Tensor Layer::stage_norm(int stage, const at::Tensor& in) const {
  return stage == 0 ? layer_norm(in, c_.norm_gain(ln1_w), ln1_b, c_.eps)
                    : layer_norm(in, c_.norm_gain(ln2_w), ln2_b, c_.eps);
}

at::Tensor Layer::stage_partial(int stage, const at::Tensor& projected, const DominoChunk& chunk) const {
  if (stage == 1) return dtk::linear(gelu(projected, c_), fc2.weight);
  // Under context parallelism the chunk's exchanges, as the plain layer's (forward_residual).
  const at::Tensor whole = c_.cp.heads_from_sequence(projected, heads_local_ * c_.cp.size);
  const at::Tensor context = core_attention(whole, chunk.mask, [&](at::IntArrayRef) { return chunk.attention_probs; });
  return dtk::linear(c_.cp.sequence_from_heads(context, heads_local_), dense.weight);
}

LayerMasks Layer::draw_masks(int64_t batch, int64_t seq, DropoutRng& rng, bool training) const {
  return draw_layer_masks(batch, seq, heads_local_, c_.hidden, c_.attention_dropout, c_.hidden_dropout, rng, training,
                          c_.cp);
}

// q, k, v [b, s, np, hn] of the projection [b, s, np * 3 * hn] (per head: query, key, value):
// split, not three narrows, so that the backward is one cat into the projection's layout (three
// narrows' backward zero a whole projection each and add them).
std::vector<at::Tensor> Layer::split_qkv(const at::Tensor& projected) const {
  return projected.view({projected.size(0), projected.size(1), heads_local_, 3 * head_dim_}).split(head_dim_, -1);
}

bool Layer::fused_attention_takes(const at::Tensor& projected) const {
  const std::vector<at::Tensor> qkv = split_qkv(projected);
  return fused_attention_applies(qkv[0], qkv[1], qkv[2], {}, c_.kernels);
}

template <class KeepFn>
at::Tensor Layer::core_attention(const at::Tensor& projected, const at::Tensor& given, KeepFn&& probs_keep) const {
  const int64_t b = projected.size(0), s = projected.size(1);
  const bool plain = !given.defined() && window_ < 0;  // causal, nothing else masked
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  // Context parallelism's all_gather: this rank's queries over the whole sequence's keys.
  if (c_.cp.gathers_keys()) {
    const std::vector<at::Tensor> qkv = split_qkv(projected);
    return c_.cp.attend_whole_keys(qkv[0], qkv[1], qkv[2], scale, given, window_,
                                   probs_keep(at::IntArrayRef(c_.cp.gathered_probs_shape(b, heads_local_, s))),
                                   c_.kernels);
  }
  // The plain causal case on the CPU in fp32: the kernel that skips the masked half
  // (dtk/layers/attention.hpp), same probabilities and dropout bits.
  if (plain && causal_attention_supported(projected))
    return causal_attention_qkv(projected, heads_local_, scale, probs_keep(at::IntArrayRef{b, heads_local_, s, s}),
                                c_.selective_recompute);
  const std::vector<at::Tensor> qkv = split_qkv(projected);
  const DropoutMask keep = probs_keep(at::IntArrayRef{b, heads_local_, s, s});
  // On a GPU, DTK's kernel, the probabilities never in memory: with attention dropout, the masks'
  // bits the model's generator decides (LibTorch's fused attention draws its own); in a sliding
  // window, with or without dropout, its walks bounded by the window (no [s, s] mask either).
  if (!given.defined() && (keep.defined() || window_ >= 0) &&
      fused_attention_applies(qkv[0], qkv[1], qkv[2], keep, c_.kernels))
    return fused_attention(qkv[0], qkv[1], qkv[2], scale, keep, window_);
  // Elsewhere a sliding-window layer masks the keys before each query's window too: Megatron's
  // CoreAttention with its window mask, below.
  const at::Tensor mask = window_ >= 0 ? window_mask(given, s, s, window_, projected.device()) : given;
#if TORCH_VERSION_MAJOR >= 2
  // Without dropout: LibTorch's fused kernel. Strided q, k, v (unit stride in the head dimension)
  // go in as they are, as nanoGPT's do.
  if (!mask.defined() && !keep.defined())
    return at::scaled_dot_product_attention(qkv[0].transpose(1, 2), qkv[1].transpose(1, 2), qkv[2].transpose(1, 2), {},
                                            0.0, true)
        .transpose(1, 2)
        .reshape({b, s, heads_local_ * head_dim_});
#endif
  // Megatron's CoreAttention, the probabilities [b, np, s, s] in memory.
  return attention_ops(qkv[0], qkv[1], qkv[2], scale, mask.defined() ? mask : causal_mask(s, projected.device()), keep);
}

at::Tensor Layer::causal_mask(int64_t s, at::Device device) const {
  std::lock_guard<std::mutex> lock(mask_mu_);
  at::Tensor& m = mask_cache_[s];
  if (!m.defined() || m.device() != device)
    m = at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(device)).triu(1).view({1, 1, s, s});
  return m;
}

void Layer::add_params(std::vector<Param>& out, const std::string& prefix) const {
  auto add = [&](const std::string& name, const at::Tensor& t, int partition_dim, bool no_wd) {
    add_param(out, prefix + name, t, partition_dim, no_wd);
  };
  add("input_layernorm.weight", ln1_w, -1, true);
  add("input_layernorm.bias", ln1_b, -1, true);
  add("self_attention.query_key_value.weight", qkv.weight, 0, false);
  add("self_attention.query_key_value.bias", qkv.bias, 0, true);
  add("self_attention.dense.weight", dense.weight, 1, false);
  add("self_attention.dense.bias", dense.bias, -1, true);
  add("post_attention_layernorm.weight", ln2_w, -1, true);
  add("post_attention_layernorm.bias", ln2_b, -1, true);
  if (moe) {
    moe->add_params(out, prefix + "mlp.");
    return;
  }
  add("mlp.dense_h_to_4h.weight", fc1.weight, 0, false);
  add("mlp.dense_h_to_4h.bias", fc1.bias, 0, true);
  add("mlp.dense_4h_to_h.weight", fc2.weight, 1, false);
  add("mlp.dense_4h_to_h.bias", fc2.bias, -1, true);
}

}  // namespace dtk::gpt
