// attention.cpp — see dtk/layers/attention.hpp.
//
// Per (sequence, head) pair, query rows in blocks [r0, r1); with s queries over t keys query r
// sits at position o + r (o = t - s, 0 for self-attention) and block [r0, r1) attends to keys
// [0, o + r1).
//   forward   S = scale Q_blk K^T               [rows, o + r1]  sgemm
//             P = softmax over each row's prefix [0, o + r]     softmax_rows.hpp; the rest of the
//                                                               block's columns set to 0
//             O_blk = dropout(P) V              [rows, hd]      sgemm, into the context's layout
//   backward  dV += dropout(P)^T dO_blk, dPd = dO_blk V^T, dP = dropout'(dPd),
//             dS = P (dP - rowsum(dP P)), dQ_blk = scale dS K, dK += scale dS^T Q_blk
// Backward walks the blocks from the last (which covers every key) to the first, so the last
// block's dK / dV products initialise them (beta 0) and the others accumulate; under
// grouped-query attention the group's later heads accumulate into its dK / dV too. With
// recompute_probs (Megatron's selective recomputation) forward keeps no probabilities and
// backward forms each block's again (one more Q K^T product and softmax per block).
// Forward's pairs run on the intra-op threads, backward's (sequence, key/value group) pairs (the
// group's heads in turn, as they add into one dK / dV), each product on its pair's thread.
#include <dtk/gemm.hpp>
#include <ATen/record_function.h>
#include <dtk/layers/attention.hpp>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include <ATen/ops/ones.h>

#include "dropout_rows.hpp"
#include "softmax_rows.hpp"

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Query rows per block: 4 blocks at s = 256 skip 6 of 16 score blocks.
constexpr int64_t kBlockRows = 64;

// Where a [b, n, heads, hd] operand (unit stride in hd) lives: row i of head h of sequence bi at
// at(bi, h) + i * row.
struct Operand {
  float* data = nullptr;
  int64_t batch = 0, row = 0, head = 0;
  float* at(int64_t bi, int64_t h) const { return data + bi * batch + h * head; }
};

Operand operand_of(const at::Tensor& x) { return {x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)}; }

// The queries, keys and values (or their gradients).
struct Operands {
  Operand q, k, v;
};

// s queries over t >= s keys, heads query heads over groups key/value groups.
struct Shape {
  int64_t b, s, t, heads, groups, hd;
  int64_t offset() const { return t - s; }  // query r sits at position offset() + r
  int64_t per_group() const { return heads / groups; }
};

// One (sequence, head) pair's operands, its saved probabilities and where its mask starts.
struct Pair {
  const float* q;
  const float* k;
  const float* v;
  int64_t ldq, ldk, ldv;
  float* probs;  // [s, t] row-major, saved; null when recomputed in backward
  // The index of the pair's first probability in the [b, heads, s, t] tensor the mask is applied
  // to (scale_kept maps it to the drawn mask's: a block of columns of a wider one too).
  int64_t mask_at;
};

Pair pair_of(const Shape& g, const Operands& x, float* probs, int64_t index) {
  const int64_t bi = index / g.heads, h = index % g.heads, group = h / g.per_group();
  return {x.q.at(bi, h),
          x.k.at(bi, group),
          x.v.at(bi, group),
          x.q.row,
          x.k.row,
          x.v.row,
          probs ? probs + index * g.s * g.t : nullptr,
          index * g.s * g.t};
}

// Where one (sequence, head) pair's gradients go: its dQ rows, its group's dK and dV.
struct PairGrads {
  float* q;
  float* k;
  float* v;
  int64_t ldq, ldk, ldv;
};

PairGrads grads_of(const Shape& g, const Operands& dx, int64_t index) {
  const int64_t bi = index / g.heads, h = index % g.heads, group = h / g.per_group();
  return {dx.q.at(bi, h), dx.k.at(bi, group), dx.v.at(bi, group), dx.q.row, dx.k.row, dx.v.row};
}

