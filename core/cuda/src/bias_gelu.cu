// Bias + GELU forward and backward (dtk/cuda/bias_gelu.hpp). Both kernels run on a grid of
// (column tiles of kThreads, row groups): thread t of block (i, g) owns column i * kThreads + t and
// walks rows g, g + G, ... (G = gridDim.y), so each row's columns are read by consecutive threads
// (coalesced) and no index is divided. The backward keeps its column's bias gradient in a register
// and writes one partial sum per row group; a second kernel adds the groups in order. With 2-byte
// elements, columns a multiple of 8 and aligned pointers (pack.cuh) a thread owns a pack of 8
// columns instead, and loads kUnroll rows' packs before it writes any (the bytes in flight that
// the memory's rate needs); the same arithmetic, the rows' sums in the same order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dtk/cuda/bias_gelu.hpp"
#include "element.cuh"
#include "launch.cuh"
#include "pack.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kForwardGroups = 1024;  // row groups of the forward (at most; fewer for few rows)
constexpr int kBackwardGroups = 256;  // and of the backward: its partial sums' rows
constexpr int kUnroll = 4;            // rows a packed thread loads before it writes

using element::from_float;
using element::round_to;
using element::to_float;

constexpr float kSqrtHalf = 0.70710678118654752440f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286535588f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

__device__ __forceinline__ float gelu(float h, bool tanh_form) {
  if (tanh_form) return 0.5f * h * (1.0f + tanhf(kSqrt2OverPi * (h + kKappa * h * h * h)));
  return 0.5f * h * (1.0f + erff(h * kSqrtHalf));
}

// d gelu(h) / dh.
__device__ __forceinline__ float gelu_grad(float h, bool tanh_form) {
  if (tanh_form) {
    const float t = tanhf(kSqrt2OverPi * (h + kKappa * h * h * h));
    return 0.5f * (1.0f + t) + 0.5f * h * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kKappa * h * h);
  }
  return 0.5f * (1.0f + erff(h * kSqrtHalf)) + h * expf(-0.5f * h * h) * kInvSqrt2Pi;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* x, const T* b, int64_t rows, int cols, bool tanh_form, T* y) {
  const int col = blockIdx.x * kThreads + threadIdx.x;
  if (col >= cols) return;
  const float bias = to_float(b[col]);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    y[i] = from_float<T>(gelu(round_to<T>(to_float(x[i]) + bias), tanh_form));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) backward_kernel(const T* dy, const T* x, const T* b, int64_t rows, int cols,
                                                            bool tanh_form, T* dx, float* partial) {
  const int col = blockIdx.x * kThreads + threadIdx.x;
  if (col >= cols) return;
  const float bias = to_float(b[col]);
  float db = 0.0f;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t i = row * cols + col;
    const float h = round_to<T>(to_float(x[i]) + bias);
    const float d = round_to<T>(to_float(dy[i]) * gelu_grad(h, tanh_form));
    dx[i] = from_float<T>(d);
    db += d;
  }
  partial[static_cast<int64_t>(blockIdx.y) * cols + col] = db;
}

// The packed kernels: thread t of block (i, g) owns columns (i * kThreads + t) * 8 .. + 7, rows g,
// g + G, ... as above, kUnroll rows' loads issued before their stores.
template <class T>
__global__ void __launch_bounds__(kThreads)
    forward_packed_kernel(const T* x, const T* b, int64_t rows, int cols, bool tanh_form, T* y) {
  const int col = (blockIdx.x * kThreads + threadIdx.x) * pack::kN;
  if (col >= cols) return;
  const pack::Pack<T> bias = pack::load(b + col);
  const int64_t groups = gridDim.y;
  for (int64_t row0 = blockIdx.y; row0 < rows; row0 += groups * kUnroll) {
    pack::Pack<T> in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (row0 + u * groups < rows) in[u] = pack::load(x + (row0 + u * groups) * cols + col);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = row0 + u * groups;
      if (row >= rows) break;
      pack::Pack<T> out;
#pragma unroll
      for (int e = 0; e < pack::kN; ++e) out.set(e, gelu(round_to<T>(in[u].get(e) + bias.get(e)), tanh_form));
      pack::store(y + row * cols + col, out);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) backward_packed_kernel(const T* dy, const T* x, const T* b, int64_t rows,
                                                                   int cols, bool tanh_form, T* dx, float* partial) {
  const int col = (blockIdx.x * kThreads + threadIdx.x) * pack::kN;
  if (col >= cols) return;
  const pack::Pack<T> bias = pack::load(b + col);
  float db[pack::kN] = {};
  const int64_t groups = gridDim.y;
  for (int64_t row0 = blockIdx.y; row0 < rows; row0 += groups * kUnroll) {
    pack::Pack<T> xs[kUnroll], gs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = (row0 + u * groups) * cols + col;
      if (row0 + u * groups < rows) xs[u] = pack::load(x + at), gs[u] = pack::load(dy + at);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = row0 + u * groups;
      if (row >= rows) break;
      pack::Pack<T> out;
#pragma unroll
      for (int e = 0; e < pack::kN; ++e) {
        const float h = round_to<T>(xs[u].get(e) + bias.get(e));
        const float d = round_to<T>(gs[u].get(e) * gelu_grad(h, tanh_form));
        out.set(e, d);
        db[e] += d;
      }
      pack::store(dx + row * cols + col, out);
    }
  }
  float* p = partial + static_cast<int64_t>(blockIdx.y) * cols + col;
#pragma unroll
  for (int e = 0; e < pack::kN; ++e) p[e] = db[e];
}

