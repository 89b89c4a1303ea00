// llama_layer.cpp — see llama_layer.hpp. Megatron-LM: megatron/model/transformer.py
// (ParallelAttention with num_query_groups, ParallelMLP with swiglu), megatron/model/rms_norm.py,
// megatron/core/models/common/embeddings/rotary_pos_embedding.py.
#include "llama_layer.hpp"

#include <dtk/capture.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/layers/recompute.hpp>
#include <dtk/module_hooks.hpp>

#include <cmath>

namespace dtk::llama {

std::pair<at::Tensor, at::Tensor> Rotary::table(int64_t positions, const at::Device& device) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!cos_.defined() || cos_.size(0) < positions || cos_.device() != device) {
    // Megatron's arithmetic in fp32: inv_freq = 1 / base^(2j / dim); angle = position * inv_freq;
    // the table repeats the dim / 2 angles twice (the halves that pair up). A row depends only on
    // its position, so growing the table leaves the earlier rows as they were.
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor inv_freq = 1.0 / at::pow(base_, at::arange(0, dim_, 2, f32) / static_cast<double>(dim_));
    if (scaling_.llama3) {  // the same fp32 frequencies, rescaled (rope_scaling=none leaves them as they were)
      const float* f = inv_freq.data_ptr<float>();
      const std::vector<float> scaled = llama3_inv_freq(std::vector<float>(f, f + inv_freq.numel()), scaling_);
      inv_freq = at::from_blob(const_cast<float*>(scaled.data()), {inv_freq.numel()}, f32).clone();
    }
    const at::Tensor angles = at::outer(at::arange(positions, f32), inv_freq);
    const at::Tensor emb = at::cat({angles, angles}, -1);
    // A recorded step (CUDA graph) reads the old table's memory: keep it while the model lives.
    if (cos_.defined()) retired_.insert(retired_.end(), {cos_, sin_});
    cos_ = emb.cos().to(device);
    sin_ = emb.sin().to(device);
  }
  return {cos_, sin_};
}

int64_t Rotary::table_rows(const at::Device& device) const {
  std::lock_guard<std::mutex> lock(mu_);
  return cos_.defined() && cos_.device() == device ? cos_.size(0) : 0;
}

std::pair<at::Tensor, at::Tensor> Rotary::angles(const at::Tensor& positions, const at::Device& device) const {
  std::lock_guard<std::mutex> lock(gathered_mu_);
  for (const Gathered& g : gathered_)
    if (g.positions.is_same(positions) && g.version == positions._version() && g.cos.device() == device)
      return {g.cos, g.sin};
  // The table must cover the largest position: read it, or, in a recorded step (a CUDA graph:
  // no host read), keep the table the uncaptured steps grew (at least one row per sequence
  // position) and let the host check the positions after the backward.
  int64_t rows = 0;
  if (capturing()) {
    rows = std::max(table_rows(device), positions.dim() > 0 ? positions.size(-1) : int64_t{1});
    defer_check(positions.ge(rows).any(), "llama: position ids reached " + std::to_string(rows) +
                                              ", beyond the rotary table of the recorded step");
  } else {
    rows = (positions.numel() ? positions.max().item<int64_t>() : 0) + 1;
  }
  const auto [cos_table, sin_table] = table(rows, device);
  const at::Tensor at_device = positions.to(device);
  Gathered g{positions, positions._version(), at::embedding(cos_table, at_device).unsqueeze(2),  // [b, s, 1, dim]
             at::embedding(sin_table, at_device).unsqueeze(2)};
  constexpr size_t kKept = 4;
  if (gathered_.size() == kKept) gathered_.pop_front();
  gathered_.push_back(g);
  return {g.cos, g.sin};
}

at::Tensor Rotary::apply(const at::Tensor& x, const at::Tensor& positions, const FusedKernels& kernels) const {
  if (dim_ == 0) return x;
  const auto [cos, sin] = angles(positions, x.device());
  return dtk::layers::apply_rotary(x, cos, sin, kernels);
}

