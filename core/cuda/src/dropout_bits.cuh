// dropout_bits.cuh (private to core/cuda) — whether DTK's counter-based dropout keeps element i of
// a tensor (dtk/cuda/dropout.hpp): the hash of its index in the drawn mask, for every kernel that
// applies a mask in its own pass (dropout.cu, and layer_norm.cu's residual branch). One hash per
// element: a kernel never stores or loads mask bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dtk/cuda/dropout.hpp"

namespace dtk::cuda::dropout_bits {

// splitmix64's output function of (seed, pair), as dtk/layers/dropout.cpp's mix().
__device__ __forceinline__ uint64_t mix(uint64_t seed, uint64_t pair) {
  uint64_t z = seed + (pair + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Element i of the tensor the mask applies to is element index(i) of the drawn mask; it is kept
// when its 32-bit uniform (the low half of its pair's word for an even index, the high for an odd
// one) is at least the threshold.
__device__ __forceinline__ bool kept(const DropoutBits& m, int64_t i) {
  const int64_t index = m.run_numel > 0 ? m.offset + i / m.run_numel * m.row_numel + i % m.run_numel : m.offset + i;
  const uint64_t word = mix(m.seed, static_cast<uint64_t>(index >> 1));
  const uint32_t u = static_cast<uint32_t>((index & 1) ? word >> 32 : word);
  return u >= m.threshold;
}

}  // namespace dtk::cuda::dropout_bits