// dbias_j = sum_g partial[g][j], g in order.
__global__ void sum_partials(const float* partial, int groups, int cols, float* dbias) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float total = 0.0f;
  for (int g = 0; g < groups; ++g) total += partial[static_cast<int64_t>(g) * cols + j];
  dbias[j] = total;
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_shape(int64_t rows, int64_t cols) {
  if (cols <= 0 || cols > 0x7fffffffLL - kThreads || rows < 0)
    throw CudaError("bias_gelu: " + std::to_string(rows) + " x " + std::to_string(cols) +
                    " outside what the kernels take");
}

unsigned column_tiles(int64_t cols) { return static_cast<unsigned>((cols + kThreads - 1) / kThreads); }
// Column tiles of the packed kernels: kThreads packs of 8 columns a block.
unsigned pack_tiles(int64_t cols) { return column_tiles((cols + pack::kN - 1) / pack::kN); }

template <class T>
void forward(const void* x, const void* b, int64_t rows, int64_t cols, bool tanh_form, void* y, StreamHandle stream) {
  const unsigned groups = static_cast<unsigned>(std::min<int64_t>(rows, kForwardGroups));
  if constexpr (sizeof(T) == 2) {
    if (pack::packable(sizeof(T), cols, x, b, y)) {
      launch_kernel(forward_packed_kernel<T>, dim3(pack_tiles(cols), groups), kThreads, 0, stream,
                    static_cast<const T*>(x), static_cast<const T*>(b), rows, static_cast<int>(cols), tanh_form,
                    static_cast<T*>(y));
      return;
    }
  }
  launch_kernel(forward_kernel<T>, dim3(column_tiles(cols), groups), kThreads, 0, stream, static_cast<const T*>(x),
                static_cast<const T*>(b), rows, static_cast<int>(cols), tanh_form, static_cast<T*>(y));
}

template <class T>
void backward(const void* dy, const void* x, const void* b, int64_t rows, int64_t cols, bool tanh_form, void* dx,
              float* partial, float* dbias, StreamHandle stream) {
  const int groups = static_cast<int>(bias_gelu_backward_groups(rows));
  bool packed = false;
  if constexpr (sizeof(T) == 2) {
    packed = pack::packable(sizeof(T), cols, dy, x, b, dx);
    if (packed)
      launch_kernel(backward_packed_kernel<T>, dim3(pack_tiles(cols), static_cast<unsigned>(groups)), kThreads, 0,
                    stream, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(b), rows,
                    static_cast<int>(cols), tanh_form, static_cast<T*>(dx), partial);
  }
  if (!packed)
    launch_kernel(backward_kernel<T>, dim3(column_tiles(cols), static_cast<unsigned>(groups)), kThreads, 0, stream,
                  static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(b), rows,
                  static_cast<int>(cols), tanh_form, static_cast<T*>(dx), partial);
  launch_kernel(sum_partials, column_tiles(cols), kThreads, 0, stream, partial, groups, static_cast<int>(cols), dbias);
}

}  // namespace

int64_t bias_gelu_backward_groups(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, kBackwardGroups));
}

void bias_gelu_forward(const void* x, const void* bias, ElementType type, int64_t rows, int64_t cols, bool tanh,
                       void* y, StreamHandle stream) {
  check_shape(rows, cols);
  if (rows == 0) return;
  element::dispatch(type, [&](auto t) { forward<decltype(t)>(x, bias, rows, cols, tanh, y, stream); });
  check("bias_gelu_forward");
}

void bias_gelu_backward(const void* dy, const void* x, const void* bias, ElementType type, int64_t rows, int64_t cols,
                        bool tanh, void* dx, float* partial, float* dbias, StreamHandle stream) {
  check_shape(rows, cols);
  if (rows == 0) {
    cudaMemsetAsync(dbias, 0, static_cast<size_t>(cols) * sizeof(float), stream);
    return;
  }
  element::dispatch(type,
                    [&](auto t) { backward<decltype(t)>(dy, x, bias, rows, cols, tanh, dx, partial, dbias, stream); });
  check("bias_gelu_backward");
}

}  // namespace dtk::cuda
