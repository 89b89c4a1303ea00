// attention.cpp — see dtk/layers/attention.hpp.
//
// Per (sequence, head) pair, query rows in blocks [r0, r1); block i attends to keys [0, r1).
//   forward   S = scale Q_blk K^T               [rows, r1]   sgemm
//             P = softmax over each row's prefix [0, r]      softmax_rows.hpp; the rest of the
//                                                            block's columns set to 0
//             O_blk = dropout(P) V              [rows, hd]   sgemm, into the context's layout
//   backward  dV += dropout(P)^T dO_blk, dPd = dO_blk V^T, dP = dropout'(dPd),
//             dS = P (dP - rowsum(dP P)), dQ_blk = scale dS K, dK += scale dS^T Q_blk
// Backward walks the blocks from the last (which covers every key) to the first, so the last
// block's dK / dV products initialise them (beta 0) and the others accumulate. With
// recompute_probs (Megatron's selective recomputation) forward keeps no probabilities and
// backward forms each block's again (one more Q K^T product and softmax per block).
// Pairs run on the intra-op threads, each product on its pair's thread.
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

// Where one (sequence, head) pair's operands live. Q, K, V rows are `ld` apart (the fused
// projection's row: heads * 3 * hd); the context and its gradient rows `ldo` apart.
struct Pair {
  const float* q;
  const float* k;
  const float* v;
  int64_t ld;
  float* probs;     // [s, s] row-major, saved; null when recomputed in backward
  int64_t mask_at;  // index of the pair's first probability in the dropout mask
};

struct Shape {
  int64_t b, s, heads, hd;
  int64_t ld() const { return heads * 3 * hd; }
  int64_t ldo() const { return heads * hd; }
};

Pair pair_of(const Shape& g, const float* qkv, float* probs, int64_t index) {
  const int64_t bi = index / g.heads, h = index % g.heads;
  const float* q = qkv + bi * g.s * g.ld() + h * 3 * g.hd;
  return {q, q + g.hd, q + 2 * g.hd, g.ld(), probs ? probs + index * g.s * g.s : nullptr, index * g.s * g.s};
}

// The probabilities of query rows [r0, r1) over keys [0, r1) into `dst` (rows `ld` apart): the
// scaled scores, each row's softmax over its unmasked prefix, zeros after it.
void probs_block(const Pair& p, double scale, int64_t hd, int64_t r0, int64_t r1, float* dst, int64_t ld) {
  const int64_t width = r1;
  sgemm('N', 'T', r1 - r0, width, hd, static_cast<float>(scale), p.q + r0 * p.ld, p.ld, p.k, p.ld, 0.0f, dst, ld);
  for (int64_t r = r0; r < r1; ++r) {
    float* row = dst + (r - r0) * ld;
    float max = 0, sum = 0;
    softmax_rows::row_max(row, 1, r + 1, ld, &max);
    softmax_rows::exp_sum(row, 1, r + 1, ld, &max, nullptr, &sum, nullptr, /*write=*/true);
    softmax_rows::normalize_minus_onehot(row, 1, r + 1, ld, &sum, nullptr);
    std::fill(row + r + 1, row + width, 0.0f);  // the masked future: exp(-10000 - max) = 0
  }
}

// The block's probabilities: the saved ones, or recomputed into `scratch`. Returns (data, ld).
std::pair<const float*, int64_t> block_probs(const Pair& p, double scale, int64_t s, int64_t hd, int64_t r0,
                                             int64_t r1, float* scratch) {
  if (p.probs) return {p.probs + r0 * s, s};
  probs_block(p, scale, hd, r0, r1, scratch, r1);
  return {scratch, r1};
}

void forward_pair(const Shape& g, const Pair& p, double scale, const DropoutMask& keep, float* out,
                  std::vector<float>& scratch) {
  const int64_t s = g.s, hd = g.hd;
  for (int64_t r0 = 0; r0 < s; r0 += kBlockRows) {
    const int64_t r1 = std::min(s, r0 + kBlockRows), rows = r1 - r0, width = r1;
    scratch.resize(static_cast<size_t>(2 * rows * width));
    float* dropped = scratch.data() + rows * width;
    float* probs = p.probs ? p.probs + r0 * s : scratch.data();
    const int64_t ldp = p.probs ? s : width;
    probs_block(p, scale, hd, r0, r1, probs, ldp);
    const float* used = probs;
    int64_t ld_used = ldp;
    if (keep.defined()) {
      for (int64_t r = r0; r < r1; ++r)
        scale_kept(keep, p.mask_at + r * s, width, probs + (r - r0) * ldp, dropped + (r - r0) * width);
      used = dropped;
      ld_used = width;
    }
    sgemm('N', 'N', rows, hd, width, 1.0f, used, ld_used, p.v, p.ld, 0.0f, out + r0 * g.ldo(), g.ldo());
  }
}

