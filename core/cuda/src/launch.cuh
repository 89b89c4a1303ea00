// launch.cuh (private to core/cuda) — how DTK's kernels are launched and reach their dynamic
// shared memory: through launch_kernel() and DTK_DYNAMIC_SHARED rather than <<<...>>> and an extern
// __shared__ array, so that the CPU emulation (tests/cuda_emulated, DTK_SIMT_EMULATION) runs the
// same host code, launch geometry and kernel choice as a GPU does.
#pragma once

#ifdef DTK_SIMT_EMULATION
#include DTK_SIMT_EMULATION  // launch_kernel() and DTK_DYNAMIC_SHARED on CPU threads
#else
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

// `type name[]`: the block's dynamic shared memory, 128-byte aligned.
#define DTK_DYNAMIC_SHARED(type, name) extern __shared__ __align__(128) type name[]

namespace dtk::cuda {

// kernel<<<grid, block, shared, stream>>>(args...).
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                   Args&&... args) {
  // clang-format would split the chevrons of a header it does not take for CUDA.
  // clang-format off
  kernel<<<grid, block, shared, stream>>>(std::forward<Args>(args)...);
  // clang-format on
}

}  // namespace dtk::cuda
#endif
