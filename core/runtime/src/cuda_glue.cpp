#include "cuda_glue.hpp"
#include "dtk/core/cuda_support.hpp"

#include <ATen/Context.h>
#include <torch/version.h>

#include <stdexcept>

#if DTK_HAVE_CUDA
#include "dtk/cuda/nccl.hpp"
#endif
#if DTK_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtk::core {

bool cuda_training_available(std::string* why) {
  std::string reason;
#if !DTK_HAVE_CUDA
  reason = "this dtk was built without CUDA (no CUDA toolkit with NCCL at build time, or DTK_WITH_CUDA=OFF)";
#elif !DTK_TORCH_CUDA
  reason = "this dtk was built against a CPU-only LibTorch (" TORCH_VERSION
           "); build it against a CUDA LibTorch (tools/gpu_check.sh)";
#else
  if (!at::hasCUDA()) reason = "LibTorch finds no CUDA device";
  else if (dtk::cuda::device_count(&reason) > 0) return true;
#endif
  if (why) *why = reason;
  return false;
}

std::string cuda_build_summary() {
#if !DTK_HAVE_CUDA
  return "CUDA: not built (CPU only)";
#else
  const int v = dtk::cuda::runtime_version();
  std::string s = "CUDA: runtime " + std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10) + ", NCCL " +
                  dtk::cuda::nccl_version() + "; LibTorch " + (DTK_TORCH_CUDA ? "with CUDA" : "CPU-only") + "; ";
  std::string why;
  const int n = dtk::cuda::device_count(&why);
  if (n == 0) return s + why;
  s += std::to_string(n) + " device" + (n == 1 ? "" : "s");
  try {
    s += ", cuda:0 " + dtk::cuda::device_description(0);
  } catch (const std::exception& e) {
    s += std::string(" (") + e.what() + ")";
  }
  return s;
#endif
}

namespace cuda_glue {
#if DTK_HAVE_CUDA
dtk::cuda::StreamHandle torch_current_stream(int device) {
#if DTK_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return dtk::cuda::default_stream();
#endif
}

void torch_set_current_stream(dtk::cuda::StreamHandle stream, int device) {
#if DTK_TORCH_CUDA
  c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
#else
  (void)stream, (void)device;
  throw std::runtime_error("LibTorch kernels follow a CUDA stream only in a dtk built against a CUDA LibTorch");
#endif
}
#endif
}  // namespace cuda_glue

}  // namespace dtk::core
