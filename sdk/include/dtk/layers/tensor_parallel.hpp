// dtk/layers/tensor_parallel.hpp — Megatron-LM's tensor-parallel building blocks, for model plugins (gpt, llama,
// yours).
//
// Every block holds the shard this tensor-parallel (TP) rank owns and performs exactly the
// communication Megatron's layer performs (megatron/core/tensor_parallel/{layers,mappings,
// cross_entropy}.py). At TP size 1 every collective is skipped, so each block is the plain layer:
//
//   ColumnParallelLinear    Y_i = X A_i^T + b_i        A split along the OUTPUT dim (rows of [out, in]);
//                           input passes through copy_to_tp_region (identity forward,
//                           all-reduce of the input gradient in backward).
//   RowParallelLinear       Y = all_reduce(X_i A_i^T) + b  A split along the INPUT dim (columns);
//                           input already parallel; output through reduce_from_tp_region
//                           (all-reduce forward, identity backward); bias added after the reduce.
//   VocabParallelEmbedding  rows [start, end) of the vocabulary on each rank; ids outside the
//                           range are masked to zero and the result is all-reduced.
//   With sequence parallelism (TPGroup::sequence_parallel; Korthikanti et al. 2022, Megatron's
//   --sequence-parallel) the activations between the blocks are split along the sequence (dim 1
//   of [b, s, h]): the column-parallel input is all-gathered along the sequence (its gradient
//   reduce-scattered) and the row-parallel output reduce-scattered (its gradient all-gathered),
//   the same bytes as the all-reduces they replace; the embedding reduce-scatters too.
//   vocab_parallel_cross_entropy
//                           loss over logits split along the vocabulary: all-reduce MAX of the
//                           row maxima, all-reduce SUM of the target logit and of sum(exp).
//
// Weights are initialized as Megatron's CPU initialization does: the full ("master") weight is
// drawn from a generator that is identical on all TP ranks and each rank keeps its slice, so a
// TP=N model is exactly the TP=1 model cut in pieces (ParamFactory, dtk/layers/param_factory.hpp,
// which also builds them deferred for ZeRO-3's partitioned construction).
#pragma once

#include <optional>

#include <dtk/layers/dropout.hpp>
#include <dtk/layers/param_factory.hpp>
#include <dtk/model.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace dtk::layers {

// Where this rank sits in its tensor-parallel group.
struct TPGroup {
  int rank = 0;
  int size = 1;
  // Activations outside the tensor-parallel blocks hold this rank's rows of the sequence (only
  // with size > 1): [b, s / size, h], rows [rank * s / size, (rank + 1) * s / size).
  bool sequence_parallel = false;
  bool splits_sequence() const { return sequence_parallel && size > 1; }
};

// Megatron's region mappings (autograd functions).
// Forward identity; backward all-reduce (SUM) over the TP group.
at::Tensor copy_to_tp_region(const at::Tensor& x, const TPGroup& tp);
// Forward all-reduce (SUM) over the TP group; backward identity.
at::Tensor reduce_from_tp_region(const at::Tensor& x, const TPGroup& tp);

