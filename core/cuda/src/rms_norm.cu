// RMSNorm forward and backward, alone or after a residual add (dtk/cuda/rms_norm.hpp). Forward:
// one warp per row (with a residual, the sum written first), the sum of squares reduced over the
// warp, then the row written. Backward: a warp per row too, where a row fits in the lanes'
// registers (hidden <= 1024): the row's incoming gradient and input read once into registers, the
// dot reduced over the warp, dx written, and each warp's weight gradient added up in its own row
// of shared memory over its rows; the block's warps then add theirs in warp order into the
// block's partial row. Wider rows: a block per row (one block reduction per row, the weight
// gradient in shared memory, one column per thread). Either way no atomics: a second kernel adds
// the blocks' partial weight gradients in a fixed order, so the result is the same on every run.
// With 2-byte elements, hidden a multiple of 8 and aligned pointers (pack.cuh) both directions'
// warp kernels load a lane's columns as packs of 8 (columns 8 (lane + 32 v) .. + 7), every load of
// a row issued before its first store: the same arithmetic, the row's sums in another order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dtk/cuda/rms_norm.hpp"
#include "element.cuh"
#include "launch.cuh"
#include "norm_backward.cuh"
#include "pack.cuh"

namespace dtk::cuda {
namespace {

using norm_backward::add_warps_packed_rows;
using norm_backward::kThreads;
using norm_backward::kWarps;
using norm_backward::packed_slot;
using norm_backward::warp_sum;
constexpr int kRowsPerBlock = kWarps;  // the forward's warps, a row each

using element::from_float;
using element::to_float;
using element::round_to;

// The sum of v over the block, in every thread (warp shuffles, then the warps' sums in order).
__device__ float block_sum(float v) {
  __shared__ float warps[kThreads / 32];
  v = warp_sum(v);
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
  squares = warp_sum(squares);
  const float r = rsqrtf(squares / static_cast<float>(hidden) + eps);
  if (lane == 0) rstd[row] = r;
  T* yr = y + row * hidden;
  for (int64_t j = lane; j < hidden; j += 32) yr[j] = from_float<T>(round_to<T>(to_float(xr[j]) * r) * to_float(w[j]));
}

// One column's input gradient from the row's r and c = mean_j(dn_j x_j), dn = T(dy w) (the
// reference's product gradient in T): d/dx of x r with r = (mean x^2 + eps)^-1/2 is r dn - x r^3 c.
// With dsum (the gradient of a residual add's sum) dx is T(T(the norm's dx) + dsum), as autograd
// adds the two gradients of the sum.
template <class T>
__device__ __forceinline__ T input_gradient(float g, float xv, float wv, float r, float c, const T* dsum, int64_t at) {
  const float d = r * round_to<T>(g * wv) - xv * r * r * r * c;
  return dsum ? from_float<T>(round_to<T>(d) + to_float(dsum[at])) : from_float<T>(d);
}

// A warp per row, the row in registers: kColumns columns per lane (lane + 32 i), rows
// blockIdx.x * kWarps + warp, then gridDim.x * kWarps further on. Each warp adds its rows' weight
// gradient into its own row of shared memory (a lane, its own columns: no barrier, and registers
// left for the loads in flight); at the end the block adds its warps' rows in warp order into
// partial, the block's weight gradient row.
template <class T, int kColumns>
__global__ void __launch_bounds__(kThreads, norm_backward::min_blocks_per_sm<kColumns, 32>())
    backward_warp_kernel(const T* dy, const T* dsum, const T* x, const T* w, int64_t rows, int hidden,
                         const float* rstd, T* dx, float* partial) {
  __shared__ float warps_dw[kWarps][kColumns * 32];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  float* dw = warps_dw[warp];
#pragma unroll
  for (int i = 0; i < kColumns; ++i) dw[lane + 32 * i] = 0.0f;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * hidden;
    float xv[kColumns], gv[kColumns];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kColumns; ++i) {
      const int j = lane + 32 * i;
      xv[i] = gv[i] = 0.0f;
      if (j < hidden) {
        xv[i] = to_float(x[base + j]);
        gv[i] = to_float(dy[base + j]);
        dot += round_to<T>(gv[i] * to_float(w[j])) * xv[i];
      }
    }
    const float c = warp_sum(dot) / static_cast<float>(hidden);
    const float r = rstd[row];
#pragma unroll
    for (int i = 0; i < kColumns; ++i) {
      const int j = lane + 32 * i;
      if (j < hidden) {
        dx[base + j] = input_gradient<T>(gv[i], xv[i], to_float(w[j]), r, c, dsum, base + j);
        dw[j] += gv[i] * round_to<T>(xv[i] * r);
      }
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < hidden; j += kThreads) {
    float total = 0.0f;
    for (int k = 0; k < kWarps; ++k) total += warps_dw[k][j];
    partial[static_cast<int64_t>(blockIdx.x) * hidden + j] = total;
  }
}

// A block per row (rows too wide for the lanes' registers): rows blockIdx.x, blockIdx.x +
// gridDim.x, ...; per row one block reduction, then dx written and the weight gradient
// accumulated in shared memory, one column per thread.
template <class T>
__global__ void __launch_bounds__(kThreads)
    backward_block_kernel(const T* dy, const T* dsum, const T* x, const T* w, int64_t rows, int64_t hidden,
                          const float* rstd, T* dx, float* partial) {
  DTK_DYNAMIC_SHARED(float, dw);  // this block's weight gradient, [hidden]
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) dw[j] = 0.0f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * hidden;
    const T* gr = dy + row * hidden;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < hidden; j += kThreads)
      dot += round_to<T>(to_float(gr[j]) * to_float(w[j])) * to_float(xr[j]);
    const float c = block_sum(dot) / static_cast<float>(hidden);
    for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
      const float xv = to_float(xr[j]), g = to_float(gr[j]);
      dx[row * hidden + j] = input_gradient<T>(g, xv, to_float(w[j]), r, c, dsum, row * hidden + j);
      dw[j] += g * round_to<T>(xv * r);
    }
  }
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) partial[blockIdx.x * hidden + j] = dw[j];
}

