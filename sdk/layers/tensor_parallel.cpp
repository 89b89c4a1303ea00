// tensor_parallel.cpp — see tensor_parallel.hpp. Megatron: core/tensor_parallel/{mappings,
// layers,cross_entropy}.py. Collectives go through the host (dtk::Comm) on the TP group and are
// skipped entirely at TP size 1.
#include <dtk/layers/tensor_parallel.hpp>

#include <torch/csrc/autograd/custom_function.h>
#include <dtk/capture.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/module_hooks.hpp>

namespace dtk::layers {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// In-place SUM/MAX all-reduce over the TP group (no-op at size 1). `t` must be contiguous.
void tp_all_reduce(const at::Tensor& t, const TPGroup& tp, int32_t op = DTK_REDUCE_SUM) {
  if (tp.size <= 1) return;
  Comm::all_reduce(t, DTK_GROUP_TENSOR_PARALLEL, op);
}

struct CopyToTP : public torch::autograd::Function<CopyToTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, TPGroup tp) {
    ctx->saved_data["tp_rank"] = static_cast<int64_t>(tp.rank);
    ctx->saved_data["tp_size"] = static_cast<int64_t>(tp.size);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    TPGroup tp{static_cast<int>(ctx->saved_data["tp_rank"].toInt()),
               static_cast<int>(ctx->saved_data["tp_size"].toInt())};
    at::Tensor g = grad[0].contiguous().clone();
    tp_all_reduce(g, tp);
    return {g, at::Tensor()};
  }
};

struct ReduceFromTP : public torch::autograd::Function<ReduceFromTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, TPGroup tp) {
    at::Tensor y = x.contiguous().clone();
    tp_all_reduce(y, tp);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) { return {grad[0], at::Tensor()}; }
};

// Sequence parallelism's collectives along dim 1 of [b, s, ...]. The host's all-gather and
// reduce-scatter concatenate along dim 0, so the shards travel as [tp, b, s / tp, ...].
at::Tensor gathered_buffer(const at::Tensor& shard, int size) {
  std::vector<int64_t> gathered = shard.sizes().vec();
  gathered[0] *= size;
  return at::empty(gathered, shard.options());
}

// [tp * b, s / tp, ...] as gathered -> [b, s, ...]
at::Tensor sequence_order(const at::Tensor& gathered, int size) {
  std::vector<int64_t> split = gathered.sizes().vec();
  split[0] /= size;
  split.insert(split.begin(), size);
  std::vector<int64_t> whole = gathered.sizes().vec();
  whole[0] /= size;
  whole[1] *= size;
  return gathered.view(split).transpose(0, 1).reshape(whole);
}

at::Tensor seq_all_gather(const at::Tensor& shard, int size) {
  at::Tensor out = gathered_buffer(shard, size);
  Comm::all_gather(out, shard.contiguous(), DTK_GROUP_TENSOR_PARALLEL);
  return sequence_order(out, size);
}

// x [b, s, ...] reordered as the reduce-scatter sends it, [tp * b, s / tp, ...], and the shard
// it fills.
std::pair<at::Tensor, at::Tensor> seq_reduce_scatter_buffers(const at::Tensor& x, int size) {
  if (x.size(1) % size != 0)
    throw Error("sequence parallelism: a sequence of " + std::to_string(x.size(1)) +
                " tokens does not split over the tensor-parallel size " + std::to_string(size));
  std::vector<int64_t> split = x.sizes().vec();
  split[1] /= size;
  split.insert(split.begin() + 1, size);  // [b, tp, s / tp, ...]
  std::vector<int64_t> shard = x.sizes().vec();
  shard[1] /= size;
  std::vector<int64_t> flat = shard;
  flat[0] *= size;
  return {x.reshape(split).transpose(0, 1).contiguous().view(flat), at::empty(shard, x.options())};
}