// Sequence parallelism's mappings along dim 1 of [b, s, ...] (Megatron's
// gather_from_sequence_parallel_region and reduce_scatter_to_sequence_parallel_region), identity
// where the group does not split the sequence.
// Forward all-gather of the sequence shards [b, s / tp, ..] -> [b, s, ..]; backward reduce-scatter.
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const TPGroup& tp);
// Forward reduce-scatter (SUM) [b, s, ..] -> this rank's [b, s / tp, ..]; backward all-gather.
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const TPGroup& tp);
// The way into and out of a tensor-parallel block, whichever layout the group uses:
// enter_tp_region is copy_to_tp_region, or with sequence parallelism the sequence all-gather;
// exit_tp_region is reduce_from_tp_region, or the sequence reduce-scatter.
at::Tensor enter_tp_region(const at::Tensor& x, const TPGroup& tp);
at::Tensor exit_tp_region(const at::Tensor& x, const TPGroup& tp);
// The same collectives outside autograd, for schedules that wait later (Domino): the blocking
// all-gather of the shards, and a reduce-scatter in flight (`shard` holds the result once `work`
// is waited; `send` the reordered input, kept alive until then).
at::Tensor sequence_all_gather(const at::Tensor& shard, const TPGroup& tp);
struct PendingShard {
  at::Tensor shard, send;
  std::optional<Comm::Work> work;
};
PendingShard sequence_reduce_scatter_async(const at::Tensor& x, const TPGroup& tp);
// An all-gather of the sequence shards in flight; wait() returns [b, s, ..].
struct PendingGather {
  at::Tensor buffer, send;
  std::optional<Comm::Work> work;
  int size = 1;
  at::Tensor wait();
};
PendingGather sequence_all_gather_async(const at::Tensor& shard, const TPGroup& tp);
// This rank's rows of dim 1 (no communication; forward of Megatron's
// scatter_to_sequence_parallel_region, without its backward: for tensors that need no gradient,
// such as position ids). Identity where the group does not split the sequence.
at::Tensor sequence_shard(const at::Tensor& x, const TPGroup& tp);
// Dropout of activations outside the tensor-parallel blocks ([b, s or s / tp, ...]): under
// sequence parallelism the mask is drawn for the whole sequence and this rank applies its rows,
// so every element is dropped exactly as without sequence parallelism (the same losses, not just
// the same statistics; Megatron draws per-shard masks from its tensor-parallel stream instead).
at::Tensor dropout(const at::Tensor& x, double p, bool training, at::Generator& gen, const TPGroup& tp);
// The mask that dropout(x, p, training, gen, tp) applies, drawn (gen advances as there) and not
// applied: for a kernel that applies it in its own pass (add_bias_dropout_layer_norm). Undefined
// when not training or p == 0.
DropoutMask dropout_mask(const at::Tensor& x, double p, bool training, at::Generator& gen, const TPGroup& tp);
// The draw dropout_mask takes (draw_uniforms: one draw of `gen`, no drop probability) for an
// activation x [b, s or s / tp, ...]: under sequence parallelism the whole sequence's, sliced to
// this rank's rows. For noise other than a mask (the MoE router's input jitter).
DropoutMask draw_uniforms(const at::Tensor& x, at::Generator& gen, const TPGroup& tp);

// Megatron's _vocab_size_with_padding: the smallest multiple of divisible_by x tp_size that is
// >= vocab_size.
int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int64_t tp_size);

// Y = X A^T + b with A [out, in] split along out. gather_output is false (Megatron's GPT). Its
// input enters the TP region (enter_tp_region: all-gathered along the sequence under sequence
// parallelism).
class ColumnParallelLinear {
 public:
  ColumnParallelLinear() = default;
  ColumnParallelLinear(int64_t in, int64_t out, bool bias, double init_std, const TPGroup& tp, ParamFactory& f);
  at::Tensor forward(const at::Tensor& x) const;
  int64_t out_per_partition = 0;
  at::Tensor weight;  // [out / tp, in]
  at::Tensor bias;    // [out / tp] or undefined
  TPGroup tp;
};

// Y = X A^T + b with A [out, in] split along in; X arrives already split (input_is_parallel).
// The output leaves the TP region (exit_tp_region: reduce-scattered along the sequence under
// sequence parallelism, then the bias is added to this rank's rows).
class RowParallelLinear {
 public:
  RowParallelLinear() = default;
  RowParallelLinear(int64_t in, int64_t out, bool bias, double init_std, const TPGroup& tp, ParamFactory& f);
  at::Tensor forward(const at::Tensor& x) const;
  // forward() without the bias (Megatron's skip_bias_add): the caller adds `bias` later, where a
  // kernel can take it (dtk::layers::add_bias_layer_norm).
  at::Tensor forward_unbiased(const at::Tensor& x) const;
  int64_t in_per_partition = 0;
  at::Tensor weight;  // [out, in / tp]
  at::Tensor bias;    // [out], replicated, added after the all-reduce
  TPGroup tp;
};

