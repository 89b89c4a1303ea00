// dtk/core/perf/startup_report.hpp — the lines a run prints once before its first iteration
// (after the checkpoint it resumed from): the FLOPs model behind TFLOP/s and MFU, the bf16 speed
// on a CPU, the CPU matrix-product engine, the memory allocator and the loss scaling. Built from
// plain facts so that each line is testable without a run.
#pragma once

#include <string>
#include <vector>

#include "dtk/core/perf/flops.hpp"

namespace dtk::core {

struct StartupFacts {
  ModelStats stats;
  int64_t num_layers = 0, hidden_size = 0, seq_length = 0;
  int world_size = 1;
  std::string bf16_line;        // perf/peak_throughput.hpp's bf16_speed_line ("" for none)
  std::string cpu_gemm_engine;  // "" on a GPU
  std::string malloc_name;      // "tcmalloc" or another (core/allocator.hpp)
  bool loss_scaling = false, dynamic_scale = false;
  double loss_scale = 1;
};

std::vector<std::string> startup_report(const StartupFacts& f);

}  // namespace dtk::core
