// dtk/core/logging/progress_log.hpp — Megatron's progress.txt (--log-progress): one line per job
// start and per save, appended to the save directory, which Megatron's tools and people read to
// follow a run across its restarts. Each line is
//   YYYY-MM-DD HH:MM:SS<TAB>Job ID: $SLURM_JOB_ID<TAB># GPUs: <world size><TAB><event>...
// with the events Megatron writes: "Starting job"; "Saved checkpoint" (or "Saving async
// checkpoint") with "Iteration: N", "Job throughput: X TFLOP/s/GPU", "Cumulative throughput: Y
// TFLOP/s/GPU", "Floating-point operations: Z" and "Tokens (in billions): T"; "Saved async
// checkpoint" and "Deleted checkpoint" with "Iteration: N".
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace dtk::core {

// Seconds since this process started (exec, from /proc/self/stat); 0 where that cannot be read.
double seconds_since_process_start();

class ProgressLog {
 public:
  // Appends "Starting job". `flops_so_far`: the floating-point operations of the run before this
  // job (a resumed checkpoint's). A line that cannot be written is a warning on stderr, and the
  // file gets no more lines (checkpoint.save's checks refuse a progress.txt that cannot take any).
  // `job_seconds`: how long the job has run (since its earliest rank's process start, as
  // Megatron's _TRAIN_START_TIME: the job throughput counts the start-up's time too).
  ProgressLog(const std::string& save_dir, int world_size, double flops_so_far, double job_seconds);

  // A save of `iteration` (`async`: started, published later), after `flops_so_far` operations
  // and `tokens_so_far` tokens. The job throughput counts this job's operations over its wall
  // time; the cumulative throughput those since the earliest job start of this world size after
  // the file's last line of another world size (Megatron's get_start_time_from_progress_log),
  // with an async save's operations counted once it is published.
  void saved(int64_t iteration, double flops_so_far, int64_t tokens_so_far, bool async);
  void async_saved(int64_t iteration);
  void deleted(int64_t iteration);

  const std::string& path() const { return path_; }

 private:
  void append(const std::string& event);
  std::string path_;
  int world_size_;
  double job_start_flops_;
  std::chrono::steady_clock::time_point job_start_;   // the process start (the job throughput's clock)
  std::chrono::steady_clock::time_point start_line_;  // when "Starting job" was written
  bool failed_ = false;  // a line could not be written: no more lines
};

}  // namespace dtk::core