// The probabilities of query rows [r0, r1) over keys [0, o + r1) into `dst` (rows `ld` apart): the
// scaled scores, each row's softmax over its unmasked prefix [0, o + r], zeros after it.
void probs_block(const Pair& p, double scale, int64_t hd, int64_t o, int64_t r0, int64_t r1, float* dst, int64_t ld) {
  const int64_t width = o + r1;
  sgemm('N', 'T', r1 - r0, width, hd, static_cast<float>(scale), p.q + r0 * p.ldq, p.ldq, p.k, p.ldk, 0.0f, dst, ld);
  for (int64_t r = r0; r < r1; ++r) {
    float* row = dst + (r - r0) * ld;
    const int64_t seen = o + r + 1;
    float max = 0, sum = 0;
    softmax_rows::row_max(row, 1, seen, ld, &max);
    softmax_rows::exp_sum(row, 1, seen, ld, &max, nullptr, &sum, nullptr, /*write=*/true);
    softmax_rows::normalize_minus_onehot(row, 1, seen, ld, &sum, nullptr);
    std::fill(row + seen, row + width, 0.0f);  // the masked future: exp(-10000 - max) = 0
  }
}

// The block's probabilities: the saved ones, or recomputed into `scratch`. Returns (data, ld).
std::pair<const float*, int64_t> block_probs(const Pair& p, double scale, const Shape& g, int64_t r0, int64_t r1,
                                             float* scratch) {
  if (p.probs) return {p.probs + r0 * g.t, g.t};
  probs_block(p, scale, g.hd, g.offset(), r0, r1, scratch, g.offset() + r1);
  return {scratch, g.offset() + r1};
}

void forward_pair(const Shape& g, const Pair& p, double scale, const DropoutMask& keep, float* out, int64_t ldo,
                  std::vector<float>& scratch) {
  const int64_t s = g.s, hd = g.hd, o = g.offset();
  for (int64_t r0 = 0; r0 < s; r0 += kBlockRows) {
    const int64_t r1 = std::min(s, r0 + kBlockRows), rows = r1 - r0, width = o + r1;
    scratch.resize(static_cast<size_t>(2 * rows * width));
    float* dropped = scratch.data() + rows * width;
    float* probs = p.probs ? p.probs + r0 * g.t : scratch.data();
    const int64_t ldp = p.probs ? g.t : width;
    probs_block(p, scale, hd, o, r0, r1, probs, ldp);
    const float* used = probs;
    int64_t ld_used = ldp;
    if (keep.defined()) {
      for (int64_t r = r0; r < r1; ++r)
        scale_kept(keep, p.mask_at + r * g.t, width, probs + (r - r0) * ldp, dropped + (r - r0) * width);
      used = dropped;
      ld_used = width;
    }
    sgemm('N', 'N', rows, hd, width, 1.0f, used, ld_used, p.v, p.ldv, 0.0f, out + r0 * ldo, ldo);
  }
}

// One pair's gradients: dQ's rows written, dK and dV written (`accumulate` false: the group's
// first head) or added to.
void backward_pair(const Shape& g, const Pair& p, double scale, const DropoutMask& keep, const float* d_out,
                   int64_t ldo, const PairGrads& d, bool accumulate, std::vector<float>& scratch) {
  const int64_t s = g.s, hd = g.hd, o = g.offset();
  const int64_t blocks = (s + kBlockRows - 1) / kBlockRows;
  for (int64_t blk = blocks - 1; blk >= 0; --blk) {
    const int64_t r0 = blk * kBlockRows, r1 = std::min(s, r0 + kBlockRows), rows = r1 - r0, width = o + r1;
    const float beta = blk == blocks - 1 && !accumulate ? 0.0f : 1.0f;  // the last block covers every key
    scratch.resize(static_cast<size_t>(4 * rows * width));
    float* grad = scratch.data();                // dP after dropout, then dS
    float* mult = grad + rows * width;           // the dropout's keep multipliers (made once)
    float* dropped_probs = mult + rows * width;  // dropout(P)
    const auto [probs, ldp] = block_probs(p, scale, g, r0, r1, dropped_probs + rows * width);
    const float* used = probs;
    int64_t ld_used = ldp;
    if (keep.defined()) {
      for (int64_t r = r0; r < r1; ++r) {
        float* m = mult + (r - r0) * width;
        const float* pr = probs + (r - r0) * ldp;
        float* out = dropped_probs + (r - r0) * width;
        keep_multipliers(keep, p.mask_at + r * g.t, o + r + 1, m);
        for (int64_t j = 0; j <= o + r; ++j) out[j] = pr[j] * m[j];
        std::fill(out + o + r + 1, out + width, 0.0f);
      }
      used = dropped_probs;
      ld_used = width;
    }
    sgemm('T', 'N', width, hd, rows, 1.0f, used, ld_used, d_out + r0 * ldo, ldo, beta, d.v, d.ldv);
    sgemm('N', 'T', rows, width, hd, 1.0f, d_out + r0 * ldo, ldo, p.v, p.ldv, 0.0f, grad, width);
    for (int64_t r = r0; r < r1; ++r) {
      float* dp = grad + (r - r0) * width;
      softmax_rows::softmax_backward_row(probs + (r - r0) * ldp, dp, keep.defined() ? mult + (r - r0) * width : nullptr,
                                         o + r + 1);
      std::fill(dp + o + r + 1, dp + width, 0.0f);
    }
    const auto sc = static_cast<float>(scale);
    sgemm('N', 'N', rows, hd, width, sc, grad, width, p.k, p.ldk, 0.0f, d.q + r0 * d.ldq, d.ldq);
    sgemm('T', 'N', width, hd, rows, sc, grad, width, p.q + r0 * p.ldq, p.ldq, beta, d.k, d.ldk);
  }
}