at::Tensor seq_reduce_scatter(const at::Tensor& x, int size) {
  auto [send, out] = seq_reduce_scatter_buffers(x, size);
  Comm::reduce_scatter(out, send, DTK_GROUP_TENSOR_PARALLEL);
  return out;
}

struct GatherFromSequence : public torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t size) {
    ctx->saved_data["size"] = size;
    return seq_all_gather(x, static_cast<int>(size));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {seq_reduce_scatter(grad[0], static_cast<int>(ctx->saved_data["size"].toInt())), at::Tensor()};
  }
};

struct ReduceScatterToSequence : public torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t size) {
    ctx->saved_data["size"] = size;
    return seq_reduce_scatter(x, static_cast<int>(size));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {seq_all_gather(grad[0], static_cast<int>(ctx->saved_data["size"].toInt())), at::Tensor()};
  }
};

// Column-parallel products of a sequence shard (Megatron's linear with sequence_parallel): the
// input all-gathered for the products, only the shard saved, gathered again in backward; the input
// gradient reduce-scattered. `params`: n weights, then their n biases (all or none).
struct SequenceColumns : public torch::autograd::Function<SequenceColumns> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& shard, at::TensorList params, int64_t n_weights,
                               TPGroup tp) {
    const auto n = static_cast<size_t>(n_weights);
    const bool bias = params.size() == 2 * n;
    const at::Tensor total = seq_all_gather(shard, tp.size);
    variable_list out;
    std::vector<at::Tensor> saved{shard};
    for (size_t i = 0; i < n; ++i) {
      out.push_back(dtk::linear_product(total, params[i], bias ? params[n + i] : at::Tensor()));
      saved.push_back(params[i]);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["bias"] = bias;
    ctx->saved_data["tp_size"] = static_cast<int64_t>(tp.size);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const size_t n = saved.size() - 1;
    const bool bias = ctx->saved_data["bias"].toBool();
    const int size = static_cast<int>(ctx->saved_data["tp_size"].toInt());
    const at::Tensor total = seq_all_gather(saved[0], size);
    const at::Tensor total2 = total.reshape({-1, total.size(-1)});
    at::Tensor gx;
    variable_list weights, biases;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& w = saved[1 + i];
      if (!grad[i].defined()) {
        weights.push_back(at::zeros_like(w));
        if (bias) biases.push_back(at::zeros({w.size(0)}, w.options()));
        continue;
      }
      const at::Tensor g = grad[i].reshape({-1, grad[i].size(-1)});
      if (gx.defined())
        dtk::addmm_(gx, g, w);
      else
        gx = dtk::mm(g, w);
      weights.push_back(dtk::mm(g.t(), total2));
      if (bias) biases.push_back(g.sum(0));
    }
    if (!gx.defined()) gx = at::zeros(total2.sizes(), total.options());
    variable_list out{seq_reduce_scatter(gx.view(total.sizes()), size)};
    for (auto& w : weights) out.push_back(w);
    for (auto& b : biases) out.push_back(b);
    out.push_back(at::Tensor());  // n_weights
    out.push_back(at::Tensor());  // tp
    return out;
  }
};

// Megatron's LinearWithGradAccumulationAndAsyncCommunication (no bias, input replicated on the TP
// ranks): backward issues the input gradient's all-reduce, computes the weight gradient while it
// is in flight, then waits. Saves the weight itself (as dtk::linear), so ZeRO-3 may release it.
struct LinearAsyncGradAllReduce : public torch::autograd::Function<LinearAsyncGradAllReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    return dtk::linear_product(x, weight);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor g = grad[0].reshape({-1, grad[0].size(-1)});
    at::Tensor gx = dtk::mm(g, weight).view(x.sizes());
    Comm::Work reduce = Comm::all_reduce_async(gx, DTK_GROUP_TENSOR_PARALLEL);
    at::Tensor gw = dtk::mm(g.t(), x.reshape({-1, x.size(-1)}));
    reduce.wait();
    return {gx, gw};
  }
};

