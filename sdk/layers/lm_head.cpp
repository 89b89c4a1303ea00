// lm_head.cpp — see lm_head.hpp. The cross-entropy arithmetic is vocab_parallel_cross_entropy's
// (tensor_parallel.cpp, Megatron's _VocabParallelCrossEntropy) in the same order, per chunk.
#include <dtk/layers/lm_head.hpp>

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Tokens per chunk. Smaller chunks keep the [chunk, V] block in cache but make the three GEMMs
// re-read W (V x h) once per chunk and run less efficiently: on a 2-core EPYC, 128 tokens made a
// 6-layer/384-hidden step 15% slower than 512, and 512 beat the unfused logits at both h = 64
// and h = 384 (docs/benchmarks.md). 512 x 50304 fp32 logits are 103 MB.
constexpr int64_t kChunkTokens = 512;

int64_t chunk_rows(int64_t rows, int64_t vocab, int64_t requested) {
  return std::max<int64_t>(1, std::min(rows, requested > 0 ? requested : kChunkTokens));
}

void tp_all_reduce(const at::Tensor& t, const TPGroup& tp, int32_t op) {
  if (tp.size > 1) Comm::all_reduce(t, DTK_GROUP_TENSOR_PARALLEL, op);
}

// out[n, V] (fp32) = x[n, h] w[V, h]^T; a low-precision product is computed in its dtype.
void logits_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat)
    at::mm_out(out, x, w.t());
  else
    out.copy_(at::mm(x, w.t()));
}

// This rank's column of each row's target, and whether the target is one of its rows of the
// vocabulary (Megatron's target_mask, inverted).
struct LocalTargets {
  at::Tensor column, here;
  LocalTargets(const at::Tensor& target, int64_t start, int64_t vocab) {
    at::Tensor local = target - start;
    here = (local >= 0).logical_and_(local < vocab);
    column = local.masked_fill(here.logical_not(), 0);
  }
  // logits[i, column_i] -= 1 where the target is here: softmax -> softmax - onehot.
  void subtract_onehot(at::Tensor& logits) const {
    logits.scatter_add_(1, column.unsqueeze(1), here.to(at::kFloat).neg_().unsqueeze(1));
  }
};

// What the forward pass computes for all tokens.
struct HeadPass {
  at::Tensor loss;      // [N] fp32
  at::Tensor max, sum;  // [N] fp32: the row maximum and sum of exp(logit - max), over all TP ranks
  at::Tensor gx;        // [N, h] (x's dtype): D W per token, before the incoming gradient
  at::Tensor gw;        // [V, h] fp32: sum over tokens of D^T x, before the incoming gradient
};

HeadPass run_chunks(const at::Tensor& x, const at::Tensor& w, const at::Tensor& target, const TPGroup& tp,
                    int64_t requested_chunk, bool with_grads) {
  const int64_t n_all = x.size(0), vocab = w.size(0), start = static_cast<int64_t>(tp.rank) * vocab;
  const auto f32 = x.options().dtype(at::kFloat);
  HeadPass p;
  p.loss = at::empty({n_all}, f32);
  p.max = at::empty({n_all}, f32);
  p.sum = at::empty({n_all}, f32);
  if (with_grads) {
    p.gx = at::empty(x.sizes(), x.options());
    p.gw = at::zeros(w.sizes(), f32);
  }
  const int64_t chunk = chunk_rows(n_all, vocab, requested_chunk);
  at::Tensor buffer = at::empty({chunk, vocab}, f32);
  for (int64_t c0 = 0; c0 < n_all; c0 += chunk) {
    const int64_t n = std::min(chunk, n_all - c0);
    const at::Tensor xc = x.narrow(0, c0, n);
    at::Tensor logits = buffer.narrow(0, 0, n);
    logits_into(logits, xc, w);
    // Megatron's order: subtract the global row maximum, take the target logit, exponentiate.
    at::Tensor max = p.max.narrow(0, c0, n);
    at::amax_out(max, logits, {1});
    tp_all_reduce(max, tp, DTK_REDUCE_MAX);
    logits.sub_(max.unsqueeze(1));
    const LocalTargets t(target.narrow(0, c0, n), start, vocab);
    at::Tensor reduced = at::empty({2, n}, f32);  // sum of exp, target logit: one all-reduce
    at::Tensor sum = reduced[0], target_logit = reduced[1];
    target_logit.copy_(logits.gather(1, t.column.unsqueeze(1)).squeeze(1).masked_fill_(t.here.logical_not(), 0.0));
    logits.exp_();
    at::sum_out(sum, logits, {1});
    tp_all_reduce(reduced, tp, DTK_REDUCE_SUM);
    p.sum.narrow(0, c0, n).copy_(sum);
    at::Tensor loss = p.loss.narrow(0, c0, n);
    at::sub_out(loss, at::log(sum), target_logit);
    if (!with_grads) continue;
    logits.div_(sum.unsqueeze(1));  // softmax
    t.subtract_onehot(logits);             // D = softmax - onehot
    at::Tensor gx = p.gx.narrow(0, c0, n);
    if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat) {
      at::mm_out(gx, logits, w);
      p.gw.addmm_(logits.t(), xc);
    } else {
      const at::Tensor d = logits.to(x.scalar_type());
      gx.copy_(d.mm(w));
      p.gw.add_(d.t().mm(xc));
    }
  }
  return p;
}

