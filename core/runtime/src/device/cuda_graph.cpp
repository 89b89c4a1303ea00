// cuda_graph.cpp — the CUDA graph behind train.cuda_graphs (dtk/core/device/step_capture.hpp):
// LibTorch's at::cuda::CUDAGraph, so the graph's memory comes from the caching allocator's
// private pool and CUDA's random generators are registered with it. Needs a CUDA LibTorch; CI
// compiles this half against Debian's ATen/cuda headers (dtk_torch_cuda_compile_check).
#include "dtk/core/device/step_capture.hpp"

#if DTK_TORCH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/version.h>
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
    {
      const c10::cuda::CUDAStreamGuard on_side(side);
#if TORCH_VERSION_MAJOR >= 2
      // Thread-local: the batch loader's thread may pin host memory meanwhile.
      graph_->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
#else
      graph_->capture_begin();
#endif
      try {
        body();
      } catch (...) {
        end_failed_capture();
        throw;
      }
      graph_->capture_end();
    }
    side.synchronize();
  }

  void replay(const std::function<void()>&) override {
    const c10::cuda::CUDAGuard guard(device_);
    graph_->replay();  // on the current stream
  }
  bool replays_body() const override { return false; }

 private:
  // A capture that threw: the stream leaves capture mode (the graph, invalid, is dropped).
  void end_failed_capture() {
    try {
      graph_->capture_end();
    } catch (...) {
    }
    graph_.reset();
  }

  c10::DeviceIndex device_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
};

}  // namespace

std::unique_ptr<StepRecorder> make_cuda_graph_recorder(int device) { return std::make_unique<CudaGraphRecorder>(device); }
#else
std::unique_ptr<StepRecorder> make_cuda_graph_recorder(int) { return nullptr; }
#endif

}  // namespace dtk::core
