// simt.hpp — core/cuda/src/warp_mma.cuh's instructions on the CPU (shim/simt_runtime.hpp's
// threads): a kernel source compiled with -DDTK_SIMT_EMULATION='"simt.hpp"' takes these instead
// of the PTX. Each follows the PTX ISA's definition (cp.async, ldmatrix, mma.m16n8k16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simt_runtime.hpp"

namespace dtk::cuda::warp {

// Where copies land: when a wait_copies that covers their group runs, as late as cp.async allows
// (a read before its wait sees the NaN bytes shared memory starts with), or at once, as early as
// it allows (a copy into a buffer another warp still reads overwrites it under that warp).
inline bool copies_land_at_once = false;

inline void copy_async(void* dst, const void* src, int size, bool valid) {
  const auto land = [dst, src, size, valid] {
    if (valid)
      std::memcpy(dst, src, size);
    else
      std::memset(dst, 0, size);
  };
  if (copies_land_at_once)
    land();
  else
    simt::self.open.push_back(land);
}
inline void copy16(void* dst, const void* src, bool valid) { copy_async(dst, src, 16, valid); }
inline void copy4(void* dst, const void* src, bool valid) { copy_async(dst, src, 4, valid); }
inline void commit_copies() {
  simt::self.groups.push_back(std::move(simt::self.open));
  simt::self.open.clear();
}
template <int pending>
void wait_copies() {
  while (simt::self.groups.size() > static_cast<size_t>(pending)) {
    for (auto& copy : simt::self.groups.front()) copy();
    simt::self.groups.pop_front();
  }
}

namespace detail {

inline uint16_t element(const void* row, int column) {
  uint16_t x;
  std::memcpy(&x, static_cast<const unsigned char*>(row) + 2 * column, sizeof x);
  return x;
}
inline uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t{lo} | uint32_t{hi} << 16; }

// Lanes 8m..8m+7 give the rows of matrix m; lane l receives row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 of each (transposed: column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1).
inline void load(uint32_t (&r)[4], const void* row, bool transposed) {
  simt::Warp& w = simt::warp();
  const int lane = simt::self.lane;
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0) ++simt::faults;
  w.rows[lane] = row;
  w.meet.arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    const void* const* rows = w.rows + 8 * m;
    const int a = lane / 4, b = 2 * (lane % 4);
    r[m] = transposed ? pair(element(rows[b], a), element(rows[b + 1], a))
                      : pair(element(rows[a], b), element(rows[a], b + 1));
  }
  w.meet.arrive_and_wait();
}

template <class T>
float value(uint16_t bits) {
  T x;
  std::memcpy(&x, &bits, sizeof x);
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return __half2float(x);
}

}  // namespace detail

inline void load_matrices(uint32_t (&r)[4], const void* row) { detail::load(r, row, false); }
inline void load_matrices_transposed(uint32_t (&r)[4], const void* row) { detail::load(r, row, true); }

// c (16 x 8) += a (16 x 16) b (16 x 8) over the warp's fragments: a's (row, k) at lane
// (row % 8) 4 + (k % 8) / 2, register row / 8 + 2 (k / 8); b's (k, n) at lane n 4 + (k % 8) / 2,
// register k / 8; the low half of a register holds the even column (a) or row (b).
template <class T>
void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  simt::Warp& w = simt::warp();
  const int lane = simt::self.lane;
  std::memcpy(w.a[lane], a, sizeof a);
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.meet.arrive_and_wait();
  const auto half = [](uint32_t reg, int odd) { return static_cast<uint16_t>(odd ? reg >> 16 : reg & 0xffffu); };
  const auto A = [&](int row, int k) {
    return detail::value<T>(half(w.a[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2));
  };
  const auto B = [&](int k, int n) { return detail::value<T>(half(w.b[n * 4 + (k % 8) / 2][k / 8], k % 2)); };
  const int g = lane / 4, t = lane % 4;
  float d[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), column = 2 * t + e % 2;
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, column);
    d[e] = acc;
  }
  w.meet.arrive_and_wait();
  std::memcpy(c, d, sizeof d);
}

}  // namespace dtk::cuda::warp