// The forward with packs: kPacks packs a lane (hidden <= 256 kPacks); the row (with a residual:
// the sum, each value rounded to T) held in xs from its load to the output's store.
template <class T, int kPacks>
__global__ void __launch_bounds__(kThreads)
    forward_packed_kernel(const T* x, const T* res, const T* w, int64_t rows, int64_t hidden, float eps, T* sum, T* y,
                          float* rstd) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp: its shuffles below stay full
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t base = row * hidden;
  pack::Pack<T> xs[kPacks], rs[kPacks];
#pragma unroll
  for (int v = 0; v < kPacks; ++v) {
    const int c = (lane + 32 * v) * pack::kN;
    if (c < hidden) {
      xs[v] = pack::load(x + base + c);
      if (res) rs[v] = pack::load(res + base + c);
    }
  }
  float squares = 0.0f;
#pragma unroll
  for (int v = 0; v < kPacks; ++v) {
    const int c = (lane + 32 * v) * pack::kN;
    if (c >= hidden) continue;
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) {
      if (res) xs[v].set(e, xs[v].get(e) + rs[v].get(e));
      squares += xs[v].get(e) * xs[v].get(e);
    }
    if (res) pack::store(sum + base + c, xs[v]);
  }
  const float r = rsqrtf(warp_sum(squares) / static_cast<float>(hidden) + eps);
  if (lane == 0) rstd[row] = r;
