// Causal attention with DTK's dropout (dtk/cuda/attention.hpp): FlashAttention-2's schedule with
// the scores, probabilities and accumulators in registers. Each warp multiplies through
// mma.sync (m16n8k16: T in, fp32 out), its operands read from shared memory by ldmatrix, so a
// tile's scores never leave the registers: the fragment a product leaves (16 rows x 8 columns,
// each thread two rows' two adjacent columns) is, rounded to T, the left operand of the next
// product (FlashAttention-2's register reuse). Tiles move from global to shared memory by
// cp.async, the next one while the warps compute on the current one.
//
// Fragments (PTX ISA, mma.m16n8k16 with .bf16/.f16): lane l is in row group g = l / 4 with
// column pair t = l % 4. An accumulator c[4] holds rows g and g + 8, columns 2t and 2t + 1; the
// left operand a[4] rows g and g + 8, columns 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2],
// a[3]); the right operand b[2] column g, rows 2t, 2t + 1 (b[0]) and 2t + 8, 2t + 9 (b[1]).
//
// Forward: a block per (64 query rows, head, sequence), 4 warps of 16 rows. Per key tile up to
// the diagonal: S = Q K^T, the rows' running max and sum (fp32, base 2; each thread keeps its
// share of the sum, the quad's shares added at the end), P Z in T and O += P Z V.
//
// Backward, after a pass for delta = rowsum(dO O): a block per (64 keys, key/value group,
// sequence) walks every query tile that reaches its keys (from the one holding its first key's
// position; with a window, up to the last whose window reaches them) for each query head of the group, forming
// S^T = K Q^T and dP^T = V dO^T (keys as rows), P^T from the scores and lse, dV += (P Z)^T dO and
// dK += dS^T Q with dS = P (Z dP - delta) scale; then a block per (64 query rows, head, sequence)
// walks its key tiles for dQ += dS K, in key order. No atomics: every gradient is the same bits
// on every run (FlashAttention-2's deterministic backward, at two products more).
//
// A sliding window (Megatron's --window-size W,0: query i sees keys i - W to i) bounds every
// walk: the forward and the dQ pass start at the key tile of their first row's window, the key
// pass stops at the query tile its last key's window ends in, so a layer costs 64 s (ceil(W /
// 64) + 1) score elements a head (about s (W + 96)) instead of s^2 / 2; tiles crossing a
// window's edge are masked like the diagonal.
//
// Fewer queries than keys (seq < keys: a context-parallel chunk of queries over the keys up to
// its end): query i sits at position keys - seq + i, the diagonal bottom-right aligned
// (FlashAttention's causal rule for such shapes). The walks start and stop where that diagonal
// and the window put them; the key pass starts at the query tile holding its first key's
// position, and a key tile that no query sees (a window ending before the queries) gets zeros.
//
// Mask: element (b, h, i, j) is kept when dropout_bits::kept_at of its index ((b heads + h) seq +
// i) pitch + j does (pitch = keys, or the row length of a wider mask a block of columns is
// taken from); one hash word holds an even index and the odd one after it. Where a thread
// holds a row's two adjacent keys (forward, dQ) they share a word where the row starts at an even
// index (an even seq and offset), and take two words otherwise. Where keys are the rows (dK
// and dV), the ldmatrix rows are permuted so that a thread's two rows g and g + 8 are keys 2g and
// 2g + 1 of its warp's 16: again one word for two elements. Positions j > p, j < p - W (p = keys
// - seq + i, query i's position) and padding past seq or keys are P = 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "dropout_bits.cuh"
#include "dtk/cuda/attention.hpp"
#include "element.cuh"
#include "launch.cuh"
#ifdef DTK_SIMT_EMULATION
#include DTK_SIMT_EMULATION  // the instructions on the CPU (tests/cuda_emulated/simt.hpp)
#else
#include "warp_mma.cuh"
#endif

