// Causal attention with DTK's dropout (dtk/cuda/attention.hpp), FlashAttention-2's schedule in
// WMMA tensor-core products (16x16x16, T in, fp32 out) on tiles in shared memory.
//
// Forward: a block per (64 query rows, head, sequence), 4 warps, each owning 16 of the rows. The
// block walks the key tiles 0..its own (causal: later keys are all masked), loading each tile of
// K and V once for all warps; each warp forms its rows' scores S (16 x 64), updates its rows'
// running max m and sum l, writes P Z (unnormalised, rescaled to the new max) in T and adds P Z V
// to its rows of O (fp32, rescaled by exp(m_old - m_new) first). Only the tile loads need the
// whole block; everything else is a warp's own rows.
//
// Backward, after a pass for delta = rowsum(dO O): a block per (64 keys, key/value group,
// sequence) keeps its K and V tiles and its rows' dK and dV in registers (WMMA accumulators) and
// walks every query tile at or after its own, for each query head of the group: P from the scores
// and lse, P Z and dS in T, dV += (P Z)^T dO, dK += dS^T Q. Then a block per (64 query rows, head,
// sequence) walks its key tiles for dQ += dS K, in order: no atomics, so every gradient is the
// same bits on every run (FlashAttention-2's deterministic backward, at two products more).
//
// Mask: element (b, h, i, j) is kept when dropout_bits::kept of its index ((b heads + h) seq + i)
// seq + j does; positions j > i and padding rows/columns past seq are P = 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "dropout_bits.cuh"
#include "dtk/cuda/attention.hpp"
#include "element.cuh"

namespace dtk::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 64;  // query rows and keys per tile
constexpr int kWarps = 4;  // each owns 16 rows of a tile
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using element::from_float;
using element::to_float;

// Shared-memory tiles. Rows are padded (8 elements) so that the 16 rows a WMMA
// load reads fall in different banks; every size is a multiple of 128 bytes, so each tile carved
// after another stays 32-byte aligned, as WMMA's loads and stores need.
template <class T, int D>
struct Tiles {
  static constexpr int kLdT = D + 8;      // a [64, D] tile of T (Q, K, V, dO)
  static constexpr int kLdS = kTile + 8;  // a [64, 64] tile of fp32 (S, dP)
  static constexpr int kLdP = kTile + 8;  // a [64, 64] tile of T (P Z, dS)
  static constexpr int kLdO = D + 8;      // a [64, D] tile of fp32 (O, dQ)
  static constexpr size_t kT = size_t{kTile} * kLdT * sizeof(T);
  static constexpr size_t kS = size_t{kTile} * kLdS * sizeof(float);
  static constexpr size_t kP = size_t{kTile} * kLdP * sizeof(T);
  static constexpr size_t kO = size_t{kTile} * kLdO * sizeof(float);
  static constexpr size_t kRows = kTile * sizeof(float);
  static constexpr size_t kForward = 3 * kT + kS + kP + kO + 3 * kRows;           // Q K V S P O m l alpha
  static constexpr size_t kBackward = 4 * kT + 2 * kS + 2 * kP + kO + 2 * kRows;  // K V Q dO S dP PZ dS out lse D
  static constexpr size_t kDq = 4 * kT + 2 * kS + kP + kO + 2 * kRows;            // Q dO K V S dP dS dQ lse D
};

template <class T>
__device__ __forceinline__ T* carve(unsigned char*& at, size_t bytes) {
  T* p = reinterpret_cast<T*>(at);
  at += bytes;
  return p;
}

template <class T>
struct Params {
  const T* q;
  const T* k;
  const T* v;
  AttentionLayout ql, kl, vl;
  int64_t seq;
  int heads, per_group;
  float scale, scale_log2;  // the scores' scale, and times log2(e) for exp2
  bool dropout;
  DropoutBits bits;
};

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Rows [first, first + 64) of a [seq, D] operand whose rows are `stride` apart into a tile; rows
// past seq are zeros. 16 bytes a load.
template <class T, int D>
__device__ void load_tile(T* tile, const T* src, int64_t stride, int64_t first, int64_t seq) {
  constexpr int kVectors = D / 8;
  for (int at = threadIdx.x; at < kTile * kVectors; at += kThreads) {
    const int r = at / kVectors, c = at % kVectors * 8;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (first + r < seq) x = *reinterpret_cast<const uint4*>(src + (first + r) * stride + c);
    *reinterpret_cast<uint4*>(tile + r * Tiles<T, D>::kLdT + c) = x;
  }
}