Layer::Layer(const Config& c, int64_t index, const TPGroup& tp, ParamFactory& f, const Rotary& rotary)
    : c_(c), rotary_(rotary) {
  // Megatron's scaled init for the projections into the residual stream.
  const double scaled_std = c.init_std / std::sqrt(2.0 * static_cast<double>(c.num_layers));
  const int64_t hd = c.head_dim();
  input_norm = c.norm_1p ? f.zeros({c.hidden}) : f.ones({c.hidden});
  qkv = ColumnParallelLinear(c.hidden, (c.heads + 2 * c.groups) * hd, c.bias || c.qkv_bias, c.init_std, tp, f);
  if (c.qk_layernorm) {
    q_norm = c.norm_1p ? f.zeros({hd}) : f.ones({hd});
    k_norm = c.norm_1p ? f.zeros({hd}) : f.ones({hd});
  }
  dense = RowParallelLinear(c.heads * hd, c.hidden, c.bias, scaled_std, tp, f);
  post_attention_norm = c.norm_1p ? f.zeros({c.hidden}) : f.ones({c.hidden});
  if (c.moe.is_moe_layer(index)) {
    MoeConfig m = c.moe.at_layer(index, c.num_layers);
    m.ffn = c.expert_ffn();
    moe = std::make_unique<MoeMlp>(m, c.hidden, std::vector<std::string>{"gate", "up"}, "dense_4h_to_h", c.bias,
                                   c.init_std, scaled_std, tp, f);
  } else {
    gate = ColumnParallelLinear(c.hidden, c.ffn, c.bias, c.init_std, tp, f);
    up = ColumnParallelLinear(c.hidden, c.ffn, c.bias, c.init_std, tp, f);
    down = RowParallelLinear(c.ffn, c.hidden, c.bias, scaled_std, tp, f);
  }
  // Under context parallelism's a2a core attention runs whole sequences of 1 / cp of this rank's
  // key/value groups and their query heads; under all_gather this rank's queries of all of them.
  heads_local_ = c.cp.attention_units(c.heads / tp.size);
  groups_local_ = c.cp.attention_units(c.groups / tp.size);
  if (c.windowed(index)) window_ = c.window;
}

Layer::QKV Layer::project(const at::Tensor& x, const at::Tensor& positions) const {
  return split_qkv(qkv.forward(x), positions);
}

Layer::QKV Layer::split_qkv(const at::Tensor& projected, const at::Tensor& positions) const {
  const int64_t b = projected.size(0), s = projected.size(1), hd = c_.head_dim(),
                per_group = heads_local_ / groups_local_;
  // [b, s, groups, (per_group + 2) * hd]: per group its queries, then its key and its value.
  // One split (its backward is one cat into the projection; three narrows' would zero and add a
  // whole projection each).
  const std::vector<at::Tensor> parts =
      projected.view({b, s, groups_local_, (per_group + 2) * hd}).split_with_sizes({per_group * hd, hd, hd}, -1);
  at::Tensor q = parts[0].reshape({b, s, heads_local_, hd}), k = parts[1];
  if (c_.qk_layernorm) {  // Megatron's q_layernorm / k_layernorm: each head over its channels, before rotary
    q = rms_norm(q, c_.norm_gain(q_norm), c_.eps, c_.kernels);
    k = rms_norm(k, c_.norm_gain(k_norm), c_.eps, c_.kernels);
  }
  QKV out;
  out.q = rotary_.apply(q, positions, c_.kernels);
  out.k = rotary_.apply(k, positions, c_.kernels);
  out.v = parts[2];
  return out;
}

