// Residual add + LayerNorm forward and backward (dtk/cuda/layer_norm.hpp). Forward: one warp per
// row, eight rows a block: the row's sum written while its total is taken, then the squared
// deviations from the mean (two passes over the row, which the warp itself just wrote: cached),
// then the normalised row. Backward: a warp per row too, where a row fits in the lanes' registers
// (hidden <= 768): the row's incoming gradient and normalised input read once into registers, two
// dots (the incoming gradient times the weight, and that times the normalised row) reduced over
// the warp, dx written, and each warp's weight and bias gradients added up in its own rows of
// shared memory; the block's warps then add theirs in warp order into the block's partial rows.
// Wider rows: a block per row (one block reduction of the two dots per row, the gradients in
// shared memory, one column per thread). Either way no atomics: a second kernel adds the blocks'
// partial gradients in a fixed order, so the result is the same on every run. With the residual
// branch's bias (a row-parallel product's, added here instead of in the product) the forward adds
// it to the branch first, and the backward also sums each column of dx (the branch's gradient,
// hence the bias's) as a third partial row: in registers in the warp kernel (the shared memory
// holds two rows per warp at most), in shared memory in the block kernel. With the branch's
// dropout each element's mask bit is hashed where it is used (dropout_bits.cuh): forward on the
// branch before the add, backward on dx, written as the branch's own gradient (and summed for its
// bias). With 2-byte elements, hidden a multiple of 8 and aligned pointers (pack.cuh) both
// directions' warp kernels load a lane's columns as packs of 8 (columns 8 (lane + 32 v) .. + 7),
// every load of a row issued before its first store, the packs kept in registers: the same
// arithmetic, the row's sums in another order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dropout_bits.cuh"
#include "dtk/cuda/layer_norm.hpp"
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
using element::round_to;
using element::to_float;

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
    forward_kernel(const T* x, const T* res, const T* res_bias, DropoutBits drop, bool dropout, const T* w, const T* b,
                   int64_t rows, int hidden, float eps, T* sum, T* y, float* mean_out, float* rstd_out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp: its shuffles below stay full
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t base = row * hidden;
  if (dropout) drop = dropout_bits::resolved(drop);
  const int64_t mask_row = dropout ? dropout_bits::mask_index(drop, base) : 0;  // the row's first mask index
  // h = T(x + r), as the add rounds it (r = T(branch + its bias) with a bias, then T(r scale) or 0
  // with dropout); each lane re-reads below only what it wrote itself.
  float total = 0.0f;
  for (int j = lane; j < hidden; j += 32) {
    float r = res_bias ? round_to<T>(to_float(res[base + j]) + to_float(res_bias[j])) : to_float(res[base + j]);
    if (dropout) r = dropout_bits::kept_at(drop, mask_row + j) ? round_to<T>(r * drop.scale) : 0.0f;
    const float v = round_to<T>(to_float(x[base + j]) + r);
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

// One column's input gradient: the norm's, rounded to T as the norm's backward writes it, plus
// the residual stream's gradient (autograd's add of the two, rounded again) where there is one.
template <class T>
__device__ __forceinline__ T input_gradient(float g, float xhat, float wv, float r, float a, float c, const T* dsum,
                                            int64_t at) {
  const float d = r * (g * wv - a - xhat * c);
  return dsum ? from_float<T>(round_to<T>(d) + to_float(dsum[at])) : from_float<T>(d);
}

// The branch's gradient at `at` (mask element `mask_at`) from dx's value d there: d itself, or with
// the branch's dropout d through the mask, written to dres (the branch's own gradient). What the
// branch bias's column sums add.
template <class T>
__device__ __forceinline__ float branch_gradient(T d, const DropoutBits& drop, bool dropout, int64_t mask_at, T* dres,
                                                 int64_t at) {
  if (!dropout) return to_float(d);
  const T g = dropout_bits::kept_at(drop, mask_at) ? from_float<T>(to_float(d) * drop.scale) : from_float<T>(0.0f);
  dres[at] = g;
  return to_float(g);
}

// out[j] = the sum of the block's warps' rows at column j, in warp order.
template <int kColumns>
__device__ void add_warps_rows(const float (*warps)[kColumns * 32], int hidden, float* out) {
  for (int j = threadIdx.x; j < hidden; j += kThreads) {
    float total = 0.0f;
    for (int k = 0; k < kWarps; ++k) total += warps[k][j];
    out[j] = total;
  }
}

// A warp per row, the row in registers: kColumns columns per lane (lane + 32 i), rows
// blockIdx.x * kWarps + warp, then gridDim.x * kWarps further on. Each warp adds its rows' weight
// and bias gradients into its own rows of shared memory (a lane, its own columns: no barrier, and
// registers left for the loads in flight); at the end the block adds its warps' rows in warp order
// into partial ([2][gridDim.x][hidden]: the block's weight gradient row and its bias gradient row;
// kBranchBias: [3][gridDim.x][hidden], the third row the branch gradient's column sums, which each
// lane keeps for its own columns in registers until the end).
template <class T, int kColumns, bool kBranchBias>
__global__ void __launch_bounds__(kThreads, norm_backward::min_blocks_per_sm<kColumns, 24>())
    backward_warp_kernel(const T* dy, const T* dsum, const T* h, const T* w, int64_t rows, int hidden,
                         const float* mean, const float* rstd, DropoutBits drop, bool dropout, T* dx, T* dres,
                         float* partial) {
  if (dropout) drop = dropout_bits::resolved(drop);
  __shared__ float warps_grad[2][kWarps][kColumns * 32];  // each warp's weight gradient, and its bias gradient
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const float inv_n = 1.0f / static_cast<float>(hidden);
  float* dw = warps_grad[0][warp];
  float* db = warps_grad[1][warp];
  float dbranch[kBranchBias ? kColumns : 1];  // this lane's columns of the branch's gradient, summed over rows
#pragma unroll
  for (int i = 0; i < kColumns; ++i) {
    dw[lane + 32 * i] = db[lane + 32 * i] = 0.0f;
    if constexpr (kBranchBias) dbranch[i] = 0.0f;
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * hidden;
    const int64_t mask_row = dropout ? dropout_bits::mask_index(drop, base) : 0;
    const float m = mean[row], r = rstd[row];
    float xhat[kColumns], g[kColumns];
    float gw_sum = 0.0f, gwx_sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kColumns; ++i) {
      const int j = lane + 32 * i;
      xhat[i] = g[i] = 0.0f;
      if (j < hidden) {
        g[i] = to_float(dy[base + j]);
        xhat[i] = (to_float(h[base + j]) - m) * r;
        const float gw = g[i] * to_float(w[j]);
        gw_sum += gw;
        gwx_sum += gw * xhat[i];
      }
    }
    const float a = warp_sum(gw_sum) * inv_n, c = warp_sum(gwx_sum) * inv_n;
#pragma unroll
    for (int i = 0; i < kColumns; ++i) {
      const int j = lane + 32 * i;
      if (j < hidden) {
        const T d = input_gradient<T>(g[i], xhat[i], to_float(w[j]), r, a, c, dsum, base + j);
        dx[base + j] = d;
        const float gr = branch_gradient<T>(d, drop, dropout, mask_row + j, dres, base + j);
        if constexpr (kBranchBias) dbranch[i] += gr;
        dw[j] += g[i] * xhat[i];
        db[j] += g[i];
      }
    }
  }
  __syncthreads();
  add_warps_rows<kColumns>(warps_grad[0], hidden, partial + static_cast<int64_t>(blockIdx.x) * hidden);
  add_warps_rows<kColumns>(warps_grad[1], hidden, partial + static_cast<int64_t>(gridDim.x + blockIdx.x) * hidden);
  if constexpr (kBranchBias) {
    __syncthreads();  // every thread has read the weight gradients' rows: reuse them for the branch's
#pragma unroll
    for (int i = 0; i < kColumns; ++i) dw[lane + 32 * i] = dbranch[i];
    __syncthreads();
    add_warps_rows<kColumns>(warps_grad[0], hidden,
                             partial + static_cast<int64_t>(2 * gridDim.x + blockIdx.x) * hidden);
  }
}

// A block per row (rows too wide for the lanes' registers): rows blockIdx.x, blockIdx.x +
// gridDim.x, ...; per row one block reduction of the two dots, then dx written and the gradients
// accumulated in shared memory, one column per thread.
template <class T, bool kBranchBias>
__global__ void __launch_bounds__(kThreads)
    backward_block_kernel(const T* dy, const T* dsum, const T* h, const T* w, int64_t rows, int hidden,
                          const float* mean, const float* rstd, DropoutBits drop, bool dropout, T* dx, T* dres,
                          float* partial) {
  if (dropout) drop = dropout_bits::resolved(drop);
  // This block's weight gradient [hidden], its bias gradient [hidden] (and the branch gradient's
  // column sums [hidden]).
  DTK_DYNAMIC_SHARED(float, grads);
  float* dw = grads;
  float* db = grads + hidden;
  float* dbranch = grads + 2 * hidden;
  // Each thread owns columns threadIdx.x, threadIdx.x + kThreads, ... here and below: no barrier.
  for (int j = threadIdx.x; j < hidden; j += kThreads) {
    dw[j] = db[j] = 0.0f;
    if (kBranchBias) dbranch[j] = 0.0f;
  }
  const float inv_n = 1.0f / static_cast<float>(hidden);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * hidden;
    const int64_t mask_row = dropout ? dropout_bits::mask_index(drop, base) : 0;
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
      const T d = input_gradient<T>(g, xhat, to_float(w[j]), r, a, c, dsum, base + j);
      dx[base + j] = d;
      const float gr = branch_gradient<T>(d, drop, dropout, mask_row + j, dres, base + j);
      if (kBranchBias) dbranch[j] += gr;
      dw[j] += g * xhat;
      db[j] += g;
    }
  }
  float* pw = partial + static_cast<int64_t>(blockIdx.x) * hidden;
  float* pb = partial + static_cast<int64_t>(gridDim.x + blockIdx.x) * hidden;
  float* pr = partial + static_cast<int64_t>(2 * gridDim.x + blockIdx.x) * hidden;
  for (int j = threadIdx.x; j < hidden; j += kThreads) {
    pw[j] = dw[j];
    pb[j] = db[j];
    if (kBranchBias) pr[j] = dbranch[j];
  }
}

