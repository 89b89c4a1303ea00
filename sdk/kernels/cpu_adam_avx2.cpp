// The AVX2 body of the cpu_adam kernel (this file alone is built with -mavx2 -mfma -mf16c): 8
// floats a step, the same operations as detail::update_one() lane for lane, the tail done by
// update_one().
#include <immintrin.h>

#include "cpu_adam_internal.hpp"

namespace dtk::cpu_adam::detail {
namespace {

// c10::BFloat16 rounding on 8 lanes: (u + 0x7FFF + lsb) >> 16, NaN -> 0x7FC0.
inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Every lane is <= 0xFFFF, so the unsigned-saturating pack is a plain narrowing.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Stores of the updated values. kStream: non-temporal (the run is larger than the caches, so the
// lines go straight to memory instead of evicting the arrays still to be read; the caller checked
// the alignment: run_job streams only 64-byte aligned arrays, and every vector here starts at a
// multiple of the vector width from the tile's start).
template <bool kStream>
inline void store(float* dst, __m256 x) {
  if constexpr (kStream)
    _mm256_stream_ps(dst, x);
  else
    _mm256_storeu_ps(dst, x);
}
template <bool kStream>
inline void store_half(uint16_t* dst, __m128i x) {
  if constexpr (kStream)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), x);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), x);
}

template <bool kBf16Grad, bool kStream>
void body(const Job& j, int64_t begin, int64_t end) {
  const Consts& k = j.k;
  const __m256 decay = _mm256_set1_ps(k.decay), wd = _mm256_set1_ps(k.wd), b1 = _mm256_set1_ps(k.b1),
               omb1 = _mm256_set1_ps(k.omb1), b2 = _mm256_set1_ps(k.b2), omb2 = _mm256_set1_ps(k.omb2),
               bc2_sqrt = _mm256_set1_ps(k.bc2_sqrt), eps = _mm256_set1_ps(k.eps),
               neg_step = _mm256_set1_ps(k.neg_step), grad_scale = _mm256_set1_ps(k.grad_scale);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g;
    if constexpr (kBf16Grad) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(j.grad16 + i));
      g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      g = _mm256_loadu_ps(j.grad32 + i);
    }
    __m256 p = _mm256_loadu_ps(j.param + i);
    if (k.scale_grad) g = _mm256_div_ps(g, grad_scale);
    if (k.adamw) {
      if (k.decay_on) p = _mm256_mul_ps(p, decay);
    } else if (k.l2_on) {
      g = _mm256_fmadd_ps(p, wd, g);
    }
    const __m256 m = _mm256_fmadd_ps(g, omb1, _mm256_mul_ps(_mm256_loadu_ps(j.exp_avg + i), b1));
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(_mm256_loadu_ps(j.exp_avg_sq + i), b2));
    store<kStream>(j.exp_avg + i, m);
    store<kStream>(j.exp_avg_sq + i, v);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
    store<kStream>(j.param + i, p);
    if (j.bf16_out) store_half<kStream>(j.bf16_out + i, to_bf16(p));
    if (j.fp16_out)
      store_half<kStream>(j.fp16_out + i,
                       _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  if constexpr (kStream) _mm_sfence();  // the streamed lines are visible before the tail and the join
  update_range_scalar(j, i, end);
}

}  // namespace

void update_range_avx2(const Job& j, int64_t begin, int64_t end) {
  if (j.stream)
    j.grad16 ? body<true, true>(j, begin, end) : body<false, true>(j, begin, end);
  else
    j.grad16 ? body<true, false>(j, begin, end) : body<false, false>(j, begin, end);
}

}  // namespace dtk::cpu_adam::detail
