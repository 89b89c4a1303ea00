// dtk/core/train/micro_batch.hpp — one micro-batch at a time: what every forward-backward
// schedule (train/schedule.hpp) is made of. A schedule decides the order; this class runs one
// forward (the batch, its checks, the step plugin's forward_step), one backward (the loss scaled
// by 1 / micro-batches and the loss scale, or a pipeline stage's output with its gradient), and
// moves a pipeline stage's tensors (their agreed shape and dtype, the bounded receive).
//
// The checks of the plugins' contracts live here because they are made per micro-batch: the
// dataset's token ids and sample length (first iterations after a start, or every batch with
// train.check_every_batch), the loss's shape and graph (each chunk's first micro-batch, decided
// by every rank together), a stage's output shape and dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dtk/core/components/components.hpp"
#include "dtk/core/logging/timers.hpp"
#include "dtk/core/train/batch_loader.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/hooks.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

using Metrics = StepMetrics;  // one micro-batch's (dtk/core/logging/step_metrics.hpp)

// What a micro-batch needs of the run, owned by the Trainer (alive as long as the runner).
struct MicroBatchParts {
  const config::RunConfig* cfg = nullptr;
  const Topology* topo = nullptr;
  const BatchPlan* plan = nullptr;
  Timers* timers = nullptr;
  ModelInstance* model = nullptr;
  StrategyInstance* strategy = nullptr;
  const DatasetInstance* data = nullptr;
  BatchLoader* train_loader = nullptr;
  std::vector<std::unique_ptr<StepInstance>>* steps = nullptr;  // one per model chunk
  at::ScalarType stage_dtype = at::kFloat;                      // what pipeline stages send
  // The plugins' names, for errors.
  std::string model_name, step_name, strategy_name, dataset_name;
  int64_t resumed_iteration = 0;  // where this process started (the batch checks' window)
  // train.calculate_per_token_loss: the steps return summed losses and their token counts, which
  // the backward does not divide by the number of micro-batches (the host divides the gradients
  // by the global batch's token count instead).
  bool per_token_loss = false;
  TrainerHooks hooks;
};

class MicroBatchRunner {
 public:
  explicit MicroBatchRunner(MicroBatchParts parts) : p_(std::move(parts)) {}

  ModelInstance& model() { return *p_.model; }
  const Topology& topo() const { return *p_.topo; }

  // The next training micro-batch, checked in the first iterations (every rank decides together).
  // `on_host`: left in host memory and checked every time, there (a recorded step copies it into
  // its fixed inputs itself, and cannot check ids on the device).
  TensorList next_batch(int64_t iteration, bool on_host = false);
  // Micro-batch `m`'s forward step: its batch (`fetched`, or the next one), then the step plugin's
  // forward. Returns the loss, or (a stage before the last) the stage's output. `before_forward`
  // runs between the two: a pipeline stage receives its input there, after the batch check, which
  // waits for every rank.
  at::Tensor forward(int64_t iteration, int64_t m, Metrics* metrics, const std::function<void()>& before_forward = {},
                     const TensorList* fetched = nullptr);
  // A forward without gradients or timers (evaluation).
  at::Tensor forward_only(const TensorList& batch, Metrics* metrics);
  // The last stage's loss: a scalar attached to the graph; on a chunk's first micro-batch, training
  // no tensor the model does not list. `stage_input`: the input a pipeline stage received.
  void check_loss_output(const at::Tensor& out, const at::Tensor& stage_input = at::Tensor());
  // Only the graph check (a stage before the last: after its output was sent).
  // `error`: a problem already found with this output, decided on with the others.
  void check_graph(const at::Tensor& out, const at::Tensor& stage_input, std::string error = {});
  // What a stage before the last hands on: the agreed shape and dtype; throws naming the plugins.
  void check_stage_output(const at::Tensor& out) const;
  // Backward of micro-batch `m` of `num_micro`: the loss scaled by 1 / num_micro and `scale`, or
  // (before the last stage, `out_grad` defined) the output with the gradient the next stage sent.
  // `pass` of `passes`: what the strategy's before_backward is told (default: m of num_micro; the
  // interleaved schedule counts one pass per micro-batch and chunk).
  void backward(int64_t iteration, int64_t m, int64_t num_micro, double scale, const at::Tensor& out,
                const at::Tensor& out_grad, int64_t pass = -1, int64_t passes = -1);
  // One stage's micro-batch `m` of `num_micro` whole: forward (of `fetched`, or the next batch),
  // the loss check, backward.
  void forward_backward(int64_t iteration, int64_t m, int64_t num_micro, double scale, Metrics* metrics,
                        const TensorList* fetched = nullptr);
  // What the strategy hears before the backward of micro-batch `m` of `num_micro`.
  void before_backward(int64_t m, int64_t num_micro);
  // The step's forward and the loss's backward on `batch`, with nothing around them (no batch
  // fetch, timers, trace spans or strategy call): what a CUDA graph records.
  void bare_forward_backward(int64_t iteration, const TensorList& batch, int64_t num_micro, double scale,
                             Metrics* metrics);