namespace dtk::cuda {
namespace {

constexpr int kTile = 64;  // query rows and keys per tile
constexpr int kWarps = 4;  // each owns 16 rows of a tile
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using element::from_float;
using element::to_float;
using warp::commit_copies;
using warp::copy16;
using warp::copy4;
using warp::load_matrices;
using warp::load_matrices_transposed;
using warp::mma;
using warp::wait_copies;

// A [64, D] tile of T in shared memory, rows padded by 16 bytes so that the 8 rows an ldmatrix
// reads start in different banks.
template <class T, int D>
struct Tile {
  static constexpr int kLd = D + 8;
  static constexpr int kElements = kTile * kLd;
  static constexpr size_t kBytes = size_t{kElements} * sizeof(T);
};

// Shared memory a block of each kernel takes: forward Q and two buffers of K and V; the key
// pass K, V and two buffers of Q, dO, lse and delta; the query pass Q, dO and two of K and V.
template <class T, int D>
struct Shared {
  static constexpr size_t kForward = 5 * Tile<T, D>::kBytes;
  static constexpr size_t kKeys = 6 * Tile<T, D>::kBytes + 4 * kTile * sizeof(float);
  static constexpr size_t kQueries = 6 * Tile<T, D>::kBytes;
};

template <class T>
struct Params {
  const T* q;
  const T* k;
  const T* v;
  AttentionLayout ql, kl, vl;
  int64_t seq, keys;   // queries, keys (keys >= seq): query i sits at position offset + i
  int64_t offset;      // keys - seq: the causal diagonal is bottom-right aligned
  int64_t mask_pitch;  // the dropout mask's elements per row (keys, or a wider mask's row)
  int heads, per_group;
  float scale, scale_log2;  // the scores' scale, and times log2(e) for exp2
  int64_t window;           // a sliding window: keys before (position) - window masked too; -1: none
  bool dropout;
  DropoutBits bits;
};

// Whether query i (at position offset + i) attends to key j: causal, and within the sliding
// window where there is one.
template <class T>
__device__ __forceinline__ bool attends(const Params<T>& p, int64_t i, int64_t j) {
  const int64_t at = p.offset + i;
  return j <= at && (p.window < 0 || j >= at - p.window);
}

// The first key tile a query tile whose rows start at row0 reaches (its first row's window).
template <class T>
__device__ __forceinline__ int first_key_tile(const Params<T>& p, int64_t row0) {
  const int64_t at = p.offset + row0;
  return p.window < 0 || at <= p.window ? 0 : static_cast<int>((at - p.window) / kTile);
}

// The last key tile (of `tiles`) a query tile whose rows start at row0 reaches: its last row's.
template <class T>
__device__ __forceinline__ int last_key_tile(const Params<T>& p, int64_t row0, int tiles) {
  const int64_t last = (p.offset + row0 + kTile - 1) / kTile;
  return last < tiles - 1 ? static_cast<int>(last) : tiles - 1;
}

// The query tiles (of `tiles`) that reach a key tile whose keys start at key0: from the one
// holding the row at the tile's first key (offset + i >= key0) to the one whose last key's window
// ends at key0 + 63 + window; none where that is before the first.
template <class T>
__device__ __forceinline__ int first_query_tile(const Params<T>& p, int64_t key0) {
  return key0 <= p.offset ? 0 : static_cast<int>((key0 - p.offset) / kTile);
}
template <class T>
__device__ __forceinline__ int last_query_tile(const Params<T>& p, int64_t key0, int tiles) {
  if (p.window < 0) return tiles - 1;
  const int64_t reach = key0 + kTile - 1 + p.window - p.offset;  // the last row seeing a key here
  if (reach < 0) return -1;
  const int64_t last = reach / kTile;
  return last < tiles - 1 ? static_cast<int>(last) : tiles - 1;
}

// Whether key tile kt holds a key some row of the query tile at row0 does not attend to: one past
// the first row's position (the diagonal's future), or before the last row's window.
template <class T>
__device__ __forceinline__ bool tile_masked(const Params<T>& p, int kt, int64_t row0) {
  const int64_t key0 = int64_t{kt} * kTile;
  return key0 + kTile - 1 > p.offset + row0 || (p.window >= 0 && key0 < p.offset + row0 + kTile - 1 - p.window);
}

// Two fp32 rounded to T, the first in the low half (the lower column).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T x[2] = {from_float<T>(lo), from_float<T>(hi)};
  uint32_t r;
  memcpy(&r, x, sizeof r);
  return r;
}

// ---- Products of a warp's 16 rows ----

// c[n] += A B^T for a 16 x D left operand whose row for this lane starts at a_row (in a tile)
// and B the 64 rows of tile b: S = Q K^T, dP = dO V^T, S^T = K Q^T, dP^T = V dO^T. Column block n
// of c is B's rows 8n..8n+7.
template <class T, int D>
__device__ __forceinline__ void times_rows(const T* a_row, const T* b, float (&c)[kTile / 8][4], int lane) {
  constexpr int kLd = Tile<T, D>::kLd;
  // ldmatrix rows of B: lanes 0-7 rows 0-7 (columns 0-7), 8-15 the same rows (columns 8-15),
  // 16-23 rows 8-15, 24-31 rows 8-15 (columns 8-15): b[0], b[1] of two column blocks.
  const T* b_row = b + (lane / 16 * 8 + lane % 8) * kLd + (lane / 8 % 2) * 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_matrices(a, a_row + kk * 16 + lane / 16 * 8);
#pragma unroll
    for (int np = 0; np < kTile / 16; ++np) {
      uint32_t bb[4];
      load_matrices(bb, b_row + np * 16 * kLd + kk * 16);
      mma<T>(c[2 * np], a, bb[0], bb[1]);
      mma<T>(c[2 * np + 1], a, bb[2], bb[3]);
    }
  }
}

