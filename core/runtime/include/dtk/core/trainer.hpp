// dtk/core/trainer.hpp — `dtk train`, in the shape of Megatron's pretrain():
//
//   Trainer(cfg, plugins)   initialize (config, process groups, runtime), then
//                           setup_model_and_optimizer (model, strategy, optimizer, step, and the
//                           checkpoint to resume from), then the data iterators
//   train()                 the loop: train_step, training_log, periodic evaluate and save,
//                           exit conditions (signal, duration, interval), the bench summary
//   train_step(it)          micro-batches (forward step + backward), gradient reduction,
//                           clipping, optimizer step
//   evaluate(split)         evaluate_and_print_results
//   save(it)                save_checkpoint_and_time
//   final_evaluation()      validation and test at the end
//
// Every plugin call goes through core/components, so errors name the plugin and the call.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dtk/core/batch_loader.hpp"
#include "dtk/core/batch_plan.hpp"
#include "dtk/core/bench_report.hpp"
#include "dtk/core/checkpoint.hpp"
#include "dtk/core/components.hpp"
#include "dtk/core/flops.hpp"
#include "dtk/core/grad_scaler.hpp"
#include "dtk/core/lr_schedule.hpp"
#include "dtk/core/timers.hpp"
#include "dtk/core/training_log.hpp"
#include "dtk/host/plugin_host.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

class Trainer {
 public:
  // Initializes the run and builds every component; throws HostError for bad input.
  Trainer(const config::RunConfig& cfg, host::PluginHost& plugins);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void train();
  void final_evaluation();

  int64_t iteration() const { return progress_.iteration; }
  // An exit condition ended train() before train_iters (no final evaluation then).
  bool stopped_early() const { return stopped_early_; }

 private:
  // The plugins of the run and their validated options (alive as long as their objects).
  struct Slot {
    const host::Plugin& plugin;
    host::OptionValues options;
  };
  Slot resolve(host::PluginHost& plugins, int32_t kind, const config::PluginChoice& choice) const;
  // The context a plugin is created with. `chunk` >= 0: model chunk `chunk` of the interleaved
  // schedule, built as virtual stage chunk x pp_size + pp_rank of virtual_stages() x pp_size.
  dtk_build_context build_context(const Slot& slot, int chunk = -1) const;
  // Model chunks per pipeline rank (distributed.virtual_pipeline_model_parallel_size; 1 = 1F1B).
  int virtual_stages() const;

