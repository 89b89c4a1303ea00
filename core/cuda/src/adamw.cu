// The fused multi-tensor AdamW kernel (dtk/cuda/adamw.hpp). A launch carries up to kMaxTensors
// tensors by value in its parameters (no metadata copy); every block updates one chunk of
// kChunk elements of one tensor, found from the prefix sums of the blocks per tensor.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "dtk/cuda/adamw.hpp"
#include "launch.cuh"

namespace dtk::cuda {
namespace {

constexpr int kMaxTensors = 32;
constexpr int kThreads = 512;
constexpr int64_t kChunk = 16384;  // elements per block

struct Launch {
  float* p[kMaxTensors];
  const void* g[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  int64_t n[kMaxTensors];
  int first_block[kMaxTensors + 1];  // blocks of tensor i: [first_block[i], first_block[i + 1])
  int count;
};

__device__ __forceinline__ float load_grad(const void* g, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(g)[i]) : static_cast<const float*>(g)[i];
}

template <bool kBf16>
__global__ void adamw_kernel(Launch l, AdamWScalars k) {
  const int block = static_cast<int>(blockIdx.x);
  int t = 0;
  while (t + 1 < l.count && l.first_block[t + 1] <= block) ++t;
  const int64_t begin = static_cast<int64_t>(block - l.first_block[t]) * kChunk;
  const int64_t end = min(begin + kChunk, l.n[t]);
  float* __restrict__ p = l.p[t];
  float* __restrict__ m = l.m[t];
  float* __restrict__ v = l.v[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float grad = load_grad(l.g[t], i, kBf16) * k.inv_grad_scale;
    const float mi = k.beta1 * m[i] + k.one_minus_beta1 * grad;
    const float vi = k.beta2 * v[i] + k.one_minus_beta2 * grad * grad;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * k.inv_sqrt_bc2 + k.eps;
    p[i] = p[i] * k.decay - k.step_size * mi / denom;
  }
}

void launch(const Launch& l, int blocks, bool bf16, const AdamWScalars& k, StreamHandle stream) {
  if (blocks == 0) return;
  launch_kernel(bf16 ? adamw_kernel<true> : adamw_kernel<false>, blocks, kThreads, 0, stream, l, k);
  check(cudaGetLastError(), "fused_adamw: kernel launch");
}

}  // namespace

void fused_adamw(const std::vector<AdamWTensor>& tensors, bool grad_bf16, const AdamWScalars& k, StreamHandle stream) {
  Launch l{};
  int blocks = 0;
  // Grid size stays far below CUDA's limit: a launch is flushed at 65536 blocks (1G elements).
  constexpr int kMaxBlocks = 65536;
  for (const AdamWTensor& t : tensors) {
    if (t.n <= 0) continue;
    const int64_t need = (t.n + kChunk - 1) / kChunk;
    if (l.count == kMaxTensors || (l.count > 0 && blocks + need > kMaxBlocks)) {
      l.first_block[l.count] = blocks;
      launch(l, blocks, grad_bf16, k, stream);
      l = Launch{};
      blocks = 0;
    }
    // A tensor larger than one launch's blocks goes alone, in pieces.
    for (int64_t off = 0; off < t.n; off += int64_t{kMaxBlocks} * kChunk) {
      const int64_t n = std::min<int64_t>(t.n - off, int64_t{kMaxBlocks} * kChunk);
      const int64_t nb = (n + kChunk - 1) / kChunk;
      if (l.count == kMaxTensors || blocks + nb > kMaxBlocks) {
        l.first_block[l.count] = blocks;
        launch(l, blocks, grad_bf16, k, stream);
        l = Launch{};
        blocks = 0;
      }
      const int i = l.count++;
      l.p[i] = t.p + off;
      l.g[i] = grad_bf16 ? static_cast<const void*>(static_cast<const __nv_bfloat16*>(t.g) + off)
                         : static_cast<const void*>(static_cast<const float*>(t.g) + off);
      l.m[i] = t.m + off;
      l.v[i] = t.v + off;
      l.n[i] = n;
      l.first_block[i] = blocks;
      blocks += static_cast<int>(nb);
    }
  }
  l.first_block[l.count] = blocks;
  launch(l, blocks, grad_bf16, k, stream);
}

}  // namespace dtk::cuda