  // Pipeline stages exchange [micro_batch, seq, hidden] tensors in the parameters' dtype (seq / tp
  // under sequence parallelism).
  std::vector<int64_t> stage_shape() const;
  // The sequence length the next micro-batches run at: a training iteration's under a curriculum
  // (train.curriculum_schedule), else (evaluation too) train.seq_length.
  void set_sequence_length(int64_t length) { seq_length_ = length; }
  // The most device memory one micro-batch's forward left allocated since the last call (its
  // stored activations), then starts again.
  int64_t take_activation_bytes() { return std::exchange(activation_bytes_, 0); }
  // train.calculate_per_token_loss: the tokens this rank's training micro-batches summed their
  // loss over since the last call (a double on the training device; zeros before the last
  // pipeline stage).
  at::Tensor take_tokens();
  // eval.full_validation: evaluation asks the steps for summed losses too, so that a loss is the
  // mean over every token of the split (padding rows weigh nothing). take_evaluation_error(): what a
  // step did wrong meanwhile (no token count), for every rank to agree on after the evaluation.
  void set_summed_evaluation(bool on) { summed_evaluation_ = on; }
  std::string take_evaluation_error() { return std::exchange(evaluation_error_, std::string()); }
  at::TensorOptions stage_options() const;
  // Receives the agreed stage tensor from pipeline rank `peer` (blocking, bounded), timed under
  // `phase` and shown as the span `what` in the trace.
  at::Tensor receive_stage_tensor(int32_t peer, int32_t tag, Phase phase, const char* what);

 private:
  StepInstance& step() { return *(*p_.steps)[static_cast<size_t>(p_.model->selected_chunk())]; }
  at::Tensor step_forward(const TensorList& batch, Metrics* metrics, bool training);
  void check_batch(const TensorList& batch, int64_t iteration) const;
  static TensorList cut_to_length(TensorList batch, int64_t seq, int64_t length);
  void run_backward(int64_t iteration, int64_t m, int64_t num_micro, double scale, const at::Tensor& out,
                    const at::Tensor& out_grad);
  void trace_span(const char* what, int64_t m, int64_t start) const;
  static constexpr int64_t kCheckedIterations = 2;  // batches checked after a (re)start
  MicroBatchParts p_;
  // The model chunks whose graph was checked: each chunk's first micro-batch. Every rank runs a
  // chunk's first forward before any backward, in the same order, so their agreements line up.
  std::set<int> graph_checked_;
  int64_t activation_bytes_ = 0;
  int64_t seq_length_ = 0;       // set_sequence_length (0: train.seq_length)
  at::Tensor tokens_;            // take_tokens()
  std::string tokens_error_;     // what was wrong with the last loss's token count
  bool summed_evaluation_ = false;
  std::string evaluation_error_;  // take_evaluation_error()
};

}  // namespace dtk::core