template <class T>
using RowsA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using ColumnsA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <class T>
using RowsB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <class T>
using ColumnsB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// c [16, 64] (fp32, kLdS) = a [16, D] (kLdT) b^T, b [64, D] (kLdT): a warp's rows of S = Q K^T or
// of dO V^T.
template <class T, int D>
__device__ void rows_times_transposed(const T* a, const T* b, float* c) {
  using L = Tiles<T, D>;
  Accumulator acc[kTile / 16];
#pragma unroll
  for (int n = 0; n < kTile / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    RowsA<T> fa;
    wmma::load_matrix_sync(fa, a + kk * 16, L::kLdT);
#pragma unroll
    for (int n = 0; n < kTile / 16; ++n) {
      ColumnsB<T> fb;  // (k, n) at b[n * kLdT + k]: b^T
      wmma::load_matrix_sync(fb, b + n * 16 * L::kLdT + kk * 16, L::kLdT);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kTile / 16; ++n) wmma::store_matrix_sync(c + n * 16, acc[n], L::kLdS, wmma::mem_row_major);
}

// c [16, D] (fp32, kLdO) (+)= a [16, 64] (kLdP) b, b [64, D] (kLdT): a warp's rows of O += P Z V
// or of dQ = dS K.
template <class T, int D>
__device__ void rows_times(const T* a, const T* b, float* c, bool accumulate) {
  using L = Tiles<T, D>;
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    Accumulator acc;
    if (accumulate)
      wmma::load_matrix_sync(acc, c + n * 16, L::kLdO, wmma::mem_row_major);
    else
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      RowsA<T> fa;
      RowsB<T> fb;
      wmma::load_matrix_sync(fa, a + kk * 16, L::kLdP);
      wmma::load_matrix_sync(fb, b + kk * 16 * L::kLdT + n * 16, L::kLdT);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + n * 16, acc, L::kLdO, wmma::mem_row_major);
  }
}