void backward_pair(const Shape& g, const Pair& p, double scale, const DropoutMask& keep, const float* d_out,
                   float* d_q, float* d_k, float* d_v, std::vector<float>& scratch) {
  const int64_t s = g.s, hd = g.hd, ldo = g.ldo();
  const int64_t blocks = (s + kBlockRows - 1) / kBlockRows;
  for (int64_t blk = blocks - 1; blk >= 0; --blk) {
    const int64_t r0 = blk * kBlockRows, r1 = std::min(s, r0 + kBlockRows), rows = r1 - r0, width = r1;
    const float beta = blk == blocks - 1 ? 0.0f : 1.0f;  // the last block covers every key
    scratch.resize(static_cast<size_t>(4 * rows * width));
    float* grad = scratch.data();                // dP after dropout, then dS
    float* mult = grad + rows * width;           // the dropout's keep multipliers (made once)
    float* dropped_probs = mult + rows * width;  // dropout(P)
    const auto [probs, ldp] = block_probs(p, scale, s, hd, r0, r1, dropped_probs + rows * width);
    const float* used = probs;
    int64_t ld_used = ldp;
    if (keep.defined()) {
      for (int64_t r = r0; r < r1; ++r) {
        float* m = mult + (r - r0) * width;
        const float* pr = probs + (r - r0) * ldp;
        float* out = dropped_probs + (r - r0) * width;
        keep_multipliers(keep, p.mask_at + r * s, r + 1, m);
        for (int64_t j = 0; j <= r; ++j) out[j] = pr[j] * m[j];
        std::fill(out + r + 1, out + width, 0.0f);
      }
      used = dropped_probs;
      ld_used = width;
    }
    sgemm('T', 'N', width, hd, rows, 1.0f, used, ld_used, d_out + r0 * ldo, ldo, beta, d_v, p.ld);
    sgemm('N', 'T', rows, width, hd, 1.0f, d_out + r0 * ldo, ldo, p.v, p.ld, 0.0f, grad, width);
    for (int64_t r = r0; r < r1; ++r) {
      float* dp = grad + (r - r0) * width;
      softmax_rows::softmax_backward_row(probs + (r - r0) * ldp, dp,
                                         keep.defined() ? mult + (r - r0) * width : nullptr, r + 1);
      std::fill(dp + r + 1, dp + width, 0.0f);
    }
    const auto sc = static_cast<float>(scale);
    sgemm('N', 'N', rows, hd, width, sc, grad, width, p.k, p.ld, 0.0f, d_q + r0 * p.ld, p.ld);
    sgemm('T', 'N', width, hd, rows, sc, grad, width, p.q + r0 * p.ld, p.ld, beta, d_k, p.ld);
  }
}

struct CausalAttention : public torch::autograd::Function<CausalAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& qkv, int64_t heads, double scale, DropoutMask keep,
                            bool recompute) {
    RECORD_FUNCTION("dtk::causal_attention", std::vector<c10::IValue>());  // a row in logging.profile_steps' table
    const Shape g{qkv.size(0), qkv.size(1), heads, qkv.size(2) / (3 * heads)};
    at::Tensor probs = recompute ? at::Tensor() : at::empty({g.b, heads, g.s, g.s}, qkv.options());
    at::Tensor out = at::empty({g.b, g.s, heads * g.hd}, qkv.options());
    const float* x = qkv.data_ptr<float>();
    float* pr = probs.defined() ? probs.data_ptr<float>() : nullptr;
    float* o = out.data_ptr<float>();
    at::parallel_for(0, g.b * heads, 1, [&](int64_t first, int64_t last) {
      std::vector<float> scratch;
      for (int64_t i = first; i < last; ++i) {
        const int64_t bi = i / heads, h = i % heads;
        forward_pair(g, pair_of(g, x, pr, i), scale, keep, o + bi * g.s * g.ldo() + h * g.hd, scratch);
      }
    });
    ctx->save_for_backward({qkv, probs});
    ctx->saved_data["recompute"] = recompute;
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
    const int64_t heads = ctx->saved_data["heads"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const DropoutMask keep = saved_mask(ctx, "keep");
    const Shape g{qkv.size(0), qkv.size(1), heads, qkv.size(2) / (3 * heads)};
    const at::Tensor d_out = grad[0].contiguous();
    at::Tensor d_qkv = at::empty_like(qkv);
    const float* x = qkv.data_ptr<float>();
    float* pr = probs.defined() ? probs.data_ptr<float>() : nullptr;
    const float* dout = d_out.data_ptr<float>();
    float* dx = d_qkv.data_ptr<float>();
    at::parallel_for(0, g.b * heads, 1, [&](int64_t first, int64_t last) {
      std::vector<float> scratch;
      for (int64_t i = first; i < last; ++i) {
        const int64_t bi = i / heads, h = i % heads;
        float* dq = dx + bi * g.s * g.ld() + h * 3 * g.hd;
        backward_pair(g, pair_of(g, x, pr, i), scale, keep, dout + bi * g.s * g.ldo() + h * g.hd, dq, dq + g.hd,
                      dq + 2 * g.hd, scratch);
      }
    });
    return {d_qkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
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

at::Tensor window_mask(const at::Tensor& mask, int64_t s, int64_t t, int64_t window, at::Device device) {
  const at::Tensor ones = at::ones({s, t}, at::TensorOptions().dtype(at::kBool).device(device));
  // Key j is before query i's window where j - i <= t - s - window - 1, in its future where
  // j - i >= t - s + 1.
  const at::Tensor before = ones.tril(t - s - window - 1).view({1, 1, s, t});
  return mask.defined() ? mask.logical_or(before) : ones.triu(t - s + 1).view({1, 1, s, t}).logical_or(before);
}

}  // namespace dtk::layers
