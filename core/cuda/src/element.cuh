// element.cuh (private to core/cuda) — loads and stores of the element types DTK's kernels take
// (ElementType: fp32, bf16, fp16), in fp32 arithmetic, and the host's dispatch on the type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda::element {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// x rounded to T and back: where a reference computed in T rounds.
template <class T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// f(T{}) for the C++ type T of `type` (float, __nv_bfloat16 or __half): each kernel file's launch
// for the element type a call names, e.g. dispatch(type, [&](auto t) { launch<decltype(t)>(...); }).
template <class F>
inline void dispatch(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kFloat32:
      f(float{});
      break;
    case ElementType::kBFloat16:
      f(__nv_bfloat16{});
      break;
    case ElementType::kFloat16:
      f(__half{});
      break;
  }
}

}  // namespace dtk::cuda::element