at::Tensor Layer::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& given,
                         const DropoutMask& keep) const {
  // b: read by LibTorch 2.x's fused attention below only.
  [[maybe_unused]] const int64_t b = q.size(0), s = q.size(1), t = k.size(1), hd = c_.head_dim();
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  // Context parallelism's all_gather: this rank's queries over the whole sequence's keys (not
  // while generating: forward_cached runs without context parallelism).
  if (c_.cp.gathers_keys()) return c_.cp.attend_whole_keys(q, k, v, scale, given, window_, keep, c_.kernels);
  // On a GPU, DTK's kernel (it reads each key/value group for its query heads itself): with
  // attention dropout, the masks' bits the model's generator decides; in a sliding window, with or
  // without dropout, its walks bounded by the window (no [s, t] mask or probabilities in memory).
  if (!given.defined() && (keep.defined() || window_ >= 0) && fused_attention_applies(q, k, v, keep, c_.kernels))
    return fused_attention(q, k, v, scale, keep, window_);
  // On the CPU in fp32, the causal kernel that skips the masked keys (dtk/layers/attention.hpp; it
  // reads each key/value group for its query heads itself): no [b, heads, s, t] mask or scores.
  if (!given.defined() && window_ < 0 && causal_attention_applies(q, k, v, keep))
    return causal_attention(q, k, v, scale, keep);
  // Elsewhere a sliding-window layer masks the keys before each query's window too, so it takes
  // the masked path below (Megatron's CoreAttention with its window mask).
  const at::Tensor mask = window_ >= 0 ? window_mask(given, s, t, window_, q.device()) : given;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  // Without dropout, LibTorch's fused kernel for the plain causal case, which reads each key/value
  // group for its query heads itself (enable_gqa: query head i reads group i / per_group), so the
  // groups are never copied per head; strided inputs go in as they are.
  if (!mask.defined() && !keep.defined() && s == t) {
    const int64_t per_group = heads_local_ / groups_local_;
    return at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), {}, 0.0, true,
                                            std::nullopt, /*enable_gqa=*/per_group > 1)
        .transpose(1, 2)
        .reshape({b, s, heads_local_ * hd});
  }
#elif TORCH_VERSION_MAJOR == 2
  // LibTorch 2.0-2.4: no enable_gqa; the fused kernel on the groups expanded to the heads.
  if (!mask.defined() && !keep.defined() && s == t) {
    const int64_t per_group = heads_local_ / groups_local_;
    const auto heads_of = [&](const at::Tensor& x) {
      return x.transpose(1, 2)
          .unsqueeze(2)
          .expand({b, groups_local_, per_group, t, hd})
          .reshape({b, heads_local_, t, hd});
    };
    return at::scaled_dot_product_attention(q.transpose(1, 2), heads_of(k), heads_of(v), {}, 0.0, true)
        .transpose(1, 2)
        .reshape({b, s, heads_local_ * hd});
  }
#endif
  // Megatron's CoreAttention, the probabilities [b, np, s, t] in memory. Without a mask, query i
  // sits at position t - s + i (as in the kernels above and window_mask).
  const at::Tensor masked = mask.defined() ? mask
                                           : at::ones({s, t}, at::TensorOptions().dtype(at::kBool).device(q.device()))
                                                 .triu(t - s + 1)
                                                 .view({1, 1, s, t});
  return attention_ops(q, k, v, scale, masked, keep);
}

at::Tensor Layer::mlp(const at::Tensor& h, at::Generator* jitter_rng, bool generating, bool training) const {
  if (moe)
    return moe->forward(
        h, [this](const std::vector<at::Tensor>& projected) { return swiglu(projected[0], projected[1], c_.kernels); },
        generating, jitter_rng, training);
  // One copy into the tensor-parallel region for both projections: a single all-reduce of the
  // input gradient in backward, not one per projection.
  if (gate.tp.splits_sequence()) {  // one gather of the sequence shards for both
    const std::vector<at::Tensor> gate_up = sequence_parallel_columns(h, {&gate, &up});
    return down.forward(swiglu(gate_up[0], gate_up[1], c_.kernels));
  }
  const at::Tensor x = copy_to_tp_region(h, gate.tp);
  // silu(gate) * up: one kernel each way on a GPU (dtk/layers/activations.hpp).
  return down.forward(swiglu(dtk::linear(x, gate.weight, gate.bias), dtk::linear(x, up.weight, up.bias), c_.kernels));
}

