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

// The mask with its seed in place: its constant, or (a step recorded into a CUDA graph) the value
// the host put at seed_at before this replay. Once, at a kernel's start.
__device__ __forceinline__ DropoutBits resolved(DropoutBits m) {
  if (m.seed_at) m.seed = *m.seed_at;
  return m;
}

// The index in the drawn mask of element i of the tensor the mask applies to
// (dtk::layers::DropoutMask::index). A kernel working by rows whose mask runs hold whole rows
// (run_numel a multiple of the row) takes it once per row: element j of the row is then at
// mask_index(row's first) + j, with no division per element.
__device__ __forceinline__ int64_t mask_index(const DropoutBits& m, int64_t i) {
  return m.run_numel > 0 ? m.offset + i / m.run_numel * m.row_numel + i % m.run_numel : m.offset + i;
}

// The 32-bit uniform of element `index` of the drawn mask: the low half of its pair's word for an
// even index, the high for an odd one.
__device__ __forceinline__ uint32_t uniform_at(const DropoutBits& m, int64_t index) {
  const uint64_t word = mix(m.seed, static_cast<uint64_t>(index >> 1));
  return static_cast<uint32_t>((index & 1) ? word >> 32 : word);
}

// Whether element `index` of the drawn mask is kept: its uniform is at least the threshold.
__device__ __forceinline__ bool kept_at(const DropoutBits& m, int64_t index) {
  return uniform_at(m, index) >= m.threshold;
}

// Whether element i of the tensor the mask applies to is kept.
__device__ __forceinline__ bool kept(const DropoutBits& m, int64_t i) { return kept_at(m, mask_index(m, i)); }

}  // namespace dtk::cuda::dropout_bits
