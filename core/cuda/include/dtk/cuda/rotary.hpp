// dtk/cuda/rotary.hpp — rotary position embeddings applied in one kernel each way
// (src/rotary.cu), for dtk::layers::apply_rotary (dtk/layers/rotary.hpp) on a GPU. The
// arithmetic is Megatron's non-interleaved rotary as LibTorch ops compute it in fp32 (the
// reference): for the first `dim` channels of each head,
//   out_i = T(x_i cos_i + r_i sin_i),  r_i = -x_{i + dim/2} (i < dim/2), x_{i - dim/2} (else),
// each product and the sum rounded to fp32 as the ops round them; the other channels pass
// through. The ops make an fp32 copy, a concatenation and five more passes each way.
#pragma once

#include <cstdint>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// x: [b, s, heads, head_dim] of `type` with element strides {stride_b, stride_s, stride_h, 1};
// cos, sin: fp32 [b, s, dim] contiguous; out: [b, s, heads, head_dim] contiguous, of `type`.
// backward: the same with dy in place of x (contiguous: strides s*heads*hd, heads*hd, hd) and dx
// out: dx_i = T(dy_i cos_i + q_i), q_i = dy_{i + dim/2} sin_{i + dim/2} (i < dim/2),
// -dy_{i - dim/2} sin_{i - dim/2} (else).
struct RotaryShape {
  int64_t batch, seq, heads, head_dim, dim;
  int64_t stride_b, stride_s, stride_h;
};

void rotary_forward(const void* x, ElementType type, const RotaryShape& shape, const float* cos, const float* sin,
                    void* out, StreamHandle stream);
void rotary_backward(const void* dy, ElementType type, const RotaryShape& shape, const float* cos, const float* sin,
                     void* dx, StreamHandle stream);

}  // namespace dtk::cuda
