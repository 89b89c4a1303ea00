// dtk_bench_optim — one optimizer step of the `adamw` plugin (through the C ABI) next to
// LibTorch's torch::optim::AdamW on the same parameters, and next to the machine's memory
// bandwidth (a large tensor copy) in the same run. AdamW must read p, g, m, v and write p, m, v:
// 28 bytes per fp32 parameter at the very least, so bandwidth bounds the step.
//   build/bin/dtk_bench_optim [millions of parameters, default 16] [steps, default 5]
#include <dtk/core/memory/allocator.hpp>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "../../tests/optim/optim_support.hpp"

using namespace dtk_optim_support;
using Clock = std::chrono::steady_clock;

namespace {
template <class F>
double median_seconds(int reps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto s = Clock::now();
    f(i);
    t.push_back(std::chrono::duration<double>(Clock::now() - s).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  dtk::core::reexec_with_caching_allocator(argv);  // as dtk train runs (tcmalloc)
  const int64_t millions = argc > 1 ? std::atoll(argv[1]) : 16;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 5;
  at::set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  const int64_t n = millions * 1000 * 1000;
  std::printf("AdamW step over %lld M fp32 parameters (4 tensors), %d threads, median of %d steps\n",
              static_cast<long long>(millions), at::get_num_threads(), steps);

  // Bandwidth ceiling: copy a buffer as large as the four optimizer arrays.
  at::Tensor src = at::rand({4 * n}), dst = at::empty({4 * n});
  const double copy_s = median_seconds(steps, [&](int) { dst.copy_(src); });
  const double copy_gbs = 2.0 * 4.0 * static_cast<double>(4 * n) / copy_s / 1e9;  // read + write
  src = dst = at::Tensor();

  auto make = [&] {
    at::manual_seed(0);
    std::vector<at::Tensor> ps;
    for (int i = 0; i < 4; ++i) {
      at::Tensor p = at::randn({n / 4}).set_requires_grad(true);
      p.mutable_grad() = at::randn({n / 4});
      ps.push_back(p);
    }
    return ps;
  };
  double dtk_s = 0, torch_s = 0;
  {
    auto ps = make();
    PluginOptimizer opt(plugin(DTK_BENCH_PLUGIN_DIR, "dtk_plugin_adamw.so"), {}, {{ps, 0.01}});
    opt.step(1e-3, 1);  // allocate state outside the timing
    dtk_s = median_seconds(steps, [&](int i) { opt.step(1e-3, i + 2); });
  }
  {
    auto ps = make();
    torch::optim::AdamW opt(ps, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    opt.step();
    torch_s = median_seconds(steps, [&](int) { opt.step(); });
  }
  const double bytes = 28.0 * static_cast<double>(n);
  std::printf("%-28s %10s %12s %14s\n", "implementation", "ms/step", "Mparams/s", "GB/s (28 B/p)");
  std::printf("%-28s %10.1f %12.0f %14.2f\n", "dtk adamw plugin (ABI)", dtk_s * 1e3, n / dtk_s / 1e6,
              bytes / dtk_s / 1e9);
  std::printf("%-28s %10.1f %12.0f %14.2f\n", "torch::optim::AdamW", torch_s * 1e3, n / torch_s / 1e6,
              bytes / torch_s / 1e9);
  std::printf("%-28s %10s %12s %14.2f\n", "memory copy (ceiling)", "-", "-", copy_gbs);
  return 0;
}