// c[n] += A B for A 16 x 64 in registers (a[kk]: columns 16kk..16kk+15) and B a [64, N] tile:
// O += P Z V, dQ += dS K, dV += (P Z)^T dO, dK += dS^T Q. Column block n of c is B's columns
// 8n..8n+7.
template <class T, int D>
__device__ __forceinline__ void times_tile(const uint32_t (&a)[kTile / 16][4], const T* b, float (&c)[D / 8][4],
                                           int lane) {
  constexpr int kLd = Tile<T, D>::kLd;
  // Transposed ldmatrix of B's rows: lanes 0-7 rows 0-7, 8-15 rows 8-15 (columns 0-7), 16-31
  // the same rows (columns 8-15): b[0], b[1] of two column blocks.
  const T* b_row = b + (lane / 8 % 2 * 8 + lane % 8) * kLd + lane / 16 * 8;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t bb[4];
      load_matrices_transposed(bb, b_row + kk * 16 * kLd + np * 16);
      mma<T>(c[2 * np], a[kk], bb[0], bb[1]);
      mma<T>(c[2 * np + 1], a[kk], bb[2], bb[3]);
    }
  }
}

// A 16 x 64 accumulator rounded to T as a left operand (the accumulator's layout is the left
// operand's, two column blocks at a time).
template <class T>
__device__ __forceinline__ void as_left_operand(const float (&c)[kTile / 8][4], uint32_t (&a)[kTile / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    a[kk][0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
}

// ---- Tiles, masks, rows ----

// Rows [first, first + 64) of a [seq, D] operand whose rows are `stride` apart into a tile, by
// cp.async; rows past seq are zeros.
template <class T, int D>
__device__ __forceinline__ void copy_tile(T* tile, const T* src, int64_t stride, int64_t first, int64_t seq) {
  constexpr int kVectors = D / 8;
  for (int at = threadIdx.x; at < kTile * kVectors; at += kThreads) {
    const int r = at / kVectors, c = at % kVectors * 8;
    const bool valid = first + r < seq;
    copy16(tile + r * Tile<T, D>::kLd + c, valid ? src + (first + r) * stride + c : src, valid);
  }
}

// Before a block of the forward or the query pass works on key tile kt of 0..last (its K and V
// in buffer kt % 2 of sK and sV): once no warp reads the other buffer any more, tile kt + 1's
// copies into it start, and tile kt's have landed.
template <class T, int D>
__device__ __forceinline__ void next_key_tile(const Params<T>& p, const T* k, const T* v, T* sK, T* sV, int kt,
                                              int last) {
  constexpr int kTileElements = Tile<T, D>::kElements;
  const int other = 1 - kt % 2;
  __syncthreads();
  if (kt < last) {
    copy_tile<T, D>(sK + other * kTileElements, k, p.kl.seq, int64_t{kt + 1} * kTile, p.keys);
    copy_tile<T, D>(sV + other * kTileElements, v, p.vl.seq, int64_t{kt + 1} * kTile, p.keys);
    commit_copies();
    wait_copies<1>();
  } else {
    wait_copies<0>();
  }
  __syncthreads();
}

// The dropout multipliers (scale where kept, 0 where dropped) of mask elements first and
// first + 1: one hash where first is even, two where the pair straddles words.
__device__ __forceinline__ float2 pair_factors(const DropoutBits& m, int64_t first) {
  const uint64_t word = dropout_bits::mix(m.seed, static_cast<uint64_t>(first >> 1));
  uint32_t u0 = static_cast<uint32_t>(word), u1 = static_cast<uint32_t>(word >> 32);
  if (first & 1) {
    u0 = u1;
    u1 = static_cast<uint32_t>(dropout_bits::mix(m.seed, static_cast<uint64_t>(first >> 1) + 1));
  }
  return make_float2(u0 >= m.threshold ? m.scale : 0.0f, u1 >= m.threshold ? m.scale : 0.0f);
}

// Tiles of the queries (a grid's x for the forward and the dQ pass) and of the keys (the key pass).
template <class T>
__device__ __forceinline__ int query_tiles_of(const Params<T>& p) {
  return static_cast<int>((p.seq + kTile - 1) / kTile);
}
template <class T>
__device__ __forceinline__ int key_tiles(const Params<T>& p) {
  return static_cast<int>((p.keys + kTile - 1) / kTile);
}

// The mask's element (b, h, i, 0): the offset, then rows of mask_pitch elements, [b, heads, seq]
// of them (row-major [b, heads, seq, keys] where the pitch is keys).
template <class T>
__device__ __forceinline__ int64_t mask_row(const Params<T>& p, int64_t b, int h, int64_t i) {
  return p.bits.offset + ((b * p.heads + h) * p.seq + i) * p.mask_pitch;
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

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A thread's two rows (g and g + 8 of its warp's 16) of a [rows, D] result, columns 8n + 2t and
// 8n + 2t + 1, times each row's factor, into dst (row r at dst + r * stride); rows at or past
// `rows_left` are not written.
template <class T, int D>
__device__ __forceinline__ void write_rows(const float (&c)[D / 8][4], const float (&factor)[2], T* dst0, T* dst1,
                                           bool write0, bool write1, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int d = 8 * n + 2 * t;
    if (write0) *reinterpret_cast<uint32_t*>(dst0 + d) = pack2<T>(c[n][0] * factor[0], c[n][1] * factor[0]);
    if (write1) *reinterpret_cast<uint32_t*>(dst1 + d) = pack2<T>(c[n][2] * factor[1], c[n][3] * factor[1]);
  }
}

// ---- Forward ----

template <class T, int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 4 : 2) forward_kernel(Params<T> p, T* out, float* lse) {
  if (p.dropout) p.bits = dropout_bits::resolved(p.bits);
  constexpr int kLd = Tile<T, D>::kLd, kTileElements = Tile<T, D>::kElements;
  DTK_DYNAMIC_SHARED(unsigned char, smem);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kTileElements;      // two buffers
  T* sV = sK + 2 * kTileElements;  // two buffers

  const auto [qt, h, group, b, row0] = query_tile(p);
  const T* k = p.k + b * p.kl.batch + group * p.kl.head;
  const T* v = p.v + b * p.vl.batch + group * p.vl.head;
  const int kt0 = first_key_tile(p, row0), kt1 = last_key_tile(p, row0, key_tiles(p));
  copy_tile<T, D>(sQ, p.q + b * p.ql.batch + h * p.ql.head, p.ql.seq, row0, p.seq);
  copy_tile<T, D>(sK + kt0 % 2 * kTileElements, k, p.kl.seq, int64_t{kt0} * kTile, p.keys);
  copy_tile<T, D>(sV + kt0 % 2 * kTileElements, v, p.vl.seq, int64_t{kt0} * kTile, p.keys);
  commit_copies();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q_row = sQ + (warp * 16 + lane % 16) * kLd;
  const int64_t rows[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  int64_t mask_rows[2] = {0, 0};
  if (p.dropout) mask_rows[0] = mask_row(p, b, h, rows[0]), mask_rows[1] = mask_row(p, b, h, rows[1]);
  float o[D / 8][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // l: this thread's share of the sum

  for (int kt = kt0; kt <= kt1; ++kt) {
    const int buffer = kt % 2;
    next_key_tile<T, D>(p, k, v, sK, sV, kt, kt1);

    float s[kTile / 8][4];
    zero(s);
    times_rows<T, D>(q_row, sK + buffer * kTileElements, s, lane);

    // Scaled scores (base 2), the mask on the diagonal tile (and the window's edge), the rows'
    // new max. A row may see none of a tile at its window's edge: its max stays -inf.
    const int64_t key0 = int64_t{kt} * kTile + 2 * t;
    const bool masked = tile_masked(p, kt, row0);
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = key0 + 8 * n + e % 2;
        s[n][e] = masked && !attends(p, rows[e / 2], j) ? -INFINITY : s[n][e] * p.scale_log2;
        row_max[e / 2] = fmaxf(row_max[e / 2], s[n][e]);
      }
    float alpha[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(row_max[r]));
      base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing yet stays at 0
      alpha[r] = exp2f(m[r] - base[r]);
      m[r] = m_new;
    }

    // P = exp2(S - max) summed before the mask, then P Z.
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        sum[e / 2] += s[n][e];
      }
      if (p.dropout) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float2 z = pair_factors(p.bits, mask_rows[r] + key0 + 8 * n);
          s[n][2 * r] *= z.x;
          s[n][2 * r + 1] *= z.y;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    uint32_t pz[kTile / 16][4];
    as_left_operand<T>(s, pz);
    times_tile<T, D>(pz, sV + buffer * kTileElements, o, lane);
  }

  const float total[2] = {quad_sum(l[0]), quad_sum(l[1])};
  const float inverse[2] = {1.0f / total[0], 1.0f / total[1]};
  T* o0 = out + ((b * p.seq + rows[0]) * p.heads + h) * D;
  T* o1 = out + ((b * p.seq + rows[1]) * p.heads + h) * D;
  write_rows<T, D>(o, inverse, o0, o1, rows[0] < p.seq, rows[1] < p.seq, lane);
  if (t == 0)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (rows[r] < p.seq) lse[(b * p.heads + h) * p.seq + rows[r]] = (m[r] + log2f(total[r])) * kLn2;
}

