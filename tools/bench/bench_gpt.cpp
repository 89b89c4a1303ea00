// dtk_bench_gpt — forward+backward throughput of the shipped "gpt" model + "causal_lm" step
// plugins on the CPU, next to the rate of one large fp32 matmul measured in the same run (the
// machine's practical ceiling for a GEMM-bound training step).
//
//   build/bin/dtk_bench_gpt [iterations]        (default 10 timed iterations per model)
//
// Times are the median over iterations (and over 10 matmuls for the ceiling).
//
// The plugins are loaded from the build tree through the host's loader and driven through the
// C ABI, exactly as `dtk train` drives them. All cores are used (at::set_num_threads).
// FLOPs per iteration count every matmul of forward and backward (backward = 2 x forward):
//   3 x [ 2 B s (L (4h^2 + 2 h f) + h V) + 4 B s^2 h L ]      (attention counted as full s x s)
#include <dtk/core/allocator.hpp>
#include <dtk/core/services.hpp>
#include <dtk/host/plugin_host.hpp>
#include <dtk/tensor.hpp>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void check(dtk_status* s) {
  if (!s) return;
  std::string m = dtk_status_get_message(s);
  dtk_status_release(s);
  throw std::runtime_error(m);
}

// Median rate of `reps` n x n x n fp32 matmuls.
double matmul_gflops(int64_t n, int reps) {
  at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  at::Tensor c = at::matmul(a, b);  // warm-up
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    at::mm_out(c, a, b);
    times.push_back(seconds_since(t0));
  }
  std::sort(times.begin(), times.end());
  return 2.0 * n * n * n / times[times.size() / 2] / 1e9;
}

struct Shape {
  const char* name;
  int64_t layers, hidden, heads, seq, batch, vocab;
};

void bench(dtk::host::PluginHost& host, const Shape& S, int iters, double peak) {
  const auto& gpt = host.get(DTK_KIND_MODEL, "gpt");
  const auto& step_p = host.get(DTK_KIND_STEP, "causal_lm");
  std::map<std::string, std::string> user{{"num_layers", std::to_string(S.layers)},
                                          {"hidden_size", std::to_string(S.hidden)},
                                          {"num_attention_heads", std::to_string(S.heads)},
                                          {"vocab_size", std::to_string(S.vocab)}};
  dtk::host::OptionValues mopts(dtk::host::resolve_options(gpt, user));
  dtk::host::OptionValues sopts(dtk::host::resolve_options(step_p, {}));
  dtk_build_context ctx{};
  ctx.struct_size = sizeof(ctx);
  ctx.device = {DTK_DEVICE_CPU, -1};
  ctx.params_dtype = DTK_DTYPE_FLOAT32;
  ctx.tp_size = ctx.pp_size = ctx.dp_size = 1;
  ctx.pre_process = ctx.post_process = 1;
  ctx.seq_length = S.seq;
  ctx.micro_batch_size = S.batch;
  ctx.seed = 1234;
  ctx.options = mopts.get();
  const auto* mapi = gpt.api_as<dtk_model_api>();
  const auto* sapi = step_p.api_as<dtk_step_api>();
  dtk_model* model = nullptr;
  check(mapi->create(&ctx, &model));
  ctx.options = sopts.get();
  dtk_step* step = nullptr;
  check(sapi->create(&ctx, &step));
  dtk_model_ref ref{sizeof(ref), mapi, model};
  dtk_model_info info{};
  info.struct_size = sizeof(info);
  check(mapi->get_info(model, &info));

  at::Tensor text = at::randint(S.vocab, {S.batch, S.seq + 1}, at::kLong);
  dtk::TensorList batch{{"text", text}};
  dtk::MapView view(batch);
  dtk_metric_sink sink{sizeof(sink), nullptr, [](void*, const char*, double) {}};
  auto one = [&] {
    dtk_step_forward_args args{dtk_step_forward_args_STRUCT_SIZE, &ref, view.get(), &sink, nullptr};
    check(sapi->forward_step(step, &args));
    dtk_tensor* loss = args.loss;
    dtk::TensorHandle owned(loss);
    dtk::unwrap(loss).backward();
  };
  one();  // warm-up (allocator, kernels)
  if (const char* trace = std::getenv("DTK_BENCH_PROFILE")) {  // one profiled iteration (chrome trace)
    std::string name = S.name;
    std::replace_if(name.begin(), name.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); }, '-');
    torch::autograd::profiler::RecordProfile profile(std::string(trace) + "." + name + ".json");
    one();
  }
  // Median of per-iteration times: robust to other processes on a shared machine.
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    one();
    times.push_back(seconds_since(t0));
  }
  std::sort(times.begin(), times.end());
  const double secs = times[times.size() / 2];

  const double B = S.batch, s = S.seq, L = S.layers, h = S.hidden, f = info.ffn_hidden_size, V = info.vocab_size;
  const double flops = 3.0 * (2.0 * B * s * (L * (4 * h * h + 2 * h * f) + h * V) + 4.0 * B * s * s * h * L);
  const double gflops = flops / secs / 1e9;
  std::printf(
      "%-28s L=%-2lld h=%-4lld heads=%-2lld seq=%-4lld batch=%-2lld vocab=%lld | %8.1f ms/iter | "
      "%9.0f tokens/s | %6.1f GFLOP/s (%4.1f%% of the matmul)\n",
      S.name, static_cast<long long>(S.layers), static_cast<long long>(S.hidden), static_cast<long long>(S.heads),
      static_cast<long long>(S.seq), static_cast<long long>(S.batch), static_cast<long long>(info.vocab_size),
      secs * 1e3, B * s / secs, gflops, 100.0 * gflops / peak);
  sapi->destroy(step);
  mapi->destroy(model);
}

}  // namespace

int main(int argc, char** argv) {
  dtk::core::reexec_with_caching_allocator(argv);  // as dtk train runs (tcmalloc)
  try {
    const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 10;
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    at::set_num_threads(threads);
    dtk::host::PluginHost host(dtk::core::host_torch_version(), dtk::core::host_services());
    host.load_file(std::string(DTK_BENCH_PLUGIN_DIR) + "/dtk_plugin_gpt.so");
    host.load_file(std::string(DTK_BENCH_PLUGIN_DIR) + "/dtk_plugin_causal_lm.so");
    std::printf("LibTorch %s, %d threads, %s, fp32, training mode (dropout 0.1), %d timed iterations (median)\n",
                dtk::core::host_torch_version(), at::get_num_threads(), dtk::core::malloc_name().c_str(), iters);
    const double peak = matmul_gflops(2048, 10);
    std::printf("%-28s %.1f GFLOP/s (2048 x 2048 x 2048 fp32 at::mm)\n", "ceiling: one large matmul", peak);
    bench(host, {"gpt-tiny", 2, 64, 4, 64, 8, 50257}, iters, peak);
    bench(host, {"6L/384h/6 heads/seq 256", 6, 384, 6, 256, 8, 50257}, iters, peak);
    std::printf("%-28s %.1f GFLOP/s (measured again after the models)\n", "ceiling: one large matmul",
                matmul_gflops(2048, 10));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtk_bench_gpt: error: %s\n", e.what());
    return 1;
  }
}
