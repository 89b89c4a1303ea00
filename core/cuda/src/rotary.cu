// Rotary embeddings forward and backward (dtk/cuda/rotary.hpp): one thread per pair of channels
// that rotate together. The fp32 products and sum use the round-to-nearest
// intrinsics so the compiler cannot contract them into a fused multiply-add: the reference ops
// round each product, and so does this. With 2-byte elements and every stride, width and pointer
// on a 4-element boundary, one thread takes four pairs (8-byte loads of the channels, 16-byte
// loads of cos and sin), all loaded before the first store: a quarter of the threads' index
// divisions and four times the bytes in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "dtk/cuda/rotary.hpp"
#include "element.cuh"
#include "launch.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 256;

using element::from_float;
using element::to_float;

// One thread per pair of rotating channels (k, k + dim/2) of one (b, s, head) row, and one per
// channel that passes through. Index is 32-bit where the elements fit (the divisions that place
// a thread are the kernel's main cost; 64-bit ones ran it at a fifth of its bytes' time on an H200).
template <class T, bool kBackward, class Index>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const T* in, RotaryShape sh, const float* cos,
                                                          const float* sin, T* out) {
  const Index half = static_cast<Index>(sh.dim / 2), dim = static_cast<Index>(sh.dim);
  const Index per_row = half + static_cast<Index>(sh.head_dim - sh.dim), hd = static_cast<Index>(sh.head_dim);
  const Index heads = static_cast<Index>(sh.heads), seq = static_cast<Index>(sh.seq);
  const Index total = static_cast<Index>(sh.batch * sh.seq * sh.heads) * per_row;
  for (Index e = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; e < total;
       e += static_cast<Index>(gridDim.x) * kThreads) {
    const Index row = e / per_row, k = e - row * per_row;  // row: (b, s, head)
    const Index bs = row / heads, h = row - bs * heads;    // bs: b * seq + s
    const Index b = bs / seq, s = bs - b * seq;
    const T* x = in + b * sh.stride_b + s * sh.stride_s + h * sh.stride_h;
    T* y = out + static_cast<int64_t>(row) * hd;
    if (k >= half) {  // a channel past the rotating ones
      const Index c = dim + (k - half);
      y[c] = x[c];
      continue;
    }
    const float* c = cos + static_cast<int64_t>(bs) * dim;
    const float* sn = sin + static_cast<int64_t>(bs) * dim;
    const float lo = to_float(x[k]), hi = to_float(x[k + half]);
    if (!kBackward) {  // x cos + rotate_half(x) sin, rotate_half(x) = (-hi, lo)
      y[k] = from_float<T>(__fadd_rn(__fmul_rn(lo, c[k]), -__fmul_rn(hi, sn[k])));
      y[k + half] = from_float<T>(__fadd_rn(__fmul_rn(hi, c[k + half]), __fmul_rn(lo, sn[k + half])));
    } else {  // rotate_half's transpose: each channel takes its partner's sin
      y[k] = from_float<T>(__fadd_rn(__fmul_rn(lo, c[k]), __fmul_rn(hi, sn[k + half])));
      y[k + half] = from_float<T>(__fadd_rn(__fmul_rn(hi, c[k + half]), -__fmul_rn(lo, sn[k])));
    }
  }
}

// Four channels of T in 8 bytes.
template <class T>
struct Quad {
  static_assert(sizeof(T) == 2, "quads hold 2-byte elements");
  uint2 raw;
  __device__ __forceinline__ float get(int e) const { return to_float(reinterpret_cast<const T*>(&raw)[e]); }
  __device__ __forceinline__ void set(int e, float v) { reinterpret_cast<T*>(&raw)[e] = from_float<T>(v); }
};

