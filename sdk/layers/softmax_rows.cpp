// softmax_rows.cpp — see softmax_rows.hpp. Built with -O3; each entry point has an AVX-512
// (x86-64-v4) and an AVX2 (x86-64-v3) clone picked at load time, and a portable default. The loops
// use GCC's vector extension rather than hoping for auto-vectorisation (which reductions only get
// with -ffast-math's reassociation): reductions keep 8 lane partials, combined in a fixed order.
#include "softmax_rows.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#define DTK_ROWS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

namespace dtk::layers::softmax_rows {
namespace {

// 8 floats in GCC's vector extension: one ymm register in the AVX-512 and AVX2 clones (a Zen 4 core
// runs 512-bit operations as two 256-bit halves anyway, and 16 lanes made GCC scalarise the AVX2
// clone), two xmm in the default one. Unaligned loads and stores go through memcpy.
constexpr int kLanes = 8;
typedef float vfloat __attribute__((vector_size(4 * kLanes)));
typedef int32_t vint __attribute__((vector_size(4 * kLanes)));

inline __attribute__((always_inline)) vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline __attribute__((always_inline)) void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline __attribute__((always_inline)) vfloat splat(float x) { return vfloat{} + x; }
inline __attribute__((always_inline)) vfloat select(vint mask, vfloat a, vfloat b) {
  return reinterpret_cast<vfloat>((mask & reinterpret_cast<vint>(a)) | (~mask & reinterpret_cast<vint>(b)));
}

// Cephes expf without branches: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7
// polynomial, times 2^n built in the exponent bits. Inputs above 88 give exp(88) (the callers
// pass x - max <= 0); below -87.33 (where 2^n would leave the normal range) 0; NaN gives NaN.
inline __attribute__((always_inline)) vfloat exp_cephes(vfloat x) {
  const vfloat lo = splat(-87.3365447504f), hi = splat(88.0f);
  vfloat xc = select(x > hi, hi, x);
  xc = select(xc < lo, lo, xc);
  // Round to nearest with the 1.5 x 2^23 trick (exact for |x log2 e| < 2^22).
  const vfloat magic = splat(12582912.0f);
  const vfloat n = (xc * 1.44269504088896341f + magic) - magic;
  vfloat r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const vint exponent = (__builtin_convertvector(n, vint) + 127) << 23;
  return select(x < lo, vfloat{}, p * reinterpret_cast<vfloat>(exponent));
}
inline float exp_cephes(float x) { return exp_cephes(splat(x))[0]; }

constexpr int64_t kBlock = 512;  // values summed in float before the partial goes to double

// Lane partials combined in a fixed order: the result does not depend on the thread count.
inline double lanes_sum(vfloat a) {
  double s = 0;
  for (int k = 0; k < kLanes; ++k) s += a[k];
  return s;
}
inline float max_skipping_nan(float m, float x) { return m < x ? x : m; }

}  // namespace

DTK_ROWS_CLONES void row_max(const float* x, int64_t n, int64_t width, int64_t ld, float* max) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * ld;
    vfloat acc = splat(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + kLanes <= width; j += kLanes) {
      const vfloat v = load(row + j);
      acc = select(acc < v, v, acc);
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < kLanes; ++k) m = max_skipping_nan(m, acc[k]);
    for (; j < width; ++j) m = max_skipping_nan(m, row[j]);
    max[i] = m;
  }
}

DTK_ROWS_CLONES void exp_sum(float* x, int64_t n, int64_t width, int64_t ld, const float* max, const int64_t* col,
                             float* sum, float* target, bool write) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = x + i * ld;
    const float m = max[i];
    if (target) target[i] = col && col[i] >= 0 ? row[col[i]] - m : 0.0f;
    const vfloat mv = splat(m);
    // Lane partials over blocks of kBlock values, the blocks' sums added in double: the error
    // stays at a few ulp for any row length (one float per lane over a 50304-wide row drifted
    // ~1e-5 relative).
    double total = 0;
    int64_t j = 0;
    while (j + kLanes <= width) {
      const int64_t block_end = std::min(width - kLanes, j + kBlock - kLanes);
      vfloat acc{};
      for (; j <= block_end; j += kLanes) {
        const vfloat e = exp_cephes(load(row + j) - mv);
        if (write) store(row + j, e);
        acc += e;
      }
      total += lanes_sum(acc);
    }
    for (; j < width; ++j) {
      const float e = exp_cephes(row[j] - m);
      if (write) row[j] = e;
      total += e;
    }
    sum[i] = static_cast<float>(total);
  }
}

DTK_ROWS_CLONES void normalize_minus_onehot(float* x, int64_t n, int64_t width, int64_t ld, const float* sum,
                                            const int64_t* col) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = x + i * ld;
    const float s = sum[i];
    const vfloat sv = splat(s);
    int64_t j = 0;
    for (; j + kLanes <= width; j += kLanes) store(row + j, load(row + j) / sv);
    for (; j < width; ++j) row[j] = row[j] / s;
    if (col && col[i] >= 0) row[col[i]] -= 1.0f;
  }
}

DTK_ROWS_CLONES void softmax_backward_row(const float* p, float* g, const float* mult, int64_t n) {
  int64_t j = 0;
  vfloat acc{};
  if (mult) {
    for (; j + kLanes <= n; j += kLanes) {
      const vfloat gj = load(g + j) * load(mult + j);
      store(g + j, gj);
      acc += gj * load(p + j);
    }
  } else {
    for (; j + kLanes <= n; j += kLanes) acc += load(g + j) * load(p + j);
  }
  double dot = lanes_sum(acc);
  for (; j < n; ++j) {
    if (mult) g[j] *= mult[j];
    dot += g[j] * p[j];
  }
  const float d = static_cast<float>(dot);
  const vfloat dv = splat(d);
  j = 0;
  for (; j + kLanes <= n; j += kLanes) store(g + j, load(p + j) * (load(g + j) - dv));
  for (; j < n; ++j) g[j] = p[j] * (g[j] - d);
}

}  // namespace dtk::layers::softmax_rows
