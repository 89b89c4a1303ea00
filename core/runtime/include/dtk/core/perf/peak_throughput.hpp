// dtk/core/perf/peak_throughput.hpp — the peak TFLOP/s per device that MFU divides by: given
// (logging.peak_tflops), or in bench mode on a CPU measured here (the best 2048^3 fp32 matmul of
// LibTorch's BLAS and the CPU engine of dtk/gemm.hpp, before the model takes memory and threads,
// and again after the steps). A GPU's dense peak is its datasheet's, never measured.
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "dtk_config.pb.h"

namespace dtk::core {

struct PeakThroughput {
  double tflops = 0;     // 0: unknown (no MFU)
  std::string source;    // where the figure comes from, as the bench summary prints it
  bool measured = false; // measured here: measure it again after the steps (remeasure)
};

// `device`: the training device.
PeakThroughput find_peak_throughput(const config::RunConfig& cfg, const c10::Device& device);

// The measured peak taken again (a shared machine's speed wanders by minutes: the caller keeps the
// higher). 0 when the peak was not measured.
double remeasure_peak(const PeakThroughput& peak);

// The bf16 speed line of a CPU run in bf16 ("" otherwise): fast with native bf16 arithmetic
// (AVX512-BF16, AMX), many times slower than fp32 where LibTorch emulates it. Measured on a few
// 256x256 products.
std::string bf16_speed_line(const config::RunConfig& cfg);

}  // namespace dtk::core
