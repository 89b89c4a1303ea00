// lm_head.cpp — see lm_head.hpp. The cross-entropy arithmetic is vocab_parallel_cross_entropy's
// (tensor_parallel.cpp, Megatron's _VocabParallelCrossEntropy) in the same order, per chunk.
#include <dtk/layers/lm_head.hpp>
#include <ATen/record_function.h>

#include <ATen/Parallel.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/scatter_add.h>
#include <ATen/ops/where.h>
#include <torch/csrc/autograd/custom_function.h>
#include <dtk/capture.hpp>
#include <dtk/gemm.hpp>

#include <algorithm>

#include "cuda_kernels.hpp"
#include "softmax_rows.hpp"

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Tokens per chunk on the CPU. Smaller chunks keep the [chunk, V] block in cache but make the
// three GEMMs re-read W (V x h) once per chunk and run less efficiently: on a 2-core EPYC, 128
// tokens made a 6-layer/384-hidden step 15% slower than 512, and 512 beat the unfused logits at
// both h = 64 and h = 384 (docs/benchmarks.md). 512 x 50304 fp32 logits are 103 MB.
constexpr int64_t kChunkTokens = 512;
// On a GPU the chunk is sized by bytes instead: about 1 GiB of logits (10,624 tokens of a 50,304
// vocabulary in bf16, 5,248 in fp32, in multiples of 128), so each of the three GEMMs is large
// enough to run at the tensor cores' rate while the [tokens, V] logits (6.6 GB in fp32 at 32K
// tokens) never exist.
constexpr int64_t kGpuChunkBytes = int64_t{1} << 30;

int64_t chunk_rows(int64_t rows, int64_t vocab, int64_t requested, bool on_cpu, int64_t element_bytes = 4) {
  int64_t chunk = requested;
  if (chunk <= 0)
    chunk = on_cpu ? kChunkTokens
                   : std::max<int64_t>(128, kGpuChunkBytes / (element_bytes * std::max<int64_t>(vocab, 1)) / 128 * 128);
  return std::max<int64_t>(1, std::min(rows, chunk));
}

// Whether a chunk's cross entropy runs as DTK's GPU kernel (dtk/cuda/cross_entropy.hpp: each row
// read once for its max and exp-sum, once more to write D, on logits in the weights' type) instead
// of ops: on a GPU where the build has it, with one tensor-parallel rank (under TP the all-reduces
// of the max and the sums come between the passes) and x, W of one type.
bool kernel_rows(CrossEntropyRows rows, const at::Tensor& x, const at::Tensor& w, const TPGroup& tp) {
  return rows == CrossEntropyRows::kAuto && tp.size == 1 && x.scalar_type() == w.scalar_type() &&
         gpu::cross_entropy_applies(x.device(), x.scalar_type());
}

bool host_rows(CrossEntropyRows rows, const at::Tensor& logits) {
  if (rows == CrossEntropyRows::kAuto) return logits.device().is_cpu();
  if (rows == CrossEntropyRows::kHost && !logits.device().is_cpu())
    throw Error("fused output layer: the host row passes (cross_entropy_impl host) need the logits on the CPU, not " +
                logits.device().str());
  return rows == CrossEntropyRows::kHost;
}

void tp_all_reduce(const at::Tensor& t, const TPGroup& tp, int32_t op) {
  if (tp.size > 1) Comm::all_reduce(t, DTK_GROUP_TENSOR_PARALLEL, op);
}

// out[n, V] (fp32) = x[n, h] w[V, h]^T; a low-precision product is rounded to its dtype first,
// as a GPU's (on the CPU widened to fp32 and rounded once, dtk/gemm.hpp).
void logits_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat)
    dtk::mm_out(out, x, w.t());
  else
    out.copy_(dtk::mm(x, w.t()));
}

// Each row's target as a column of this rank's vocabulary rows, or -1 where another rank holds
// it (Megatron's target_mask): int64 [n], contiguous.
at::Tensor local_columns(const at::Tensor& target, int64_t start, int64_t vocab) {
  const at::Tensor local = target - start;
  return local.masked_fill((local < 0).logical_or_(local >= vocab), -1).contiguous();
}