// ---- Backward ----

// delta[(b heads + h) seq + i] = sum over d of dout * out at (b, i, h, d): a warp per row.
template <class T, int D>
__global__ void __launch_bounds__(256)
    delta_kernel(const T* dout, const T* out, int64_t rows, int64_t seq, int heads, float* delta) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t row = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
    float acc = 0.0f;
    for (int c = lane; c < D; c += 32) acc += to_float(dout[row * D + c]) * to_float(out[row * D + c]);
    for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    const int64_t h = row % heads, position = row / heads;  // position = b seq + i
    if (lane == 0) delta[(position / seq * heads + h) * seq + position % seq] = acc;
  }
}

// The gradient of a probability from its score and dP = dO V^T (both as the products left them):
// P = exp2(S scale log2(e) - lse) where the query attends to the key, else 0; returns P Z (into
// score) and dS = P (Z dP - delta) scale (into dp). lse in base 2.
template <class T>
__device__ __forceinline__ void probability_gradient(const Params<T>& p, bool attends, float lse2, float delta, float z,
                                                     float& score, float& dp) {
  const float prob = attends ? exp2f(score * p.scale_log2 - lse2) : 0.0f;
  score = prob * z;
  dp = prob * (dp * z - delta) * p.scale;
}

// dK and dV of 64 keys of a key/value group.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    key_gradients_kernel(Params<T> p, const T* dout, const float* lse, const float* delta, T* dk, AttentionLayout dkl,
                         T* dv, AttentionLayout dvl) {
  if (p.dropout) p.bits = dropout_bits::resolved(p.bits);
  constexpr int kLd = Tile<T, D>::kLd, kTileElements = Tile<T, D>::kElements;
  DTK_DYNAMIC_SHARED(unsigned char, smem);
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kTileElements;
  T* sQ = sV + kTileElements;                                       // two buffers
  T* sdO = sQ + 2 * kTileElements;                                  // two buffers
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kTileElements);  // two buffers
  float* sDelta = sLse + 2 * kTile;                                 // two buffers

  const int kt = blockIdx.x;
  const int64_t key0 = int64_t{kt} * kTile;
  const int qt0 = first_query_tile(p, key0);
  const int reach = last_query_tile(p, key0, query_tiles_of(p)) - qt0 + 1;
  const int query_tiles = reach > 0 ? reach : 0;
  const int group = blockIdx.y;
  const int64_t b = blockIdx.z;
  // Step `at` of the block's walk: query tile qt0 + at % query_tiles of the group's head
  // at / query_tiles, its Q, dO, lse and delta into buffer at % 2.
  const auto copy_step = [&](int at) {
    const int h = group * p.per_group + at / query_tiles;
    const int64_t row0 = int64_t{qt0 + at % query_tiles} * kTile;
    const int buffer = at % 2;
    copy_tile<T, D>(sQ + buffer * kTileElements, p.q + b * p.ql.batch + h * p.ql.head, p.ql.seq, row0, p.seq);
    copy_tile<T, D>(sdO + buffer * kTileElements, dout + (b * p.seq * p.heads + h) * D, int64_t{p.heads} * D, row0,
                    p.seq);
    if (threadIdx.x < kTile) {
      const int64_t i = row0 + threadIdx.x, row = (b * p.heads + h) * p.seq + i;
      copy4(sLse + buffer * kTile + threadIdx.x, i < p.seq ? lse + row : lse, i < p.seq);
      copy4(sDelta + buffer * kTile + threadIdx.x, i < p.seq ? delta + row : delta, i < p.seq);
    }
    commit_copies();
  };
  // No query reaches these keys where a window ends before the queries' first position: dK and
  // dV are zero, written below.
  if (query_tiles > 0) {
    copy_tile<T, D>(sK, p.k + b * p.kl.batch + group * p.kl.head, p.kl.seq, key0, p.keys);
    copy_tile<T, D>(sV, p.v + b * p.vl.batch + group * p.vl.head, p.vl.seq, key0, p.keys);
    copy_step(0);
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // This lane's ldmatrix row of K and V: product rows 0-7 are the warp's keys 0, 2, .., 14 and
  // rows 8-15 keys 1, 3, .., 15, so that a thread's rows g and g + 8 are adjacent keys.
  const int r16 = lane % 16, key_of_row = r16 < 8 ? 2 * r16 : 2 * (r16 - 8) + 1;
  const T* k_row = sK + (warp * 16 + key_of_row) * kLd;
  const T* v_row = sV + (warp * 16 + key_of_row) * kLd;
  const int64_t keys[2] = {key0 + warp * 16 + 2 * g, key0 + warp * 16 + 2 * g + 1};
  float dK[D / 8][4], dV[D / 8][4];
  zero(dK);
  zero(dV);

  const int steps = p.per_group * query_tiles;
  for (int at = 0; at < steps; ++at) {
    const int h = group * p.per_group + at / query_tiles, buffer = at % 2;
    const int64_t row0 = int64_t{qt0 + at % query_tiles} * kTile;
    __syncthreads();  // no warp still reads the buffer the next copies fill
    if (at + 1 < steps) {
      copy_step(at + 1);
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const T* q = sQ + buffer * kTileElements;
    const T* d_out = sdO + buffer * kTileElements;

    float s[kTile / 8][4], dp[kTile / 8][4];  // S^T and dP^T: rows keys, columns queries
    zero(s);
    zero(dp);
    times_rows<T, D>(k_row, q, s, lane);
    times_rows<T, D>(v_row, d_out, dp, lane);
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // query column 8n + 2t + c; s[n][c] key 0, s[n][2 + c] key 1
        const int column = 8 * n + 2 * t + c;
        const int64_t i = row0 + column;
        const float lse2 = sLse[buffer * kTile + column] * kLog2e, d = sDelta[buffer * kTile + column];
        float2 z = make_float2(1.0f, 1.0f);
        if (p.dropout && i < p.seq) z = pair_factors(p.bits, mask_row(p, b, h, i) + keys[0]);
        probability_gradient(p, i < p.seq && attends(p, i, keys[0]), lse2, d, z.x, s[n][c], dp[n][c]);
        probability_gradient(p, i < p.seq && attends(p, i, keys[1]), lse2, d, z.y, s[n][2 + c], dp[n][2 + c]);
      }
    uint32_t a[kTile / 16][4];
    as_left_operand<T>(s, a);
    times_tile<T, D>(a, d_out, dV, lane);
    as_left_operand<T>(dp, a);
    times_tile<T, D>(a, q, dK, lane);
  }

  const float one[2] = {1.0f, 1.0f};
  const auto row_of = [&](T* base, const AttentionLayout& layout, int64_t j) {
    return base + b * layout.batch + j * layout.seq + group * layout.head;
  };
  write_rows<T, D>(dK, one, row_of(dk, dkl, keys[0]), row_of(dk, dkl, keys[1]), keys[0] < p.keys, keys[1] < p.keys,
                   lane);
  write_rows<T, D>(dV, one, row_of(dv, dvl, keys[0]), row_of(dv, dvl, keys[1]), keys[0] < p.keys, keys[1] < p.keys,
                   lane);
}

