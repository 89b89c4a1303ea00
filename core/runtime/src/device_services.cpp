// The device services of a CPU-only build (abi.h dtk_device_services). CPU work is synchronous
// and in order, so every stream is a valid handle for that one queue, recording an event and
// waiting for one do nothing, and synchronizing returns at once. Pinned memory is ordinary host
// memory, counted in the host pool of the memory report. A CUDA build replaces this file's functions with ones over c10::cuda streams and
// events; plugin code written against the table runs unchanged on both.
#include <dtk/tensor.hpp>

#include "dtk/core/memory.hpp"
#include "dtk/core/services.hpp"
#include "dtk/host/plugin_host.hpp"

struct dtk_stream {
  dtk_device device;
};
struct dtk_event {
  int recorded = 0;
};

namespace dtk::core {
namespace {

dtk_stream g_cpu_stream{{DTK_DEVICE_CPU, -1}};  // the default (and only) CPU queue

dtk_status* error(int32_t code, const std::string& message) { return host::make_status(code, message.c_str()); }

dtk_status* check_device(dtk_device d, const char* what) {
  if (d.type == DTK_DEVICE_CPU) return nullptr;
  if (d.type == DTK_DEVICE_CUDA)
    return error(DTK_ERR_UNSUPPORTED, std::string(what) + ": CUDA device services need a CUDA build of dtk");
  return error(DTK_ERR_INVALID_ARGUMENT, std::string(what) + ": unknown device type " + std::to_string(d.type));
}

thread_local dtk_stream* t_current = &g_cpu_stream;

dtk_status* stream_create(void*, dtk_device device, int32_t priority, dtk_stream** out) {
  (void)priority;  // one CPU queue: priorities order nothing
  if (!out) return error(DTK_ERR_INVALID_ARGUMENT, "stream_create: null output");
  if (dtk_status* s = check_device(device, "stream_create")) return s;
  *out = new dtk_stream{device};
  return nullptr;
}
void stream_destroy(void*, dtk_stream* stream) {
  if (stream != &g_cpu_stream) delete stream;
}
dtk_stream* current_stream(void*, dtk_device) { return t_current; }
dtk_status* set_current_stream(void*, dtk_stream* stream, dtk_stream** previous) {
  if (!stream) return error(DTK_ERR_INVALID_ARGUMENT, "set_current_stream: null stream");
  if (previous) *previous = t_current;
  t_current = stream;
  return nullptr;
}
dtk_status* stream_synchronize(void*, dtk_stream* stream) {
  return stream ? nullptr : error(DTK_ERR_INVALID_ARGUMENT, "stream_synchronize: null stream");
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
  return nullptr;
}
dtk_status* stream_wait_event(void*, dtk_stream* stream, dtk_event* event) {
  return stream && event ? nullptr : error(DTK_ERR_INVALID_ARGUMENT, "stream_wait_event: null stream or event");
}
dtk_status* event_synchronize(void*, dtk_event* event, int64_t) {
  return event ? nullptr : error(DTK_ERR_INVALID_ARGUMENT, "event_synchronize: null event");
}
dtk_status* alloc_pinned(void*, const int64_t* shape, int32_t ndim, int32_t dtype, dtk_tensor** out) {
  if (!out || ndim < 0 || (ndim > 0 && !shape))
    return error(DTK_ERR_INVALID_ARGUMENT, "alloc_pinned: null output or shape");
  for (int32_t i = 0; i < ndim; ++i)
    if (shape[i] < 0) return error(DTK_ERR_INVALID_ARGUMENT, "alloc_pinned: negative dimension");
  return dtk::guard([&] {
    memory::HostScope host;  // host memory, not the device's (dtk/core/memory.hpp)
    *out = dtk::wrap(at::empty(at::IntArrayRef(shape, static_cast<size_t>(ndim)), dtk::to_scalar_type(dtype)));
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
