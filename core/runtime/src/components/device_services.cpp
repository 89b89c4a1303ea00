// The device services (abi.h dtk_device_services).
//
// CPU: work is synchronous and in order, so every CPU stream is a valid handle for that one
// queue, recording an event and waiting for one do nothing, and synchronizing returns at once.
// Pinned memory is ordinary host memory, counted in the host pool of the memory report.
//
// CUDA (a build with core/cuda, DTK_HAVE_CUDA): streams and events are CUDA runtime ones
// (dtk/cuda/runtime.hpp), waits are bounded by the run's collective timeout, pinned memory is
// page-locked (cudaHostAlloc) when a device is visible. Making a stream LibTorch's current one
// needs a CUDA LibTorch (cuda_glue.hpp). Plugin code written against the table runs unchanged on
// both.
#include <dtk/tensor.hpp>

#include <map>
#include <memory>
#include <mutex>

#include "../device/cuda_glue.hpp"
#include "dtk/core/comm/comm.hpp"
#include "dtk/core/memory/memory.hpp"
#include "dtk/core/components/services.hpp"
#include "dtk/host/plugin_host.hpp"

struct dtk_stream {
  dtk_device device;
#if DTK_HAVE_CUDA
  std::unique_ptr<dtk::cuda::Stream> owned;  // null: a borrowed stream (LibTorch's, the default)
  dtk::cuda::StreamHandle handle = nullptr;
#endif
};
struct dtk_event {
  int recorded = 0;
#if DTK_HAVE_CUDA
  std::mutex mu;                           // the table's functions are thread-safe
  std::unique_ptr<dtk::cuda::Event> cuda;  // created when recorded on a CUDA stream
  int cuda_device = -1;                    // the device it was created on
#endif
};

