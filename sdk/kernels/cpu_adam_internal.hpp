// Shared by the per-ISA translation units of the cpu_adam kernel: the step's scalars, the
// one-element update every ISA uses for its tail, and the exact fp32 -> bf16 / fp16 conversions.
// Every kernel TU is built with -ffp-contract=off: the only fused multiply-adds are the explicit
// ones below, so the vector bodies and the scalar tails round identically.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dtk::cpu_adam::detail {

// The step's scalars, rounded to float once from double (see dtk/kernels/cpu_adam.hpp).
struct Consts {
  float decay;  // 1 - lr*wd (adamw)
  float wd;     // L2 coefficient (classic Adam)
  float b1, omb1, b2, omb2;
  float bc2_sqrt;  // sqrt(1 - b2^t), 1 without bias correction
  float eps;
  float neg_step;  // -(lr / (1 - b1^t))
  float grad_scale;
  bool adamw, decay_on, l2_on, scale_grad;
};

// What one step works on; either grad32 or grad16 is set.
struct Job {
  float* param;
  const float* grad32;
  const uint16_t* grad16;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* bf16_out;
  uint16_t* fp16_out;
  Consts k;
  bool stream = false;  // non-temporal stores (set by run_job for large, 64-byte aligned arrays)
};

// Internal linkage on purpose: each TU compiles these with its own -m flags, and one shared
// inline definition would let the linker hand the baseline path a copy built for AVX-512.
namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// c10::BFloat16's round-to-nearest-even; NaN becomes the canonical quiet NaN 0x7FC0 as in c10.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE fp32 -> fp16, round-to-nearest-even, subnormals and overflow to inf as F16C's VCVTPS2PH
// and c10::Half do (NaN -> 0x7E00 with the sign, as c10).
inline uint16_t float_to_fp16(float f) {
  uint32_t x = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00;
  if (x >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds (ties to even) to infinity
  if (x < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5f puts the half's ulp (2^-24) at the float's
    // last mantissa bit, so the FPU's own round-to-nearest-even does the rounding.
    const float r = bits_to_float(x) + 0.5f;
    return sign | static_cast<uint16_t>(float_to_bits(r) - 0x3F000000u);
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd;
  return sign | static_cast<uint16_t>(x >> 13);
}

// One element of the update, in torch's op order; the vector bodies mirror it lane for lane.
inline float update_one(float p, float g, float* m_io, float* v_io, const Consts& k) {
  if (k.scale_grad) g = g / k.grad_scale;
  if (k.adamw) {
    if (k.decay_on) p = p * k.decay;
  } else if (k.l2_on) {
    g = __builtin_fmaf(p, k.wd, g);
  }
  const float m = __builtin_fmaf(g, k.omb1, *m_io * k.b1);
  const float v = __builtin_fmaf(k.omb2 * g, g, *v_io * k.b2);
  *m_io = m;
  *v_io = v;
  const float denom = std::sqrt(v) / k.bc2_sqrt + k.eps;
  return p + (k.neg_step * m) / denom;
}

inline void update_range_scalar(const Job& j, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = j.grad32 ? j.grad32[i] : bf16_to_float(j.grad16[i]);
    const float p = update_one(j.param[i], g, j.exp_avg + i, j.exp_avg_sq + i, j.k);
    j.param[i] = p;
    if (j.bf16_out) j.bf16_out[i] = float_to_bf16(p);
    if (j.fp16_out) j.fp16_out[i] = float_to_fp16(p);
  }
}

}  // namespace

// Per-ISA range kernels: update elements [begin, end). Defined only in TUs built for that ISA.
void update_range_avx2(const Job& j, int64_t begin, int64_t end);
void update_range_avx512(const Job& j, int64_t begin, int64_t end);

}  // namespace dtk::cpu_adam::detail
