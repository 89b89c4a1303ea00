// dtk/cuda/swiglu.hpp — SwiGLU's elementwise half (llama's MLP: silu(gate) * up, both products
// of the MLP's input), forward and backward in one kernel each (src/swiglu.cu), for
// dtk::layers::swiglu (dtk/layers/activations.hpp) on a GPU. The arithmetic is that of the
// LibTorch ops it replaces (ATen's SiLU and product compute in fp32 and round to T, the inputs'
// type), sigma(g) = 1 / (1 + exp(-g)):
//   s = T(g / (1 + exp(-g))),  y = T(s u)
//   du = T(dy s),  dg = T(T(dy u) sigma(g) (1 + g (1 - sigma(g))))
// where the ops write s forward (and keep it for the backward) and take three passes backward.
#pragma once

#include <cstdint>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

// gate, up, y: n elements each, contiguous, of `type` (fp32, bf16 or fp16).
void swiglu_forward(const void* gate, const void* up, ElementType type, int64_t n, void* y, StreamHandle stream);

// dy, gate, up, dgate, dup: n elements each of `type`.
void swiglu_backward(const void* dy, const void* gate, const void* up, ElementType type, int64_t n, void* dgate,
                     void* dup, StreamHandle stream);

}  // namespace dtk::cuda
