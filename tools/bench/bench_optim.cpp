// dtk_bench_optim — one optimizer step of the `adamw` plugin (through the C ABI, loaded and
// created by the host's own OptimizerInstance, as `dtk train` does) next to
// LibTorch's torch::optim::AdamW on the same parameters, and next to the machine's memory
// bandwidth (a large tensor copy) in the same run. AdamW must read p, g, m, v and write p, m, v:
// 28 bytes per fp32 parameter at the very least, so bandwidth bounds the step.
//   build/bin/dtk_bench_optim [millions of parameters, default 16] [steps, default 5]
#include <dtk/core/components/components.hpp>
#include <dtk/core/components/services.hpp>
#include <dtk/core/memory/allocator.hpp>
#include <dtk/core/optim/param_groups.hpp>
#include <dtk/host/plugin_host.hpp>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

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

// The adamw plugin over `params` (weight decay 0.01, one group), created through the host's
// OptimizerInstance; returns the median seconds of `steps` steps after one untimed step.
double time_plugin_adamw(const std::vector<at::Tensor>& params, int steps) {
  dtk::host::PluginHost host(dtk::core::host_torch_version(), dtk::core::host_services());
  const dtk::host::Plugin& adamw = host.load_file(std::string(DTK_BENCH_PLUGIN_DIR) + "/dtk_plugin_adamw.so");
  const dtk::host::OptionValues options(dtk::host::resolve_options(adamw, {}));
  dtk_build_context ctx{};
  ctx.struct_size = dtk_build_context_STRUCT_SIZE;
  ctx.options = options.get();
  ctx.device = {DTK_DEVICE_CPU, -1};
  ctx.params_dtype = DTK_DTYPE_FLOAT32;
  ctx.tp_size = ctx.pp_size = ctx.dp_size = 1;
  ctx.pre_process = ctx.post_process = 1;
  std::vector<dtk::Param> named;
  for (size_t i = 0; i < params.size(); ++i) named.push_back({"layers." + std::to_string(i) + ".weight", params[i]});
  dtk::config::LrSchedule lr;
  lr.set_weight_decay(0.01);
  const dtk::core::ParamGroups groups(lr, 0.01);
  dtk::core::OptimizerInstance opt(adamw, ctx, named, groups);
  auto step = [&](int64_t iteration) {
    const dtk_optimizer_step_args args{dtk_optimizer_step_args_STRUCT_SIZE, 1e-3, iteration, 1.0, 1.0};
    if (dtk_status* s = opt.ref()->api->step(opt.ref()->optimizer, &args)) {
      const std::string message = dtk_status_get_message(s);
      dtk_status_release(s);
      throw std::runtime_error("adamw step: " + message);
    }
  };
  step(1);  // allocates the state outside the timing
  return median_seconds(steps, [&](int i) { step(i + 2); });
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
    dtk_s = time_plugin_adamw(make(), steps);
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
