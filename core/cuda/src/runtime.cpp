#include "dtk/cuda/runtime.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <thread>

namespace dtk::cuda {

void check(int status, const char* what) {
  const auto e = static_cast<cudaError_t>(status);
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky-free error so the next call does not report it again
  throw CudaError(std::string(what) + ": " + cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")");
}

int runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return CUDART_VERSION;
  return v;
}

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = std::string("no CUDA device (CUDA runtime: ") + cudaGetErrorString(e) + ")";
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device visible (CUDA_VISIBLE_DEVICES?)";
  return n;
}

std::string device_description(int device) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  char buf[400];
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor,
                static_cast<double>(p.totalGlobalMem) / (1ull << 30));
  return buf;
}

size_t device_memory_bytes(int device) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  return p.totalGlobalMem;
}

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

int current_device() {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

DeviceGuard::DeviceGuard(int device) {
  previous_ = current_device();
  if (previous_ != device) set_device(device);
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

StreamHandle default_stream() { return cudaStreamLegacy; }

Stream::Stream(int priority) {
  device_ = current_device();
  int least = 0, greatest = 0;  // numerically: least = lowest priority (0), greatest = most negative
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  const int p = std::clamp(priority, greatest, least);
  check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, p), "cudaStreamCreateWithPriority");
}

Stream::~Stream() {
  if (stream_) cudaStreamDestroy(stream_);
}

void Stream::synchronize() const { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

Event::Event(bool timing) {
  check(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming),
        "cudaEventCreateWithFlags");
}

Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}

void Event::record(StreamHandle stream) { check(cudaEventRecord(event_, stream), "cudaEventRecord"); }

void Event::block(StreamHandle stream) const { check(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent"); }

bool Event::query() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;  // not an error: nothing to clear
  check(e, "cudaEventQuery");
  return true;
}

bool wait_event(EventHandle event, std::chrono::milliseconds timeout, const std::function<std::string()>& failed) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(2);
  for (;;) {
    // The failure check first: an aborted NCCL communicator ends its kernels, so the event of a
    // collective that never happened completes too.
    if (failed) {
      const std::string message = failed();
      if (!message.empty()) throw CudaError(message);
    }
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) check(e, "cudaEventQuery");
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

double elapsed_ms(const Event& start, const Event& end, std::chrono::milliseconds timeout) {
  if (!wait_event(end.get(), timeout)) throw CudaError("timing a phase: its end event did not complete in time");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start.get(), end.get()), "cudaEventElapsedTime");
  return ms;
}

void* alloc_pinned(size_t bytes) {
  void* p = nullptr;
  check(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable), "cudaHostAlloc");
  return p;
}

void free_pinned(void* p) noexcept {
  if (p) cudaFreeHost(p);
}

void copy_async(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
}

}  // namespace dtk::cuda