// Runs fn(first_row, rows) over the rows of a block, split over the intra-op threads.
template <class Fn>
void for_rows(int64_t n, Fn&& fn) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) { fn(begin, end - begin); });
}

// What the forward pass computes for all tokens.
struct HeadPass {
  at::Tensor loss;      // [N] fp32
  at::Tensor max, sum;  // [N] fp32: the row maximum and sum of exp(logit - max), over all TP ranks
  at::Tensor gx;        // [N, h] (x's dtype): D W per token, before the incoming gradient
  at::Tensor gw;        // [V, h] fp32: sum over tokens of D^T x, before the incoming gradient
};

// The cross entropy of one chunk of logits [n, V] (fp32, contiguous), Megatron's order: the
// global row maximum, the target logit and the sum of exp(logit - max), all-reduced over the TP
// group; with `with_grads` the logits become D = softmax - onehot. In one process each row goes
// through all its passes while it is in the core's cache (softmax_rows.hpp); under TP the
// all-reduces come between the passes.
void cross_entropy_rows(at::Tensor& logits, const at::Tensor& col, at::Tensor max, at::Tensor sum, at::Tensor loss,
                        const TPGroup& tp, bool with_grads) {
  namespace rows = softmax_rows;
  const int64_t n = logits.size(0), vocab = logits.size(1), ld = logits.stride(0);
  float* l = logits.data_ptr<float>();
  const int64_t* c = col.data_ptr<int64_t>();
  float* mx = max.data_ptr<float>();
  at::Tensor reduced = at::empty({2, n}, logits.options());  // sum of exp, target logit: one all-reduce
  float* s = reduced.data_ptr<float>();
  float* target_logit = s + n;
  if (tp.size == 1) {
    for_rows(n, [&](int64_t first, int64_t k) {
      for (int64_t i = first; i < first + k; ++i) {  // row by row: each stays in cache for its passes
        rows::row_max(l + i * ld, 1, vocab, ld, mx + i);
        rows::exp_sum(l + i * ld, 1, vocab, ld, mx + i, c + i, s + i, target_logit + i, with_grads);
        if (with_grads) rows::normalize_minus_onehot(l + i * ld, 1, vocab, ld, s + i, c + i);
      }
    });
  } else {
    for_rows(n, [&](int64_t i, int64_t k) { rows::row_max(l + i * ld, k, vocab, ld, mx + i); });
    tp_all_reduce(max, tp, DTK_REDUCE_MAX);
    for_rows(n, [&](int64_t i, int64_t k) {
      rows::exp_sum(l + i * ld, k, vocab, ld, mx + i, c + i, s + i, target_logit + i, with_grads);
    });
    tp_all_reduce(reduced, tp, DTK_REDUCE_SUM);
    if (with_grads)
      for_rows(n, [&](int64_t i, int64_t k) { rows::normalize_minus_onehot(l + i * ld, k, vocab, ld, s + i, c + i); });
  }
  sum.copy_(reduced[0]);
  at::sub_out(loss, at::log(reduced[0]), reduced[1]);
}

// The same passes as LibTorch ops, on any device (a GPU's path; cross entropy 'aten' on the CPU):
// the row maximum, the target logit, exp in place, the sum, and D = e / s - onehot, each op one
// pass over the chunk (7 in all, where the host rows make each row's passes in cache).
void cross_entropy_ops(at::Tensor& logits, const at::Tensor& col, at::Tensor max, at::Tensor sum, at::Tensor loss,
                       const TPGroup& tp, bool with_grads) {
  at::amax_out(max, logits, {1});
  tp_all_reduce(max, tp, DTK_REDUCE_MAX);
  const at::Tensor held = col.ge(0);  // this rank holds the target's column
  const at::Tensor column = col.clamp_min(0).unsqueeze(1);
  at::Tensor reduced = at::empty({2, logits.size(0)}, logits.options());  // sum of exp, target logit
  at::Tensor exp_sum = reduced[0], target_logit = reduced[1];
  const at::Tensor target = logits.gather(1, column).squeeze(1).sub_(max);
  target_logit.copy_(at::where(held, target, at::zeros({}, target.options())));
  logits.sub_(max.unsqueeze(1)).exp_();
  at::sum_out(exp_sum, logits, {1});
  tp_all_reduce(reduced, tp, DTK_REDUCE_SUM);
  if (with_grads) {
    logits.div_(exp_sum.unsqueeze(1));
    logits.scatter_add_(1, column, held.to(logits.scalar_type()).neg_().unsqueeze(1));  // - onehot
  }
  sum.copy_(exp_sum);
  at::sub_out(loss, at::log(exp_sum), target_logit);
}

