// dtk/cuda/dropout.hpp — DTK's counter-based dropout (dtk/layers/dropout.hpp) in one pass on a
// GPU (src/dropout.cu), for dtk::layers::apply_dropout on a GPU tensor. Element i of a tensor is
// element index(i) of the drawn mask (offset + i, or offset + (i / run_numel) * row_numel +
// i % run_numel for a strided view); it is kept when its 32-bit uniform, the low (even index) or
// high (odd) half of splitmix64(seed, index / 2), is at least `threshold`. Kept elements are
// scaled by `scale` in fp32 and rounded once to T, dropped ones are zero: the CPU's arithmetic
// (masked_scale), and value for value that of the ops a GPU ran before, (x * keep) * scale (which
// wrote -0 for a dropped negative element and NaN for a dropped infinity), which made the bits
// with some fifteen passes over int64 tensors.
#pragma once

#include <cstdint>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// One mask as dtk::layers::DropoutMask holds it, the threshold and scale made on the host.
struct DropoutBits {
  uint64_t seed = 0;
  // Where set, the seed is read from this device address at the kernel's start instead: a step
  // recorded into a CUDA graph, whose host draws each replay's seeds into device memory.
  const uint64_t* seed_at = nullptr;
  uint32_t threshold = 0;  // round(p * 2^32), at most 2^32 - 1
  float scale = 1.0f;      // 1 / (1 - p), rounded to fp32
  int64_t offset = 0, row_numel = 0, run_numel = 0;
};

// out[i] = kept(i) ? T(x[i] * scale) : 0 for i < n; x and out contiguous, of `type` (fp32, bf16 or
// fp16); out may be x.
void dropout_apply(const void* x, ElementType type, int64_t n, const DropoutBits& mask, void* out,
                   StreamHandle stream);

// out[i] = fp32(low + u_i * (high - low) / 2^32) for i < n, u_i element i's 32-bit uniform under
// `draw` (its threshold and scale unused), the product and sum in fp64 without contraction:
// dtk::layers::uniform_noise_on's noise, value for value, in one pass (Megatron's router input
// jitter, dtk/layers/moe.hpp).
void uniform_noise(int64_t n, const DropoutBits& draw, double low, double high, float* out, StreamHandle stream);

}  // namespace dtk::cuda
