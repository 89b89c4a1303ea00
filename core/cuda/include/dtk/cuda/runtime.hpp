// dtk/cuda/runtime.hpp — what DTK needs of the CUDA runtime, without LibTorch (core/cuda, built
// when CMake finds a CUDA toolkit: DTK_WITH_CUDA=AUTO|ON). Streams, events, bounded waits and
// page-locked host memory. Errors throw dtk::cuda::CudaError naming the call and CUDA's message.
//
// Why not c10::cuda: Debian's LibTorch is CPU-only, so code written against c10::cuda would only
// ever compile on a GPU machine and rot; these pieces compile (and CI builds them) wherever the
// CUDA toolkit is installed. Only the glue that must talk to LibTorch's own CUDA state (its
// current stream) needs a CUDA LibTorch (DTK_TORCH_CUDA).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>

struct CUstream_st;
struct CUevent_st;

namespace dtk::cuda {

using StreamHandle = CUstream_st*;  // cudaStream_t
using EventHandle = CUevent_st*;    // cudaEvent_t

// The element types DTK's kernels take (dtk/cuda/squares.hpp, cross_entropy.hpp, rms_norm.hpp).
enum class ElementType { kFloat32, kBFloat16, kFloat16 };

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The CUDA runtime's version (e.g. 13000) this library was built with.
int runtime_version();
// How many CUDA devices this process sees; 0 (and *why, if given, says why: no driver, no
// device, CUDA_VISIBLE_DEVICES empty) when none. Never throws.
int device_count(std::string* why = nullptr);
// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)"; throws for a bad index.
std::string device_description(int device);
// The device's memory in bytes (what the run's memory estimate is checked against).
size_t device_memory_bytes(int device);
void set_device(int device);
int current_device();

// Makes `device` current for a scope and restores the previous one (CUDA calls on events and
// streams must run on their device; a library must not leave the caller's device changed).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The stream LibTorch launches on unless told otherwise (CUDA's legacy default stream).
StreamHandle default_stream();

// An owned stream on the current device. priority: 0 = default, negative = higher (CUDA's
// convention, clamped to the device's range): communication streams get the highest.
class Stream {
 public:
  explicit Stream(int priority = 0);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  StreamHandle get() const { return stream_; }
  int device() const { return device_; }
  void synchronize() const;

 private:
  StreamHandle stream_ = nullptr;
  int device_ = 0;
};

// An owned event. Timing is off unless asked for (cheaper to record and query); timed events
// measure device time between two of them (elapsed_ms): the Megatron timers on a GPU.
class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  EventHandle get() const { return event_; }
  void record(StreamHandle stream);
  // Makes future work on `stream` wait for this event; the host does not block.
  void block(StreamHandle stream) const;
  bool query() const;  // true once every recorded piece of work completed

 private:
  EventHandle event_ = nullptr;
};

// Device time in milliseconds from `start` to `end` (both timed events, recorded): blocks the
// host until `end` completed, bounded by `timeout` (throws CudaError past it).
double elapsed_ms(const Event& start, const Event& end, std::chrono::milliseconds timeout);

// Blocks the host until `event` completed, polling with a growing sleep (the host thread stays
// free for signals and the watchdog); `failed` (optional) is polled too and ends the wait with
// its message when it returns non-empty (a communicator's asynchronous error). Returns false on
// timeout; throws CudaError if the event reports an error.
bool wait_event(EventHandle event, std::chrono::milliseconds timeout,
                const std::function<std::string()>& failed = nullptr);

// Page-locked host memory (cudaHostAlloc, portable): fast asynchronous copies to and from every
// device. Release with free_pinned.
void* alloc_pinned(size_t bytes);
void free_pinned(void* p) noexcept;

// Asynchronous copy of `bytes` between any two pointers (host, pinned or device) on `stream`.
void copy_async(void* dst, const void* src, size_t bytes, StreamHandle stream);

// Throws CudaError("<what>: <CUDA's message>") when `status` (a cudaError_t) is not success.
void check(int status, const char* what);

}  // namespace dtk::cuda