// acc[D / 16] += a^T b for the 16 columns of a [64, 64] tile (kLdP) starting at `a`, b [64, D]
// (kLdT): a warp's key rows of dV += (P Z)^T dO or dK += dS^T Q.
template <class T, int D>
__device__ void columns_transposed_times(const T* a, const T* b, Accumulator* acc) {
  using L = Tiles<T, D>;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    ColumnsA<T> fa;  // (r, c) at a[(kk 16 + c) kLdP + r]: the tile's columns as rows
    wmma::load_matrix_sync(fa, a + kk * 16 * L::kLdP, L::kLdP);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      RowsB<T> fb;
      wmma::load_matrix_sync(fb, b + kk * 16 * L::kLdT + n * 16, L::kLdT);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// The dropout multipliers (scale where kept, 0 where dropped) of columns 2 lane and 2 lane + 1 of
// a tile's row whose column 0 is element `first` of the mask (warp-uniform). One hash word holds
// an even element and the odd one after it (dropout_bits::kept_at): where `first` is even a lane's
// two columns share its word; where it is odd, the second's word is the next lane's (lane 31
// hashes it itself). One hash per lane per row.
__device__ __forceinline__ float2 pair_factors(const DropoutBits& m, int64_t first, int lane) {
  const uint64_t pair = static_cast<uint64_t>((first + 2 * lane) >> 1);
  const unsigned long long word = dropout_bits::mix(m.seed, pair);
  uint32_t u0 = static_cast<uint32_t>(word), u1 = static_cast<uint32_t>(word >> 32);
  if (first & 1) {
    unsigned long long next = __shfl_down_sync(0xffffffffu, word, 1);
    if (lane == 31) next = dropout_bits::mix(m.seed, pair + 1);
    u0 = static_cast<uint32_t>(word >> 32);
    u1 = static_cast<uint32_t>(next);
  }
  return make_float2(u0 >= m.threshold ? m.scale : 0.0f, u1 >= m.threshold ? m.scale : 0.0f);
}

// The mask's element (b, h, i, 0) (run_numel 0: the offset, then row-major [b, heads, seq, seq]).
template <class T>
__device__ __forceinline__ int64_t mask_row(const Params<T>& p, int64_t b, int h, int64_t i) {
  return p.bits.offset + ((b * p.heads + h) * p.seq + i) * p.seq;
}

// The query tile a block of the forward or the dQ pass owns, the longest rows (most key tiles)
// first: tile qt of head h (of key/value group `group`) of sequence b, its rows from row0.
struct QueryTile {
  int qt, h, group;
  int64_t b, row0;
};
template <class T>
__device__ __forceinline__ QueryTile query_tile(const Params<T>& p) {
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y;
  return {qt, h, h / p.per_group, int64_t{blockIdx.z}, int64_t{qt} * kTile};
}

template <class T, int D>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params<T> p, T* out, float* lse) {
  if (p.dropout) p.bits = dropout_bits::resolved(p.bits);
  using L = Tiles<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* at = smem;
  T* sQ = carve<T>(at, L::kT);
  T* sK = carve<T>(at, L::kT);
  T* sV = carve<T>(at, L::kT);
  float* sS = carve<float>(at, L::kS);
  T* sP = carve<T>(at, L::kP);
  float* sO = carve<float>(at, L::kO);
  float* sM = carve<float>(at, L::kRows);
  float* sL = carve<float>(at, L::kRows);
  float* sAlpha = carve<float>(at, L::kRows);

  const auto [qt, h, group, b, row0] = query_tile(p);
  const T* k = p.k + b * p.kl.batch + group * p.kl.head;
  const T* v = p.v + b * p.vl.batch + group * p.vl.head;
  load_tile<T, D>(sQ, p.q + b * p.ql.batch + h * p.ql.head, p.ql.seq, row0, p.seq);
  for (int e = threadIdx.x; e < kTile * L::kLdO; e += kThreads) sO[e] = 0.0f;
  if (threadIdx.x < kTile) {
    sM[threadIdx.x] = -INFINITY;
    sL[threadIdx.x] = 0.0f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wrow = warp * 16;

  for (int kt = 0; kt <= qt; ++kt) {
    __syncthreads();  // no warp still reads the previous K and V
    load_tile<T, D>(sK, k, p.kl.seq, int64_t{kt} * kTile, p.seq);
    load_tile<T, D>(sV, v, p.vl.seq, int64_t{kt} * kTile, p.seq);
    __syncthreads();
    rows_times_transposed<T, D>(sQ + wrow * L::kLdT, sK, sS + wrow * L::kLdS);
    __syncwarp();
    const int64_t j = int64_t{kt} * kTile + 2 * lane;  // this lane's columns: j and j + 1
    for (int r = 0; r < 16; ++r) {
      const int row = wrow + r;
      const int64_t i = row0 + row;
      const float2 raw = *reinterpret_cast<const float2*>(sS + row * L::kLdS + 2 * lane);
      const float s0 = j <= i && j < p.seq ? raw.x * p.scale_log2 : -INFINITY;
      const float s1 = j + 1 <= i && j + 1 < p.seq ? raw.y * p.scale_log2 : -INFINITY;
      const float m_old = sM[row];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing yet stays at 0
      float e0 = exp2f(s0 - base), e1 = exp2f(s1 - base);
      const float sum = warp_sum(e0 + e1);
      if (p.dropout && i < p.seq) {  // row-uniform: the pair's hash shuffles across the warp
        const float2 z = pair_factors(p.bits, mask_row(p, b, h, i) + int64_t{kt} * kTile, lane);
        e0 *= z.x;
        e1 *= z.y;
      }
      sP[row * L::kLdP + 2 * lane] = from_float<T>(e0);
      sP[row * L::kLdP + 2 * lane + 1] = from_float<T>(e1);
      __syncwarp();  // every lane has read m_old
      if (lane == 0) {
        const float alpha = exp2f(m_old - base);
        sAlpha[row] = alpha;
        sL[row] = sL[row] * alpha + sum;
        sM[row] = m_new;
      }
    }
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      const float alpha = sAlpha[wrow + r];
      for (int c = lane; c < D; c += 32) sO[(wrow + r) * L::kLdO + c] *= alpha;
    }
    __syncwarp();
    rows_times<T, D>(sP + wrow * L::kLdP, sV, sO + wrow * L::kLdO, true);
    __syncwarp();
  }

  for (int r = 0; r < 16; ++r) {
    const int row = wrow + r;
    const int64_t i = row0 + row;
    if (i >= p.seq) break;
    const float inverse = 1.0f / sL[row];
    T* o = out + ((b * p.seq + i) * p.heads + h) * D;
    for (int c = lane; c < D; c += 32) o[c] = from_float<T>(sO[row * L::kLdO + c] * inverse);
    if (lane == 0) lse[(b * p.heads + h) * p.seq + i] = (sM[row] + log2f(sL[row])) * kLn2;
  }
}

