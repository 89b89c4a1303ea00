// cpu_adam kernel: ISA choice, the step's scalars, and the split of the arrays over threads.
// The per-ISA bodies are in cpu_adam_avx2.cpp / cpu_adam_avx512.cpp (built with their own -m
// flags); this file is built for the baseline x86-64 so it runs on any CPU and is the scalar path.
#include "dtk/kernels/cpu_adam.hpp"

#include <omp.h>

#include <cpuid.h>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cpu_adam_internal.hpp"

namespace dtk::cpu_adam {
namespace {

// 64K elements: 256 KB of each fp32 array per tile, large enough that scheduling costs nothing
// next to the memory traffic, small enough to balance 100M parameters over any core count. A
// multiple of every vector width, so tiles never start mid-vector.
constexpr int64_t kTile = int64_t{1} << 16;

bool cpu_has_f16c() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & bit_F16C) != 0;
}

Isa choose_isa() {
  const char* env = std::getenv("DTK_CPU_ADAM_ISA");
  if (env && *env) {
    const std::string name(env);
    Isa isa;
    if (name == "scalar")
      isa = Isa::kScalar;
    else if (name == "avx2")
      isa = Isa::kAvx2;
    else if (name == "avx512")
      isa = Isa::kAvx512;
    else
      throw std::runtime_error("DTK_CPU_ADAM_ISA=" + name + ": expected scalar, avx2 or avx512");
    if (!isa_supported(isa)) throw std::runtime_error("DTK_CPU_ADAM_ISA=" + name + ": not supported by this CPU");
    return isa;
  }
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
    if (isa_supported(isa)) return isa;
  return Isa::kScalar;
}

detail::Consts make_consts(const AdamParams& p) {
  // LibTorch's options are doubles: these scalars are formed in double and rounded to float when
  // they reach the float kernels, and so they are here.
  const double lr = p.lr, b1 = p.beta1, b2 = p.beta2, wd = p.weight_decay;
  const double bc1 = p.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(p.step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(p.step)) : 1.0;
  detail::Consts k;
  k.decay = static_cast<float>(1.0 - lr * wd);
  k.wd = p.weight_decay;
  k.b1 = p.beta1;
  k.omb1 = static_cast<float>(1.0 - b1);
  k.b2 = p.beta2;
  k.omb2 = static_cast<float>(1.0 - b2);
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.eps = p.eps;
  k.neg_step = static_cast<float>(-(lr / bc1));
  k.grad_scale = p.grad_scale;
  k.adamw = p.adamw;
  k.decay_on = p.adamw && p.weight_decay != 0.f;
  k.l2_on = !p.adamw && p.weight_decay != 0.f;
  k.scale_grad = p.grad_scale != 1.f;
  return k;
}

bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63u) == 0; }

// Whether the step streams its stores (RunOptions::stream); the scalar path never does.
bool streams(const detail::Job& j, int64_t n, const RunOptions& run) {
  if (run.stream == 0 || run.isa == Isa::kScalar) return false;
  const bool aligned = aligned64(j.param) && aligned64(j.exp_avg) && aligned64(j.exp_avg_sq) &&
                       (!j.bf16_out || aligned64(j.bf16_out)) && (!j.fp16_out || aligned64(j.fp16_out));
  if (!aligned) return false;
  // bytes touched: p, m, v read and written, the gradient read, the copies written
  const int64_t per = 24 + (j.grad32 ? 4 : 2) + (j.bf16_out ? 2 : 0) + (j.fp16_out ? 2 : 0);
  return run.stream > 0 || n * per >= kStreamMinBytes;
}

void run_job(detail::Job job, int64_t n, const RunOptions& run) {
  if (!isa_supported(run.isa))
    throw std::invalid_argument(std::string("cpu_adam: ISA not supported: ") + isa_name(run.isa));
  void (*range)(const detail::Job&, int64_t, int64_t) = detail::update_range_scalar;
  if (run.isa == Isa::kAvx512) range = detail::update_range_avx512;
  if (run.isa == Isa::kAvx2) range = detail::update_range_avx2;
  job.stream = streams(job, n, run);
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int threads = run.threads > 0 ? run.threads : omp_get_max_threads();
  if (tiles <= 1 || threads == 1) {
    range(job, 0, n);
    return;
  }
  // Static schedule: each thread takes one contiguous run of tiles, which keeps the hardware
  // prefetchers streaming, and the elementwise update needs no balancing beyond equal counts.
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) range(job, t * kTile, std::min(n, (t + 1) * kTile));
}

void check(int64_t n, const AdamParams& p) {
  if (n < 0) throw std::invalid_argument("cpu_adam: negative element count");
  if (p.step < 1) throw std::invalid_argument("cpu_adam: step is 1-based");
  if (p.grad_scale == 0.f) throw std::invalid_argument("cpu_adam: grad_scale must be non-zero");
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f");
  }
  return false;
}

Isa active_isa() {
  static const Isa isa = choose_isa();
  return isa;
}

RunOptions default_run_options() { return RunOptions{active_isa(), 0}; }

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamParams& p,
               uint16_t* bf16_copy_out, uint16_t* fp16_copy_out, const RunOptions& run) {
  check(n, p);
  const detail::Job job{param, grad, nullptr, exp_avg, exp_avg_sq, bf16_copy_out, fp16_copy_out, make_consts(p)};
  run_job(job, n, run);
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamParams& p,
               uint16_t* bf16_copy_out, uint16_t* fp16_copy_out) {
  adam_step(param, grad, exp_avg, exp_avg_sq, n, p, bf16_copy_out, fp16_copy_out, default_run_options());
}

void adam_step_bf16_grad(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const AdamParams& p, uint16_t* bf16_copy_out, uint16_t* fp16_copy_out, const RunOptions& run) {
  check(n, p);
  const detail::Job job{param, nullptr, grad_bf16, exp_avg, exp_avg_sq, bf16_copy_out, fp16_copy_out, make_consts(p)};
  run_job(job, n, run);
}

void adam_step_bf16_grad(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const AdamParams& p, uint16_t* bf16_copy_out, uint16_t* fp16_copy_out) {
  adam_step_bf16_grad(param, grad_bf16, exp_avg, exp_avg_sq, n, p, bf16_copy_out, fp16_copy_out, default_run_options());
}

}  // namespace dtk::cpu_adam
