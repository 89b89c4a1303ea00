// dtk/cuda/adamw.hpp — the fused multi-tensor AdamW update on the GPU (src/adamw.cu), what apex's
// FusedAdam (adam_w_mode) and torch.optim.AdamW(fused=True) do: one kernel launch updates many
// parameters, each element read and written once (p, g, m, v), in torch.optim.AdamW's order:
//   g = g * inv_grad_scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)
// with decay = 1 - lr * wd, step_size = lr / (1 - b1^t), inv_sqrt_bc2 = 1 / sqrt(1 - b2^t).
#pragma once

#include <cstdint>
#include <vector>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

struct AdamWScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, decay, step_size, inv_sqrt_bc2, eps, inv_grad_scale;
};

// One parameter: fp32 p, m, v on the device, contiguous; g fp32 or bf16 (grad_bf16).
struct AdamWTensor {
  float* p;
  const void* g;
  float* m;
  float* v;
  int64_t n;
};

// Queues the update of every tensor on `stream` (a few launches of up to 32 tensors each).
void fused_adamw(const std::vector<AdamWTensor>& tensors, bool grad_bf16, const AdamWScalars& k, StreamHandle stream);

}  // namespace dtk::cuda
