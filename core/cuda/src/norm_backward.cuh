// norm_backward.cuh (private to core/cuda) — what the norms' backward kernels share
// (layer_norm.cu, rms_norm.cu): the warp sum, how many rows a block's warps take, how many
// columns a lane keeps in registers, and the fixed-order sum of the blocks' partial weight
// (and bias) gradients.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "launch.cuh"
#include "pack.cuh"

namespace dtk::cuda::norm_backward {
// Private to each kernel file that includes it (an unnamed namespace: no symbol shared between them).
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;  // rows in flight per block: a warp each
constexpr int kMaxBlocks = 1024;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The blocks a backward launches for `rows` (and so the partial gradients' rows). The warp-per-row
// kernels (warp_rows: hidden fits the lanes' registers): a warp per row until kMaxBlocks blocks,
// then each warp loops over rows; the block-per-row kernels: a block per row until kMaxBlocks.
inline int64_t blocks(int64_t rows, bool warp_rows) {
  const int64_t needed = warp_rows ? (rows + kWarps - 1) / kWarps : rows;
  return needed < 1 ? 1 : needed > kMaxBlocks ? kMaxBlocks : needed;
}

// The warp-per-row kernels' blocks per SM (__launch_bounds__' second argument): three, so that
// three blocks' loads are in flight, where the registers allow it without spilling; two from
// kTwoFrom columns a lane (RMSNorm's 32, LayerNorm's 24: it keeps more per row).
template <int kColumns, int kTwoFrom>
constexpr int min_blocks_per_sm() {
  return kColumns >= kTwoFrom ? 2 : 3;
}

// Columns per lane of the warp-per-row kernels, which keep a row in registers: the smallest of
// 8, 16, 24, 32 that holds hidden / 32; 0 for a row too wide (the block-per-row kernels take it).
inline int columns_per_lane(int64_t hidden) {
  const int64_t per_lane = (hidden + 31) / 32;
  for (const int c : {8, 16, 24, 32})
    if (per_lane <= c) return c;
  return 0;
}

// Lets the block-per-row `kernel` launch with `dynamic` bytes of dynamic shared memory: beyond what
// a kernel may take by default (48 KB, less its own static shared memory) it must opt in. An
// attribute that cannot be read leaves the launch to report the error.
template <class Kernel>
inline void allow_dynamic_shared(Kernel* kernel, size_t dynamic) {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) return;
  if (dynamic + attributes.sharedSizeBytes > 48 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic));
}

// The packed warp kernels' per-warp shared rows (pack.cuh): column 8 p + e (p: the pack, lane +
// 32 v) at e * 32 kPacks + p, so that a warp's lanes touch consecutive words (no bank conflict) as
// they add a pack's element e.
template <int kPacks>
__device__ __forceinline__ int packed_slot(int p, int e) {
  return e * 32 * kPacks + p;
}

// out[j] = the sum of the block's warps' packed rows at column j, in warp order.
template <int kPacks>
__device__ void add_warps_packed_rows(const float (*warps)[kPacks * pack::kN * 32], int hidden, float* out) {
  for (int j = threadIdx.x; j < hidden; j += kThreads) {
    const int at = packed_slot<kPacks>(j / pack::kN, j % pack::kN);
    float total = 0.0f;
    for (int k = 0; k < kWarps; ++k) total += warps[k][at];
    out[j] = total;
  }
}

constexpr int kSumColumns = 32, kSumSlices = 8;

// out_g[j] = the sum over b of partial[g][b][j] (partial: [groups][blocks][cols] fp32; out_g: out0,
// out1, out2 for g = 0, 1, 2): each of kSumSlices slices of b (b = s, s + kSumSlices, ...) summed
// in order, then the slices in order. A fixed order, so the same result on every run; 32 columns
// x 8 slices a block, gridDim.y = groups.
__global__ void __launch_bounds__(kSumColumns * kSumSlices)
    sum_block_partials(const float* partial, int blocks, int cols, float* out0, float* out1, float* out2) {
  __shared__ float slices[kSumSlices][kSumColumns];
  const int column = static_cast<int>(threadIdx.x) % kSumColumns, slice = static_cast<int>(threadIdx.x) / kSumColumns;
  const int j = static_cast<int>(blockIdx.x) * kSumColumns + column;
  const float* p = partial + static_cast<int64_t>(blockIdx.y) * blocks * cols;
  float total = 0.0f;
  if (j < cols)
    for (int b = slice; b < blocks; b += kSumSlices) total += p[static_cast<int64_t>(b) * cols + j];
  slices[slice][column] = total;
  __syncthreads();
  if (slice != 0 || j >= cols) return;
  float sum = 0.0f;
  for (int s = 0; s < kSumSlices; ++s) sum += slices[s][column];
  (blockIdx.y == 0 ? out0 : blockIdx.y == 1 ? out1 : out2)[j] = sum;
}

inline void sum_partials(const float* partial, int blocks, int64_t cols, int groups, float* out0, float* out1,
                         float* out2, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + kSumColumns - 1) / kSumColumns), static_cast<unsigned>(groups));
  launch_kernel(sum_block_partials, grid, kSumColumns * kSumSlices, 0, stream, partial, blocks, static_cast<int>(cols),
                out0, out1, out2);
}

}  // namespace
}  // namespace dtk::cuda::norm_backward
