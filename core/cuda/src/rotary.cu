// Rotary embeddings forward and backward (dtk/cuda/rotary.hpp): one thread per output element,
// reading its own and its partner channel. The fp32 products and sum use the round-to-nearest
// intrinsics so the compiler cannot contract them into a fused multiply-add: the reference ops
// round each product, and so does this.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dtk/cuda/rotary.hpp"
#include "element.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 256;

using element::from_float;
using element::to_float;

template <class T, bool kBackward>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const T* in, RotaryShape sh, const float* cos,
                                                          const float* sin, T* out) {
  const int64_t total = sh.batch * sh.seq * sh.heads * sh.head_dim;
  const int64_t half = sh.dim / 2;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t i = e % sh.head_dim;
    const int64_t row = e / sh.head_dim;  // (b, s, head)
    const int64_t h = row % sh.heads, bs = row / sh.heads, s = bs % sh.seq, b = bs / sh.seq;
    const T* x = in + b * sh.stride_b + s * sh.stride_s + h * sh.stride_h;
    if (i >= sh.dim) {
      out[e] = x[i];
      continue;
    }
    const float* c = cos + bs * sh.dim;
    const float* sn = sin + bs * sh.dim;
    float partner;
    if (!kBackward)  // x cos + rotate_half(x) sin
      partner = i < half ? -__fmul_rn(to_float(x[i + half]), sn[i]) : __fmul_rn(to_float(x[i - half]), sn[i]);
    else  // rotate_half's transpose: the partner's sin
      partner = i < half ? __fmul_rn(to_float(x[i + half]), sn[i + half]) : -__fmul_rn(to_float(x[i - half]), sn[i - half]);
    out[e] = from_float<T>(__fadd_rn(__fmul_rn(to_float(x[i]), c[i]), partner));
  }
}

template <class T, bool kBackward>
void launch(const void* in, const RotaryShape& shape, const float* cos, const float* sin, void* out,
            StreamHandle stream) {
  const int64_t total = shape.batch * shape.seq * shape.heads * shape.head_dim;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535LL * 16);
  rotary_kernel<T, kBackward><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const T*>(in), shape,
                                                                                      cos, sin, static_cast<T*>(out));
}

template <bool kBackward>
void dispatch(const void* in, ElementType type, const RotaryShape& shape, const float* cos, const float* sin, void* out,
              StreamHandle stream, const char* what) {
  if (shape.dim % 2 != 0 || shape.dim > shape.head_dim) throw CudaError(std::string(what) + ": bad rotary dim");
  switch (type) {
    case ElementType::kFloat32: launch<float, kBackward>(in, shape, cos, sin, out, stream); break;
    case ElementType::kBFloat16: launch<__nv_bfloat16, kBackward>(in, shape, cos, sin, out, stream); break;
    case ElementType::kFloat16: launch<__half, kBackward>(in, shape, cos, sin, out, stream); break;
  }
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