// In place: d [n, V] (fp32 logits) becomes softmax - onehot from the saved global row maximum and
// sum (the backward's correction for tokens whose incoming gradient differs).
void softmax_minus_onehot(at::Tensor& d, const at::Tensor& max, const at::Tensor& sum, const at::Tensor& col,
                          bool host) {
  if (!host) {
    d.sub_(max.unsqueeze(1)).exp_().div_(sum.unsqueeze(1));
    d.scatter_add_(1, col.clamp_min(0).unsqueeze(1), col.ge(0).to(d.scalar_type()).neg_().unsqueeze(1));
    return;
  }
  const int64_t vocab = d.size(1);
  at::Tensor local_sum = at::empty_like(sum);
  float* dp = d.data_ptr<float>();
  for_rows(d.size(0), [&](int64_t first, int64_t k) {
    for (int64_t i = first; i < first + k; ++i) {
      softmax_rows::exp_sum(dp + i * vocab, 1, vocab, vocab, max.data_ptr<float>() + i, nullptr,
                            local_sum.data_ptr<float>() + i, nullptr, /*write=*/true);
      softmax_rows::normalize_minus_onehot(dp + i * vocab, 1, vocab, vocab, sum.data_ptr<float>() + i,
                                           col.data_ptr<int64_t>() + i);
    }
  });
}

HeadPass run_chunks(const at::Tensor& x, const at::Tensor& w, const at::Tensor& target, const TPGroup& tp,
                    int64_t requested_chunk, CrossEntropyRows rows, bool with_grads) {
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
  const bool kernel = kernel_rows(rows, x, w, tp);
  const at::ScalarType logit_type = kernel ? x.scalar_type() : at::kFloat;
  const int64_t chunk =
      chunk_rows(n_all, vocab, requested_chunk, x.device().is_cpu(), static_cast<int64_t>(c10::elementSize(logit_type)));
  at::Tensor buffer = at::empty({chunk, vocab}, x.options().dtype(logit_type));
  const bool host = !kernel && host_rows(rows, buffer);
  for (int64_t c0 = 0; c0 < n_all; c0 += chunk) {
    const int64_t n = std::min(chunk, n_all - c0);
    const at::Tensor xc = x.narrow(0, c0, n);
    at::Tensor logits = buffer.narrow(0, 0, n);
    const at::Tensor col = local_columns(target.narrow(0, c0, n), start, vocab);
    const at::Tensor max = p.max.narrow(0, c0, n), sum = p.sum.narrow(0, c0, n), loss = p.loss.narrow(0, c0, n);
    if (kernel) {
      at::mm_out(logits, xc, w.t());  // in x's type: the kernel reads bf16 logits as they come
      if (!gpu::cross_entropy_rows(logits, col, max, sum, loss, with_grads))
        throw Error("fused output layer: the GPU cross entropy kernel refused " + shape_str(logits));
    } else {
      logits_into(logits, xc, w);
      (host ? cross_entropy_rows : cross_entropy_ops)(logits, col, max, sum, loss, tp, with_grads);
    }
    if (!with_grads) continue;
    // logits now hold D = softmax - onehot.
    at::Tensor gx = p.gx.narrow(0, c0, n);
    if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat) {
      dtk::mm_out(gx, logits, w);
      dtk::addmm_(p.gw, logits.t(), xc);
    } else {
      const at::Tensor d = logits.scalar_type() == x.scalar_type() ? logits : logits.to(x.scalar_type());
      dtk::mm_out(gx, d, w);
      p.gw.add_(dtk::mm(d.t(), xc));
    }
  }
  return p;
}

// The gradient most tokens share, left on the device (a host read is a synchronisation on a
// GPU): the entry of largest magnitude. A plain mean gives every token the same gradient, a loss
// mask gives the masked ones 0; any choice is exact, the rows that differ are corrected below.
at::Tensor common_gradient(const at::Tensor& g) {
  return g.index_select(0, g.abs().argmax().reshape({1})).reshape({});
}

