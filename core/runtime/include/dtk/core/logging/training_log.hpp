// dtk/core/logging/training_log.hpp — what the user sees of a run: Megatron's training_log (one line per
// log interval, TensorBoard scalars with Megatron's tags) and evaluate_and_print_results.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <dtk/abi.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/memory/memory.hpp"
#include "dtk/core/logging/metrics_jsonl.hpp"
#include "dtk/core/logging/step_metrics.hpp"
#include "dtk/core/logging/tensorboard.hpp"
#include "dtk/core/logging/timers.hpp"

namespace dtk::core {

// Means of named metrics ("lm loss") over micro-batches and iterations, in first-seen order; a
// ratio metric (ABI 2.8: [numerator, denominator]) is the sum of its numerators over the sum of
// its denominators (Megatron-LM's token-weighted loss).
// Device values are summed on the device and read together, once, by the first mean (or names,
// merge, broadcast) after they were added: one host read per iteration, not one per micro-batch.
class MetricAverager {
 public:
  void add(const std::vector<std::pair<std::string, double>>& metrics);
  void add(const StepMetrics& metrics);
  void merge(const MetricAverager& other);
  double mean(const std::string& name) const;  // NaN when never added
  std::vector<std::string> names() const;
  void clear();
  // Every rank of `group` takes `root`'s metrics (pipeline parallelism: the last stage's loss).
  void broadcast(int32_t group, int32_t root);

 private:
  void read_device_sums() const;  // the one host read of what the device holds
  void add_sum(const std::string& name, double sum, double weight);
  mutable std::vector<std::pair<std::string, double>> sums_;
  // [sum, weight] per name (also in sums_), still on the device.
  mutable std::vector<std::pair<std::string, at::Tensor>> device_sums_;
  mutable std::map<std::string, double> weights_;  // what each sum is divided by
};

// What a rank holds at the end of a step (after the optimizer step, before gradients are
// cleared): the allocator's pools (dtk/core/memory/memory.hpp) and who holds what.
struct MemorySample {
  memory::Stats allocator;                 // device and host pools: now and peak since the start
  dtk_memory_usage strategy{};             // parameters, gradients, masters (strategy's count)
  int64_t optimizer_state_bytes = 0;       // the optimizer's state tensors
  bool optimizer_on_host = false;          // ...which then live in host memory (offload)
  // The most one micro-batch's forward left allocated in the iteration: its stored activations.
  int64_t activation_bytes = 0;
  // What this rank sent during the iteration on the data-, tensor-, pipeline-, expert- and
  // context-parallel groups (expert: MoE layers' token dispatch; context: the attention's
  // all-to-alls).
  Traffic data_parallel, tensor_parallel, pipeline_parallel, expert_parallel, context_parallel;
  int dp_size = 1, tp_size = 1, pp_size = 1, ep_size = 1, cp_size = 1;
};

// One finished iteration, as the trainer hands it to the log.
struct IterationResult {
  int64_t iteration = 0;
  double learning_rate = 0;  // after the scheduler step (the next update's), as Megatron logs it
  double grad_norm = 0;      // before clipping; NaN/Inf when gradients overflowed
  bool skipped = false;      // the update was skipped (non-finite gradients)
  double loss_scale = 1;     // after this iteration's update of the scaler (Megatron logs that)
  double params_norm = NAN;  // logging.log_params_norm, on logged iterations
  double num_zeros = NAN;    // logging.log_num_zeros_in_grad
  MetricAverager metrics;    // means over the iteration's micro-batches
  std::optional<MemorySample> memory;  // taken on the first logged iteration
  CommTiming tensor_parallel_comm, data_parallel_comm;  // collectives' time in flight / exposed
  CommTiming expert_parallel_comm;                      // the MoE layers' token dispatch
  CommTiming context_parallel_comm;                     // the attention's all-to-alls
  // Pipeline stages: the activations and gradients sent and received, and the time this stage
  // waited for them (its bubble and the transfers), over `micro_batches` micro-batches.
  CommTiming pipeline_parallel_comm;
  int64_t micro_batches = 0;
  // The iteration's global batch and the samples consumed after it (they differ from the setup's
  // fixed size during a batch-size ramp-up); 0: from the setup.
  int64_t global_batch_size = 0, consumed_samples = 0;
  // The tokens of each sample it trained on: a curriculum's length (train.curriculum_schedule);
  // 0: the setup's seq_length.
  int64_t seq_length = 0;
};

// Owns the logging window: its metrics, counters and clock, the printed line and TensorBoard.
// Only the printing rank (world rank 0) prints and writes events; every rank keeps the window.
class TrainingLog {
 public:
  struct Setup {
    int64_t train_iters = 0, log_interval = 1, global_batch_size = 1, seq_length = 0;
    // The iteration the run ends after (train.train_tokens can end it before train_iters; 0: train_iters):
    // always printed, and the ETA's end.
    int64_t final_iteration = 0;
    double flops_per_token = 0;  // the FLOPs model (core/flops.hpp), at seq_length
    // What flops_per_token adds per position of the sequence (attention's 4cLh): an iteration of a
    // curriculum's shorter length counts fewer FLOPs per token.
    double attention_flops_per_position = 0;
    bool curriculum = false;  // train.curriculum_schedule: the line and TensorBoard show the length
    int world_size = 1;
    int tp_size = 1, dp_size = 1, pp_size = 1, ep_size = 1;  // comm timing is printed for groups larger than one
    int cp_size = 1;
    int virtual_stages = 1;                     // model chunks per pipeline rank (the interleaved schedule's bubble)
    bool printer = true;
    std::string tensorboard_dir;  // empty: no event file
    std::string metrics_jsonl;    // empty: no metrics file
    double peak_tflops = 0;       // per device; > 0 adds MFU to the line
    int64_t tensorboard_log_interval = 1;  // iterations between TensorBoard points
    Timers* timers = nullptr;     // reported (collectively) at each log line when its level > 0
    const Topology* topo = nullptr;
  };
  explicit TrainingLog(Setup setup);