// The forward with packs: kPacks packs a lane (hidden <= 256 kPacks). x + branch held in xs (each
// value rounded to T, so packing it loses nothing) from the sum's store to the output's.
template <class T, int kPacks>
__global__ void __launch_bounds__(kThreads)
    forward_packed_kernel(const T* x, const T* res, const T* res_bias, DropoutBits drop, bool dropout, const T* w,
                          const T* b, int64_t rows, int hidden, float eps, T* sum, T* y, float* mean_out,
                          float* rstd_out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp: its shuffles below stay full
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t base = row * hidden;
  if (dropout) drop = dropout_bits::resolved(drop);
  const int64_t mask_row = dropout ? dropout_bits::mask_index(drop, base) : 0;
  pack::Pack<T> xs[kPacks], rs[kPacks];
#pragma unroll
  for (int v = 0; v < kPacks; ++v) {
    const int c = (lane + 32 * v) * pack::kN;
    if (c < hidden) xs[v] = pack::load(x + base + c), rs[v] = pack::load(res + base + c);
  }
  float total = 0.0f;
#pragma unroll
  for (int v = 0; v < kPacks; ++v) {
    const int c = (lane + 32 * v) * pack::kN;
    if (c >= hidden) continue;
    pack::Pack<T> bias;
    if (res_bias) bias = pack::load(res_bias + c);
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) {
      float r = res_bias ? round_to<T>(rs[v].get(e) + bias.get(e)) : rs[v].get(e);
      if (dropout) r = dropout_bits::kept_at(drop, mask_row + c + e) ? round_to<T>(r * drop.scale) : 0.0f;
      xs[v].set(e, xs[v].get(e) + r);
      total += xs[v].get(e);
    }
    pack::store(sum + base + c, xs[v]);
  }
  const float mean = warp_sum(total) / static_cast<float>(hidden);
  float squares = 0.0f;