namespace dtk::core {
namespace {

dtk_stream* new_stream(dtk_device device) {
  auto* s = new dtk_stream();
  s->device = device;
  return s;
}
dtk_stream& g_cpu_stream = *new_stream({DTK_DEVICE_CPU, -1});  // the default (and only) CPU queue

dtk_status* error(int32_t code, const std::string& message) { return host::make_status(code, message.c_str()); }

bool is_cuda(const dtk_stream* s) { return s->device.type == DTK_DEVICE_CUDA; }

dtk_status* check_device(dtk_device d, const char* what) {
  if (d.type == DTK_DEVICE_CPU) return nullptr;
  if (d.type == DTK_DEVICE_CUDA) {
#if DTK_HAVE_CUDA
    std::string why;
    const int n = dtk::cuda::device_count(&why);
    if (n == 0) return error(DTK_ERR_UNSUPPORTED, std::string(what) + ": " + why);
    if (d.index >= n)
      return error(DTK_ERR_INVALID_ARGUMENT, std::string(what) + ": no device cuda:" + std::to_string(d.index) + " (" +
                                                 std::to_string(n) + " visible)");
    return nullptr;
#else
    return error(DTK_ERR_UNSUPPORTED, std::string(what) + ": CUDA device services need a CUDA build of dtk");
#endif
  }
  return error(DTK_ERR_INVALID_ARGUMENT, std::string(what) + ": unknown device type " + std::to_string(d.type));
}

// A CUDA runtime error as a status (DTK_ERR_COMM for waits, so a timeout reads like a collective's).
template <class F>
dtk_status* cuda_call(const char* what, F&& f, int32_t code = DTK_ERR_INTERNAL) {
  try {
    f();
    return nullptr;
  } catch (const std::exception& e) {
    return error(code, std::string(what) + ": " + e.what());
  }
}

thread_local dtk_stream* t_current = nullptr;  // null: g_cpu_stream

#if DTK_HAVE_CUDA
int device_index(dtk_device d) { return d.index >= 0 ? d.index : dtk::cuda::current_device(); }

// A borrowed CUDA stream (LibTorch's current one, or the default): one object per (device,
// handle), kept for the process lifetime as the ABI promises, never changed once handed out.
dtk_stream* borrowed_stream(int device, dtk::cuda::StreamHandle handle) {
  static std::mutex mu;
  static auto* streams = new std::map<std::pair<int, dtk::cuda::StreamHandle>, dtk_stream*>();
  std::lock_guard<std::mutex> lock(mu);
  dtk_stream*& s = (*streams)[{device, handle}];
  if (!s) {
    s = new_stream({DTK_DEVICE_CUDA, device});
    s->handle = handle;
  }
  return s;
}
dtk_stream* torch_stream(int device) { return borrowed_stream(device, cuda_glue::torch_current_stream(device)); }
#endif

dtk_status* stream_create(void*, dtk_device device, int32_t priority, dtk_stream** out) {
  if (!out) return error(DTK_ERR_INVALID_ARGUMENT, "stream_create: null output");
  if (dtk_status* s = check_device(device, "stream_create")) return s;
  if (device.type == DTK_DEVICE_CPU) {
    (void)priority;  // one CPU queue: priorities order nothing
    *out = new_stream(device);
    return nullptr;
  }
#if DTK_HAVE_CUDA
  return cuda_call("stream_create", [&] {
    auto s = std::unique_ptr<dtk_stream>(new_stream({DTK_DEVICE_CUDA, device_index(device)}));
    dtk::cuda::DeviceGuard on(s->device.index);
    s->owned = std::make_unique<dtk::cuda::Stream>(priority);
    s->handle = s->owned->get();
    *out = s.release();
  });
#else
  return nullptr;  // unreachable: check_device refused CUDA
#endif
}
void stream_destroy(void*, dtk_stream* stream) {
  if (stream == &g_cpu_stream) return;
#if DTK_HAVE_CUDA
  if (is_cuda(stream) && !stream->owned) return;  // borrowed: kept for the process lifetime
#endif
  delete stream;
}
dtk_stream* current_stream(void*, dtk_device device) {
#if DTK_HAVE_CUDA
  if (device.type == DTK_DEVICE_CUDA && dtk::cuda::device_count() > 0) {
    try {
      return torch_stream(device_index(device));
    } catch (const std::exception&) {
    }
  }
#endif
  (void)device;
  return t_current ? t_current : &g_cpu_stream;
}
dtk_status* set_current_stream(void*, dtk_stream* stream, dtk_stream** previous) {
  if (!stream) return error(DTK_ERR_INVALID_ARGUMENT, "set_current_stream: null stream");
#if DTK_HAVE_CUDA
  if (is_cuda(stream))
    return cuda_call("set_current_stream", [&] {
      if (previous) *previous = torch_stream(stream->device.index);
      cuda_glue::torch_set_current_stream(stream->handle, stream->device.index);
    }, DTK_ERR_UNSUPPORTED);
#endif
  if (previous) *previous = t_current ? t_current : &g_cpu_stream;
  t_current = stream;
  return nullptr;
}
dtk_status* stream_synchronize(void*, dtk_stream* stream) {
  if (!stream) return error(DTK_ERR_INVALID_ARGUMENT, "stream_synchronize: null stream");
#if DTK_HAVE_CUDA
  if (is_cuda(stream)) {
    // Bounded like every wait: an event at the end of the queue, waited for with the timeout.
    return cuda_call("stream_synchronize", [&] {
      dtk::cuda::DeviceGuard on(stream->device.index);
      dtk::cuda::Event end;
      end.record(stream->handle);
      if (!dtk::cuda::wait_event(end.get(), collective_timeout()))
        throw std::runtime_error("timed out after " + std::to_string(collective_timeout().count()) + " ms");
    }, DTK_ERR_COMM);
  }
#endif
  return nullptr;
}
dtk_status* event_create(void*, dtk_event** out) {
  if (!out) return error(DTK_ERR_INVALID_ARGUMENT, "event_create: null output");
  *out = new dtk_event();
  return nullptr;
}
void event_destroy(void*, dtk_event* event) { delete event; }
dtk_status* event_record(void*, dtk_event* event, dtk_stream* stream) {
  if (!event || !stream) return error(DTK_ERR_INVALID_ARGUMENT, "event_record: null event or stream");
  event->recorded = 1;
#if DTK_HAVE_CUDA
  std::lock_guard<std::mutex> lock(event->mu);
  if (is_cuda(stream))
    return cuda_call("event_record", [&] {
      dtk::cuda::DeviceGuard on(stream->device.index);
      // An event belongs to the device it was created on: another device needs a new one.
      if (!event->cuda || event->cuda_device != stream->device.index) {
        event->cuda = std::make_unique<dtk::cuda::Event>();
        event->cuda_device = stream->device.index;
      }
      event->cuda->record(stream->handle);
    });
  event->cuda.reset();  // recorded on the CPU queue: complete at once
#endif
  return nullptr;
}
dtk_status* event_synchronize(void*, dtk_event* event, int64_t timeout_ms) {
  if (!event) return error(DTK_ERR_INVALID_ARGUMENT, "event_synchronize: null event");
#if DTK_HAVE_CUDA
  std::unique_lock<std::mutex> lock(event->mu);
  if (event->cuda) {
    const auto timeout = timeout_ms > 0 ? std::chrono::milliseconds(timeout_ms) : collective_timeout();
    return cuda_call("event_synchronize", [&] {
      dtk::cuda::DeviceGuard on(event->cuda_device);
      if (!dtk::cuda::wait_event(event->cuda->get(), timeout))
        throw std::runtime_error("timed out after " + std::to_string(timeout.count()) + " ms");
    }, DTK_ERR_COMM);
  }
#endif
  (void)timeout_ms;
  return nullptr;
}
dtk_status* stream_wait_event(void* ctx, dtk_stream* stream, dtk_event* event) {
  if (!stream || !event) return error(DTK_ERR_INVALID_ARGUMENT, "stream_wait_event: null stream or event");
#if DTK_HAVE_CUDA
  {
    std::lock_guard<std::mutex> lock(event->mu);
    // A CUDA stream waits on the device (cross-device waits are allowed by CUDA).
    if (event->cuda && is_cuda(stream))
      return cuda_call("stream_wait_event", [&] {
        dtk::cuda::DeviceGuard on(stream->device.index);
        event->cuda->block(stream->handle);
      });
  }
  // The CPU queue (synchronous) waits on the host, bounded.
  if (event->cuda) return event_synchronize(ctx, event, 0);
#endif
  (void)ctx;
  return nullptr;
}
dtk_status* alloc_pinned(void*, const int64_t* shape, int32_t ndim, int32_t dtype, dtk_tensor** out) {
  if (!out || ndim < 0 || (ndim > 0 && !shape))
    return error(DTK_ERR_INVALID_ARGUMENT, "alloc_pinned: null output or shape");
  for (int32_t i = 0; i < ndim; ++i)
    if (shape[i] < 0) return error(DTK_ERR_INVALID_ARGUMENT, "alloc_pinned: negative dimension");
  return dtk::guard([&] {
    const at::IntArrayRef sizes(shape, static_cast<size_t>(ndim));
    const at::ScalarType type = dtk::to_scalar_type(dtype);
#if DTK_HAVE_CUDA
    // Page-locked when a device can use it: CUDA's copies from it are asynchronous.
    if (dtk::cuda::device_count() > 0) {
      const int64_t bytes = at::detail::computeStorageNbytesContiguous(sizes, c10::elementSize(type));
      std::unique_ptr<void, void (*)(void*)> p(dtk::cuda::alloc_pinned(static_cast<size_t>(bytes)),
                                               [](void* q) { dtk::cuda::free_pinned(q); });
      *out = dtk::wrap(at::from_blob(p.get(), sizes, [](void* q) { dtk::cuda::free_pinned(q); }, at::TensorOptions(type)));
      p.release();  // the tensor owns it now
      return;
    }
#endif
    memory::HostScope host;  // host memory, not the device's (dtk/core/memory/memory.hpp)
    *out = dtk::wrap(at::empty(sizes, type));
  });
}

const dtk_device_services kDevice = {
    dtk_device_services_STRUCT_SIZE,
    nullptr,
    &stream_create,
    &stream_destroy,
    &current_stream,
    &set_current_stream,
    &stream_synchronize,
    &event_create,
    &event_destroy,
    &event_record,
    &stream_wait_event,
    &event_synchronize,
    &alloc_pinned,
};

}  // namespace

const dtk_device_services* device_services() { return &kDevice; }

}  // namespace dtk::core