// The value most entries of g share (the gradient every token of a plain mean gets).
double most_common(const at::Tensor& g) {
  const auto u = at::_unique2(g, /*sorted=*/false, /*return_inverse=*/false, /*return_counts=*/true);
  const at::Tensor& values = std::get<0>(u);
  const at::Tensor& counts = std::get<2>(u);
  return values[counts.argmax().item<int64_t>()].item<double>();
}

struct FusedLmHead : public torch::autograd::Function<FusedLmHead> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& labels, TPGroup tp, int64_t chunk) {
    const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    const at::Tensor target = labels.reshape({-1}).to(at::kLong);
    HeadPass p = run_chunks(x2, weight, target, tp, chunk, /*with_grads=*/true);
    ctx->save_for_backward({x, weight});  // the parameter itself, as dtk::linear (ZeRO-3)
    ctx->saved_data["target"] = target;
    ctx->saved_data["max"] = p.max;
    ctx->saved_data["sum"] = p.sum;
    ctx->saved_data["gx"] = p.gx;
    ctx->saved_data["gw"] = p.gw;
    ctx->saved_data["tp_rank"] = static_cast<int64_t>(tp.rank);
    ctx->saved_data["chunk"] = chunk;
    return p.loss.view(labels.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    if (!ctx->saved_data["gw"].isTensor())
      throw Error("the fused output layer's backward ran twice (retain_graph is not supported by it)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    at::Tensor gx = ctx->saved_data["gx"].toTensor();
    at::Tensor gw = ctx->saved_data["gw"].toTensor();
    ctx->saved_data["gx"] = c10::IValue();  // scaled in place below: no second use
    ctx->saved_data["gw"] = c10::IValue();
    const at::Tensor g = grad[0].reshape({-1}).to(at::kFloat).contiguous();
    // gx: each token's row times its own gradient (exact for any g).
    gx.mul_(g.unsqueeze(1).to(gx.scalar_type()));
    // gw: everything times the common gradient c, then the tokens whose gradient differs.
    const double c = g.numel() > 0 ? most_common(g) : 0.0;
    gw.mul_(c);
    const at::Tensor rows = g.ne(c).nonzero().squeeze(1);
    if (rows.numel() > 0) {
      const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
      const at::Tensor target = ctx->saved_data["target"].toTensor();
      const at::Tensor max = ctx->saved_data["max"].toTensor(), sum = ctx->saved_data["sum"].toTensor();
      const int64_t vocab = weight.size(0), start = ctx->saved_data["tp_rank"].toInt() * vocab;
      const int64_t chunk = chunk_rows(rows.numel(), vocab, ctx->saved_data["chunk"].toInt());
      for (int64_t r0 = 0; r0 < rows.numel(); r0 += chunk) {
        const at::Tensor idx = rows.narrow(0, r0, std::min(chunk, rows.numel() - r0));
        const at::Tensor xr = x2.index_select(0, idx);
        at::Tensor d = at::empty({idx.numel(), vocab}, g.options());
        logits_into(d, xr, weight);
        d.sub_(max.index_select(0, idx).unsqueeze(1)).exp_().div_(sum.index_select(0, idx).unsqueeze(1));
        LocalTargets(target.index_select(0, idx), start, vocab).subtract_onehot(d);
        d.mul_((g.index_select(0, idx) - c).unsqueeze(1));
        gw.add_(d.t().mm(xr.to(at::kFloat)));
      }
    }
    return {gx.view(x.sizes()), gw.to(weight.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fused_lm_head_loss(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& labels,
                              const TPGroup& tp, int64_t chunk_tokens) {
  if (x.dim() != labels.dim() + 1 || x.sizes().slice(0, labels.dim()) != labels.sizes())
    throw Error("fused output layer: input " + shape_str(x) + " does not match labels " + shape_str(labels));
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad()))
    return FusedLmHead::apply(x, weight, labels, tp, chunk_tokens);
  // Evaluation: the loss only, chunk by chunk.
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  return run_chunks(x2, weight, labels.reshape({-1}).to(at::kLong), tp, chunk_tokens, /*with_grads=*/false)
      .loss.view(labels.sizes());
}

}  // namespace dtk::layers
