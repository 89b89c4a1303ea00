// cuda_graph.cpp — the CUDA graph behind train.cuda_graphs (dtk/core/device/step_capture.hpp):
// LibTorch's at::cuda::CUDAGraph, so the graph's memory comes from the caching allocator's
// private pool and CUDA's random generators are registered with it. Needs a CUDA LibTorch; CI
// compiles this half against Debian's ATen/cuda headers (dtk_torch_cuda_compile_check).
#include "dtk/core/device/step_capture.hpp"

#if DTK_TORCH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>

#include <exception>
#endif

namespace dtk::core {

#if DTK_TORCH_CUDA
namespace {

class CudaGraphRecorder final : public StepRecorder {
 public:
  explicit CudaGraphRecorder(int device) : device_(static_cast<c10::DeviceIndex>(device)) {}

  // Recorded on a side stream (CUDA cannot capture the legacy default stream), ordered after
  // everything the current stream holds (the inputs just copied in) and before what follows.
  void record(const std::function<void()>& body) override {
    const c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_);
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_);
    side.synchronize();
    current.synchronize();
    // Cached blocks of the eager steps are returned first: the graph's pool is private.
    c10::cuda::CUDACachingAllocator::emptyCache();
    graph_ = std::make_unique<at::cuda::CUDAGraph>();
    std::exception_ptr failed;
    {
      const c10::cuda::CUDAStreamGuard on_side(side);
#if TORCH_VERSION_MAJOR >= 2
      // A pool of our own: its id is known even when the capture fails (abandon_pool).
      pool_ = at::cuda::graph_pool_handle();
      // Thread-local: the batch loader's thread may pin host memory meanwhile. (So CUDA does not
      // refuse an unsafe call made from autograd's thread during the backward; PyTorch's own
      // calls there are the allocator's, which routes this stream to the graph's pool.)
      graph_->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
#else
      graph_->capture_begin();
#endif
      try {
        body();
      } catch (...) {
        failed = std::current_exception();  // a host error (dropout's refusal) or a CUDA one
      }
      // Invalidated (a synchronising call inside): ending it fails at its first step, before
      // LibTorch's own bookkeeping, so LibTorch will not hand the pool back; that is done here.
      // (After any later failure LibTorch owns the pool: handing it back twice would abort.)
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      (void)cudaStreamIsCapturing(side.stream(), &status);
      const bool invalidated = status == cudaStreamCaptureStatusInvalidated;
      try {
        graph_->capture_end();
      } catch (...) {
        if (invalidated) abandon_pool();
        if (!failed) failed = std::current_exception();
      }
    }
    if (failed) {
      graph_.reset();
      (void)cudaGetLastError();  // the invalidated capture's error is not the next kernel's
      std::rethrow_exception(failed);
    }
    side.synchronize();
  }

  void replay(const std::function<void()>&) override {
    const c10::cuda::CUDAGuard guard(device_);
    graph_->replay();  // on the current stream
  }
  bool replays_body() const override { return false; }

 private:
  // After an invalidated capture: allocations stop going to the graph's pool and its memory (the
  // micro-batch's activations) goes back to the caching allocator.
  void abandon_pool() {
#if TORCH_VERSION_MAJOR >= 2
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device_, pool_);
      c10::cuda::CUDACachingAllocator::releasePool(device_, pool_);
    } catch (...) {
    }
#endif
  }

  c10::DeviceIndex device_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
#if TORCH_VERSION_MAJOR >= 2
  c10::cuda::MempoolId_t pool_{0, 0};
#endif
};

}  // namespace

std::unique_ptr<StepRecorder> make_cuda_graph_recorder(int device) { return std::make_unique<CudaGraphRecorder>(device); }
#else
std::unique_ptr<StepRecorder> make_cuda_graph_recorder(int) { return nullptr; }
#endif

}  // namespace dtk::core
