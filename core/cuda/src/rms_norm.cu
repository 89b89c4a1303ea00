// RMSNorm forward and backward, alone or after a residual add (dtk/cuda/rms_norm.hpp). Forward:
// one warp per row (with a residual, the sum written first), the sum of squares reduced over the
// warp, then the row written. Backward: a fixed grid of blocks, each
// taking rows blockIdx.x, blockIdx.x + gridDim.x, ...; per row one block reduction (the dot of
// the row's incoming gradient with it), then dx written and the weight gradient accumulated in
// shared memory, one column per thread (no atomics); a second kernel adds the blocks' partial
// weight gradients in block order, so the result is the same on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dtk/cuda/rms_norm.hpp"
#include "element.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;  // the forward's warps, a row each
constexpr int kBackwardBlocks = 1024;

using element::from_float;
using element::to_float;
using element::round_to;

// The sum of v over the block, in every thread (warp shuffles, then the warps' sums in order).
__device__ float block_sum(float v) {
  __shared__ float warps[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += warps[w];
  __syncthreads();  // `warps` is reused by the next call
  return total;
}

// A warp per row: the sum of squares reduced by shuffles alone (no block barrier), 8 rows a block.
// With a residual (res, sum not null) the row normalised is sum = T(x + res), written first; each
// lane re-reads only what it wrote itself.
template <class T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* x, const T* res, const T* w, int64_t rows,
                                                           int64_t hidden, float eps, T* sum, T* y, float* rstd) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp: its shuffles below stay full
  const int lane = static_cast<int>(threadIdx.x % 32);
  const T* xr = x + row * hidden;
  float squares = 0.0f;
  if (res) {
    const T* rr = res + row * hidden;
    T* sr = sum + row * hidden;
    for (int64_t j = lane; j < hidden; j += 32) {
      const float v = round_to<T>(to_float(xr[j]) + to_float(rr[j]));
      sr[j] = from_float<T>(v);
      squares += v * v;
    }
    xr = sr;
  } else {
    for (int64_t j = lane; j < hidden; j += 32) {
      const float v = to_float(xr[j]);
      squares += v * v;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
  const float r = rsqrtf(squares / static_cast<float>(hidden) + eps);
  if (lane == 0) rstd[row] = r;
  T* yr = y + row * hidden;
  for (int64_t j = lane; j < hidden; j += 32) yr[j] = from_float<T>(round_to<T>(to_float(xr[j]) * r) * to_float(w[j]));
}

// With dsum (the gradient of a residual add's sum, not null) dx is T(T(the norm's dx) + dsum), as
// autograd adds the two gradients of the sum.
template <class T>
__global__ void __launch_bounds__(kThreads) backward_kernel(const T* dy, const T* dsum, const T* x, const T* w,
                                                            int64_t rows, int64_t hidden, const float* rstd, T* dx,
                                                            float* partial) {
  extern __shared__ float dw[];  // this block's weight gradient, [hidden]
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) dw[j] = 0.0f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * hidden;
    const T* gr = dy + row * hidden;
    const float r = rstd[row];
    // The reference: dn = T(dy w) (the product's gradient in T), c = sum_j dn_j x_j.
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < hidden; j += kThreads)
      dot += round_to<T>(to_float(gr[j]) * to_float(w[j])) * to_float(xr[j]);
    const float c = block_sum(dot) / static_cast<float>(hidden);
    T* dxr = dx + row * hidden;
    for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
      const float xv = to_float(xr[j]), g = to_float(gr[j]);
      const float dn = round_to<T>(g * to_float(w[j]));
      // d/dx of x r with r = (mean x^2 + eps)^-1/2: r dn - x r^3 c.
      const float d = r * dn - xv * r * r * r * c;
      dxr[j] = dsum ? from_float<T>(round_to<T>(d) + to_float(dsum[row * hidden + j])) : from_float<T>(d);
      dw[j] += g * round_to<T>(xv * r);
    }
  }
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) partial[blockIdx.x * hidden + j] = dw[j];
}

