// dtk/core/perf/bench_report.hpp — the performance summary at the end of a bench run
// (train.bench_steps, train.perf_warmup_steps, --bench_out): step time statistics over the
// measured iterations only, tokens/s, TFLOP/s per device, MFU, peak memory and, under tensor or
// data parallelism, the communication in flight and exposed per iteration (Domino's figure).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dtk/core/logging/metrics_jsonl.hpp"

namespace dtk::core {

struct BenchSetup {
  int64_t warmup_steps = 0;
  int64_t tokens_per_iteration = 0;  // global batch x sequence length
  double flops_per_token = 0;        // core/flops.hpp, whole model
  int world_size = 1;
  double peak_tflops = 0;   // per device; 0 = unknown (no MFU)
  std::string peak_source;  // "logging.peak_tflops" or how it was measured
  int tp_size = 1, dp_size = 1, ep_size = 1, cp_size = 1;
};

// One measured step's communication per parallel group (core/comm.hpp's CommTiming figures):
// the time collectives were in flight and the time the training thread waited for them.
struct StepComm {
  double tp_in_flight_ms = 0, tp_exposed_ms = 0, dp_in_flight_ms = 0, dp_exposed_ms = 0;
  double ep_in_flight_ms = 0, ep_exposed_ms = 0, cp_in_flight_ms = 0, cp_exposed_ms = 0;
};

class BenchReport {
 public:
  explicit BenchReport(BenchSetup setup) : setup_(std::move(setup)) {}
  void add_step(double seconds, const StepComm& comm = {}) {
    steps_.push_back(seconds);
    comm_.push_back(comm);
  }
  int64_t measured() const { return static_cast<int64_t>(steps_.size()); }
  // A measured peak taken again after the steps: the higher of the two stands (a shared machine's
  // speed wanders by minutes, and a ceiling caught in a slow minute would put MFU above 100%).
  void raise_peak(double tflops) { setup_.peak_tflops = std::max(setup_.peak_tflops, tflops); }

  // The summary as printed lines, and as one JSON object (for --bench_out).
  std::vector<std::string> lines() const;
  JsonObject json() const;

 private:
  struct Stats {
    double mean = 0, median = 0, p95 = 0, min = 0, max = 0;
  };
  Stats step_stats() const;
  struct CommMeans {
    const char* name;  // "tensor" | "data" | "expert" | "context"
    double in_flight_ms, exposed_ms;
  };
  std::vector<CommMeans> comm_groups() const;
  double tokens_per_second() const;
  double tflops_per_device() const;

  BenchSetup setup_;
  std::vector<double> steps_;
  std::vector<StepComm> comm_;
};

// The host's matmul ceiling in TFLOP/s: the best of a few n x n fp32 matmuls on the run's
// intra-op threads (what "peak" means for MFU on a CPU).
double measure_matmul_tflops(int64_t n = 2048, int repeats = 4);

// How many times longer an n x n bf16 matmul takes than an fp32 one on the run's intra-op threads
// (best of a few each), both as the model's products run (dtk::mm_out: a bf16 one widened to fp32
// and rounded once on a CPU without AVX-512, dtk/gemm.hpp): about 1 there, > 1.5 under
// DTK_CPU_GEMM=aten on such a CPU, or on an AVX-512 CPU without AVX512-BF16, where LibTorch
// emulates bf16.
double bf16_matmul_slowdown(int64_t n = 256, int repeats = 3);

}  // namespace dtk::core