  // Adds an iteration to the window and prints the window on log-interval boundaries and at
  // the last iteration, followed by the memory report when the result carries one.
  void record(const IterationResult& result);
  // The floating-point operations of one iteration, by the FLOPs model of the log line.
  double flops_of(const IterationResult& r) const;
  // Whether `iteration` ends a window (its result is printed).
  bool logs(int64_t iteration) const { return iteration % setup_.log_interval == 0 || iteration == last_iteration(); }
  int64_t last_iteration() const { return setup_.final_iteration > 0 ? setup_.final_iteration : setup_.train_iters; }
  // Validation/test results: Megatron's dashed block (" validation loss at iteration N[ on test
  // set] | ...": `label` follows "at") and TensorBoard "<metric> <what>" tags. after_training:
  // the evaluation after the loop (marked "after_training" in the metrics file, where the loop's
  // own validation at the same iteration precedes it).
  void report_evaluation(const std::string& what, const std::string& label, int64_t iteration,
                         const MetricAverager& metrics, bool after_training = false);
  // Prints a line from the printing rank only, flushed (so it precedes any later error line).
  void print(const std::string& line) const;

  // Time spent inside an Excluded scope (evaluation, checkpoint saves) does not count towards
  // the window's iteration time.
  class Excluded {
   public:
    explicit Excluded(TrainingLog& log) : log_(log), start_(std::chrono::steady_clock::now()) {}
    ~Excluded() { log_.excluded_ += std::chrono::steady_clock::now() - start_; }

   private:
    TrainingLog& log_;
    std::chrono::steady_clock::time_point start_;
  };

 private:
  void print_window(const IterationResult& last);
  // Megatron's per-iteration TensorBoard scalars (tensorboard_log_interval), each also "vs samples".
  void write_iteration_scalars(const IterationResult& r);
  // `tag` against the iteration and, as "<tag> vs samples", against the samples consumed.
  void add_scalar(const std::string& tag, double value, int64_t iteration, int64_t consumed);
  void print_memory(int64_t iteration, const MemorySample& m) const;
  void clear_window();

  Setup setup_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<JsonlWriter> metrics_;
  MetricAverager window_;
  int64_t iterations_ = 0, skipped_ = 0, nan_iterations_ = 0;
  int64_t window_tokens_ = 0;                        // tokens trained in the window (tokens per second)
  double window_flops_ = 0;                          // and their FLOPs (TFLOP/s)
  int64_t last_iteration_ = -1, last_consumed_ = 0;  // the last recorded iteration (evaluations after it)
  int64_t seq_of(const IterationResult& r) const { return r.seq_length > 0 ? r.seq_length : setup_.seq_length; }
  int64_t batch_of(const IterationResult& r) const { return r.global_batch_size > 0 ? r.global_batch_size : setup_.global_batch_size; }
  int64_t consumed_of(const IterationResult& r) const {
    return r.consumed_samples > 0 ? r.consumed_samples : r.iteration * setup_.global_batch_size;
  }
  CommTiming tp_comm_sum_, dp_comm_sum_, pp_comm_sum_, ep_comm_sum_, cp_comm_sum_;  // over the window's iterations
  std::chrono::steady_clock::time_point window_start_;
  std::chrono::steady_clock::duration excluded_{};
  // For the progress fields: wall time since the start, and training time and iterations of
  // this process (the ETA's rate).
  const std::chrono::steady_clock::time_point start_;
  double trained_seconds_ = 0;
  int64_t trained_iterations_ = 0;
};

// "YYYY-MM-DD HH:MM:SS", local time, as Megatron's log lines begin.
std::string timestamp();

}  // namespace dtk::core