// dQ of 64 query rows of a head: the block walks the key tiles up to its own, forming S, dP and
// dS again as key_gradients_kernel does (queries as rows here), and adds dS K to its rows in
// registers, in key order. A pass of its own (two products more than adding into dQ from the key
// pass by atomics) so that dQ is the same bits on every run: resumed == uninterrupted holds
// with attention dropout too.
template <class T, int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 3 : 2)
    query_gradients_kernel(Params<T> p, const T* dout, const float* lse, const float* delta, T* dq,
                           AttentionLayout dql) {
  if (p.dropout) p.bits = dropout_bits::resolved(p.bits);
  constexpr int kLd = Tile<T, D>::kLd, kTileElements = Tile<T, D>::kElements;
  DTK_DYNAMIC_SHARED(unsigned char, smem);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + kTileElements;
  T* sK = sdO + kTileElements;     // two buffers
  T* sV = sK + 2 * kTileElements;  // two buffers

  const auto [qt, h, group, b, row0] = query_tile(p);
  const T* k = p.k + b * p.kl.batch + group * p.kl.head;
  const T* v = p.v + b * p.vl.batch + group * p.vl.head;
  const int kt0 = first_key_tile(p, row0), kt1 = last_key_tile(p, row0, key_tiles(p));
  copy_tile<T, D>(sQ, p.q + b * p.ql.batch + h * p.ql.head, p.ql.seq, row0, p.seq);
  copy_tile<T, D>(sdO, dout + (b * p.seq * p.heads + h) * D, int64_t{p.heads} * D, row0, p.seq);
  copy_tile<T, D>(sK + kt0 % 2 * kTileElements, k, p.kl.seq, int64_t{kt0} * kTile, p.keys);
  copy_tile<T, D>(sV + kt0 % 2 * kTileElements, v, p.vl.seq, int64_t{kt0} * kTile, p.keys);
  commit_copies();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q_row = sQ + (warp * 16 + lane % 16) * kLd;
  const T* dout_row = sdO + (warp * 16 + lane % 16) * kLd;
  const int64_t rows[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  float lse2[2] = {0.0f, 0.0f}, row_delta[2] = {0.0f, 0.0f};
  int64_t mask_rows[2] = {0, 0};
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (rows[r] < p.seq) {
      lse2[r] = lse[(b * p.heads + h) * p.seq + rows[r]] * kLog2e;
      row_delta[r] = delta[(b * p.heads + h) * p.seq + rows[r]];
      if (p.dropout) mask_rows[r] = mask_row(p, b, h, rows[r]);
    }
  float dQ[D / 8][4];
  zero(dQ);

  for (int kt = kt0; kt <= kt1; ++kt) {
    const int buffer = kt % 2;
    next_key_tile<T, D>(p, k, v, sK, sV, kt, kt1);
    const T* keys = sK + buffer * kTileElements;

    float s[kTile / 8][4], dp[kTile / 8][4];
    zero(s);
    zero(dp);
    times_rows<T, D>(q_row, keys, s, lane);
    times_rows<T, D>(dout_row, sV + buffer * kTileElements, dp, lane);
    const int64_t key0 = int64_t{kt} * kTile + 2 * t;
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t j = key0 + 8 * n;
        float2 z = make_float2(1.0f, 1.0f);
        if (p.dropout && rows[r] < p.seq) z = pair_factors(p.bits, mask_rows[r] + j);
        const bool row_valid = rows[r] < p.seq;
        probability_gradient(p, row_valid && attends(p, rows[r], j), lse2[r], row_delta[r], z.x, s[n][2 * r],
                             dp[n][2 * r]);
        probability_gradient(p, row_valid && attends(p, rows[r], j + 1), lse2[r], row_delta[r], z.y, s[n][2 * r + 1],
                             dp[n][2 * r + 1]);
      }
    uint32_t a[kTile / 16][4];
    as_left_operand<T>(dp, a);
    times_tile<T, D>(a, keys, dQ, lane);
  }

  const float one[2] = {1.0f, 1.0f};
  write_rows<T, D>(dQ, one, dq + b * dql.batch + rows[0] * dql.seq + h * dql.head,
                   dq + b * dql.batch + rows[1] * dql.seq + h * dql.head, rows[0] < p.seq, rows[1] < p.seq, lane);
}

