// dtk_bench_cpu_adam — one step of the cpu_adam kernel (fp32 p/m/v, fp32 or bf16 grads, bf16
// copy-out of the parameters) next to torch::optim::AdamW::step on the same tensors and next to a
// plain multi-threaded memcpy moving the same number of bytes, all in one run. The step is
// memory-bound: per parameter it reads p, g, m, v and writes p, m, v and the bf16 copy
// (30 bytes with fp32 grads, 28 with bf16 grads), so the copy is its ceiling.
//   dtk_bench_cpu_adam [--n 100000000] [--threads <cores>] [--reps 5] [--grad fp32|bf16] [--no-torch]
// DTK_CPU_ADAM_ISA=scalar|avx2|avx512 forces the kernel's instruction set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/optim/adamw.h>

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <dtk/kernels/cpu_adam.hpp>

namespace ca = dtk::cpu_adam;
using Clock = std::chrono::steady_clock;

namespace {

// A 64-byte-per-instruction streaming copy (AVX-512 loads, non-temporal stores), compiled for
// AVX-512 on its own and run only where the CPU has it: the widest copy this machine can do.
__attribute__((target("avx512f"))) void copy_avx512_stream(char* o, const char* i, int64_t len) {
  for (int64_t k = 0; k < len; k += 64)
    _mm512_stream_ps(reinterpret_cast<float*>(o + k), _mm512_load_ps(reinterpret_cast<const float*>(i + k)));
  _mm_sfence();
}

template <class F>
double median_seconds(int reps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto s = Clock::now();
    f(i);
    t.push_back(std::chrono::duration<double>(Clock::now() - s).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

[[noreturn]] void usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--n N] [--threads T] [--reps R] [--grad fp32|bf16] [--no-torch]\n", argv0);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 100'000'000;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int reps = 5;
  bool bf16_grad = false, with_torch = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : (usage(argv[0]), nullptr); };
    if (a == "--n")
      n = std::atoll(next());
    else if (a == "--threads")
      threads = std::atoi(next());
    else if (a == "--reps")
      reps = std::atoi(next());
    else if (a == "--grad")
      bf16_grad = std::string(next()) == "bf16";
    else if (a == "--no-torch")
      with_torch = false;
    else
      usage(argv[0]);
  }
  if (n <= 0 || threads <= 0 || reps <= 0) usage(argv[0]);
  at::set_num_threads(threads);
  // read p, m, v (12) + grad (4 or 2); write p, m, v (12) + bf16 copy (2)
  const double kernel_bytes = static_cast<double>(n) * (12 + (bf16_grad ? 2 : 4) + 12 + 2);
  const double bpp = kernel_bytes / static_cast<double>(n);
  std::printf("cpu_adam step: %lld fp32 params, %s grads, bf16 copy-out, ISA %s, %d threads, median of %d\n",
              static_cast<long long>(n), bf16_grad ? "bf16" : "fp32", ca::isa_name(ca::active_isa()), threads, reps);
  std::printf("allocator: LibTorch's default CPU allocator (c10 posix_memalign, 64-byte aligned), for every buffer\n");

  // Ceiling: the best of several copies of kernel_bytes/2 bytes (so read + write = kernel_bytes),
  // one contiguous slice per thread: glibc memcpy, LibTorch's Tensor::copy_, SSE2 loops with
  // ordinary and with non-temporal stores, and an AVX-512 streaming loop where the CPU has it. The best one is the bandwidth this machine gives a
  // streaming kernel in this run; a kernel beating a weak probe would prove nothing.
  // Every timed body runs once per round, rounds interleaved (copy probes, then the kernel with
  // ordinary and with streaming stores), so a change of the machine's load during the run moves
  // the ceiling and the kernel alike; each figure is the median over the rounds.
  const int64_t half = static_cast<int64_t>(kernel_bytes / 2) / 64 * 64;
  at::Tensor src = at::empty({half / 4}), dst = at::empty({half / 4});
  std::memset(src.data_ptr(), 1, half);  // fault every page in before timing
  std::memset(dst.data_ptr(), 0, half);
  char* s = static_cast<char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  auto sliced = [&](auto&& body) {
    return [&, body](int) {
#pragma omp parallel num_threads(threads)
      {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t b = half / 64 * t / nt * 64, e = half / 64 * (t + 1) / nt * 64;  // 64-byte aligned
        body(d + b, s + b, e - b);
      }
    };
  };
  const auto memcpy_probe = sliced([](char* o, const char* i, int64_t len) { std::memcpy(o, i, len); });
  const auto sse_probe = sliced([](char* o, const char* i, int64_t len) {
    for (int64_t k = 0; k < len; k += 64)
      for (int64_t l = 0; l < 64; l += 16)
        _mm_store_ps(reinterpret_cast<float*>(o + k + l), _mm_load_ps(reinterpret_cast<const float*>(i + k + l)));
  });
  const auto nt_probe = sliced([](char* o, const char* i, int64_t len) {
    for (int64_t k = 0; k < len; k += 64)
      for (int64_t l = 0; l < 64; l += 16)
        _mm_stream_ps(reinterpret_cast<float*>(o + k + l), _mm_load_ps(reinterpret_cast<const float*>(i + k + l)));
    _mm_sfence();
  });

  at::manual_seed(0);
  at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  at::Tensor g32 = at::randn({n}) * 1e-2;
  at::Tensor g16 = bf16_grad ? g32.to(at::kBFloat16) : at::Tensor();
  at::Tensor out = at::empty({n}, at::kBFloat16);
  std::memset(out.data_ptr(), 0, n * 2);
  ca::AdamParams hp;
  hp.lr = 1e-4f;
  hp.weight_decay = 0.1f;
  int64_t step = 0;
  auto kernel_with = [&](int stream) {
    return [&, stream](int) {
      hp.step = ++step;
      ca::RunOptions run{ca::active_isa(), threads, stream};
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      if (bf16_grad)
        ca::adam_step_bf16_grad(p.data_ptr<float>(), reinterpret_cast<const uint16_t*>(g16.data_ptr<at::BFloat16>()),
                                m.data_ptr<float>(), v.data_ptr<float>(), n, hp, o, nullptr, run);
      else
        ca::adam_step(p.data_ptr<float>(), g32.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, hp, o,
                      nullptr, run);
    };
  };
  const auto avx512_probe = sliced(copy_avx512_stream);
  const bool has_avx512 = ca::isa_supported(ca::Isa::kAvx512);
  const std::pair<const char*, std::function<void(int)>> bodies[] = {
      {"copy memcpy (glibc)", memcpy_probe},
      {"copy Tensor::copy_", [&](int) { dst.copy_(src); }},
      {"copy SSE2 load/store", sse_probe},
      {"copy SSE2 stream store", nt_probe},
      {has_avx512 ? "copy AVX-512 stream st." : "copy SSE2 stream (again)", has_avx512 ? std::function<void(int)>(avx512_probe) : std::function<void(int)>(nt_probe)},
      {"cpu_adam ordinary st.", kernel_with(0)},
      {"cpu_adam streaming st.", kernel_with(1)}};
  constexpr size_t kBodies = sizeof(bodies) / sizeof(bodies[0]), kProbes = 5;
  std::vector<std::vector<double>> times(kBodies);
  for (const auto& b : bodies) b.second(0);  // warm-up: pages, OpenMP threads
  for (int r = 0; r < reps; ++r)
    for (size_t b = 0; b < kBodies; ++b) times[b].push_back(median_seconds(1, bodies[b].second));
  auto median = [](std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  double copy_gbs = 0;
  for (size_t b = 0; b < kProbes; ++b) {
    const double sec = median(times[b]), gbs = 2.0 * static_cast<double>(half) / sec / 1e9;
    copy_gbs = std::max(copy_gbs, gbs);
    std::printf("%-23s: %8.2f ms  %7.2f GB/s (read+write of %.2f GB)\n", bodies[b].first, sec * 1e3, gbs,
                2.0 * static_cast<double>(half) / 1e9);
  }
  double k_sec = 0;
  for (size_t b = kProbes; b < kBodies; ++b) {
    const double sec = median(times[b]), gbs = kernel_bytes / sec / 1e9;
    std::printf("%-23s: %8.2f ms  %7.2f GB/s at %.0f bytes/param = %5.1f %% of the best copy\n", bodies[b].first,
                sec * 1e3, gbs, bpp, 100.0 * gbs / copy_gbs);
  }
  // What the kernel does by default (RunOptions::stream = -1) at this size.
  const bool auto_streams = static_cast<double>(n) * bpp >= static_cast<double>(ca::kStreamMinBytes);
  k_sec = median(times[auto_streams ? kBodies - 1 : kBodies - 2]);
  std::printf("cpu_adam default       : %s stores at this size: %5.1f %% of the best copy\n",
              auto_streams ? "streaming" : "ordinary", 100.0 * kernel_bytes / k_sec / 1e9 / copy_gbs);
  src = dst = at::Tensor();
  m = v = g16 = at::Tensor();

  if (with_torch) {
    // The same parameter tensor and gradient, LibTorch's optimizer with its own fp32 state; the
    // bf16 copy-out it lacks is done as the extra op a user would write (out.copy_(p)).
    at::Tensor tp = p.set_requires_grad(true);
    tp.mutable_grad() = g32;
    torch::optim::AdamW opt({tp}, torch::optim::AdamWOptions(hp.lr).weight_decay(hp.weight_decay));
    auto torch_step = [&](int) {
      opt.step();
      at::NoGradGuard ng;
      out.copy_(tp);
    };
    torch_step(0);  // allocates the state
    const double t_sec = median_seconds(reps, torch_step);
    std::printf("torch AdamW + bf16 copy: %8.2f ms  %7.2f GB/s-equivalent; cpu_adam is %.2fx faster\n", t_sec * 1e3,
                kernel_bytes / t_sec / 1e9, t_sec / k_sec);
    // torch::optim::AdamW alone, without the bf16 copy, for the record.
    const double t2 = median_seconds(reps, [&](int) { opt.step(); });
    std::printf("torch AdamW alone      : %8.2f ms  (cpu_adam with copy-out is %.2fx faster)\n", t2 * 1e3, t2 / k_sec);
  }
  return 0;
}
