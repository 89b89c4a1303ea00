// dtk/core/train/trainer.hpp — `dtk train`, in the shape of Megatron's pretrain(). The Trainer
// only trains: its constructor puts together what train/run_setup.hpp builds (initialize, the
// plugins, setup_model_and_optimizer, the data iterator), train/resume.hpp resumes and
// train/schedule.hpp orders; what it keeps is the state the loop shares.
//
//   train()                 the loop: train_step, training_log, periodic evaluate and save,
//                           exit conditions (signal, duration, interval), the bench summary
//   train_step(it)          the schedule's forwards and backwards, gradient reduction,
//                           clipping, optimizer step
//   evaluate(split)         evaluate_and_print_results (the same schedule, forward only)
//   save(it)                save_checkpoint_and_time (checkpoint.async_save: in the background,
//                           published when every rank has written it, as Megatron's async save)
//   final_evaluation()      validation and test at the end
//
// Every plugin call goes through core/components, so errors name the plugin and the call.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "dtk/core/checkpoint/checkpoint.hpp"
#include "dtk/core/logging/progress_log.hpp"
#include "dtk/core/logging/timers.hpp"
#include "dtk/core/logging/training_log.hpp"
#include "dtk/core/optim/grad_scaler.hpp"
#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/core/perf/bench_report.hpp"
#include "dtk/core/perf/peak_throughput.hpp"
#include "dtk/core/timeline/op_profile.hpp"
#include "dtk/core/train/exit_conditions.hpp"
#include "dtk/core/train/layer_metrics.hpp"
#include "dtk/core/train/micro_batch.hpp"
#include "dtk/core/train/run_setup.hpp"
#include "dtk/core/train/schedule.hpp"
#include "dtk/core/train/sequence_parallel_gradients.hpp"
#include "dtk/core/train/tied_gradients.hpp"

namespace dtk::core {

class Trainer {
 public:
  // Initializes the run and builds every component; throws HostError for bad input. `hooks`:
  // train/micro_batch.hpp (empty in a normal run).
  Trainer(const config::RunConfig& cfg, host::PluginHost& plugins, TrainerHooks hooks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void train();
  void final_evaluation();

  int64_t iteration() const { return progress_.iteration; }
  // An exit condition ended train() before train_iters (no final evaluation then).
  bool stopped_early() const { return stopped_early_; }

 private:
  std::unique_ptr<TrainingLog> make_log();
  void print_startup_report();
  std::unique_ptr<BenchReport> make_bench_report() const;
  std::unique_ptr<trace::OpProfile> make_op_profile();
  void refuse_unreadable_gradients() const;
  void start_micro_batches(TrainerHooks hooks);
  std::unique_ptr<StepRecorder> step_recorder(const TrainerHooks& hooks) const;
  IterationResult train_step(int64_t iteration);
  // The strategy's reduction, clipping and (unless the gradients are not finite) the update.
  // `scale`: what the gradients carry (the loss scale, times gradient_token_factor()).
  void reduce_clip_and_update(int64_t iteration, double scale, IterationResult& r);
  double gradient_token_factor();
  const std::vector<double>& group_rates();
  // train.skipped_steps_limit: throws once that many iterations in a row were skipped.
  void check_skipped_in_a_row(const IterationResult& r);
  // One iteration of train(): the step, its log line and timings; evaluation and save when due.
  void run_iteration(int64_t it);
  bool should_stop(int64_t it, ExitConditions& exit);
  void print_bench_summary();
  void evaluate(int32_t split, const char* what, const std::string& label, int64_t iteration,
                bool after_training = false);
  // One split of `data` read whole; `announced`: its line was printed.
  void evaluate_whole(const DatasetInstance& data, int32_t split, const std::string& what, bool& announced,
                      const std::string& label, int64_t iteration, bool after_training);
  MetricAverager run_evaluation(BatchLoader& loader, int64_t num_batches);
  // `may_defer`: with checkpoint.async_save, the files are written in the background (a save
  // that ends the run is not deferred). A save in flight is finished first either way.
  void save(int64_t iteration, bool may_defer = false);
  // checkpoint.async_save: publishes the save in flight once every rank has written it (poll),
  // or waiting for it (finish); each logs the line a synchronous save prints.
  void poll_async_save();
  void finish_async_save();
  void log_saved(int64_t iteration, const SaveReport& r, bool in_background);
  // logging.log_progress: the save's progress.txt line (async: started, published later).
  void log_progress_save(int64_t iteration, bool async);
  bool saving() const { return !cfg_.checkpoint().save().empty(); }

  const config::RunConfig& cfg_;
  const Topology& topo_;
  const BatchPlan plan_;
  LearningRateSchedule schedule_;
  GradScaler scaler_;  // loss scaling (none: scale 1)
  Timers timers_;      // logging.timing_log_level
  const RunPlugins plugins_;
  const std::vector<std::string> writers_;  // the plugins, as checkpoints record them
  const PeakThroughput peak_;               // per device, for MFU

  TrainingParts parts_;  // model chunks, strategy, optimizer, steps
  std::unique_ptr<TiedGradients> tied_;
  std::unique_ptr<SequenceParallelGradients> sequence_parallel_;
  std::unique_ptr<LayerMetrics> layer_metrics_;  // what the layers record (an MoE router's losses)
  std::unique_ptr<DatasetInstance> data_;
  std::unique_ptr<BatchLoader> train_loader_;
  // Validation's and test's sample orders (a cyclic one keeps its epoch's permutation), and the
  // validation samples consumed when this process started (where Megatron's iterator begins).
  std::array<std::unique_ptr<const SampleOrder>, 2> eval_orders_;
  int64_t valid_loader_start_ = 0;
  std::array<bool, 3> announced_whole_{};  // eval.full_validation's line, once per split
  // eval.validation_sets: validation reads these in place of the run's validation split.
  struct ValidationSet {
    std::string what;  // "validation-NAME"
    std::unique_ptr<DatasetInstance> data;
    bool announced = false;
  };
  std::vector<ValidationSet> validation_sets_;
  std::unique_ptr<MicroBatchRunner> runner_;
  std::unique_ptr<ForwardBackwardSchedule> forward_backward_;
  std::unique_ptr<TrainingLog> log_;
  std::unique_ptr<BenchReport> bench_;  // bench mode or --bench_out
  std::unique_ptr<trace::OpProfile> profile_;  // logging.profile_steps

  TrainProgress progress_;         // iteration, consumed samples, scheduler step
  int64_t resumed_iteration_ = 0;  // where this process started
  int64_t last_saved_ = -1;
  std::unique_ptr<AsyncSave> async_save_;  // checkpoint.async_save: the save being written
  std::unique_ptr<ProgressLog> progress_log_;  // logging.log_progress (world rank 0)
  bool memory_reported_ = false;  // the memory report follows the first logged iteration
  bool stopped_early_ = false;
  int64_t skipped_in_a_row_ = 0;  // train.skipped_steps_limit
  int32_t num_experts_ = 0;       // of each MoE layer of the model (0: dense), read once at start
  std::vector<double> group_lr_;  // group_rates()'s, lent to the optimizer for one step
  bool hands_betas_ = false;      // the schedule sets Adam's betas (OneCycle's cycle_momentum)
};

}  // namespace dtk::core
