// cpu_adam kernel — the fp32 Adam/AdamW update on plain host arrays, the numeric core of the
// `cpu_adam` optimizer plugin and of ZeRO-Offload's host-side step. LibTorch-free on purpose: the
// offload path hands it pinned host buffers, and the plugin glue (C ABI) lives elsewhere.
//
// The math is torch.optim.AdamW / torch.optim.Adam of PyTorch 1.13, op for op and in the same
// float rounding order (each tensor op of the reference rounds to fp32 once; where ATen's
// vectorised kernel fuses a multiply-add into one FMA, so does this kernel: add_ with alpha is an
// explicit fmadd there, and addcmul's `self + value * t1 * t2` is contracted into one by GCC, which
// builds Debian's LibTorch with its default -ffp-contract=fast). The result is bit-identical to
// torch::optim::AdamW / Adam on this LibTorch (tests/cpu_adam):
//   g = grad / grad_scale                                   (only when grad_scale != 1)
//   adamw:  p = p * (1 - lr*wd)          Adam (L2):  g = g + wd*p   (both only when wd != 0)
//   m = fma(g, 1-b1, m*b1)                                  exp_avg.mul_(b1).add_(g, 1-b1)
//   v = fma((1-b2)*g, g, v*b2)                              exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
//   denom = sqrt(v) / sqrt(1-b2^t) + eps                    (bias_correction=false: sqrt(v) + eps)
//   p = p + (-(lr/(1-b1^t)) * m) / denom                    p.addcdiv_(m, denom, -step_size)
// Scalars (1 - lr*wd, 1-b1, bias corrections, step size) are formed in double, as LibTorch's
// double-valued options do, then rounded to float once.
#pragma once

#include <cstdint>

namespace dtk::cpu_adam {

struct AdamParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.f;
  bool adamw = true;       // true: decoupled decay (AdamW); false: L2 folded into the gradient (Adam)
  int64_t step = 1;        // 1-based step number of the update being applied
  float grad_scale = 1.f;  // gradients are divided by this (loss scaling); 1 leaves them untouched
  bool bias_correction = true;
};

// Instruction sets with a kernel. Listed from the weakest to the strongest.
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
// Whether this CPU can run `isa` (AVX2 needs FMA and F16C too).
bool isa_supported(Isa isa);
// The ISA adam_step() uses: the strongest supported one, or the one named by the environment
// variable DTK_CPU_ADAM_ISA=scalar|avx2|avx512 (an unsupported or unknown name throws
// std::runtime_error). Decided once per process.
Isa active_isa();

// How a step runs. threads <= 0 means OpenMP's current default, omp_get_max_threads(): in a process
// with LibTorch that is whatever at::set_num_threads() set (LibTorch 1.13 starts at the number of
// physical cores, 1 on this 2-vCPU VM), so pass the count explicitly when it matters.
// stream: the updated p, m, v and the half-precision copy are written with non-temporal stores
// (they bypass the caches; no read-for-ownership of the copy-out). -1 (the default) streams when
// the step is larger than kStreamMinBytes and every array is 64-byte aligned, where it saves
// memory traffic; small steps keep ordinary stores, whose lines the next use finds in cache.
// 0: never, 1: whenever aligned. The values written are the same either way.
struct RunOptions {
  Isa isa;
  int threads = 0;
  int stream = -1;
};
constexpr int64_t kStreamMinBytes = int64_t{32} << 20;
RunOptions default_run_options();

// One update of n parameters in place (param, exp_avg, exp_avg_sq). When bf16_copy_out /
// fp16_copy_out are not null, the updated parameters are also written there, converted with
// round-to-nearest-even (as at::Tensor::to(kBFloat16 / kHalf)) in the same pass. Arrays must not
// overlap. Throws std::invalid_argument on bad arguments (n < 0, step < 1, unsupported ISA).
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamParams& p,
               uint16_t* bf16_copy_out = nullptr, uint16_t* fp16_copy_out = nullptr);
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamParams& p,
               uint16_t* bf16_copy_out, uint16_t* fp16_copy_out, const RunOptions& run);

// The same update with bf16 gradients (ZeRO-Offload moves bf16 grads to the host); each gradient is
// widened to fp32 exactly, so the result equals adam_step() on the upcast gradients.
void adam_step_bf16_grad(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const AdamParams& p, uint16_t* bf16_copy_out = nullptr, uint16_t* fp16_copy_out = nullptr);
void adam_step_bf16_grad(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const AdamParams& p, uint16_t* bf16_copy_out, uint16_t* fp16_copy_out, const RunOptions& run);

}  // namespace dtk::cpu_adam