struct FusedLmHead : public torch::autograd::Function<FusedLmHead> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& labels, TPGroup tp, int64_t chunk, int64_t rows) {
    RECORD_FUNCTION("dtk::fused_lm_head_loss", std::vector<c10::IValue>());  // a row in logging.profile_steps' table
    const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
    const at::Tensor target = labels.reshape({-1}).to(at::kLong);
    HeadPass p = run_chunks(x2, weight, target, tp, chunk, static_cast<CrossEntropyRows>(rows), /*with_grads=*/true);
    ctx->save_for_backward({x, weight});  // the parameter itself, as dtk::linear (ZeRO-3)
    ctx->saved_data["target"] = target;
    ctx->saved_data["max"] = p.max;
    ctx->saved_data["sum"] = p.sum;
    ctx->saved_data["gx"] = p.gx;
    ctx->saved_data["gw"] = p.gw;
    ctx->saved_data["tp_rank"] = static_cast<int64_t>(tp.rank);
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["rows"] = rows;
    return p.loss.view(labels.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::fused_lm_head_loss_backward", std::vector<c10::IValue>());
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
    const at::Tensor c = g.numel() > 0 ? common_gradient(g) : at::zeros({}, g.options());
    gw.mul_(c);
    // One host read in the common case (no token differs); the rows' indices only when some do.
    // A recorded step (CUDA graph) cannot branch on it: there the gradient must be common (the
    // shipped steps' mean loss without a loss mask), and the host checks it after the backward.
    const at::Tensor differs = g.ne(c);
    if (capturing()) {
      defer_check(differs.any(),
                  "the fused output layer's loss gradient differs between tokens (a loss mask: eod_mask_loss, or "
                  "the dataset's loss_mask), which a step recorded into a CUDA graph cannot follow: run with "
                  "train.cuda_graphs=false");
    } else if (differs.any().item<bool>()) {
      const at::Tensor rows = differs.nonzero().squeeze(1);
      const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
      const at::Tensor target = ctx->saved_data["target"].toTensor();
      const at::Tensor max = ctx->saved_data["max"].toTensor(), sum = ctx->saved_data["sum"].toTensor();
      const int64_t vocab = weight.size(0), start = ctx->saved_data["tp_rank"].toInt() * vocab;
      const int64_t chunk = chunk_rows(rows.numel(), vocab, ctx->saved_data["chunk"].toInt(), weight.device().is_cpu());
      for (int64_t r0 = 0; r0 < rows.numel(); r0 += chunk) {
        const at::Tensor idx = rows.narrow(0, r0, std::min(chunk, rows.numel() - r0));
        const at::Tensor xr = x2.index_select(0, idx);
        at::Tensor d = at::empty({idx.numel(), vocab}, g.options());
        logits_into(d, xr, weight);
        // D from the saved global max and sum, with the forward's kernels.
        const at::Tensor col = local_columns(target.index_select(0, idx), start, vocab);
        softmax_minus_onehot(d, max.index_select(0, idx), sum.index_select(0, idx), col,
                             host_rows(static_cast<CrossEntropyRows>(ctx->saved_data["rows"].toInt()), d));
        d.mul_((g.index_select(0, idx) - c).unsqueeze(1));
        dtk::addmm_(gw, d.t(), xr.to(at::kFloat));
      }
    }
    return {gx.view(x.sizes()), gw.to(weight.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fused_lm_head_loss(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& labels,
                              const TPGroup& tp, int64_t chunk_tokens, CrossEntropyRows rows) {
  if (x.dim() != labels.dim() + 1 || x.sizes().slice(0, labels.dim()) != labels.sizes())
    throw Error("fused output layer: input " + shape_str(x) + " does not match labels " + shape_str(labels));
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad()))
    return FusedLmHead::apply(x, weight, labels, tp, chunk_tokens, static_cast<int64_t>(rows));
  // Evaluation: the loss only, chunk by chunk.
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  return run_chunks(x2, weight, labels.reshape({-1}).to(at::kLong), tp, chunk_tokens, rows, /*with_grads=*/false)
      .loss.view(labels.sizes());
}

}  // namespace dtk::layers
