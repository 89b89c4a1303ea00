// dtk/core/timeline/op_profile.hpp — where every millisecond of chosen iterations goes, op by op
// and kernel by kernel (logging.profile_steps; Megatron's --profile, torchtitan's profiling).
//
// LibTorch's profiler records the iterations [first, last]: every ATen op on the CPU and, on a GPU
// with a Kineto build of LibTorch, every CUDA kernel. At the end of the range each rank writes a
// Chrome/Perfetto trace (<dir>/rank<R>.json: LibTorch's own Kineto trace where the build has
// Kineto, else DTK writes the recorded ops itself) and rank 0 prints the top ops by self time and
// the top kernels by time, each with its share of the profiled iterations' wall time.
// logging.trace_file is the other timeline: DTK's own spans (compute, waits, collectives).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace dtk::core::trace {

// logging.profile_steps is parsed by trace::parse_iterations (trace.hpp).

class OpProfile {
 public:
  struct Settings {
    int64_t first = 0, last = -1;  // the profiled iterations
    std::string dir;               // where rank<R>.json goes
    int rank = 0;
    bool cuda = false;             // record CUDA kernels too
    std::function<void(const std::string&)> print;  // the table (rank 0); null: no table
  };
  explicit OpProfile(Settings settings);
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Around each training iteration; `seconds` is the iteration's wall time.
  void before_iteration(int64_t iteration);
  void after_iteration(int64_t iteration, double seconds);
  // A run that stops inside the range: what was recorded is written and printed.
  void finish();

 private:
  void stop_and_report();
  Settings s_;
  bool on_ = false, done_ = false;
  double seconds_ = 0;
  int64_t iterations_ = 0;
};

}  // namespace dtk::core::trace
