// SwiGLU forward and backward (dtk/cuda/swiglu.hpp): elementwise, a grid-stride loop over the
// elements, one element per thread per step (consecutive threads, consecutive elements); with
// 2-byte elements, a multiple of 8 of them and aligned pointers (pack.cuh), a pack of 8 per thread
// per step, each tensor's pack loaded before any is written.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dtk/cuda/swiglu.hpp"
#include "element.cuh"
#include "launch.cuh"
#include "pack.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

using element::from_float;
using element::round_to;
using element::to_float;

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <class T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* gate, const T* up, int64_t n, T* y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float g = to_float(gate[i]);
    const float s = round_to<T>(g / (1.0f + expf(-g)));
    y[i] = from_float<T>(s * to_float(up[i]));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* dy, const T* gate, const T* up, int64_t n, T* dgate, T* dup) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float g = to_float(gate[i]), d = to_float(dy[i]);
    const float sig = sigmoid(g);
    const float s = round_to<T>(g / (1.0f + expf(-g)));  // SiLU's output as the product saw it
    const float ds = round_to<T>(d * to_float(up[i]));
    dup[i] = from_float<T>(d * s);
    dgate[i] = from_float<T>(ds * sig * (1.0f + g * (1.0f - sig)));
  }
}

// The packed kernels: the same arithmetic, pack p = elements 8p .. 8p + 7.
template <class T>
__global__ void __launch_bounds__(kThreads) forward_packed_kernel(const T* gate, const T* up, int64_t packs, T* y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < packs; p += stride) {
    const pack::Pack<T> g = pack::load(gate + p * pack::kN), u = pack::load(up + p * pack::kN);
    pack::Pack<T> out;
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) {
      const float gv = g.get(e);
      out.set(e, round_to<T>(gv / (1.0f + expf(-gv))) * u.get(e));
    }
    pack::store(y + p * pack::kN, out);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    backward_packed_kernel(const T* dy, const T* gate, const T* up, int64_t packs, T* dgate, T* dup) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < packs; p += stride) {
    const int64_t at = p * pack::kN;
    const pack::Pack<T> gs = pack::load(gate + at), us = pack::load(up + at), ds = pack::load(dy + at);
    pack::Pack<T> dg, du;
#pragma unroll
    for (int e = 0; e < pack::kN; ++e) {
      const float g = gs.get(e), d = ds.get(e);
      const float sig = sigmoid(g);
      const float s = round_to<T>(g / (1.0f + expf(-g)));
      const float dsilu = round_to<T>(d * us.get(e));
      du.set(e, d * s);
      dg.set(e, dsilu * sig * (1.0f + g * (1.0f - sig)));
    }
    pack::store(dup + at, du);
    pack::store(dgate + at, dg);
  }
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

template <class T>
void forward(const void* gate, const void* up, int64_t n, void* y, StreamHandle stream) {
  if constexpr (sizeof(T) == 2) {
    if (pack::packable(sizeof(T), n, gate, up, y)) {
      launch_kernel(forward_packed_kernel<T>, blocks_for(n / pack::kN), kThreads, 0, stream,
                    static_cast<const T*>(gate), static_cast<const T*>(up), n / pack::kN, static_cast<T*>(y));
      return;
    }
  }
  launch_kernel(forward_kernel<T>, blocks_for(n), kThreads, 0, stream, static_cast<const T*>(gate),
                static_cast<const T*>(up), n, static_cast<T*>(y));
}

template <class T>
void backward(const void* dy, const void* gate, const void* up, int64_t n, void* dgate, void* dup,
              StreamHandle stream) {
  if constexpr (sizeof(T) == 2) {
    if (pack::packable(sizeof(T), n, dy, gate, up, dgate, dup)) {
      launch_kernel(backward_packed_kernel<T>, blocks_for(n / pack::kN), kThreads, 0, stream, static_cast<const T*>(dy),
                    static_cast<const T*>(gate), static_cast<const T*>(up), n / pack::kN, static_cast<T*>(dgate),
                    static_cast<T*>(dup));
      return;
    }
  }
  launch_kernel(backward_kernel<T>, blocks_for(n), kThreads, 0, stream, static_cast<const T*>(dy),
                static_cast<const T*>(gate), static_cast<const T*>(up), n, static_cast<T*>(dgate),
                static_cast<T*>(dup));
}

}  // namespace

void swiglu_forward(const void* gate, const void* up, ElementType type, int64_t n, void* y, StreamHandle stream) {
  if (n < 0) throw CudaError("swiglu: " + std::to_string(n) + " elements");
  if (n == 0) return;
  element::dispatch(type, [&](auto t) { forward<decltype(t)>(gate, up, n, y, stream); });
  check("swiglu_forward");
}

void swiglu_backward(const void* dy, const void* gate, const void* up, ElementType type, int64_t n, void* dgate,
                     void* dup, StreamHandle stream) {
  if (n < 0) throw CudaError("swiglu: " + std::to_string(n) + " elements");
  if (n == 0) return;
  element::dispatch(type, [&](auto t) { backward<decltype(t)>(dy, gate, up, n, dgate, dup, stream); });
  check("swiglu_backward");
}

}  // namespace dtk::cuda