// The context [b, s, heads * hd] of every pair; `probs` [b, heads, s, t] or null.
void attention_forward(const Shape& g, const Operands& x, float* probs, double scale, const DropoutMask& keep,
                       float* out) {
  const int64_t ldo = g.heads * g.hd;
  at::parallel_for(0, g.b * g.heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch;
    for (int64_t i = first; i < last; ++i) {
      const int64_t bi = i / g.heads, h = i % g.heads;
      forward_pair(g, pair_of(g, x, probs, i), scale, keep, out + bi * g.s * ldo + h * g.hd, ldo, scratch);
    }
  });
}

// The gradients into `dx` (its dq, dk and dv written, in their layouts) from the context's `d_out`
// (contiguous [b, s, heads * hd]).
void attention_backward(const Shape& g, const Operands& x, float* probs, double scale, const DropoutMask& keep,
                        const float* d_out, const Operands& dx) {
  const int64_t ldo = g.heads * g.hd;
  at::parallel_for(0, g.b * g.groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch;
    for (int64_t i = first; i < last; ++i) {
      const int64_t bi = i / g.groups, group = i % g.groups;
      for (int64_t k = 0; k < g.per_group(); ++k) {
        const int64_t h = group * g.per_group() + k, index = bi * g.heads + h;
        backward_pair(g, pair_of(g, x, probs, index), scale, keep, d_out + bi * g.s * ldo + h * g.hd, ldo,
                      grads_of(g, dx, index), /*accumulate=*/k > 0, scratch);
      }
    }
  });
}

float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// The context [b, s, heads * hd] and, unless recomputed in backward, the probabilities [b, heads,
// s, t] kept for it.
std::pair<at::Tensor, at::Tensor> forward_all(const Shape& g, const Operands& x, double scale, const DropoutMask& keep,
                                              bool recompute, const at::TensorOptions& options) {
  at::Tensor probs = recompute ? at::Tensor() : at::empty({g.b, g.heads, g.s, g.t}, options);
  at::Tensor out = at::empty({g.b, g.s, g.heads * g.hd}, options);
  attention_forward(g, x, data_or_null(probs), scale, keep, out.data_ptr<float>());
  return {out, probs};
}