// Column-parallel projections of one sequence shard [b, s / tp, in] (sequence parallelism; Megatron's
// linear with sequence_parallel): the shards all-gathered once for every projection, only the
// shard kept for backward, which gathers it again (the paper's 34 s b h / t counts the shard) and
// reduce-scatters the input gradient. Outputs [b, s, out / tp] each, in order.
std::vector<at::Tensor> sequence_parallel_columns(const at::Tensor& shard,
                                                  const std::vector<const ColumnParallelLinear*>& columns);

// Ids outside [0, limit) would index an embedding table out of bounds (or be dropped by every
// rank's vocabulary slice and scored silently): refused with one line naming the model, the input
// and the limit, e.g. "gpt: 'tokens' holds ids in [0, 60000], outside [0, 50304) (the padded
// vocabulary)".
void check_id_range(const char* model, const char* what, const at::Tensor& ids, int64_t limit, const char* limit_name);

// Several id tensors checked as check_id_range checks one, with a single host read for all of
// them: on a GPU each read is a synchronisation, and a forward checks its tokens, positions and
// labels. verify() throws check_id_range's line for the first tensor out of range.
class IdRangeChecks {
 public:
  explicit IdRangeChecks(std::string model) : model_(std::move(model)) {}
  void add(const char* what, const at::Tensor& ids, int64_t limit, const char* limit_name);
  void verify();

 private:
  struct Check {
    const char* what;
    at::Tensor ids;
    int64_t limit;
    const char* limit_name;
  };
  std::string model_;
  std::vector<Check> checks_;
  std::vector<at::Tensor> out_of_range_;  // one bool per check, on the ids' device
};

class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding() = default;
  VocabParallelEmbedding(int64_t vocab, int64_t hidden, double init_std, const TPGroup& tp, ParamFactory& f);
  // [..] int64 -> [.., hidden]; under sequence parallelism [b, s] -> this rank's [b, s / tp, hidden]
  // (the partial sums reduce-scattered instead of all-reduced).
  at::Tensor forward(const at::Tensor& ids) const;
  // This rank's share before the all-reduce (rows of ids outside its slice are zero); summed over
  // the TP group it is forward(ids). At TP 1 it is forward(ids).
  at::Tensor partial(const at::Tensor& ids) const;
  int64_t vocab_start = 0, vocab_end = 0;
  at::Tensor weight;  // [vocab / tp, hidden]
  TPGroup tp;
};

// Megatron's parallel_lm_logits with parallel_output=True: copy_to_tp_region(x) @ W^T, giving
// this rank's [.., vocab / tp] slice of the logits.
// With `async_grad` the backward overlaps the input gradient's all-reduce with the weight
// gradient's product (Megatron's async_tensor_model_parallel_allreduce; Domino turns it on): the
// same values, the all-reduce no longer alone on the critical path.
at::Tensor parallel_lm_logits(const at::Tensor& x, const at::Tensor& weight, const TPGroup& tp,
                              bool async_grad = false);

// Per-token cross entropy of logits split along the last (vocabulary) dim. `logits` [.., V/tp]
// (computed in fp32 whatever its dtype), `target` [..] int64 global ids. Returns [..] fp32.
// Backward: (softmax - one_hot(target)) * grad, with the softmax kept from forward.
// As in Megatron, fp32 contiguous logits are overwritten in place (they hold the softmax
// afterwards): pass logits that are not read again.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const TPGroup& tp);

// The same in three phases, so that its two all-reduces (the row maxima; then the target logits
// and sums of exponentials, packed in one) can be in flight while other work runs: Domino starts
// a phase on every chunk before waiting for any. Called back to back: the function above.
class VocabParallelCrossEntropy {
 public:
  VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& target, const TPGroup& tp);
  void reduce_max();   // this rank's row maxima; their all-reduce (MAX) issued
  void reduce_sums();  // waits for it; target logits and sums of exponentials; their all-reduce issued
  at::Tensor loss();   // waits for it; the per-token loss (differentiable w.r.t. the logits)

 private:
  void all_reduce(const at::Tensor& t, int32_t op);
  void wait();
  at::Tensor logits_, target_;
  at::Tensor work_;  // fp32 logits - max, then exp, then the softmax
  at::Tensor max_, sums_, target_mask_, masked_target_;
  TPGroup tp_;
  std::optional<Comm::Work> pending_;
};

}  // namespace dtk::layers