#pragma unroll
  for (int v = 0; v < kPacks; ++v)
    if ((lane + 32 * v) * pack::kN < hidden)
#pragma unroll
      for (int e = 0; e < pack::kN; ++e) {
        const float d = xs[v].get(e) - mean;
        squares += d * d;
      }
  const float rstd = rsqrtf(warp_sum(squares) / static_cast<float>(hidden) + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int v = 0; v < kPacks; ++v) {
    const int c = (lane + 32 * v) * pack::kN;
    if (c >= hidden) continue;
    const pack::Pack<T> wv = pack::load(w + c), bv = pack::load(b + c);
    pack::Pack<T> out;
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) out.set(e, (xs[v].get(e) - mean) * rstd * wv.get(e) + bv.get(e));
    pack::store(y + base + c, out);
  }
}

// The backward with packs: as backward_warp_kernel, a lane's columns as kPacks packs. The rows'
// dy, h and dsum packs are loaded before anything is written; dx (and the branch's gradient
// under dropout) written a pack at a time.
template <class T, int kPacks, bool kBranchBias>
__global__ void __launch_bounds__(kThreads, norm_backward::min_blocks_per_sm<kPacks * pack::kN, 24>())
    backward_packed_kernel(const T* dy, const T* dsum, const T* h, const T* w, int64_t rows, int hidden,
                           const float* mean, const float* rstd, DropoutBits drop, bool dropout, T* dx, T* dres,
                           float* partial) {
  constexpr int kColumns = kPacks * pack::kN;
  if (dropout) drop = dropout_bits::resolved(drop);
  __shared__ float warps_grad[2][kWarps][kColumns * 32];  // each warp's weight gradient, and its bias gradient
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const float inv_n = 1.0f / static_cast<float>(hidden);
  float* dw = warps_grad[0][warp];
  float* db = warps_grad[1][warp];
  float dbranch[kBranchBias ? kColumns : 1];  // this lane's columns of the branch's gradient, summed over rows
#pragma unroll
  for (int v = 0; v < kPacks; ++v) {
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) {
      dw[packed_slot<kPacks>(lane + 32 * v, e)] = db[packed_slot<kPacks>(lane + 32 * v, e)] = 0.0f;
      if constexpr (kBranchBias) dbranch[v * pack::kN + e] = 0.0f;
    }
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * hidden;
    const int64_t mask_row = dropout ? dropout_bits::mask_index(drop, base) : 0;
    const float m = mean[row], r = rstd[row];
    // The weight's packs too, each row (from L1: registers kept for the loads in flight).
    pack::Pack<T> gy[kPacks], hh[kPacks], ds[kPacks], wv[kPacks];
#pragma unroll
    for (int v = 0; v < kPacks; ++v) {
      const int c = (lane + 32 * v) * pack::kN;
      if (c < hidden) {
        wv[v] = pack::load(w + c);
        gy[v] = pack::load(dy + base + c);
        hh[v] = pack::load(h + base + c);
        if (dsum) ds[v] = pack::load(dsum + base + c);
      }
    }
    float gw_sum = 0.0f, gwx_sum = 0.0f;
#pragma unroll
    for (int v = 0; v < kPacks; ++v)
      if ((lane + 32 * v) * pack::kN < hidden)
#pragma unroll
        for (int e = 0; e < pack::kN; ++e) {
          const float gw = gy[v].get(e) * wv[v].get(e);
          gw_sum += gw;
          gwx_sum += gw * ((hh[v].get(e) - m) * r);
        }
    const float a = warp_sum(gw_sum) * inv_n, c = warp_sum(gwx_sum) * inv_n;
#pragma unroll
    for (int v = 0; v < kPacks; ++v) {
      const int col = (lane + 32 * v) * pack::kN;
      if (col >= hidden) continue;
      pack::Pack<T> out, branch;
#pragma unroll
      for (int e = 0; e < pack::kN; ++e) {
        const float g = gy[v].get(e), xhat = (hh[v].get(e) - m) * r;
        const float d = r * (g * wv[v].get(e) - a - xhat * c);
        out.set(e, dsum ? round_to<T>(d) + ds[v].get(e) : d);
        float gr = out.get(e);
        if (dropout) {
          branch.set(e, dropout_bits::kept_at(drop, mask_row + col + e) ? out.get(e) * drop.scale : 0.0f);
          gr = branch.get(e);
        }
        if constexpr (kBranchBias) dbranch[v * pack::kN + e] += gr;
        dw[packed_slot<kPacks>(lane + 32 * v, e)] += g * xhat;
        db[packed_slot<kPacks>(lane + 32 * v, e)] += g;
      }
      pack::store(dx + base + col, out);
      if (dropout) pack::store(dres + base + col, branch);
    }
  }
  __syncthreads();
  add_warps_packed_rows<kPacks>(warps_grad[0], hidden, partial + static_cast<int64_t>(blockIdx.x) * hidden);
  add_warps_packed_rows<kPacks>(warps_grad[1], hidden, partial + static_cast<int64_t>(gridDim.x + blockIdx.x) * hidden);
  if constexpr (kBranchBias) {
    __syncthreads();  // every thread has read the weight gradients' rows: reuse them for the branch's
#pragma unroll
    for (int v = 0; v < kPacks; ++v)
#pragma unroll
      for (int e = 0; e < pack::kN; ++e) dw[packed_slot<kPacks>(lane + 32 * v, e)] = dbranch[v * pack::kN + e];
    __syncthreads();
    add_warps_packed_rows<kPacks>(warps_grad[0], hidden,
                                  partial + static_cast<int64_t>(2 * gridDim.x + blockIdx.x) * hidden);
  }
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_shape(int64_t rows, int64_t hidden, const DropoutBits* drop) {
  if (hidden <= 0 || hidden > kLayerNormMaxHidden || rows < 0 || rows > 0x7fffffffLL)
    throw CudaError("add_layer_norm: hidden size " + std::to_string(hidden) + " or " + std::to_string(rows) +
                    " rows outside what the kernels take");
  if (drop && drop->run_numel % hidden != 0)
    throw CudaError("add_layer_norm: a residual dropout's runs of " + std::to_string(drop->run_numel) +
                    " elements do not hold whole rows of " + std::to_string(hidden));
}