// ---- Launches ----

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
  p.keys = a.shape.keys == 0 ? a.shape.seq : a.shape.keys;
  p.offset = p.keys - p.seq;
  // A block of columns of a wider mask (dtk::layers::DropoutMask::columns): its rows are
  // row_numel apart; otherwise the mask is [batch, heads, seq, keys] (rows of one).
  p.mask_pitch = a.dropout && a.dropout->run_numel > 0 ? a.dropout->row_numel : p.keys;
  p.heads = static_cast<int>(a.shape.heads);
  p.per_group = static_cast<int>(a.shape.heads / a.shape.groups);
  p.scale = a.scale;
  p.scale_log2 = a.scale * kLog2e;
  // A window of seq or more hides nothing: none (also keeps key0 + 63 + window from overflowing).
  p.window = a.window >= p.keys ? -1 : a.window;
  p.dropout = a.dropout != nullptr;
  if (a.dropout) p.bits = *a.dropout;
  return p;
}

int64_t keys_of(const AttentionShape& s) { return s.keys == 0 ? s.seq : s.keys; }
unsigned tiles_of(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

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
  const int64_t keys = keys_of(s);
  // A mask: whole rows of keys, or a block of keys columns of rows row_numel apart.
  const bool mask_fits =
      !a.dropout || a.dropout->run_numel == 0 || (a.dropout->run_numel == keys && a.dropout->row_numel >= keys);
  const bool fits = s.batch > 0 && s.seq > 0 && keys >= s.seq && s.heads > 0 && s.groups > 0 &&
                    s.heads % s.groups == 0 && s.batch <= 65535 && s.heads <= 65535 &&
                    (keys + kTile - 1) / kTile <= 0x7fffffffLL && attention_supported(a.type, s.head_dim, device) &&
                    mask_fits && a.window >= -1;
  if (!fits)
    throw CudaError("attention: shape [" + std::to_string(s.batch) + ", " + std::to_string(s.seq) + " over " +
                    std::to_string(keys) + ", " + std::to_string(s.heads) + "/" + std::to_string(s.groups) + ", " +
                    std::to_string(s.head_dim) + "] or its type, mask or window (" + std::to_string(a.window) +
                    ") is not one the kernels take");
}

