#include "dtk/core/perf/peak_throughput.hpp"

#include <ATen/Parallel.h>
#include <glog/logging.h>
#include <dtk/gemm.hpp>

#include <cstdio>

#include "dtk/core/memory/memory.hpp"
#include "dtk/core/perf/bench_report.hpp"

namespace dtk::core {

PeakThroughput find_peak_throughput(const config::RunConfig& cfg, const c10::Device& device) {
  PeakThroughput peak;
  const bool bench_mode = cfg.train().bench_steps() > 0;
  if (cfg.logging().peak_tflops() > 0) {
    peak.tflops = cfg.logging().peak_tflops(), peak.source = "logging.peak_tflops";
  } else if (bench_mode && device.is_cuda()) {
    // A GPU's dense peak is its datasheet's (H100 SXM: 989 bf16), not a matmul measured here.
    LOG(WARNING) << "bench mode on " << device.str()
                 << ": MFU needs the GPU's peak TFLOP/s: set logging.peak_tflops (e.g. 989 for bf16 on an H100 SXM)";
  } else if (bench_mode) {
    peak.tflops = measure_matmul_tflops();
    memory::reset_peak();  // the probe's buffers are not the run's
    peak.measured = true;
    peak.source = "measured: best 2048x2048 fp32 matmul of LibTorch's BLAS and " + dtk::cpu_gemm_engine() + " on " +
                  std::to_string(at::get_num_threads()) + " threads, before and after the steps";
  }
  return peak;
}

double remeasure_peak(const PeakThroughput& peak) { return peak.measured ? measure_matmul_tflops() : 0.0; }

std::string bf16_speed_line(const config::RunConfig& cfg) {
  if (cfg.train().params_dtype() != "bf16" || cfg.train().device() != "cpu") return "";
  const double slowdown = bf16_matmul_slowdown();
  memory::reset_peak();
  char line[512];
  if (slowdown > 1.5)
    std::snprintf(line, sizeof line,
                  " > warning: bf16 matrix products run %.1fx slower than fp32 on this CPU (no native bf16 "
                  "arithmetic; measured at start, 256x256): train.params_dtype=fp32 trains faster here",
                  slowdown);
  else
    std::snprintf(line, sizeof line,
                  " > bf16 matrix products run %.1fx the speed of fp32 on this CPU (measured at start, 256x256)",
                  1.0 / slowdown);
  return line;
}

}  // namespace dtk::core