#pragma unroll
  for (int v = 0; v < kPacks; ++v) {
    const int c = (lane + 32 * v) * pack::kN;
    if (c >= hidden) continue;
    const pack::Pack<T> wv = pack::load(w + c);
    pack::Pack<T> out;
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) out.set(e, round_to<T>(xs[v].get(e) * r) * wv.get(e));
    pack::store(y + base + c, out);
  }
}

// The backward with packs: as backward_warp_kernel, a lane's columns as kPacks packs; the row's
// dy, x and dsum packs loaded before dx is written.
template <class T, int kPacks>
__global__ void __launch_bounds__(kThreads, norm_backward::min_blocks_per_sm<kPacks * pack::kN, 32>())
    backward_packed_kernel(const T* dy, const T* dsum, const T* x, const T* w, int64_t rows, int hidden,
                           const float* rstd, T* dx, float* partial) {
  constexpr int kColumns = kPacks * pack::kN;
  __shared__ float warps_dw[kWarps][kColumns * 32];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  float* dw = warps_dw[warp];
#pragma unroll
  for (int v = 0; v < kPacks; ++v)
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) dw[packed_slot<kPacks>(lane + 32 * v, e)] = 0.0f;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * hidden;
    // The weight's packs too, each row (from L1: registers kept for the loads in flight).
    pack::Pack<T> xs[kPacks], gs[kPacks], ds[kPacks], wv[kPacks];
#pragma unroll
    for (int v = 0; v < kPacks; ++v) {
      const int c = (lane + 32 * v) * pack::kN;
      if (c < hidden) {
        wv[v] = pack::load(w + c);
        xs[v] = pack::load(x + base + c);
        gs[v] = pack::load(dy + base + c);
        if (dsum) ds[v] = pack::load(dsum + base + c);
      }
    }
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < kPacks; ++v)
      if ((lane + 32 * v) * pack::kN < hidden)
#pragma unroll
        for (int e = 0; e < pack::kN; ++e) dot += round_to<T>(gs[v].get(e) * wv[v].get(e)) * xs[v].get(e);
    const float c = warp_sum(dot) / static_cast<float>(hidden);
    const float r = rstd[row];
#pragma unroll
    for (int v = 0; v < kPacks; ++v) {
      const int col = (lane + 32 * v) * pack::kN;
      if (col >= hidden) continue;
      pack::Pack<T> out;
#pragma unroll
      for (int e = 0; e < pack::kN; ++e) {
        const float g = gs[v].get(e), xv = xs[v].get(e);
        const float d = r * round_to<T>(g * wv[v].get(e)) - xv * r * r * r * c;
        out.set(e, dsum ? round_to<T>(d) + ds[v].get(e) : d);
        dw[packed_slot<kPacks>(lane + 32 * v, e)] += g * round_to<T>(xv * r);
      }
      pack::store(dx + base + col, out);
    }
  }
  __syncthreads();
  add_warps_packed_rows<kPacks>(warps_dw, hidden, partial + static_cast<int64_t>(blockIdx.x) * hidden);
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
  if constexpr (sizeof(T) == 2) {
    if (hidden <= 4 * 32 * pack::kN && pack::packable(sizeof(T), hidden, x, res, w, sum, y)) {
      const auto launch = [&](auto kernel) {
        launch_kernel(kernel, static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0, stream,
                      static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w), rows, hidden,
                      static_cast<float>(eps), static_cast<T*>(sum), static_cast<T*>(y), rstd);
      };
      pack::with_packs<4>(pack::packs_for(hidden),
                          [&](auto packs) { launch(forward_packed_kernel<T, decltype(packs)::value>); });
      return;
    }
  }
  launch_kernel(forward_kernel<T>, static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0,
                stream, static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w), rows, hidden,
                static_cast<float>(eps), static_cast<T*>(sum), static_cast<T*>(y), rstd);
}