  void setup_model_and_optimizer();
  void load_checkpoint();
  void check_schedule(const LrParams& saved, const std::string& dir);
  void build_data_iterators();
  IterationResult train_step(int64_t iteration);
  // One micro-batch's forward step: its batch (checked in the first iterations), then the step
  // plugin's forward. Returns the loss, or (a pipeline stage before the last) the stage's output.
  // `before_forward` runs between the two (a pipeline stage receives its input there: after the
  // batch check, which waits for every rank).
  // `batch`: the micro-batch, when the caller fetched it (next_batch) beforehand.
  at::Tensor forward_micro_batch(int64_t iteration, int64_t m, std::vector<std::pair<std::string, double>>* metrics,
                                 const std::function<void()>& before_forward = {}, const TensorList* batch = nullptr);
  // The next training micro-batch, checked in the first iterations (check_batch: every rank decides together).
  TensorList next_batch(int64_t iteration);
  // Checks forward_micro_batch's loss (a scalar) and, on the first micro-batch, its graph
  // (check_loss). `stage_input`: the input a pipeline stage received (a leaf the graph trains,
  // not a parameter).
  void check_forward_output(const at::Tensor& out, const at::Tensor& stage_input = at::Tensor());
  // Its backward: the loss scaled by 1 / num_micro and the loss scale, or (before the last stage)
  // the stage's output with the gradient the next stage sent.
  // `pass` of `passes`: what the strategy's before_backward is told (the micro-batch and their
  // count; with the interleaved schedule the backward passes, one per micro-batch and model chunk).
  void backward_micro_batch(int64_t iteration, int64_t m, int64_t num_micro, double scale, const at::Tensor& out,
                            const at::Tensor& out_grad, int64_t pass = -1, int64_t passes = -1);
  // Pipeline parallelism (trainer_pipeline.cpp): Megatron's 1F1B schedule of one iteration's
  // micro-batches on this stage; the forward-only schedule of evaluation; the last stage's
  // metrics shared with the other stages; tied embedding gradients summed over the first and
  // last stage.
  void pipeline_forward_backward(int64_t iteration, int64_t num_micro, double scale, IterationResult& r);
  void pipeline_evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics);
  // The interleaved schedule (virtual_stages() > 1): Megatron's
  // forward_backward_pipelining_with_interleaving, and its forward-only order for evaluation.
  void interleaved_forward_backward(int64_t iteration, int64_t num_micro, double scale, IterationResult& r);
  void interleaved_evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics);
  // Micro-batches per step that the interleaved schedule cannot run ("" if it can, or if it is off).
  std::string interleaving_refusal(int64_t num_micro) const;
  std::vector<int64_t> stage_activation_shape() const;
  // Receives the agreed stage tensor from pipeline rank `peer` (blocking, bounded), timed under
  // `phase` (Megatron's forward-recv / backward-recv) and shown as the span `what` in the trace.
  at::Tensor receive_stage_tensor(int32_t peer, int32_t tag, Phase phase, const char* what);
  at::ScalarType stage_dtype() const;  // the parameters' dtype: what the stages send
  // What a stage before the last hands on must have the agreed shape and dtype (training and
  // evaluation alike); throws naming the step and the model.
  void check_stage_output(const at::Tensor& out) const;
  void setup_tied_gradients();
  void sync_tied_gradients();
  int64_t tied_numel_ = 0;  // elements of the tied weights each stage sums (0: none)
  MemorySample memory_sample() const;
  double params_norm();
  double num_zeros_in_grad();
  void require_weight_decay_scale() const;
  void check_memory_estimate();
  void check_output_paths() const;
  void print_bench_summary();
  void evaluate(int32_t split, const char* what, const std::string& label, int64_t iteration);
  void save(int64_t iteration);

  const config::RunConfig& cfg_;
  const Topology& topo_;
  const BatchPlan plan_;
  LearningRateSchedule schedule_;
  GradScaler scaler_;  // loss scaling (none: scale 1)
  Timers timers_;      // logging.timing_log_level
  // The dataset contract (token ids below the vocabulary, seq_length + 1 tokens of "text"),
  // checked on the micro-batches of the first kCheckedIterations after a (re)start, or on every
  // one with train.check_every_batch.
  static constexpr int64_t kCheckedIterations = 2;
  void check_batch(const TensorList& batch, int64_t iteration) const;
  // The loss of a micro-batch before its backward: attached to the graph (naming the plugin that
  // detached it) and, on this process's first step, training no tensor the model does not list.
  void check_loss(const at::Tensor& loss, const at::Tensor& stage_input);
  // The model chunks whose graph was checked (one chunk without the interleaved schedule): each
  // chunk's first micro-batch. Every rank runs a chunk's first forward before any backward, in the
  // same order, so their agreements line up.
  std::set<int> graph_checked_;
  Slot model_slot_, data_slot_, step_slot_, optimizer_slot_, strategy_slot_;

  std::unique_ptr<ModelInstance> model_;
  std::unique_ptr<StrategyInstance> strategy_;
  std::unique_ptr<OptimizerInstance> optimizer_;
  // One step per model chunk (a step knows from its context whether its chunk ends the model).
  std::vector<std::unique_ptr<StepInstance>> steps_;
  StepInstance& step() { return *steps_[static_cast<size_t>(model_->selected_chunk())]; }
  ModelStats stats_;
  std::unique_ptr<DatasetInstance> data_;
  std::unique_ptr<BatchLoader> train_loader_;
  std::unique_ptr<TrainingLog> log_;

  TrainProgress progress_;         // iteration, consumed samples, scheduler step
  int64_t resumed_iteration_ = 0;  // where this process started
  int64_t last_saved_ = -1;
  bool memory_reported_ = false;  // the memory report follows the first logged iteration
  bool stopped_early_ = false;
  double peak_tflops_ = 0;           // per device, for MFU (0 = unknown)
  std::string peak_source_;
  bool peak_measured_ = false;       // peak_tflops_ is a matmul measured here (measured again at the end)
  std::unique_ptr<BenchReport> bench_;  // bench mode or --bench_out
  const std::set<int64_t> nonfinite_iterations_;  // test hook (DTK_TEST_NONFINITE_ITERS)
  const std::vector<std::string> writers_;         // the plugins, as checkpoints record them
};

}  // namespace dtk::core
