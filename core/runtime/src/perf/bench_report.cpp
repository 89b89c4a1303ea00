#include "dtk/core/perf/bench_report.hpp"

#include <ATen/ATen.h>
#include <dtk/gemm.hpp>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "dtk/core/memory/memory.hpp"

namespace dtk::core {

BenchReport::Stats BenchReport::step_stats() const {
  Stats s;
  if (steps_.empty()) return s;
  std::vector<double> v = steps_;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(n);
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  // Nearest rank: the smallest value with at least 95% of the steps at or below it.
  const size_t rank = static_cast<size_t>(std::ceil(0.95 * static_cast<double>(n)));
  s.p95 = v[std::max<size_t>(rank, 1) - 1];
  s.min = v.front(), s.max = v.back();
  return s;
}

double BenchReport::tokens_per_second() const {
  const Stats s = step_stats();
  return s.mean > 0 ? static_cast<double>(setup_.tokens_per_iteration) / s.mean : 0;
}

double BenchReport::tflops_per_device() const {
  return setup_.flops_per_token * tokens_per_second() / 1e12 / setup_.world_size;
}

std::vector<std::string> BenchReport::lines() const {
  const Stats s = step_stats();
  const memory::Stats mem = memory::stats();
  std::vector<std::string> out;
  char buf[256];
  std::snprintf(buf, sizeof buf, " performance summary: %lld measured iterations after %lld warm-up (rank 0)",
                static_cast<long long>(measured()), static_cast<long long>(setup_.warmup_steps));
  out.emplace_back(buf);
  std::snprintf(buf, sizeof buf, "   step time (ms): mean %.1f | median %.1f | p95 %.1f | min %.1f | max %.1f",
                1e3 * s.mean, 1e3 * s.median, 1e3 * s.p95, 1e3 * s.min, 1e3 * s.max);
  out.emplace_back(buf);
  std::snprintf(buf, sizeof buf, "   tokens per second: %.0f | throughput per device (TFLOP/s): %.4f",
                tokens_per_second(), tflops_per_device());
  out.emplace_back(buf);
  if (setup_.peak_tflops > 0)
    std::snprintf(buf, sizeof buf, "   MFU: %.1f%% of %.4f TFLOP/s per device (%s)",
                  100.0 * tflops_per_device() / setup_.peak_tflops, setup_.peak_tflops, setup_.peak_source.c_str());
  else
    std::snprintf(buf, sizeof buf, "   MFU: unknown (set logging.peak_tflops)");
  out.emplace_back(buf);
  std::snprintf(buf, sizeof buf, "   peak memory (MB): resident %.1f | tensors max allocated %.1f",
                static_cast<double>(memory::peak_rss_bytes()) / (1 << 20),
                static_cast<double>(mem.device.peak + mem.host.peak) / (1 << 20));
  out.emplace_back(buf);
  for (const auto& g : comm_groups()) {
    std::snprintf(buf, sizeof buf, "   %s-parallel comm per iteration (ms): in flight %.1f | exposed %.1f (%.0f%% of in flight)",
                  g.name, g.in_flight_ms, g.exposed_ms, g.in_flight_ms > 0 ? 100.0 * g.exposed_ms / g.in_flight_ms : 0.0);
    out.emplace_back(buf);
  }
  return out;
}

// Means over the measured steps, for each parallel group larger than one.
std::vector<BenchReport::CommMeans> BenchReport::comm_groups() const {
  std::vector<CommMeans> out;
  const double n = static_cast<double>(std::max<size_t>(comm_.size(), 1));
  auto add = [&](const char* name, int size, double StepComm::*in_flight, double StepComm::*exposed) {
    if (size <= 1) return;
    CommMeans m{name, 0, 0};
    for (const auto& c : comm_) m.in_flight_ms += c.*in_flight / n, m.exposed_ms += c.*exposed / n;
    out.push_back(m);
  };
  add("tensor", setup_.tp_size, &StepComm::tp_in_flight_ms, &StepComm::tp_exposed_ms);
  add("data", setup_.dp_size, &StepComm::dp_in_flight_ms, &StepComm::dp_exposed_ms);
  add("expert", setup_.ep_size, &StepComm::ep_in_flight_ms, &StepComm::ep_exposed_ms);
  add("context", setup_.cp_size, &StepComm::cp_in_flight_ms, &StepComm::cp_exposed_ms);
  return out;
}

JsonObject BenchReport::json() const {
  const Stats s = step_stats();
  const memory::Stats mem = memory::stats();
  JsonObject o;
  o.add("measured_iterations", measured())
      .add("warmup_iterations", setup_.warmup_steps)
      .add("step_time_ms_mean", 1e3 * s.mean)
      .add("step_time_ms_median", 1e3 * s.median)
      .add("step_time_ms_p95", 1e3 * s.p95)
      .add("step_time_ms_min", 1e3 * s.min)
      .add("step_time_ms_max", 1e3 * s.max)
      .add("tokens_per_iteration", setup_.tokens_per_iteration)
      .add("tokens_per_second", tokens_per_second())
      .add("flops_per_token", setup_.flops_per_token)
      .add("world_size", setup_.world_size)
      .add("tflops_per_device", tflops_per_device())
      .add("peak_tflops_per_device", setup_.peak_tflops > 0 ? setup_.peak_tflops : NAN)
      .add("mfu", setup_.peak_tflops > 0 ? tflops_per_device() / setup_.peak_tflops : NAN)
      .add("peak_rss_bytes", memory::peak_rss_bytes())
      .add("tensor_max_allocated_bytes", mem.device.peak + mem.host.peak);
  for (const auto& g : comm_groups())
    o.add(std::string(g.name) + "_parallel_comm_in_flight_ms_mean", g.in_flight_ms)
        .add(std::string(g.name) + "_parallel_comm_exposed_ms_mean", g.exposed_ms);
  std::string steps = "[";
  char buf[32];
  for (size_t i = 0; i < steps_.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%s%.3f", i ? ", " : "", 1e3 * steps_[i]);
    steps += buf;
  }
  o.add_raw("step_times_ms", steps + "]");
  return o;
}

double measure_matmul_tflops(int64_t n, int repeats) {
  const at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  at::Tensor c = at::mm(a, b);
  // Warm-up: the thread pools, each library's buffers and oneDNN's JIT kernels; a ceiling taken
  // on the first products of a fresh process came out ~30% low on a 2-core VM.
  for (int w = 0; w < 2; ++w) {
    at::mm_out(c, a, b);
    dtk::mm_out(c, a, b);
  }
  // The best of LibTorch's BLAS and the engine dtk's products use (dtk/gemm.hpp): the ceiling is
  // the machine's, not one library's.
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    for (const bool dtk_engine : {false, true}) {
      const auto t0 = std::chrono::steady_clock::now();
      if (dtk_engine)
        dtk::mm_out(c, a, b);
      else
        at::mm_out(c, a, b);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / s / 1e12);
    }
  }
  return best;
}

double bf16_matmul_slowdown(int64_t n, int repeats) {
  auto best_seconds = [&](at::ScalarType type) {
    const at::Tensor a = at::randn({n, n}).to(type), b = at::randn({n, n}).to(type);
    at::Tensor c = dtk::mm(a, b);  // warm-up
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      dtk::mm_out(c, a, b);  // as the model's products run (dtk/gemm.hpp)
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const double fp32 = best_seconds(at::kFloat), bf16 = best_seconds(at::kBFloat16);
  return fp32 > 0 ? bf16 / fp32 : 1.0;
}

}  // namespace dtk::core
