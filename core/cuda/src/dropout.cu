// Counter-based dropout (dtk/cuda/dropout.hpp): elementwise, a grid-stride loop, each thread
// hashing its own element's pair index (dropout_bits.cuh: splitmix64's output function, as
// dtk/layers/dropout.cpp's mix()), so the mask costs no memory traffic at all.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dropout_bits.cuh"
#include "dtk/cuda/dropout.hpp"
#include "element.cuh"
#include "launch.cuh"

namespace dtk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

using element::from_float;
using element::to_float;

template <class T>
__global__ void __launch_bounds__(kThreads) dropout_kernel(const T* x, int64_t n, DropoutBits m, T* out) {
  m = dropout_bits::resolved(m);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    out[i] = dropout_bits::kept(m, i) ? from_float<T>(to_float(x[i]) * m.scale) : from_float<T>(0.0f);
  }
}

template <class T>
void apply(const void* x, int64_t n, const DropoutBits& m, void* out, StreamHandle stream) {
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
  launch_kernel(dropout_kernel<T>, blocks, kThreads, 0, stream, static_cast<const T*>(x), n, m, static_cast<T*>(out));
}

__global__ void __launch_bounds__(kThreads)
    noise_kernel(int64_t n, DropoutBits m, double low, double step, float* out) {
  m = dropout_bits::resolved(m);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const double u = static_cast<double>(dropout_bits::uniform_at(m, dropout_bits::mask_index(m, i)));
    // Rounded as the host's tensor operations round them: the product, then the sum (no FMA).
    out[i] = static_cast<float>(__dadd_rn(__dmul_rn(u, step), low));
  }
}

}  // namespace

void uniform_noise(int64_t n, const DropoutBits& draw, double low, double high, float* out, StreamHandle stream) {
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
  launch_kernel(noise_kernel, blocks, kThreads, 0, stream, n, draw, low, (high - low) / 4294967296.0, out);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string("uniform_noise: ") + cudaGetErrorString(e));
}

void dropout_apply(const void* x, ElementType type, int64_t n, const DropoutBits& mask, void* out,
                   StreamHandle stream) {
  if (n <= 0) return;
  element::dispatch(type, [&](auto t) { apply<decltype(t)>(x, n, mask, out, stream); });
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw CudaError(std::string("dropout_apply: ") + cudaGetErrorString(e));
}

}  // namespace dtk::cuda
