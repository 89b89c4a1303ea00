// pack.cuh (private to core/cuda) — 16-byte loads and stores of 2-byte elements (bf16, fp16):
// eight elements in one instruction, kept packed in four registers until used.
//
// Why: the profile of 2026-12-04 (docs/cuda.md) had the elementwise and norm kernels that loaded
// one 2-byte element per thread per step at a third to a seventh of the memory's rate. A thread
// that stores before its next load keeps one load in flight (the compiler may not move a load
// above a store that might alias it), so each element paid a full memory latency; eight elements a
// load, all of a row's loads issued before its first store, keep the bytes in flight that the
// memory's rate needs. Used where the element count is a multiple of eight and every pointer is
// 16-byte aligned (packable()); the scalar kernels take every other case.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "element.cuh"

namespace dtk::cuda::pack {

constexpr int kN = 8;  // 2-byte elements a pack

template <class T>
struct Pack {
  static_assert(sizeof(T) == 2, "packs hold 2-byte elements");
  uint4 raw;
  __device__ __forceinline__ float get(int e) const { return element::to_float(reinterpret_cast<const T*>(&raw)[e]); }
  __device__ __forceinline__ void set(int e, float v) { reinterpret_cast<T*>(&raw)[e] = element::from_float<T>(v); }
};

template <class T>
__device__ __forceinline__ Pack<T> load(const T* p) {
  Pack<T> v;
  v.raw = *reinterpret_cast<const uint4*>(p);
  return v;
}

template <class T>
__device__ __forceinline__ void store(T* p, const Pack<T>& v) {
  *reinterpret_cast<uint4*>(p) = v.raw;
}

// Whether packs apply: 2-byte elements, `count` (a row's or a run's elements) a multiple of kN,
// and every pointer given (null ones are skipped) on a 16-byte boundary.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <class... Pointers>
inline bool packable(int element_bytes, int64_t count, const Pointers*... pointers) {
  return element_bytes == 2 && count % kN == 0 && (aligned16(pointers) && ...);
}

// Packs a lane needs for `columns` columns (a warp covers 32 packs a step).
inline int packs_for(int64_t columns) { return static_cast<int>((columns + 32 * kN - 1) / (32 * kN)); }

// f(std::integral_constant<int, K>{}) for K = min(packs, kMax) (at least 1): a host launcher's way to
// a kernel templated on its packs a lane, e.g. with_packs<4>(n, [&](auto k) { launch(kernel<T, k>); }).
template <int kMax, int K = 1, class F>
inline void with_packs(int packs, F&& f) {
  if constexpr (K >= kMax) {
    f(std::integral_constant<int, K>{});
  } else {
    if (packs <= K)
      f(std::integral_constant<int, K>{});
    else
      with_packs<kMax, K + 1>(packs, f);
  }
}

}  // namespace dtk::cuda::pack