template <class T, int kColumns>
void backward_warps(const T* dy, const T* dsum, const T* x, const T* w, int64_t rows, int64_t hidden, const float* rstd,
                    T* dx, float* partial, int blocks, StreamHandle stream) {
  launch_kernel(backward_warp_kernel<T, kColumns>, blocks, kThreads, 0, stream, dy, dsum, x, w, rows,
                static_cast<int>(hidden), rstd, dx, partial);
}

template <class T>
void backward(const void* dy_, const void* dsum_, const void* x_, const void* w_, int64_t rows, int64_t hidden,
              const float* rstd, void* dx_, float* partial, float* dweight, StreamHandle stream) {
  const int blocks = static_cast<int>(rms_norm_backward_blocks(rows, hidden));
  const T *dy = static_cast<const T*>(dy_), *dsum = static_cast<const T*>(dsum_), *x = static_cast<const T*>(x_),
          *w = static_cast<const T*>(w_);
  T* dx = static_cast<T*>(dx_);
  const int columns = norm_backward::columns_per_lane(hidden);
  if constexpr (sizeof(T) == 2) {
    if (columns != 0 && pack::packable(sizeof(T), hidden, dy, dsum, x, w, dx)) {
      const auto launch = [&](auto kernel) {
        launch_kernel(kernel, blocks, kThreads, 0, stream, dy, dsum, x, w, rows, static_cast<int>(hidden), rstd, dx,
                      partial);
      };
      pack::with_packs<4>(columns / pack::kN,
                          [&](auto packs) { launch(backward_packed_kernel<T, decltype(packs)::value>); });
      norm_backward::sum_partials(partial, blocks, hidden, 1, dweight, nullptr, nullptr, stream);
      return;
    }
  }
  switch (columns) {
    case 8:
      backward_warps<T, 8>(dy, dsum, x, w, rows, hidden, rstd, dx, partial, blocks, stream);
      break;
    case 16:
      backward_warps<T, 16>(dy, dsum, x, w, rows, hidden, rstd, dx, partial, blocks, stream);
      break;
    case 24:
      backward_warps<T, 24>(dy, dsum, x, w, rows, hidden, rstd, dx, partial, blocks, stream);
      break;
    case 32:
      backward_warps<T, 32>(dy, dsum, x, w, rows, hidden, rstd, dx, partial, blocks, stream);
      break;
    default: {
      const size_t shared = static_cast<size_t>(hidden) * sizeof(float);
      norm_backward::allow_dynamic_shared(backward_block_kernel<T>, shared);
      launch_kernel(backward_block_kernel<T>, blocks, kThreads, shared, stream, dy, dsum, x, w, rows, hidden, rstd, dx,
                    partial);
    }
  }
  norm_backward::sum_partials(partial, blocks, hidden, 1, dweight, nullptr, nullptr, stream);
}

}  // namespace

int64_t rms_norm_backward_blocks(int64_t rows, int64_t hidden) {
  return norm_backward::blocks(rows, norm_backward::columns_per_lane(hidden) != 0);
}

void add_rms_norm_forward(const void* x, const void* residual, const void* weight, ElementType type, int64_t rows,
                          int64_t hidden, double eps, void* sum, void* y, float* rstd, StreamHandle stream) {
  check_shape(rows, hidden);
  if (rows == 0) return;
  element::dispatch(
      type, [&](auto t) { forward<decltype(t)>(x, residual, weight, rows, hidden, eps, sum, y, rstd, stream); });
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
  element::dispatch(type, [&](auto t) {
    backward<decltype(t)>(dy, dsum, x, weight, rows, hidden, rstd, dx, partial, dweight, stream);
  });
  check("rms_norm_backward");
}

void rms_norm_backward(const void* dy, const void* x, const void* weight, ElementType type, int64_t rows,
                       int64_t hidden, const float* rstd, void* dx, float* partial, float* dweight,
                       StreamHandle stream) {
  add_rms_norm_backward(dy, nullptr, x, weight, type, rows, hidden, rstd, dx, partial, dweight, stream);
}

}  // namespace dtk::cuda