// delta[(b heads + h) seq + i] = sum over d of dout * out at (b, i, h, d): a warp per row.
template <class T, int D>
__global__ void __launch_bounds__(256)
    delta_kernel(const T* dout, const T* out, int64_t rows, int64_t seq, int heads, float* delta) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t row = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
    float acc = 0.0f;
    for (int c = lane; c < D; c += 32) acc += to_float(dout[row * D + c]) * to_float(out[row * D + c]);
    acc = warp_sum(acc);
    const int64_t h = row % heads, position = row / heads;  // position = b seq + i
    if (lane == 0) delta[(position / seq * heads + h) * seq + position % seq] = acc;
  }
}

// A (query tile, key tile) pair's load for the backward passes: Q and dO of query rows [row0,
// row0 + 64) of head h, and the rows' lse (base 2) and delta.
template <class T, int D>
__device__ void load_query_tile(const Params<T>& p, const T* dout, const float* lse, const float* delta, int64_t b,
                                int h, int64_t row0, T* sQ, T* sdO, float* sLse, float* sDelta) {
  load_tile<T, D>(sQ, p.q + b * p.ql.batch + h * p.ql.head, p.ql.seq, row0, p.seq);
  load_tile<T, D>(sdO, dout + (b * p.seq * p.heads + h) * D, int64_t{p.heads} * D, row0, p.seq);
  if (threadIdx.x < kTile) {
    const int64_t i = row0 + threadIdx.x;
    const int64_t row = (b * p.heads + h) * p.seq + i;
    sLse[threadIdx.x] = i < p.seq ? lse[row] * kLog2e : 0.0f;
    sDelta[threadIdx.x] = i < p.seq ? delta[row] : 0.0f;
  }
}

// A warp's 16 rows of P Z (into pz, unless null) and dS (into ds) of a tile pair, from S and
// dO V^T (fp32, kLdS) and the rows' lse and delta: P = exp2(S scale log2(e) - lse) where the row
// attends to the key (j <= i < seq), else 0; dS = P (Z dO V^T - delta) scale. Both passes of the
// backward form them alike, so dQ's pass and dK's and dV's see the same dS.
template <class T, int D>
__device__ void row_gradients(const Params<T>& p, int64_t b, int h, int64_t row0, int64_t key0, int wrow, int lane,
                              const float* sS, const float* sdP, const float* sLse, const float* sDelta, T* pz, T* ds) {
  using L = Tiles<T, D>;
  const int64_t j = key0 + 2 * lane;  // this lane's columns: j and j + 1
  for (int r = 0; r < 16; ++r) {
    const int row = wrow + r;
    const int64_t i = row0 + row;
    float pz0 = 0.0f, pz1 = 0.0f, ds0 = 0.0f, ds1 = 0.0f;
    if (i < p.seq) {  // row-uniform: the pair's hash shuffles across the warp
      const float2 z = p.dropout ? pair_factors(p.bits, mask_row(p, b, h, i) + key0, lane) : make_float2(1.0f, 1.0f);
      const float2 score = *reinterpret_cast<const float2*>(sS + row * L::kLdS + 2 * lane);
      const float2 dpz = *reinterpret_cast<const float2*>(sdP + row * L::kLdS + 2 * lane);
      const float p0 = j <= i ? exp2f(score.x * p.scale_log2 - sLse[row]) : 0.0f;
      const float p1 = j + 1 <= i ? exp2f(score.y * p.scale_log2 - sLse[row]) : 0.0f;
      pz0 = p0 * z.x;
      pz1 = p1 * z.y;
      ds0 = p0 * (dpz.x * z.x - sDelta[row]) * p.scale;
      ds1 = p1 * (dpz.y * z.y - sDelta[row]) * p.scale;
    }
    if (pz) {
      pz[row * L::kLdP + 2 * lane] = from_float<T>(pz0);
      pz[row * L::kLdP + 2 * lane + 1] = from_float<T>(pz1);
    }
    ds[row * L::kLdP + 2 * lane] = from_float<T>(ds0);
    ds[row * L::kLdP + 2 * lane + 1] = from_float<T>(ds1);
  }
}

