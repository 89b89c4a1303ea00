#include "cuda_glue.hpp"
#include "dtk/core/device/cuda_support.hpp"

#include <ATen/Context.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "dtk/core/memory/memory.hpp"
#include "dtk/host/error.hpp"  // HostError

#if DTK_HAVE_CUDA
#include "dtk/cuda/nccl.hpp"
#endif
#if DTK_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
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

namespace {
std::mutex device_mu;
c10::Device selected_device(c10::DeviceType::CPU);

// "cuda:N" -> N; "cuda" -> -1; anything else -> -2.
int cuda_index_of(const std::string& spec) {
  if (spec == "cuda") return -1;
  if (spec.rfind("cuda:", 0) != 0 || spec.size() == 5 || spec.size() > 9) return -2;
  for (size_t i = 5; i < spec.size(); ++i)
    if (spec[i] < '0' || spec[i] > '9') return -2;
  return std::atoi(spec.c_str() + 5);
}

}  // namespace

bool valid_device_spec(const std::string& spec) { return spec == "cpu" || cuda_index_of(spec) >= -1; }

c10::Device training_device() {
  std::lock_guard<std::mutex> lock(device_mu);
  return selected_device;
}

c10::Device select_training_device(const std::string& spec, int local_rank) {
  using host::HostError;
  if (spec.empty() || spec == "cpu") {
    std::lock_guard<std::mutex> lock(device_mu);
    return selected_device = c10::Device(c10::DeviceType::CPU);
  }
  const int asked = cuda_index_of(spec);
  if (asked < -1) throw HostError("config: train.device must be cpu, cuda or cuda:N, got '" + spec + "'");
  std::string why;
  if (!cuda_training_available(&why)) throw HostError("config: train.device=" + spec + ": " + why);
#if DTK_HAVE_CUDA
  // The local rank as the launcher set it: dtk launch and torchrun (LOCAL_RANK), srun
  // (SLURM_LOCALID), mpirun (OMPI_COMM_WORLD_LOCAL_RANK); 0 for one process.
  // A process that sees one GPU uses it whatever its local rank (srun --gpus-per-task=1 and
  // CUDA_VISIBLE_DEVICES per rank give each rank its own single device 0).
  const int visible = dtk::cuda::device_count(&why);
  const int index = asked >= 0 ? asked : visible == 1 ? 0 : local_rank;
  if (index >= visible)
    throw HostError(
        "config: train.device=" + spec + ": " +
        (asked >= 0 ? "device " + std::to_string(index) : "the local rank's device " + std::to_string(index)) +
        " does not exist (this process sees " + std::to_string(visible) + " CUDA device" + (visible == 1 ? "" : "s") +
        (asked >= 0 ? ")" : "; more ranks on this machine than GPUs?)"));
  cuda_glue::set_current_device(index);
  std::lock_guard<std::mutex> lock(device_mu);
  return selected_device = c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
#else
  (void)local_rank;
  throw HostError("config: train.device=" + spec + ": " + why);
#endif
}

int64_t cuda_device_memory_bytes(const c10::Device& device) {
#if DTK_HAVE_CUDA
  if (device.is_cuda()) return static_cast<int64_t>(dtk::cuda::device_memory_bytes(device.index()));
#endif
  (void)device;
  return 0;
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

void set_current_device(int device) {
  dtk::cuda::set_device(device);
#if DTK_TORCH_CUDA
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
#endif
}

namespace {
class EventClock final : public DeviceClock {
 public:
  EventClock(int device, std::chrono::milliseconds timeout) : device_(device), timeout_(timeout) {}
  // No throw: a scope's destructor marks its end, possibly while an exception unwinds (a device in
  // an error state); that sample is dropped, and the error surfaces where it was raised.
  int mark() noexcept override {
    try {
      dtk::cuda::DeviceGuard on(device_);
      if (used_ == events_.size()) events_.push_back(std::make_unique<dtk::cuda::Event>(/*timing=*/true));
      events_[used_]->record(torch_current_stream(device_));
      return static_cast<int>(used_++);
    } catch (const std::exception&) {
      return -1;
    }
  }
  double seconds(int from, int to) override {
    if (from < 0 || to < 0) return 0;
    dtk::cuda::DeviceGuard on(device_);
    return dtk::cuda::elapsed_ms(*events_.at(static_cast<size_t>(from)), *events_.at(static_cast<size_t>(to)),
                                 timeout_) /
           1e3;
  }
  void reset() override { used_ = 0; }

 private:
  int device_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<dtk::cuda::Event>> events_;  // reused from one log window to the next
  size_t used_ = 0;
};
}  // namespace

void use_gpu_memory_pool(int device) {
#if DTK_TORCH_CUDA
  // Index 0 of the stat arrays is the aggregate over pool kinds (StatType::AGGREGATE, in every
  // LibTorch version since the stats exist).
  memory::set_device_pool(
      [device] {
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
        return memory::Pool{stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};
      },
      [device] { c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device)); });
#else
  (void)device;
#endif
}

void cap_gpu_memory(int device, int64_t mib) {
  const int64_t total = static_cast<int64_t>(dtk::cuda::device_memory_bytes(device));
  const std::string name = "cuda:" + std::to_string(device);
  // Compared in MiB: a huge setting shifted into bytes would overflow.
  if (total <= 0 || mib > (total >> 20))
    throw host::HostError("config: train.memory_limit_mb (" + std::to_string(mib) + " MiB) is more than " + name +
                          " has (" + std::to_string(total >> 20) + " MiB)");
#if DTK_TORCH_CUDA
  // The allocator must exist before its fraction is set (LibTorch asserts it); CUDA's lazy
  // initialisation creates it, whichever call comes first.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
#else
  at::globalContext().lazyInitCUDA();
#endif
  c10::cuda::CUDACachingAllocator::setMemoryFraction(static_cast<double>(mib << 20) / static_cast<double>(total),
                                                     static_cast<c10::DeviceIndex>(device));
#else
  throw host::HostError("config: train.memory_limit_mb on " + name +
                        " needs a dtk built against a CUDA LibTorch (tools/gpu_check.sh)");
#endif
}

std::unique_ptr<DeviceClock> make_event_clock(int device, std::chrono::milliseconds timeout) {
  return std::make_unique<EventClock>(device, timeout);
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
