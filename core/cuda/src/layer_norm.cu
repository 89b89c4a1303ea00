// Residual add + LayerNorm forward and backward (dtk/cuda/layer_norm.hpp). Forward: one warp per
// row, eight rows a block: the row's sum written while its total is taken, then the squared
// deviations from the mean (two passes over the row, which the warp itself just wrote: cached),
// then the normalised row. Backward: a fixed grid of blocks, each taking rows blockIdx.x,
// blockIdx.x + gridDim.x, ...; per row one block reduction of two dots (the incoming gradient
// times the weight, and that times the normalised row), then dx written and the weight's and the
// bias's gradients accumulated in shared memory, one column per thread (no atomics); a second
// kernel adds the blocks' partial gradients in block order, so the result is the same on every
// run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dtk/cuda/layer_norm.hpp"
#include "element.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;  // the forward's warps, a row each
constexpr int kBackwardBlocks = 1024;

using element::from_float;
using element::round_to;
using element::to_float;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sums of a and b over the block, in every thread (warp shuffles, then the warps' sums in
// order).
__device__ float2 block_sum2(float a, float b) {
  __shared__ float2 warps[kThreads / 32];
  a = warp_sum(a);
  b = warp_sum(b);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = make_float2(a, b);
  __syncthreads();
  float2 total = make_float2(0.0f, 0.0f);
  for (int w = 0; w < kThreads / 32; ++w) {
    total.x += warps[w].x;
    total.y += warps[w].y;
  }
  __syncthreads();  // `warps` is reused by the next call
  return total;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* x, const T* res, const T* w, const T* b, int64_t rows, int hidden, float eps, T* sum, T* y,
                   float* mean_out, float* rstd_out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp: its shuffles below stay full
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t base = row * hidden;
  // h = T(x + r), as the add rounds it; each lane re-reads below only what it wrote itself.
  float total = 0.0f;
  for (int j = lane; j < hidden; j += 32) {
    const float v = round_to<T>(to_float(x[base + j]) + to_float(res[base + j]));
    sum[base + j] = from_float<T>(v);
    total += v;
  }
  const float mean = warp_sum(total) / static_cast<float>(hidden);
  float squares = 0.0f;
  for (int j = lane; j < hidden; j += 32) {
    const float d = to_float(sum[base + j]) - mean;
    squares += d * d;
  }
  const float rstd = rsqrtf(warp_sum(squares) / static_cast<float>(hidden) + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  for (int j = lane; j < hidden; j += 32)
    y[base + j] = from_float<T>((to_float(sum[base + j]) - mean) * rstd * to_float(w[j]) + to_float(b[j]));
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* dy, const T* dsum, const T* h, const T* w, int64_t rows, int hidden, const float* mean,
                    const float* rstd, T* dx, float* partial) {
  extern __shared__ float grads[];  // this block's weight gradient [hidden], then its bias gradient [hidden]
  float* dw = grads;
  float* db = grads + hidden;
  // Each thread owns columns threadIdx.x, threadIdx.x + kThreads, ... here and below: no barrier.
  for (int j = threadIdx.x; j < hidden; j += kThreads) dw[j] = db[j] = 0.0f;
  const float inv_n = 1.0f / static_cast<float>(hidden);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * hidden;
    const float m = mean[row], r = rstd[row];
    float gw_sum = 0.0f, gwx_sum = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += kThreads) {
      const float gw = to_float(dy[base + j]) * to_float(w[j]);
      gw_sum += gw;
      gwx_sum += gw * ((to_float(h[base + j]) - m) * r);
    }
    const float2 dots = block_sum2(gw_sum, gwx_sum);
    const float a = dots.x * inv_n, c = dots.y * inv_n;
    for (int j = threadIdx.x; j < hidden; j += kThreads) {
      const float g = to_float(dy[base + j]);
      const float xhat = (to_float(h[base + j]) - m) * r;
      // The norm's input gradient, rounded to T as the norm's backward writes it, plus the
      // residual stream's gradient (autograd's add of the two, rounded again).
      const float d = r * (g * to_float(w[j]) - a - xhat * c);
      dx[base + j] = dsum ? from_float<T>(round_to<T>(d) + to_float(dsum[base + j])) : from_float<T>(d);
      dw[j] += g * xhat;
      db[j] += g;
    }
  }
  float* pw = partial + static_cast<int64_t>(blockIdx.x) * hidden;
  float* pb = partial + static_cast<int64_t>(gridDim.x + blockIdx.x) * hidden;
  for (int j = threadIdx.x; j < hidden; j += kThreads) {
    pw[j] = dw[j];
    pb[j] = db[j];
  }
}

