// dtk/layers/tensor_parallel.hpp — Megatron-LM's tensor-parallel building blocks, for model plugins (gpt, llama, yours).
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
//   vocab_parallel_cross_entropy
//                           loss over logits split along the vocabulary: all-reduce MAX of the
//                           row maxima, all-reduce SUM of the target logit and of sum(exp).
//
// Weights are initialized as Megatron's CPU initialization does: the full ("master") weight is
// drawn from a generator that is identical on all TP ranks and each rank keeps its slice, so a
// TP=N model is exactly the TP=1 model cut in pieces.
#pragma once

#include <optional>

#include <dtk/model.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace dtk::layers {

// Where this rank sits in its tensor-parallel group.
struct TPGroup {
  int rank = 0;
  int size = 1;
};

// How new parameters are made: dtype/device of the parameters, init generator (CPU).
struct ParamFactory {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Generator gen;  // CPU generator used for every master weight, in construction order

  // A normal(0, std) master weight of `shape`, drawn in fp32 on the CPU.
  at::Tensor normal(at::IntArrayRef shape, double std);
  // Turns a (slice of a) master tensor into a trainable parameter.
  at::Tensor param(const at::Tensor& value) const;
  at::Tensor zeros(at::IntArrayRef shape) const;
  at::Tensor ones(at::IntArrayRef shape) const;
};

// Megatron's region mappings (autograd functions).
// Forward identity; backward all-reduce (SUM) over the TP group.
at::Tensor copy_to_tp_region(const at::Tensor& x, const TPGroup& tp);
// Forward all-reduce (SUM) over the TP group; backward identity.
at::Tensor reduce_from_tp_region(const at::Tensor& x, const TPGroup& tp);

// Megatron's _vocab_size_with_padding: the smallest multiple of divisible_by x tp_size that is
// >= vocab_size.
int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int64_t tp_size);

// Y = X A^T + b with A [out, in] split along out. gather_output is false (Megatron's GPT).
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
class RowParallelLinear {
 public:
  RowParallelLinear() = default;
  RowParallelLinear(int64_t in, int64_t out, bool bias, double init_std, const TPGroup& tp, ParamFactory& f);
  at::Tensor forward(const at::Tensor& x) const;
  int64_t in_per_partition = 0;
  at::Tensor weight;  // [out, in / tp]
  at::Tensor bias;    // [out], replicated, added after the all-reduce
  TPGroup tp;
};

// Ids outside [0, limit) would index an embedding table out of bounds (or be dropped by every
// rank's vocabulary slice and scored silently): refused with one line naming the model, the input
// and the limit, e.g. "gpt: 'tokens' holds ids in [0, 60000], outside [0, 50304) (the padded
// vocabulary)".
void check_id_range(const char* model, const char* what, const at::Tensor& ids, int64_t limit, const char* limit_name);

class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding() = default;
  VocabParallelEmbedding(int64_t vocab, int64_t hidden, double init_std, const TPGroup& tp, ParamFactory& f);
  at::Tensor forward(const at::Tensor& ids) const;  // [..] int64 -> [.., hidden]
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