at::Tensor Layer::forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& mask, DropoutRng& rng,
                          bool training) const {
  return forward_residual({x, {}}, positions, mask, rng, training).sum();
}

ResidualStream Layer::forward_residual(const ResidualStream& in, const at::Tensor& positions, const at::Tensor& mask,
                                       DropoutRng& rng, bool training) const {
  const double p = training ? c_.attention_dropout : 0.0;
  // Core attention from the projection: the query/key/value split, rotary, softmax, dropout (its
  // mask drawn as dropout(probs, p, training, r.attention) would draw it).
  RecomputedBlock attention = [this, positions, mask, p, training](const at::Tensor& projected, DropoutRng& r) {
    const QKV a = split_qkv(projected, positions);
    const int64_t b = a.q.size(0), s = a.q.size(1);
    const DropoutMask keep =
        training ? draw_keep_mask(c_.cp.gathers_keys() ? c_.cp.gathered_probs_shape(b, heads_local_, s)
                                                       : std::vector<int64_t>{b, heads_local_, s, a.k.size(1)},
                                  p, r.attention)
                 : DropoutMask{};
    return attend(a.q, a.k, a.v, mask, keep);
  };
  // x = the previous layer's stream + its MLP branch, added by the input norm's kernel.
  const auto [x, normed_in] =
      in.branch.defined() ? add_rms_norm(in.stream, in.branch_value(), c_.norm_gain(input_norm), c_.eps, c_.kernels)
                          : std::pair{in.stream, rms_norm(in.stream, c_.norm_gain(input_norm), c_.eps, c_.kernels)};
  // Under context parallelism's a2a: the whole sequence of this rank's share of the groups
  // (`positions` are the whole sequence's, for rotary); under all_gather attend() gathers the keys
  // and values (`positions` are this rank's share's).
  const at::Tensor projected = c_.cp.heads_from_sequence(qkv.forward(normed_in), groups_local_ * c_.cp.size);
  // Selective recomputation (Megatron's checkpointed core attention): one checkpoint holding only
  // the projection.
  const at::Tensor context = c_.cp.sequence_from_heads(
      c_.selective_recompute ? recompute(projected, rng, attention) : attention(projected, rng), heads_local_);
  // h = x + dropout(attention's output) and its RMSNorm in one (the dropout stays on the branch).
  const auto [h, normed] =
      add_rms_norm(x, dropout(dense.forward(context), c_.hidden_dropout, training, rng.hidden, qkv.tp),
                   c_.norm_gain(post_attention_norm), c_.eps, c_.kernels);
  // The MLP (dense or MoE) one checkpoint holding only its input where recompute_modules names
  // the layer's kind (Megatron's checkpointed MLP / MoE layer); it draws no dropout, an MoE
  // router's input jitter draws from the block's hidden stream.
  RecomputedBlock mlp_block = [this, training](const at::Tensor& in, DropoutRng& r) {
    return mlp(in, &r.hidden, /*generating=*/false, training);
  };
  const at::Tensor branch = c_.recomputes_mlp(moe != nullptr)
                                ? recompute(normed, rng, mlp_block)
                                : mlp(normed, &rng.hidden, /*generating=*/false, training);
  return {h, dropout(branch, c_.hidden_dropout, training, rng.hidden, qkv.tp)};
}

at::Tensor Layer::forward_cached(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cache,
                                 int64_t length, const at::Tensor& mask) const {
  const int64_t n = x.size(1);
  const QKV a = project(rms_norm(x, c_.norm_gain(input_norm), c_.eps, c_.kernels), positions);
  // cache [2, b, ng, capacity, hd]; the new keys (already rotated) and values at [length, length + n).
  cache[0].narrow(2, length, n).copy_(a.k.transpose(1, 2));
  cache[1].narrow(2, length, n).copy_(a.v.transpose(1, 2));
  const at::Tensor k = cache[0].narrow(2, 0, length + n).transpose(1, 2);  // [b, t, ng, hd]
  const at::Tensor v = cache[1].narrow(2, 0, length + n).transpose(1, 2);
  const at::Tensor context = attend(a.q, k, v, mask, DropoutMask{});
  const auto [h, normed] =
      add_rms_norm(x, dense.forward(context), c_.norm_gain(post_attention_norm), c_.eps, c_.kernels);
  return h + mlp(normed, /*jitter_rng=*/nullptr, /*generating=*/true, /*training=*/false);
}