template <class T>
void forward(const void* x, const void* res, const void* res_bias, const DropoutBits* drop, const void* w,
             const void* b, int64_t rows, int64_t hidden, double eps, void* sum, void* y, float* mean, float* rstd,
             StreamHandle stream) {
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  if constexpr (sizeof(T) == 2) {
    if (hidden <= 4 * 32 * pack::kN && pack::packable(sizeof(T), hidden, x, res, res_bias, w, b, sum, y)) {
      const auto launch = [&](auto kernel) {
        launch_kernel(kernel, blocks, kThreads, 0, stream, static_cast<const T*>(x), static_cast<const T*>(res),
                      static_cast<const T*>(res_bias), drop ? *drop : DropoutBits{}, drop != nullptr,
                      static_cast<const T*>(w), static_cast<const T*>(b), rows, static_cast<int>(hidden),
                      static_cast<float>(eps), static_cast<T*>(sum), static_cast<T*>(y), mean, rstd);
      };
      pack::with_packs<4>(pack::packs_for(hidden),
                          [&](auto packs) { launch(forward_packed_kernel<T, decltype(packs)::value>); });
      return;
    }
  }
  launch_kernel(forward_kernel<T>, blocks, kThreads, 0, stream, static_cast<const T*>(x), static_cast<const T*>(res),
                static_cast<const T*>(res_bias), drop ? *drop : DropoutBits{}, drop != nullptr,
                static_cast<const T*>(w), static_cast<const T*>(b), rows, static_cast<int>(hidden),
                static_cast<float>(eps), static_cast<T*>(sum), static_cast<T*>(y), mean, rstd);
}