// dK and dV of 64 keys of a key/value group.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(Params<T> p, const T* dout, const float* lse, const float* delta, T* dk, AttentionLayout dkl, T* dv,
                    AttentionLayout dvl) {
  if (p.dropout) p.bits = dropout_bits::resolved(p.bits);
  using L = Tiles<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* at = smem;
  T* sK = carve<T>(at, L::kT);
  T* sV = carve<T>(at, L::kT);
  T* sQ = carve<T>(at, L::kT);
  T* sdO = carve<T>(at, L::kT);
  float* sS = carve<float>(at, L::kS);
  float* sdP = carve<float>(at, L::kS);
  T* sPZ = carve<T>(at, L::kP);
  T* sdS = carve<T>(at, L::kP);
  float* sOut = carve<float>(at, L::kO);  // the results on their way out
  float* sLse = carve<float>(at, L::kRows);
  float* sDelta = carve<float>(at, L::kRows);

  const int kt = blockIdx.x, tiles = gridDim.x;
  const int group = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t key0 = int64_t{kt} * kTile;
  load_tile<T, D>(sK, p.k + b * p.kl.batch + group * p.kl.head, p.kl.seq, key0, p.seq);
  load_tile<T, D>(sV, p.v + b * p.vl.batch + group * p.vl.head, p.vl.seq, key0, p.seq);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wrow = warp * 16;
  Accumulator dK[D / 16], dV[D / 16];  // this warp's 16 keys
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dK[n], 0.0f);
    wmma::fill_fragment(dV[n], 0.0f);
  }

  for (int h = group * p.per_group; h < (group + 1) * p.per_group; ++h) {
    for (int qt = kt; qt < tiles; ++qt) {
      const int64_t row0 = int64_t{qt} * kTile;
      __syncthreads();  // no warp still reads the previous Q, dO, P Z, dS
      load_query_tile<T, D>(p, dout, lse, delta, b, h, row0, sQ, sdO, sLse, sDelta);
      __syncthreads();
      rows_times_transposed<T, D>(sQ + wrow * L::kLdT, sK, sS + wrow * L::kLdS);
      rows_times_transposed<T, D>(sdO + wrow * L::kLdT, sV, sdP + wrow * L::kLdS);
      __syncwarp();
      row_gradients<T, D>(p, b, h, row0, key0, wrow, lane, sS, sdP, sLse, sDelta, sPZ, sdS);
      __syncthreads();  // every warp's rows of P Z and dS are written
      columns_transposed_times<T, D>(sPZ + wrow, sdO, dV);
      columns_transposed_times<T, D>(sdS + wrow, sQ, dK);
    }
  }

  // This warp's keys of dK and dV, through its rows of sOut, into their layouts.
  const auto write = [&](Accumulator* acc, T* dst, const AttentionLayout& layout) {
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
      wmma::store_matrix_sync(sOut + wrow * L::kLdO + n * 16, acc[n], L::kLdO, wmma::mem_row_major);
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      const int64_t j = key0 + wrow + r;
      if (j >= p.seq) break;
      T* d = dst + b * layout.batch + j * layout.seq + group * layout.head;
      for (int c = lane; c < D; c += 32) d[c] = from_float<T>(sOut[(wrow + r) * L::kLdO + c]);
    }
  };
  write(dK, dk, dkl);
  write(dV, dv, dvl);
}

