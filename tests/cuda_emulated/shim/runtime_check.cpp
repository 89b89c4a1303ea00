// The emulation's dtk::cuda::check (dtk/cuda/runtime.hpp): core/cuda/src/runtime.cpp's, whose
// other functions (streams, events, pinned memory) a kernel run on CPU threads has no use for.
#include <cuda_runtime.h>

#include <string>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

void check(int status, const char* what) {
  const auto e = static_cast<cudaError_t>(status);
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace dtk::cuda