// The backward kernels' arguments, as every launch passes them.
template <class T>
struct BackwardArgs {
  const T *dy, *dsum, *h, *w;
  int64_t rows;
  int hidden;
  const float *mean, *rstd;
  DropoutBits drop;
  bool dropout;
  T *dx, *dres;
  float* partial;
};

template <class T, bool kBranchBias>
void launch_backward(const BackwardArgs<T>& a, int blocks, StreamHandle stream) {
  const auto warps = [&](auto kernel) {
    launch_kernel(kernel, blocks, kThreads, 0, stream, a.dy, a.dsum, a.h, a.w, a.rows, a.hidden, a.mean, a.rstd, a.drop,
                  a.dropout, a.dx, a.dres, a.partial);
  };
  const int columns = norm_backward::columns_per_lane(a.hidden);
  if constexpr (sizeof(T) == 2) {
    if (columns != 0 && columns <= 24 && pack::packable(sizeof(T), a.hidden, a.dy, a.dsum, a.h, a.w, a.dx, a.dres)) {
      pack::with_packs<3>(columns / pack::kN,
                          [&](auto packs) { warps(backward_packed_kernel<T, decltype(packs)::value, kBranchBias>); });
      return;
    }
  }
  switch (columns) {
    case 8:
      warps(backward_warp_kernel<T, 8, kBranchBias>);
      break;
    case 16:
      warps(backward_warp_kernel<T, 16, kBranchBias>);
      break;
    case 24:
      warps(backward_warp_kernel<T, 24, kBranchBias>);
      break;
    default: {  // 32 columns a lane would need 64 KB of shared memory: the block kernel
      const size_t shared = (kBranchBias ? 3 : 2) * static_cast<size_t>(a.hidden) * sizeof(float);
      norm_backward::allow_dynamic_shared(backward_block_kernel<T, kBranchBias>, shared);
      launch_kernel(backward_block_kernel<T, kBranchBias>, blocks, kThreads, shared, stream, a.dy, a.dsum, a.h, a.w,
                    a.rows, a.hidden, a.mean, a.rstd, a.drop, a.dropout, a.dx, a.dres, a.partial);
    }
  }
}