// dQ of 64 query rows of a head: the block walks the key tiles up to its own, forming S, dO V^T
// and dS again as backward_kernel does, and adds dS K to its rows in shared memory, in key order.
// A pass of its own (two products more than adding into dQ from backward_kernel's blocks by
// atomics) so that dQ is the same bits on every run: resumed == uninterrupted holds with
// attention dropout too.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(Params<T> p, const T* dout, const float* lse, const float* delta, T* dq, AttentionLayout dql) {
  if (p.dropout) p.bits = dropout_bits::resolved(p.bits);
  using L = Tiles<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* at = smem;
  T* sQ = carve<T>(at, L::kT);
  T* sdO = carve<T>(at, L::kT);
  T* sK = carve<T>(at, L::kT);
  T* sV = carve<T>(at, L::kT);
  float* sS = carve<float>(at, L::kS);
  float* sdP = carve<float>(at, L::kS);
  T* sdS = carve<T>(at, L::kP);
  float* sdQ = carve<float>(at, L::kO);
  float* sLse = carve<float>(at, L::kRows);
  float* sDelta = carve<float>(at, L::kRows);

  const auto [qt, h, group, b, row0] = query_tile(p);
  load_query_tile<T, D>(p, dout, lse, delta, b, h, row0, sQ, sdO, sLse, sDelta);
  for (int e = threadIdx.x; e < kTile * L::kLdO; e += kThreads) sdQ[e] = 0.0f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wrow = warp * 16;
  for (int kt = 0; kt <= qt; ++kt) {
    const int64_t key0 = int64_t{kt} * kTile;
    __syncthreads();  // no warp still reads the previous K and V
    load_tile<T, D>(sK, p.k + b * p.kl.batch + group * p.kl.head, p.kl.seq, key0, p.seq);
    load_tile<T, D>(sV, p.v + b * p.vl.batch + group * p.vl.head, p.vl.seq, key0, p.seq);
    __syncthreads();
    rows_times_transposed<T, D>(sQ + wrow * L::kLdT, sK, sS + wrow * L::kLdS);
    rows_times_transposed<T, D>(sdO + wrow * L::kLdT, sV, sdP + wrow * L::kLdS);
    __syncwarp();
    row_gradients<T, D>(p, b, h, row0, key0, wrow, lane, sS, sdP, sLse, sDelta, nullptr, sdS);
    __syncwarp();
    rows_times<T, D>(sdS + wrow * L::kLdP, sK, sdQ + wrow * L::kLdO, true);
    __syncwarp();
  }
  for (int r = 0; r < 16; ++r) {
    const int64_t i = row0 + wrow + r;
    if (i >= p.seq) break;
    T* d = dq + b * dql.batch + i * dql.seq + h * dql.head;
    for (int c = lane; c < D; c += 32) d[c] = from_float<T>(sdQ[(wrow + r) * L::kLdO + c]);
  }
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

// Lets `kernel` take `bytes` of dynamic shared memory (past the default 48 KB).
template <class Kernel>
void allow_shared_memory(Kernel* kernel, size_t bytes) {
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess)
    throw CudaError("attention: " + std::to_string(bytes) + " bytes of shared memory: " + cudaGetErrorString(e));
}

void check_shape(const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  int device = 0;
  cudaGetDevice(&device);
  const bool fits = s.batch > 0 && s.seq > 0 && s.heads > 0 && s.groups > 0 && s.heads % s.groups == 0 &&
                    s.batch <= 65535 && s.heads <= 65535 && (s.seq + kTile - 1) / kTile <= 0x7fffffffLL &&
                    attention_supported(a.type, s.head_dim, device) && (!a.dropout || a.dropout->run_numel == 0);
  if (!fits)
    throw CudaError("attention: shape [" + std::to_string(s.batch) + ", " + std::to_string(s.seq) + ", " +
                    std::to_string(s.heads) + "/" + std::to_string(s.groups) + ", " + std::to_string(s.head_dim) +
                    "] or its type or mask is not one the kernels take");
}

template <class T>
Params<T> params_of(const AttentionArgs& a) {
  Params<T> p;
  p.q = static_cast<const T*>(a.q);
  p.k = static_cast<const T*>(a.k);
  p.v = static_cast<const T*>(a.v);
  p.ql = a.q_layout;
  p.kl = a.k_layout;
  p.vl = a.v_layout;
  p.seq = a.shape.seq;
  p.heads = static_cast<int>(a.shape.heads);
  p.per_group = static_cast<int>(a.shape.heads / a.shape.groups);
  p.scale = a.scale;
  p.scale_log2 = a.scale * kLog2e;
  p.dropout = a.dropout != nullptr;
  if (a.dropout) p.bits = *a.dropout;
  return p;
}