// The autograd end of the cross entropy (VocabParallelCrossEntropy below computed the values):
// forward returns the loss log(sum of exp) - target logit from the all-reduced `sums` [2, N]
// (target logits, sums of exponentials), backward Megatron's (softmax - one_hot(target)) * grad.
at::Tensor loss_from_sums(const at::Tensor& sums, at::IntArrayRef shape) {
  return (at::log(sums[1]) - sums[0]).view(shape);
}

struct CrossEntropyFromSoftmax : public torch::autograd::Function<CrossEntropyFromSoftmax> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& softmax,
                            const at::Tensor& target_mask, const at::Tensor& masked_target, const at::Tensor& sums) {
    ctx->save_for_backward({softmax, target_mask, masked_target});
    ctx->saved_data["in_dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss_from_sums(sums, target_mask.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& softmax = saved[0];
    const at::Tensor& target_mask = saved[1];
    const at::Tensor& masked_target = saved[2];
    const int64_t part = softmax.size(-1);
    at::Tensor grad_input = softmax.clone();
    at::Tensor g2d = grad_input.view({-1, part});
    at::Tensor arange = at::arange(g2d.size(0), masked_target.options());
    at::Tensor update = 1.0 - target_mask.reshape({-1}).to(at::kFloat);
    g2d.index_put_({arange, masked_target}, g2d.index({arange, masked_target}) - update);
    grad_input.mul_(grad[0].unsqueeze(-1));
    auto in_dtype = static_cast<at::ScalarType>(ctx->saved_data["in_dtype"].toInt());
    return {grad_input.to(in_dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
at::Tensor copy_to_tp_region(const at::Tensor& x, const TPGroup& tp) {
  if (tp.size <= 1) return x;
  return CopyToTP::apply(x, tp);
}

at::Tensor reduce_from_tp_region(const at::Tensor& x, const TPGroup& tp) {
  if (tp.size <= 1) return x;
  return ReduceFromTP::apply(x, tp);
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const TPGroup& tp) {
  if (!tp.splits_sequence()) return x;
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return seq_all_gather(x, tp.size);
  return GatherFromSequence::apply(x, static_cast<int64_t>(tp.size));
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const TPGroup& tp) {
  if (!tp.splits_sequence()) return x;
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return seq_reduce_scatter(x, tp.size);
  return ReduceScatterToSequence::apply(x, static_cast<int64_t>(tp.size));
}

at::Tensor sequence_all_gather(const at::Tensor& shard, const TPGroup& tp) {
  return tp.splits_sequence() ? seq_all_gather(shard, tp.size) : shard;
}

PendingShard sequence_reduce_scatter_async(const at::Tensor& x, const TPGroup& tp) {
  auto [send, out] = seq_reduce_scatter_buffers(x, tp.size);
  PendingShard p;
  p.work.emplace(Comm::reduce_scatter_async(out, send, DTK_GROUP_TENSOR_PARALLEL));
  p.send = std::move(send);
  p.shard = std::move(out);
  return p;
}

std::vector<at::Tensor> sequence_parallel_columns(const at::Tensor& shard,
                                                  const std::vector<const ColumnParallelLinear*>& columns) {
  const TPGroup& tp = columns.front()->tp;
  const bool bias = columns.front()->bias.defined();
  std::vector<at::Tensor> params;
  for (const ColumnParallelLinear* c : columns) params.push_back(c->weight);
  for (const ColumnParallelLinear* c : columns) {
    if (c->bias.defined() != bias)
      throw Error("sequence_parallel_columns: the projections must all have biases or none");
    if (bias) params.push_back(c->bias);
  }
  if (!at::GradMode::is_enabled()) {
    const at::Tensor total = sequence_all_gather(shard, tp);
    std::vector<at::Tensor> out;
    for (const ColumnParallelLinear* c : columns) out.push_back(dtk::linear_product(total, c->weight, c->bias));
    return out;
  }
  return SequenceColumns::apply(shard, at::TensorList(params), static_cast<int64_t>(columns.size()), tp);
}

PendingGather sequence_all_gather_async(const at::Tensor& shard, const TPGroup& tp) {
  PendingGather p;
  p.size = tp.size;
  p.send = shard.contiguous();
  p.buffer = gathered_buffer(shard, tp.size);
  p.work.emplace(Comm::all_gather_async(p.buffer, p.send, DTK_GROUP_TENSOR_PARALLEL));
  return p;
}

at::Tensor PendingGather::wait() {
  if (work) work->wait();
  work.reset();
  send = at::Tensor();
  return sequence_order(buffer, size);
}

at::Tensor enter_tp_region(const at::Tensor& x, const TPGroup& tp) {
  return tp.splits_sequence() ? gather_from_sequence_parallel_region(x, tp) : copy_to_tp_region(x, tp);
}

at::Tensor exit_tp_region(const at::Tensor& x, const TPGroup& tp) {
  return tp.splits_sequence() ? reduce_scatter_to_sequence_parallel_region(x, tp) : reduce_from_tp_region(x, tp);
}

at::Tensor sequence_shard(const at::Tensor& x, const TPGroup& tp) {
  if (!tp.splits_sequence() || !x.defined()) return x;
  const int64_t local = x.size(1) / tp.size;
  return x.narrow(1, tp.rank * local, local);
}

at::Tensor dropout(const at::Tensor& x, double p, bool training, at::Generator& gen, const TPGroup& tp) {
  if (!training || p <= 0.0) return x;
  return apply_dropout(x, dropout_mask(x, p, training, gen, tp));
}

DropoutMask dropout_mask(const at::Tensor& x, double p, bool training, at::Generator& gen, const TPGroup& tp) {
  if (!training || p <= 0.0) return {};
  DropoutMask m = draw_uniforms(x, gen, tp);
  m.p = p;
  return m;
}

DropoutMask draw_uniforms(const at::Tensor& x, at::Generator& gen, const TPGroup& tp) {
  if (!tp.splits_sequence()) return draw_uniforms(x.sizes(), gen);
  std::vector<int64_t> whole = x.sizes().vec();
  const int64_t local = whole[1];
  whole[1] *= tp.size;
  return draw_uniforms(whole, gen).sequence_rows(whole[1], tp.rank * local, local);
}

int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int64_t tp_size) {
  if (vocab_size <= 0) throw Error("vocab_size must be positive");
  const int64_t multiple = std::max<int64_t>(1, divisible_by) * std::max<int64_t>(1, tp_size);
  return (vocab_size + multiple - 1) / multiple * multiple;
}

static int64_t divide(int64_t n, int64_t d, const char* what) {
  if (d <= 0 || n % d != 0)
    throw Error(std::string(what) + " (" + std::to_string(n) + ") is not divisible by the tensor-parallel size (" +
                std::to_string(d) + ")");
  return n / d;
}

// ---------------------------------------------------------------------------------------------
ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, bool with_bias, double init_std, const TPGroup& tp_,
                                           ParamFactory& f)
    : tp(tp_) {
  out_per_partition = divide(out, tp.size, "column-parallel output size");
  at::Tensor master = f.normal({out, in}, init_std);
  weight = f.param(master.narrow(0, tp.rank * out_per_partition, out_per_partition));
  if (with_bias) bias = f.zeros({out_per_partition});
}

at::Tensor ColumnParallelLinear::forward(const at::Tensor& x) const {
  if (tp.splits_sequence()) return sequence_parallel_columns(x, {this})[0];
  return dtk::linear(copy_to_tp_region(x, tp), weight, bias);
}

RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, bool with_bias, double init_std, const TPGroup& tp_,
                                     ParamFactory& f)
    : tp(tp_) {
  in_per_partition = divide(in, tp.size, "row-parallel input size");
  at::Tensor master = f.normal({out, in}, init_std);
  weight = f.param(master.narrow(1, tp.rank * in_per_partition, in_per_partition));
  if (with_bias) bias = f.zeros({out});
}

at::Tensor RowParallelLinear::forward(const at::Tensor& x) const {
  at::Tensor y = forward_unbiased(x);
  return bias.defined() ? y + bias : y;
}

at::Tensor RowParallelLinear::forward_unbiased(const at::Tensor& x) const {
  return exit_tp_region(dtk::linear(x, weight), tp);
}

namespace {

// Whether any id lies outside [0, limit), as a bool on the ids' device (no host read).
at::Tensor out_of_range(const at::Tensor& ids, int64_t limit) {
  auto [lo, hi] = at::aminmax(ids);
  return lo.lt(0).logical_or_(hi.ge(limit));
}

[[noreturn]] void throw_out_of_range(const std::string& model, const char* what, const at::Tensor& ids, int64_t limit,
                                     const char* limit_name) {
  const at::Tensor mm = at::stack({ids.min(), ids.max()}).to(at::kCPU, at::kLong);
  const int64_t lo = mm[0].item<int64_t>(), hi = mm[1].item<int64_t>();
  throw Error(model + ": '" + what + "' holds ids in [" + std::to_string(lo) + ", " + std::to_string(hi) +
              "], outside [0, " + std::to_string(limit) + ") (" + limit_name + ")");
}

}  // namespace

void check_id_range(const char* model, const char* what, const at::Tensor& ids, int64_t limit, const char* limit_name) {
  IdRangeChecks checks(model);
  checks.add(what, ids, limit, limit_name);
  checks.verify();
}

void IdRangeChecks::add(const char* what, const at::Tensor& ids, int64_t limit, const char* limit_name) {
  if (ids.numel() == 0) return;
  checks_.push_back({what, ids, limit, limit_name});
  out_of_range_.push_back(out_of_range(ids, limit).to(out_of_range_.empty() ? ids.device() : out_of_range_[0].device()));
}

void IdRangeChecks::verify() {
  if (checks_.empty()) return;
  const at::Tensor any_bad = at::stack(out_of_range_).any();
  std::vector<Check> checks = std::move(checks_);
  checks_.clear();
  out_of_range_.clear();
  if (capturing()) {  // recorded: the host reads the flag after the backward (it checked the batch's ids itself)
    std::string what;
    for (const Check& c : checks) what += std::string(what.empty() ? "'" : ", '") + c.what + "'";
    defer_check(any_bad, model_ + ": " + what + " held ids outside their ranges");
    return;
  }
  const bool bad = any_bad.item<bool>();  // the one host read
  if (!bad) return;
  for (const Check& c : checks)
    if (out_of_range(c.ids, c.limit).item<bool>()) throw_out_of_range(model_, c.what, c.ids, c.limit, c.limit_name);
}

VocabParallelEmbedding::VocabParallelEmbedding(int64_t vocab, int64_t hidden, double init_std, const TPGroup& tp_,
                                               ParamFactory& f)
    : tp(tp_) {
  const int64_t per = divide(vocab, tp.size, "padded vocabulary size");
  vocab_start = tp.rank * per;
  vocab_end = vocab_start + per;
  at::Tensor master = f.normal({vocab, hidden}, init_std);
  weight = f.param(master.narrow(0, vocab_start, per));
}

at::Tensor VocabParallelEmbedding::partial(const at::Tensor& ids) const {
  if (tp.size <= 1) return at::embedding(weight, ids);
  at::Tensor mask = (ids < vocab_start).logical_or_(ids >= vocab_end);
  at::Tensor local = (ids - vocab_start).masked_fill_(mask, 0);
  return at::embedding(weight, local).masked_fill(mask.unsqueeze(-1), 0.0);
}

at::Tensor VocabParallelEmbedding::forward(const at::Tensor& ids) const {
  if (tp.size <= 1) return at::embedding(weight, ids);
  return exit_tp_region(partial(ids), tp);
}

at::Tensor parallel_lm_logits(const at::Tensor& x, const at::Tensor& weight, const TPGroup& tp, bool async_grad) {
  if (tp.splits_sequence()) return dtk::linear(gather_from_sequence_parallel_region(x, tp), weight);
  if (async_grad && tp.size > 1 && at::GradMode::is_enabled()) return LinearAsyncGradAllReduce::apply(x, weight);
  return dtk::linear(copy_to_tp_region(x, tp), weight);
}

// Megatron's _VocabParallelCrossEntropy, in its order, with the target logits and the sums of
// exponentials all-reduced together (one collective instead of two: the same sums).
VocabParallelCrossEntropy::VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& target,
                                                     const TPGroup& tp)
    : logits_(logits), tp_(tp) {
  if (logits.dim() != target.dim() + 1 || logits.sizes().slice(0, target.dim()) != target.sizes())
    throw Error("vocab_parallel_cross_entropy: logits " + shape_str(logits) + " do not match labels " +
                shape_str(target));
  target_ = target.to(at::kLong);
}