template <class T>
void backward(const void* dy, const void* dsum, const void* h, const void* w, int64_t rows, int64_t hidden,
              const float* mean, const float* rstd, const DropoutBits* drop, void* dx, void* dres, float* partial,
              float* dweight, float* dbias, float* dres_bias, StreamHandle stream) {
  const int blocks = static_cast<int>(layer_norm_backward_blocks(rows, hidden));
  const BackwardArgs<T> args{static_cast<const T*>(dy),
                             static_cast<const T*>(dsum),
                             static_cast<const T*>(h),
                             static_cast<const T*>(w),
                             rows,
                             static_cast<int>(hidden),
                             mean,
                             rstd,
                             drop ? *drop : DropoutBits{},
                             drop != nullptr,
                             static_cast<T*>(dx),
                             static_cast<T*>(dres),
                             partial};
  if (dres_bias)
    launch_backward<T, true>(args, blocks, stream);
  else
    launch_backward<T, false>(args, blocks, stream);
  norm_backward::sum_partials(partial, blocks, hidden, dres_bias ? 3 : 2, dweight, dbias, dres_bias, stream);
}

}  // namespace

int64_t layer_norm_backward_blocks(int64_t rows, int64_t hidden) {
  // The warp-per-row kernel up to 24 columns a lane (backward()'s dispatch).
  const int columns = norm_backward::columns_per_lane(hidden);
  return norm_backward::blocks(rows, columns != 0 && columns <= 24);
}

void add_layer_norm_forward(const void* x, const void* residual, const void* residual_bias,
                            const DropoutBits* residual_dropout, const void* weight, const void* bias, ElementType type,
                            int64_t rows, int64_t hidden, double eps, void* sum, void* y, float* mean, float* rstd,
                            StreamHandle stream) {
  check_shape(rows, hidden, residual_dropout);
  if (rows == 0) return;
  element::dispatch(type, [&](auto t) {
    forward<decltype(t)>(x, residual, residual_bias, residual_dropout, weight, bias, rows, hidden, eps, sum, y, mean,
                         rstd, stream);
  });
  check("add_layer_norm_forward");
}

void add_layer_norm_backward(const void* dy, const void* dsum, const void* sum, const void* weight, ElementType type,
                             int64_t rows, int64_t hidden, const float* mean, const float* rstd,
                             const DropoutBits* residual_dropout, void* dx, void* dresidual, float* partial,
                             float* dweight, float* dbias, float* dresidual_bias, StreamHandle stream) {
  check_shape(rows, hidden, residual_dropout);
  if (residual_dropout && !dresidual) throw CudaError("add_layer_norm_backward: a residual dropout needs dresidual");
  if (rows == 0) {
    for (float* out : {dweight, dbias, dresidual_bias})
      if (out) cudaMemsetAsync(out, 0, static_cast<size_t>(hidden) * sizeof(float), stream);
    return;
  }
  element::dispatch(type, [&](auto t) {
    backward<decltype(t)>(dy, dsum, sum, weight, rows, hidden, mean, rstd, residual_dropout, dx, dresidual, partial,
                          dweight, dbias, dresidual_bias, stream);
  });
  check("add_layer_norm_backward");
}

}  // namespace dtk::cuda