unsigned tiles_of(const AttentionShape& s) { return static_cast<unsigned>((s.seq + kTile - 1) / kTile); }

template <class T, int D>
void forward(const AttentionArgs& a, void* out, float* lse, StreamHandle stream) {
  constexpr size_t bytes = Tiles<T, D>::kForward;
  allow_shared_memory(forward_kernel<T, D>, bytes);
  const dim3 grid(tiles_of(a.shape), static_cast<unsigned>(a.shape.heads), static_cast<unsigned>(a.shape.batch));
  forward_kernel<T, D><<<grid, kThreads, bytes, stream>>>(params_of<T>(a), static_cast<T*>(out), lse);
  check("attention_forward");
}

unsigned blocks_for(int64_t threads_needed) {
  return static_cast<unsigned>(std::min<int64_t>((threads_needed + 255) / 256, 65536));
}

template <class T, int D>
void backward(const AttentionArgs& a, const void* dout, const void* out, const float* lse, const AttentionGrads& g,
              StreamHandle stream) {
  const AttentionShape& s = a.shape;
  const int64_t rows = s.batch * s.seq * s.heads;
  delta_kernel<T, D><<<blocks_for(rows * 32), 256, 0, stream>>>(static_cast<const T*>(dout), static_cast<const T*>(out),
                                                                rows, s.seq, static_cast<int>(s.heads), g.delta);
  check("attention_backward (delta)");
  const Params<T> params = params_of<T>(a);
  allow_shared_memory(backward_kernel<T, D>, Tiles<T, D>::kBackward);
  const dim3 keys(tiles_of(s), static_cast<unsigned>(s.groups), static_cast<unsigned>(s.batch));
  backward_kernel<T, D><<<keys, kThreads, Tiles<T, D>::kBackward, stream>>>(params, static_cast<const T*>(dout), lse,
                                                                            g.delta, static_cast<T*>(g.dk), g.dk_layout,
                                                                            static_cast<T*>(g.dv), g.dv_layout);
  check("attention_backward (dk, dv)");
  allow_shared_memory(dq_kernel<T, D>, Tiles<T, D>::kDq);
  const dim3 queries(tiles_of(s), static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
  dq_kernel<T, D><<<queries, kThreads, Tiles<T, D>::kDq, stream>>>(params, static_cast<const T*>(dout), lse, g.delta,
                                                                   static_cast<T*>(g.dq), g.dq_layout);
  check("attention_backward (dq)");
}

// f(T{}, std::integral_constant<int, D>{}) for the call's type and head_dim.
template <class F>
void dispatch(const AttentionArgs& a, F&& f) {
  check_shape(a);
  const auto with_type = [&](auto t) {
    if (a.shape.head_dim == 128)
      f(t, std::integral_constant<int, 128>{});
    else
      f(t, std::integral_constant<int, 64>{});
  };
  if (a.type == ElementType::kBFloat16)
    with_type(__nv_bfloat16{});
  else
    with_type(__half{});
}

}  // namespace

bool attention_supported(ElementType type, int64_t head_dim, int device) {
  if (type == ElementType::kFloat32 || (head_dim != 64 && head_dim != 128)) return false;
  // bf16 WMMA needs sm_80; the backward's tiles need their shared memory (sm_86/89 allow 99 KB a
  // block, less than head_dim 128 takes).
  int major = 0, shared = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();  // a bad device index: not this call's error to keep
    return false;
  }
  const size_t need = head_dim == 128 ? std::max(Tiles<__half, 128>::kForward, Tiles<__half, 128>::kBackward)
                                      : std::max(Tiles<__half, 64>::kForward, Tiles<__half, 64>::kBackward);
  return major >= 8 && static_cast<size_t>(shared) >= need;
}

void attention_forward(const AttentionArgs& a, void* out, float* lse, StreamHandle stream) {
  dispatch(a, [&](auto t, auto d) { forward<decltype(t), decltype(d)::value>(a, out, lse, stream); });
}

void attention_backward(const AttentionArgs& a, const void* dout, const void* out, const float* lse,
                        const AttentionGrads& g, StreamHandle stream) {
  dispatch(a, [&](auto t, auto d) { backward<decltype(t), decltype(d)::value>(a, dout, out, lse, g, stream); });
}

}  // namespace dtk::cuda
