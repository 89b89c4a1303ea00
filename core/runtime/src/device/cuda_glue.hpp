// cuda_glue.hpp — the few places where dtk_core talks to CUDA (internal). In a build with
// core/cuda (DTK_HAVE_CUDA) they use the CUDA runtime directly; only LibTorch's own CUDA state
// (the stream its kernels are launched on) needs LibTorch's CUDA headers, and that part is
// compiled against a CUDA LibTorch alone (DTK_TORCH_CUDA, cuda_glue.cpp); elsewhere LibTorch's
// stream is CUDA's legacy default stream, which is where LibTorch launches unless told otherwise.
#pragma once

#include <memory>
#include <string>

#include <chrono>
#include <cstdint>

#include "dtk/core/device/clock.hpp"

#if DTK_HAVE_CUDA
#include "dtk/cuda/runtime.hpp"
#endif

namespace dtk::core::cuda_glue {

#if DTK_HAVE_CUDA
// LibTorch's current stream on `device` (CUDA's legacy default stream without a CUDA LibTorch).
dtk::cuda::StreamHandle torch_current_stream(int device);
// Makes `device` current for the CUDA runtime and for LibTorch (its own current device, where
// new CUDA tensors and LibTorch's streams go).
void set_current_device(int device);
// Installs the GPU's memory as the memory report's device pool (dtk/core/memory/memory.hpp): LibTorch's
// CUDA caching allocator's allocated bytes on `device` (needs a CUDA LibTorch; a no-op otherwise).
void use_gpu_memory_pool(int device);
// train.memory_limit_mb on a GPU: LibTorch's caching allocator refuses to hold more than `mib`
// MiB on `device` (its memory fraction), so a model that needs more fails with CUDA's
// out-of-memory error about as on a smaller GPU (cuBLAS's workspace is inside the cap, NCCL's
// buffers and CUDA's context outside). Throws a config error past the device's memory, or
// without a CUDA LibTorch.
void cap_gpu_memory(int device, int64_t mib);
// The Megatron timers' clock on `device`: timed CUDA events on LibTorch's current stream; a read
// waits for an event at most `timeout` (the run's collective timeout).
std::unique_ptr<DeviceClock> make_event_clock(int device, std::chrono::milliseconds timeout);
// Makes `stream` LibTorch's current stream on `device` (needs a CUDA LibTorch; throws otherwise).
void torch_set_current_stream(dtk::cuda::StreamHandle stream, int device);
#endif

}  // namespace dtk::core::cuda_glue
