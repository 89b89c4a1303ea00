// dtk/core/logging/timers.hpp — Megatron's timers (megatron/core/timers.py) for the training loop:
// named phases, each with a log level; those at or below logging.timing_log_level accumulate
// wall time over a log window and are printed as Megatron prints them,
//
//   (min, max) time across ranks (ms):
//       forward-backward ...............................: (812.40, 815.02)
//
// per iteration of the window, with the min and max over every rank (a slow rank or a slow data
// loader shows), and written to TensorBoard as "<name>-time" (seconds, the max, as Megatron).
//
// On a GPU the host only queues kernels, so its wall time says little: a DeviceClock (CUDA events
// recorded on LibTorch's stream, cuda_glue.cpp) times each scope on the device instead, read back
// once per log window, without the device synchronisations Megatron's timers make.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/clock.hpp"

namespace dtk::core {

// The phases DTK times, in the order they print. Level 1: the step's parts; level 2: the parts
// of each micro-batch.
enum class Phase : int {
  kForwardBackward,  // 1: every micro-batch's forward and backward
  kBatchGenerator,   // 1: waiting for the next micro-batch (the loader's prefetch did not keep up)
  kForwardCompute,   // 2: the step plugin's forward and loss
  kBackwardCompute,  // 2: backward (strategy hooks, overlapped reductions included)
  kForwardRecv,      // 2: pipeline stages: waiting for the previous stage's activations
  kBackwardRecv,     // 2: pipeline stages: waiting for the next stage's gradients
  kGradsReduce,      // 1: the strategy's gradient reduction after the last backward
  kOptimizerClip,    // 1: global norm and clipping
  kOptimizerStep,    // 1: the optimizer step through the strategy (with ZeRO's all-gather)
  kOptimizer,        // 1: clip + step
  kEvaluate,         // 1: periodic evaluation
  kSaveCheckpoint,   // 1: checkpoint saves
  kCount
};
const char* phase_name(Phase p);  // Megatron's names where Megatron has the phase
int phase_level(Phase p);


class Timers {
 public:
  explicit Timers(int log_level) : level_(log_level) {}
  int level() const { return level_; }
  // Time scopes on this clock from now on (null: the host's wall clock).
  void set_device_clock(std::unique_ptr<DeviceClock> clock) { clock_ = std::move(clock); }

  // Times a scope when its phase's level is enabled. While LibTorch's profiler records
  // (logging.profile_steps) the scope is also a user scope named after the phase, at any level,
  // so the profile accounts for time outside ATen's ops phase by phase.
  class Scope {
   public:
    Scope(Timers& t, Phase p) : t_(t.level_ >= phase_level(p) ? &t : nullptr), p_(p), record_(begin_record(p)) {
      if (t_ && t_->clock_)
        mark_ = t_->clock_->mark();
      else if (t_)
        start_ = std::chrono::steady_clock::now();
    }
    ~Scope() {
      if (t_ && t_->clock_)
        t_->marks_.emplace_back(p_, mark_, t_->clock_->mark());
      else if (t_)
        t_->add(p_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
      end_record(record_);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    // An at::RecordFunction while a profiler records, else null (timers.cpp: keeps ATen's
    // record_function.h out of this header).
    static void* begin_record(Phase p);
    static void end_record(void* record);
    Timers* t_;
    Phase p_;
    void* record_;
    std::chrono::steady_clock::time_point start_;
    int mark_ = -1;
  };
  Scope scope(Phase p) { return Scope(*this, p); }
  void add(Phase p, double seconds) { seconds_[static_cast<int>(p)] += seconds; }

  // Per-iteration times of the window (seconds / iterations) reduced over the world: a
  // collective every rank calls at the same log boundary. Returns nothing when the level is 0.
  struct Row {
    std::string name;
    double min_ms, max_ms;
  };
  std::vector<Row> window(int64_t iterations, const Topology& topo);
  void reset();

  // Megatron's text block for `rows`.
  static std::string format(const std::vector<Row>& rows);

 private:
  // Adds the device clock's scopes into seconds_ and recycles their marks.
  void read_device_clock();
  int level_;
  std::array<double, static_cast<int>(Phase::kCount)> seconds_{};
  std::unique_ptr<DeviceClock> clock_;
  std::vector<std::tuple<Phase, int, int>> marks_;  // device-timed scopes not read yet
};

}  // namespace dtk::core
