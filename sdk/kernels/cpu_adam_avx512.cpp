// The AVX-512F body of the cpu_adam kernel (this file alone is built with -mavx512f): 16 floats a
// step, the same operations as detail::update_one() lane for lane, the tail done by update_one().
#include <immintrin.h>

#include "cpu_adam_internal.hpp"

namespace dtk::cpu_adam::detail {
namespace {

// c10::BFloat16 rounding on 16 lanes: (u + 0x7FFF + lsb) >> 16, NaN -> 0x7FC0.
inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// Stores of the updated values. kStream: non-temporal (the run is larger than the caches, so the
// lines go straight to memory instead of evicting the arrays still to be read; the caller checked
// the alignment: run_job streams only 64-byte aligned arrays, and every vector here starts at a
// multiple of the vector width from the tile's start).
template <bool kStream>
inline void store(float* dst, __m512 x) {
  if constexpr (kStream)
    _mm512_stream_ps(dst, x);
  else
    _mm512_storeu_ps(dst, x);
}
template <bool kStream>
inline void store_half(uint16_t* dst, __m256i x) {
  if constexpr (kStream)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), x);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), x);
}

template <bool kBf16Grad, bool kStream>
void body(const Job& j, int64_t begin, int64_t end) {
  const Consts& k = j.k;
  const __m512 decay = _mm512_set1_ps(k.decay), wd = _mm512_set1_ps(k.wd), b1 = _mm512_set1_ps(k.b1),
               omb1 = _mm512_set1_ps(k.omb1), b2 = _mm512_set1_ps(k.b2), omb2 = _mm512_set1_ps(k.omb2),
               bc2_sqrt = _mm512_set1_ps(k.bc2_sqrt), eps = _mm512_set1_ps(k.eps),
               neg_step = _mm512_set1_ps(k.neg_step), grad_scale = _mm512_set1_ps(k.grad_scale);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 g;
    if constexpr (kBf16Grad) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(j.grad16 + i));
      g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      g = _mm512_loadu_ps(j.grad32 + i);
    }
    __m512 p = _mm512_loadu_ps(j.param + i);
    if (k.scale_grad) g = _mm512_div_ps(g, grad_scale);
    if (k.adamw) {
      if (k.decay_on) p = _mm512_mul_ps(p, decay);
    } else if (k.l2_on) {
      g = _mm512_fmadd_ps(p, wd, g);
    }
    const __m512 m = _mm512_fmadd_ps(g, omb1, _mm512_mul_ps(_mm512_loadu_ps(j.exp_avg + i), b1));
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, _mm512_mul_ps(_mm512_loadu_ps(j.exp_avg_sq + i), b2));
    store<kStream>(j.exp_avg + i, m);
    store<kStream>(j.exp_avg_sq + i, v);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step, m), denom));
    store<kStream>(j.param + i, p);
    if (j.bf16_out) store_half<kStream>(j.bf16_out + i, to_bf16(p));
    if (j.fp16_out)
      store_half<kStream>(j.fp16_out + i,
                          _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  if constexpr (kStream) _mm_sfence();  // the streamed lines are visible before the tail and the join
  update_range_scalar(j, i, end);
}

}  // namespace

void update_range_avx512(const Job& j, int64_t begin, int64_t end) {
  if (j.stream)
    j.grad16 ? body<true, true>(j, begin, end) : body<false, true>(j, begin, end);
  else
    j.grad16 ? body<true, false>(j, begin, end) : body<false, false>(j, begin, end);
}

}  // namespace dtk::cpu_adam::detail