at::Tensor Layer::stage_norm(int stage, const at::Tensor& in) const {
  return rms_norm(in, c_.norm_gain(stage == 0 ? input_norm : post_attention_norm), c_.eps, c_.kernels);
}

std::vector<const ColumnParallelLinear*> Layer::stage_columns(int stage) const {
  if (stage == 0) return {&qkv};
  return {&gate, &up};
}

at::Tensor Layer::stage_partial(int stage, const at::Tensor& projected, const DominoChunk& chunk) const {
  if (stage == 1) {  // projected = [gate | up] of this rank's ffn / tp columns each
    const int64_t f = gate.weight.size(0);
    return dtk::linear(at::silu(projected.narrow(-1, 0, f)) * projected.narrow(-1, f, f), down.weight);
  }
  // Under context parallelism the chunk's exchanges, as the plain layer's (forward_residual);
  // chunk.positions are then the whole sequence's under a2a, the share's under all_gather.
  const QKV a = split_qkv(c_.cp.heads_from_sequence(projected, groups_local_ * c_.cp.size), chunk.positions);
  const at::Tensor context = attend(a.q, a.k, a.v, chunk.mask, chunk.attention_probs);
  return dtk::linear(c_.cp.sequence_from_heads(context, heads_local_), dense.weight);
}

LayerMasks Layer::draw_masks(int64_t batch, int64_t seq, DropoutRng& rng, bool training) const {
  return draw_layer_masks(batch, seq, heads_local_, c_.hidden, c_.attention_dropout, c_.hidden_dropout, rng, training,
                          c_.cp);
}

void Layer::add_params(std::vector<Param>& out, const std::string& prefix) const {
  auto add = [&](const std::string& name, const at::Tensor& t, int partition_dim, bool no_wd) {
    add_param(out, prefix + name, t, partition_dim, no_wd);
  };
  auto add_bias = [&](const std::string& name, const at::Tensor& t, int partition_dim) {
    if (t.defined()) add(name, t, partition_dim, true);
  };
  add("input_norm.weight", input_norm, -1, true);
  add("self_attention.query_key_value.weight", qkv.weight, 0, false);
  add_bias("self_attention.query_key_value.bias", qkv.bias, 0);
  if (c_.qk_layernorm) {
    // Read by this rank's heads only: a partial gradient the host sums over the tensor-parallel
    // group (Megatron all-reduces q_layernorm / k_layernorm gradients alike).
    for (const auto& [name, t] : {std::pair{"self_attention.q_layernorm.weight", q_norm},
                                  std::pair{"self_attention.k_layernorm.weight", k_norm}}) {
      add(name, t, -1, true);
      out.back().info.sequence_parallel = qkv.tp.size > 1 ? 1 : 0;
    }
  }
  add("self_attention.dense.weight", dense.weight, 1, false);
  add_bias("self_attention.dense.bias", dense.bias, -1);
  add("post_attention_norm.weight", post_attention_norm, -1, true);
  if (moe) {
    moe->add_params(out, prefix + "mlp.");
    return;
  }
  add("mlp.gate.weight", gate.weight, 0, false);
  add_bias("mlp.gate.bias", gate.bias, 0);
  add("mlp.up.weight", up.weight, 0, false);
  add_bias("mlp.up.bias", up.bias, 0);
  add("mlp.dense_4h_to_h.weight", down.weight, 1, false);
  add_bias("mlp.dense_4h_to_h.bias", down.bias, -1);
}

}  // namespace dtk::llama