// As rotary_kernel, a thread per four pairs (k .. k + 3 with k + half ..) or four channels that
// pass through; the same roundings.
template <class T, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    rotary_quad_kernel(const T* in, RotaryShape sh, const float* cos, const float* sin, T* out) {
  const uint32_t half = static_cast<uint32_t>(sh.dim / 2), dim = static_cast<uint32_t>(sh.dim);
  const uint32_t per_row = (half + static_cast<uint32_t>(sh.head_dim - sh.dim)) / 4;
  const uint32_t hd = static_cast<uint32_t>(sh.head_dim);
  const uint32_t heads = static_cast<uint32_t>(sh.heads), seq = static_cast<uint32_t>(sh.seq);
  const uint32_t total = static_cast<uint32_t>(sh.batch * sh.seq * sh.heads) * per_row;
  for (uint32_t e = blockIdx.x * kThreads + threadIdx.x; e < total; e += gridDim.x * kThreads) {
    const uint32_t row = e / per_row, k = (e - row * per_row) * 4;  // row: (b, s, head)
    const uint32_t bs = row / heads, h = row - bs * heads;          // bs: b * seq + s
    const uint32_t b = bs / seq, s = bs - b * seq;
    const T* x = in + b * sh.stride_b + s * sh.stride_s + h * sh.stride_h;
    T* y = out + static_cast<int64_t>(row) * hd;
    if (k >= half) {  // four channels past the rotating ones
      const uint32_t c = dim + (k - half);
      *reinterpret_cast<uint2*>(y + c) = *reinterpret_cast<const uint2*>(x + c);
      continue;
    }
    const float* c = cos + static_cast<int64_t>(bs) * dim;
    const float* sn = sin + static_cast<int64_t>(bs) * dim;
    Quad<T> lo, hi, ylo, yhi;
    lo.raw = *reinterpret_cast<const uint2*>(x + k);
    hi.raw = *reinterpret_cast<const uint2*>(x + k + half);
    const float4 c_lo = *reinterpret_cast<const float4*>(c + k), c_hi = *reinterpret_cast<const float4*>(c + k + half);
    const float4 s_lo = *reinterpret_cast<const float4*>(sn + k),
                 s_hi = *reinterpret_cast<const float4*>(sn + k + half);
    const float cl[4] = {c_lo.x, c_lo.y, c_lo.z, c_lo.w}, ch[4] = {c_hi.x, c_hi.y, c_hi.z, c_hi.w};
    const float sl[4] = {s_lo.x, s_lo.y, s_lo.z, s_lo.w}, sh4[4] = {s_hi.x, s_hi.y, s_hi.z, s_hi.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float l = lo.get(i), u = hi.get(i);
      if (!kBackward) {
        ylo.set(i, __fadd_rn(__fmul_rn(l, cl[i]), -__fmul_rn(u, sl[i])));
        yhi.set(i, __fadd_rn(__fmul_rn(u, ch[i]), __fmul_rn(l, sh4[i])));
      } else {
        ylo.set(i, __fadd_rn(__fmul_rn(l, cl[i]), __fmul_rn(u, sh4[i])));
        yhi.set(i, __fadd_rn(__fmul_rn(u, ch[i]), -__fmul_rn(l, sl[i])));
      }
    }
    *reinterpret_cast<uint2*>(y + k) = ylo.raw;
    *reinterpret_cast<uint2*>(y + k + half) = yhi.raw;
  }
}

// Whether rotary_quad_kernel applies: 2-byte elements; the rotating half, the pass-through
// channels, the strides and the row width whole quads; every pointer on its load's boundary; and
// 32-bit indices.
template <class T>
bool quads_apply(const void* in, const RotaryShape& sh, const float* cos, const float* sin, const void* out) {
  const auto on = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  return (sh.dim / 2) % 4 == 0 && (sh.head_dim - sh.dim) % 4 == 0 && sh.stride_b % 4 == 0 && sh.stride_s % 4 == 0 &&
         sh.stride_h % 4 == 0 && on(in, 8) && on(out, 8) && on(cos, 16) && on(sin, 16) &&
         sh.batch * sh.seq * sh.heads * sh.head_dim < (int64_t{1} << 31) && sh.batch * sh.stride_b < (int64_t{1} << 31);
}

template <class T, bool kBackward>
void launch(const void* in, const RotaryShape& shape, const float* cos, const float* sin, void* out,
            StreamHandle stream) {
  const int64_t per_row = shape.dim / 2 + (shape.head_dim - shape.dim);
  const int64_t total = shape.batch * shape.seq * shape.heads * per_row;
  if (total == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535LL * 16));
  const T* x = static_cast<const T*>(in);
  T* y = static_cast<T*>(out);
  if constexpr (sizeof(T) == 2) {
    if (quads_apply<T>(in, shape, cos, sin, out)) {
      const unsigned quad_blocks =
          static_cast<unsigned>(std::min<int64_t>((total / 4 + kThreads - 1) / kThreads, 65535LL * 16));
      launch_kernel(rotary_quad_kernel<T, kBackward>, quad_blocks, kThreads, 0, stream, x, shape, cos, sin, y);
      return;
    }
  }
  if (shape.batch * shape.seq * shape.heads * shape.head_dim < (int64_t{1} << 31))
    launch_kernel(rotary_kernel<T, kBackward, uint32_t>, blocks, kThreads, 0, stream, x, shape, cos, sin, y);
  else
    launch_kernel(rotary_kernel<T, kBackward, int64_t>, blocks, kThreads, 0, stream, x, shape, cos, sin, y);
}

template <bool kBackward>
void dispatch(const void* in, ElementType type, const RotaryShape& shape, const float* cos, const float* sin, void* out,
              StreamHandle stream, const char* what) {
  if (shape.dim <= 0 || shape.dim % 2 != 0 || shape.dim > shape.head_dim)
    throw CudaError(std::string(what) + ": bad rotary dim " + std::to_string(shape.dim));
  element::dispatch(type, [&](auto t) { launch<decltype(t), kBackward>(in, shape, cos, sin, out, stream); });
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

void rotary_forward(const void* x, ElementType type, const RotaryShape& shape, const float* cos, const float* sin,
                    void* out, StreamHandle stream) {
  dispatch<false>(x, type, shape, cos, sin, out, stream, "rotary_forward");
}

void rotary_backward(const void* dy, ElementType type, const RotaryShape& shape, const float* cos, const float* sin,
                     void* dx, StreamHandle stream) {
  dispatch<true>(dy, type, shape, cos, sin, dx, stream, "rotary_backward");
}

}  // namespace dtk::cuda