// dweight_j = sum_b partial[0][b][j], dbias_j = sum_b partial[1][b][j], b in order.
__global__ void sum_partials(const float* partial, int blocks, int hidden, float* dweight, float* dbias) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= hidden) return;
  float tw = 0.0f, tb = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    tw += partial[static_cast<int64_t>(b) * hidden + j];
    tb += partial[static_cast<int64_t>(blocks + b) * hidden + j];
  }
  dweight[j] = tw;
  dbias[j] = tb;
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_shape(int64_t rows, int64_t hidden) {
  if (hidden <= 0 || hidden > kLayerNormMaxHidden || rows < 0 || rows > 0x7fffffffLL)
    throw CudaError("add_layer_norm: hidden size " + std::to_string(hidden) + " or " + std::to_string(rows) +
                    " rows outside what the kernels take");
}

template <class T>
void forward(const void* x, const void* res, const void* w, const void* b, int64_t rows, int64_t hidden, double eps,
             void* sum, void* y, float* mean, float* rstd, StreamHandle stream) {
  forward_kernel<T><<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w), static_cast<const T*>(b), rows,
      static_cast<int>(hidden), static_cast<float>(eps), static_cast<T*>(sum), static_cast<T*>(y), mean, rstd);
}

template <class T>
void backward(const void* dy, const void* dsum, const void* h, const void* w, int64_t rows, int64_t hidden,
              const float* mean, const float* rstd, void* dx, float* partial, float* dweight, float* dbias,
              StreamHandle stream) {
  const int blocks = static_cast<int>(layer_norm_backward_blocks(rows));
  const size_t shared = 2 * static_cast<size_t>(hidden) * sizeof(float);
  if (shared > 48 * 1024)
    cudaFuncSetAttribute(backward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  backward_kernel<T><<<blocks, kThreads, shared, stream>>>(
      static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(h), static_cast<const T*>(w), rows,
      static_cast<int>(hidden), mean, rstd, static_cast<T*>(dx), partial);
  sum_partials<<<static_cast<unsigned>((hidden + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      partial, blocks, static_cast<int>(hidden), dweight, dbias);
}

}  // namespace

int64_t layer_norm_backward_blocks(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, kBackwardBlocks));
}

void add_layer_norm_forward(const void* x, const void* residual, const void* weight, const void* bias, ElementType type,
                            int64_t rows, int64_t hidden, double eps, void* sum, void* y, float* mean, float* rstd,
                            StreamHandle stream) {
  check_shape(rows, hidden);
  if (rows == 0) return;
  switch (type) {
    case ElementType::kFloat32:
      forward<float>(x, residual, weight, bias, rows, hidden, eps, sum, y, mean, rstd, stream);
      break;
    case ElementType::kBFloat16:
      forward<__nv_bfloat16>(x, residual, weight, bias, rows, hidden, eps, sum, y, mean, rstd, stream);
      break;
    case ElementType::kFloat16:
      forward<__half>(x, residual, weight, bias, rows, hidden, eps, sum, y, mean, rstd, stream);
      break;
  }
  check("add_layer_norm_forward");
}

void add_layer_norm_backward(const void* dy, const void* dsum, const void* sum, const void* weight, ElementType type,
                             int64_t rows, int64_t hidden, const float* mean, const float* rstd, void* dx,
                             float* partial, float* dweight, float* dbias, StreamHandle stream) {
  check_shape(rows, hidden);
  if (rows == 0) {
    cudaMemsetAsync(dweight, 0, static_cast<size_t>(hidden) * sizeof(float), stream);
    cudaMemsetAsync(dbias, 0, static_cast<size_t>(hidden) * sizeof(float), stream);
    return;
  }
  switch (type) {
    case ElementType::kFloat32:
      backward<float>(dy, dsum, sum, weight, rows, hidden, mean, rstd, dx, partial, dweight, dbias, stream);
      break;
    case ElementType::kBFloat16:
      backward<__nv_bfloat16>(dy, dsum, sum, weight, rows, hidden, mean, rstd, dx, partial, dweight, dbias, stream);
      break;
    case ElementType::kFloat16:
      backward<__half>(dy, dsum, sum, weight, rows, hidden, mean, rstd, dx, partial, dweight, dbias, stream);
      break;
  }
  check("add_layer_norm_backward");
}

}  // namespace dtk::cuda