template <class T, int D>
void forward(const AttentionArgs& a, void* out, float* lse, StreamHandle stream) {
  constexpr size_t bytes = Shared<T, D>::kForward;
  allow_shared_memory(forward_kernel<T, D>, bytes);
  const dim3 grid(tiles_of(a.shape.seq), static_cast<unsigned>(a.shape.heads), static_cast<unsigned>(a.shape.batch));
  launch_kernel(forward_kernel<T, D>, grid, kThreads, bytes, stream, params_of<T>(a), static_cast<T*>(out), lse);
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
  launch_kernel(delta_kernel<T, D>, blocks_for(rows * 32), 256, 0, stream, static_cast<const T*>(dout),
                static_cast<const T*>(out), rows, s.seq, static_cast<int>(s.heads), g.delta);
  check("attention_backward (delta)");
  const Params<T> params = params_of<T>(a);
  constexpr size_t key_bytes = Shared<T, D>::kKeys, query_bytes = Shared<T, D>::kQueries;
  allow_shared_memory(key_gradients_kernel<T, D>, key_bytes);
  const dim3 keys(tiles_of(keys_of(s)), static_cast<unsigned>(s.groups), static_cast<unsigned>(s.batch));
  launch_kernel(key_gradients_kernel<T, D>, keys, kThreads, key_bytes, stream, params, static_cast<const T*>(dout), lse,
                g.delta, static_cast<T*>(g.dk), g.dk_layout, static_cast<T*>(g.dv), g.dv_layout);
  check("attention_backward (dk, dv)");
  allow_shared_memory(query_gradients_kernel<T, D>, query_bytes);
  const dim3 queries(tiles_of(s.seq), static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch));
  launch_kernel(query_gradients_kernel<T, D>, queries, kThreads, query_bytes, stream, params,
                static_cast<const T*>(dout), lse, g.delta, static_cast<T*>(g.dq), g.dq_layout);
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

template <int D>
constexpr size_t most_shared() {
  return std::max({Shared<__half, D>::kForward, Shared<__half, D>::kKeys, Shared<__half, D>::kQueries});
}

}  // namespace

bool attention_supported(ElementType type, int64_t head_dim, int device) {
  if (type == ElementType::kFloat32 || (head_dim != 64 && head_dim != 128)) return false;
  // bf16 mma.sync, ldmatrix and cp.async need sm_80; the tiles need their shared memory (sm_86/89
  // allow 99 KB a block, less than head_dim 128's key pass takes).
  int major = 0, shared = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();  // a bad device index: not this call's error to keep
    return false;
  }
  const size_t need = head_dim == 128 ? most_shared<128>() : most_shared<64>();
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
