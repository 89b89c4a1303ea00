// The fused cross entropy of logit rows (dtk/cuda/cross_entropy.hpp). One block per row: each
// thread keeps a running (maximum, sum of exp(x - maximum)) over its strided share of the row
// (rescaling the sum when the maximum grows), the block merges the threads' pairs, and with
// gradients a second sweep writes exp(x - max) / sum - onehot in place. Rows whose stride and
// start allow it are read 16 bytes at a time (8 bf16 or 4 fp32 logits per load), four loads of a
// thread issued before their values are used.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "dtk/cuda/cross_entropy.hpp"
#include "element.cuh"
#include "launch.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // packs a thread loads before it uses them

using element::from_float;
using element::to_float;

// A running softmax denominator: the maximum seen and the sum of exp(x - maximum).
struct MaxSum {
  float max = -INFINITY;
  float sum = 0.0f;
};

__device__ __forceinline__ void add(MaxSum& a, float x) {
  if (x > a.max) {
    a.sum = a.sum * expf(a.max - x) + 1.0f;
    a.max = x;
  } else if (x != -INFINITY || a.max != -INFINITY) {
    a.sum += expf(x - a.max);  // a NaN lands here and propagates
  }
}

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  MaxSum out;
  out.max = fmaxf(a.max, b.max);
  if (out.max == -INFINITY)
    out.sum = a.sum + b.sum;  // 0, or NaN where a NaN was seen
  else
    out.sum = a.sum * expf(a.max - out.max) + b.sum * expf(b.max - out.max);
  return out;
}

// The block's merged pair, in every thread.
__device__ MaxSum block_merge(MaxSum v) {
  __shared__ float maxes[kThreads / 32], sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    MaxSum other;
    other.max = __shfl_xor_sync(0xffffffffu, v.max, offset);
    other.sum = __shfl_xor_sync(0xffffffffu, v.sum, offset);
    v = merge(v, other);
  }
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 0) {
    maxes[warp] = v.max;
    sums[warp] = v.sum;
  }
  __syncthreads();
  MaxSum total;
  for (int w = 0; w < kThreads / 32; ++w) {
    MaxSum part;
    part.max = maxes[w];
    part.sum = sums[w];
    total = merge(total, part);
  }
  return total;
}

// 16 bytes of T: the vector load/store unit.
template <class T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// A thread's batch of packs p0, p0 + kThreads, ... (kUnroll of them, those below `packs`) of the
// row x, every load issued before any value is used (both sweeps).
template <class T>
__device__ __forceinline__ void load_batch(const T* x, int64_t p0, int64_t packs, Pack<T> (&buf)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (p0 + u * kThreads < packs) buf[u] = reinterpret_cast<const Pack<T>*>(x)[p0 + u * kThreads];
}

template <class T, bool kVector>
__global__ void __launch_bounds__(kThreads) cross_entropy_kernel(T* logits, int64_t vocab, int64_t ld,
                                                                 const int64_t* col, float* max_out, float* sum_out,
                                                                 float* loss_out, bool grads) {
  using P = Pack<T>;
  const int64_t row = blockIdx.x;
  T* x = logits + row * ld;
  const int64_t packs = kVector ? vocab / P::kSize : 0;
  const int64_t tail = packs * P::kSize;  // first element the scalar loop covers
  MaxSum mine;
  // kUnroll of the thread's packs loaded before any is used (both sweeps): the second sweep writes
  // where it reads, so a load issued after a store waits for nothing the compiler could prove,
  // and one pack at a time would keep a single load in flight per thread.
  for (int64_t p0 = threadIdx.x; p0 < packs; p0 += kThreads * kUnroll) {
    P buf[kUnroll];
    load_batch(x, p0, packs, buf);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (p0 + u * kThreads < packs)
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) add(mine, to_float(buf[u].v[k]));
  }
  for (int64_t j = tail + threadIdx.x; j < vocab; j += kThreads) add(mine, to_float(x[j]));
  const MaxSum total = block_merge(mine);
  const int64_t target = col[row];
  if (threadIdx.x == 0) {
    const float target_logit = target >= 0 ? to_float(x[target]) - total.max : 0.0f;
    max_out[row] = total.max;
    sum_out[row] = total.sum;
    loss_out[row] = logf(total.sum) - target_logit;
  }
  if (!grads) return;
  __syncthreads();  // thread 0 has read the target logit before it is overwritten
  const float m = total.max, s = total.sum;
  for (int64_t p0 = threadIdx.x; p0 < packs; p0 += kThreads * kUnroll) {
    P buf[kUnroll];
    load_batch(x, p0, packs, buf);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * kThreads;
      if (p >= packs) break;
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) {
        const int64_t j = p * P::kSize + k;
        buf[u].v[k] = from_float<T>(expf(to_float(buf[u].v[k]) - m) / s - (j == target ? 1.0f : 0.0f));
      }
      reinterpret_cast<P*>(x)[p] = buf[u];
    }
  }
  for (int64_t j = tail + threadIdx.x; j < vocab; j += kThreads)
    x[j] = from_float<T>(expf(to_float(x[j]) - m) / s - (j == target ? 1.0f : 0.0f));
}

template <class T>
void launch(void* logits, int64_t n, int64_t vocab, int64_t ld, const int64_t* col, float* max, float* sum,
            float* loss, bool grads, StreamHandle stream) {
  // 16-byte loads need every row to start on a 16-byte boundary.
  const bool vector = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && (ld * sizeof(T)) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(n));
  T* x = static_cast<T*>(logits);
  if (vector)
    launch_kernel(cross_entropy_kernel<T, true>, grid, kThreads, 0, stream, x, vocab, ld, col, max, sum, loss, grads);
  else
    launch_kernel(cross_entropy_kernel<T, false>, grid, kThreads, 0, stream, x, vocab, ld, col, max, sum, loss, grads);
}

}  // namespace

void cross_entropy_rows(void* logits, ElementType type, int64_t n, int64_t vocab, int64_t ld, const int64_t* col,
                        float* max, float* sum, float* loss, bool grads, StreamHandle stream) {
  if (n <= 0) return;
  if (n > 0x7fffffffLL) throw CudaError("cross_entropy_rows: more than 2^31 - 1 rows in one call");
  element::dispatch(type,
                    [&](auto t) { launch<decltype(t)>(logits, n, vocab, ld, col, max, sum, loss, grads, stream); });
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string("cross_entropy_rows: ") + cudaGetErrorString(e));
}

}  // namespace dtk::cuda