void VocabParallelCrossEntropy::all_reduce(const at::Tensor& t, int32_t op) {
  if (tp_.size > 1) pending_.emplace(Comm::all_reduce_async(t, DTK_GROUP_TENSOR_PARALLEL, op));
}

void VocabParallelCrossEntropy::wait() {
  if (pending_) pending_->wait();
  pending_.reset();
}

void VocabParallelCrossEntropy::reduce_max() {
  at::NoGradGuard no_grad;
  // Like Megatron, fp32 contiguous logits are overwritten in place (they become the softmax kept
  // for backward): nothing saved them, and callers do not read them again.
  work_ = logits_.detach().to(at::kFloat).contiguous();
  max_ = std::get<0>(work_.max(-1)).contiguous();  // the global row maximum: numerical stability
  all_reduce(max_, DTK_REDUCE_MAX);
}

void VocabParallelCrossEntropy::reduce_sums() {
  at::NoGradGuard no_grad;
  wait();
  work_.sub_(max_.unsqueeze(-1));
  // This rank's vocabulary range; targets outside it contribute 0 to the target logit.
  const int64_t part = work_.size(-1);
  const int64_t start = static_cast<int64_t>(tp_.rank) * part, end = start + part;
  target_mask_ = (target_ < start).logical_or_(target_ >= end);
  masked_target_ = (target_ - start).masked_fill_(target_mask_, 0).reshape({-1});
  const at::Tensor logits_2d = work_.view({-1, part});
  const at::Tensor arange = at::arange(logits_2d.size(0), target_.options());
  sums_ = at::empty({2, logits_2d.size(0)}, work_.options());
  at::Tensor predicted = sums_[0], sum_exp = sums_[1];
  predicted.copy_(logits_2d.index({arange, masked_target_}));
  predicted.masked_fill_(target_mask_.reshape({-1}), 0.0);
  work_.exp_();  // exp_logits, in the same buffer
  at::sum_out(sum_exp, logits_2d, {1});
  all_reduce(sums_, DTK_REDUCE_SUM);
}

at::Tensor VocabParallelCrossEntropy::loss() {
  wait();
  if (!at::GradMode::is_enabled() || !logits_.requires_grad()) {
    at::NoGradGuard no_grad;
    return loss_from_sums(sums_, target_.sizes());
  }
  at::Tensor softmax = work_;  // exp_logits / sum, kept for backward
  {
    at::NoGradGuard no_grad;
    softmax.view({-1, softmax.size(-1)}).div_(sums_[1].unsqueeze(-1));
  }
  return CrossEntropyFromSoftmax::apply(logits_, softmax, target_mask_.view(target_.sizes()), masked_target_, sums_);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const TPGroup& tp) {
  VocabParallelCrossEntropy ce(logits, target, tp);
  ce.reduce_max();
  ce.reduce_sums();
  return ce.loss();
}

}  // namespace dtk::layers
