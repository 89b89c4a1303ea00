// The CPU emulation's stand-in for <cuda_fp16.h>: fp16 as its bits, through the compiler's
// _Float16 (rounded to nearest even).
#pragma once
#include <cstdint>
#include <cstring>

#include "simt_runtime.hpp"

struct __half {
  uint16_t bits;
};
inline float __half2float(__half v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, sizeof h);
  return static_cast<float>(h);
}
inline __half __float2half(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  __half r;
  std::memcpy(&r.bits, &h, sizeof h);
  return r;
}