__global__ void sum_partials(const float* partial, int blocks, int64_t hidden, float* dweight) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= hidden) return;
  float total = 0.0f;
  for (int b = 0; b < blocks; ++b) total += partial[b * hidden + j];
  dweight[j] = total;
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_shape(int64_t rows, int64_t hidden) {
  if (hidden <= 0 || hidden > kRmsNormMaxHidden || rows > 0x7fffffffLL)
    throw CudaError("rms_norm: hidden size " + std::to_string(hidden) + " or " + std::to_string(rows) +
                    " rows outside what the kernels take");
}

template <class T>
void forward(const void* x, const void* res, const void* w, int64_t rows, int64_t hidden, double eps, void* sum,
             void* y, float* rstd, StreamHandle stream) {
  forward_kernel<T><<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w), rows, hidden,
      static_cast<float>(eps), static_cast<T*>(sum), static_cast<T*>(y), rstd);
}

template <class T>
void backward(const void* dy, const void* dsum, const void* x, const void* w, int64_t rows, int64_t hidden,
              const float* rstd, void* dx, float* partial, float* dweight, StreamHandle stream) {
  const int blocks = static_cast<int>(rms_norm_backward_blocks(rows));
  const size_t shared = static_cast<size_t>(hidden) * sizeof(float);
  if (shared > 48 * 1024) cudaFuncSetAttribute(backward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(shared));
  backward_kernel<T><<<blocks, kThreads, shared, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(dsum),
                                                           static_cast<const T*>(x), static_cast<const T*>(w), rows,
                                                           hidden, rstd, static_cast<T*>(dx), partial);
  sum_partials<<<static_cast<unsigned>((hidden + kThreads - 1) / kThreads), kThreads, 0, stream>>>(partial, blocks,
                                                                                                   hidden, dweight);
}

}  // namespace

int64_t rms_norm_backward_blocks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(rows, kBackwardBlocks)); }

void add_rms_norm_forward(const void* x, const void* residual, const void* weight, ElementType type, int64_t rows,
                          int64_t hidden, double eps, void* sum, void* y, float* rstd, StreamHandle stream) {
  check_shape(rows, hidden);
  if (rows == 0) return;
  switch (type) {
    case ElementType::kFloat32: forward<float>(x, residual, weight, rows, hidden, eps, sum, y, rstd, stream); break;
    case ElementType::kBFloat16:
      forward<__nv_bfloat16>(x, residual, weight, rows, hidden, eps, sum, y, rstd, stream);
      break;
    case ElementType::kFloat16: forward<__half>(x, residual, weight, rows, hidden, eps, sum, y, rstd, stream); break;
  }
  check("rms_norm_forward");
}

void rms_norm_forward(const void* x, const void* weight, ElementType type, int64_t rows, int64_t hidden, double eps,
                      void* y, float* rstd, StreamHandle stream) {
  add_rms_norm_forward(x, nullptr, weight, type, rows, hidden, eps, nullptr, y, rstd, stream);
}

void add_rms_norm_backward(const void* dy, const void* dsum, const void* x, const void* weight, ElementType type,
                           int64_t rows, int64_t hidden, const float* rstd, void* dx, float* partial, float* dweight,
                           StreamHandle stream) {
  check_shape(rows, hidden);
  if (rows == 0) {
    cudaMemsetAsync(dweight, 0, static_cast<size_t>(hidden) * sizeof(float), stream);
    return;
  }
  switch (type) {
    case ElementType::kFloat32:
      backward<float>(dy, dsum, x, weight, rows, hidden, rstd, dx, partial, dweight, stream);
      break;
    case ElementType::kBFloat16:
      backward<__nv_bfloat16>(dy, dsum, x, weight, rows, hidden, rstd, dx, partial, dweight, stream);
      break;
    case ElementType::kFloat16:
      backward<__half>(dy, dsum, x, weight, rows, hidden, rstd, dx, partial, dweight, stream);
      break;
  }
  check("rms_norm_backward");
}

void rms_norm_backward(const void* dy, const void* x, const void* weight, ElementType type, int64_t rows,
                       int64_t hidden, const float* rstd, void* dx, float* partial, float* dweight,
                       StreamHandle stream) {
  add_rms_norm_backward(dy, nullptr, x, weight, type, rows, hidden, rstd, dx, partial, dweight, stream);
}

}  // namespace dtk::cuda