// Causal self-attention over Megatron's fused projection [b, s, heads * 3 * hd] (per head q, k,
// v): the gradient written into one tensor of the projection's layout.
struct CausalAttention : public torch::autograd::Function<CausalAttention> {
  static Shape shape_of(const at::Tensor& qkv, int64_t heads) {
    return {qkv.size(0), qkv.size(1), qkv.size(1), heads, heads, qkv.size(2) / (3 * heads)};
  }
  static Operands operands_of(const at::Tensor& qkv, const Shape& g) {
    const Operand q{qkv.data_ptr<float>(), g.s * g.heads * 3 * g.hd, g.heads * 3 * g.hd, 3 * g.hd};
    Operand k = q, v = q;
    k.data += g.hd;
    v.data += 2 * g.hd;
    return {q, k, v};
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& qkv, int64_t heads, double scale, DropoutMask keep,
                            bool recompute) {
    RECORD_FUNCTION("dtk::causal_attention", std::vector<c10::IValue>());  // a row in logging.profile_steps' table
    const Shape g = shape_of(qkv, heads);
    auto [out, probs] = forward_all(g, operands_of(qkv, g), scale, keep, recompute, qkv.options());
    ctx->save_for_backward({qkv, probs});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["scale"] = scale;
    save_mask(ctx, "keep", keep);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::causal_attention_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& qkv = saved[0];
    const at::Tensor& probs = saved[1];  // undefined: recomputed block by block
    const Shape g = shape_of(qkv, ctx->saved_data["heads"].toInt());
    const at::Tensor d_out = grad[0].contiguous();
    at::Tensor d_qkv = at::empty_like(qkv);
    attention_backward(g, operands_of(qkv, g), data_or_null(probs), ctx->saved_data["scale"].toDouble(),
                       saved_mask(ctx, "keep"), d_out.data_ptr<float>(), operands_of(d_qkv, g));
    return {d_qkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Causal attention over separate q [b, s, heads, hd] and k, v [b, t, groups, hd] (strided views
// welcome): the gradients as three tensors of their shapes.
struct CausalAttentionSeparate : public torch::autograd::Function<CausalAttentionSeparate> {
  static Shape shape_of(const at::Tensor& q, const at::Tensor& k) {
    return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, DropoutMask keep, bool recompute) {
    RECORD_FUNCTION("dtk::causal_attention", std::vector<c10::IValue>());
    auto [out, probs] =
        forward_all(shape_of(q, k), {operand_of(q), operand_of(k), operand_of(v)}, scale, keep, recompute, q.options());
    ctx->save_for_backward({q, k, v, probs});
    ctx->saved_data["scale"] = scale;
    save_mask(ctx, "keep", keep);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::causal_attention_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &probs = saved[3];
    const Shape g = shape_of(q, k);
    const at::Tensor d_out = grad[0].contiguous();
    at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
               dv = at::empty(v.sizes(), v.options());
    attention_backward(g, {operand_of(q), operand_of(k), operand_of(v)}, data_or_null(probs),
                       ctx->saved_data["scale"].toDouble(), saved_mask(ctx, "keep"), d_out.data_ptr<float>(),
                       {operand_of(dq), operand_of(dk), operand_of(dv)});
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool causal_attention_supported(const at::Tensor& qkv) {
  return qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3 && qkv.is_contiguous();
}

at::Tensor causal_attention_qkv(const at::Tensor& qkv, int64_t heads, double scale, const DropoutMask& keep,
                                bool recompute_probs) {
  if (!causal_attention_supported(qkv))
    throw Error("causal attention: the fused projection must be a contiguous CPU fp32 [b, s, 3 * hidden] tensor, got " +
                shape_str(qkv));
  if (heads <= 0 || qkv.size(2) % (3 * heads) != 0)
    throw Error("causal attention: " + std::to_string(qkv.size(2)) + " projection columns are not 3 x " +
                std::to_string(heads) + " heads");
  if (qkv.numel() == 0) return at::empty({qkv.size(0), qkv.size(1), qkv.size(2) / 3}, qkv.options());
  // Without a graph to record (evaluation) there is nothing to keep the probabilities for.
  const bool graph = at::GradMode::is_enabled() && qkv.requires_grad();
  return CausalAttention::apply(qkv, heads, scale, keep, recompute_probs || !graph);
}

bool causal_attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DropoutMask& keep) {
  const auto operand = [&](const at::Tensor& x) {
    return x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4 && x.stride(3) == 1 &&
           x.size(0) == q.size(0) && x.size(3) == q.size(3) && x.size(2) > 0 && x.numel() > 0;
  };
  if (!operand(q) || !operand(k) || !operand(v) || k.sizes() != v.sizes() || k.size(1) < q.size(1) ||
      q.size(2) % k.size(2) != 0)
    return false;
  return mask_fits_probs(keep, q.size(2), q.size(1), k.size(1));
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const DropoutMask& keep, bool recompute_probs) {
  if (!causal_attention_applies(q, k, v, keep))
    throw Error("causal attention: queries " + shape_str(q) + ", keys " + shape_str(k) + " and values " + shape_str(v) +
                " (or the dropout mask) are not what the CPU kernel takes");
  const bool graph = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  return CausalAttentionSeparate::apply(q, k, v, scale, keep, recompute_probs || !graph);
}

at::Tensor window_mask(const at::Tensor& mask, int64_t s, int64_t t, int64_t window, at::Device device) {
  const at::Tensor ones = at::ones({s, t}, at::TensorOptions().dtype(at::kBool).device(device));
  // Key j is before query i's window where j - i <= t - s - window - 1, in its future where
  // j - i >= t - s + 1.
  const at::Tensor before = ones.tril(t - s - window - 1).view({1, 1, s, t});
  return mask.defined() ? mask.logical_or(before) : ones.triu(t - s + 1).view({1, 1, s, t}).logical_or(before);
}

}  // namespace dtk::layers
