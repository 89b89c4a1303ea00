#include "offload.hpp"

namespace dtk::zero {

namespace {
// Makes `stream` current for a scope (LibTorch's copies go there), and restores the previous one.
class OnStream {
 public:
  OnStream(const dtk_device_services* dev, dtk_stream* stream) : dev_(dev) {
    check(dev_->set_current_stream(dev_->ctx, stream, &previous_));
  }
  ~OnStream() {
    dtk_stream* ignored = nullptr;
    if (previous_) dtk_status_release(dev_->set_current_stream(dev_->ctx, previous_, &ignored));
  }
  OnStream(const OnStream&) = delete;
  OnStream& operator=(const OnStream&) = delete;

 private:
  const dtk_device_services* dev_;
  dtk_stream* previous_ = nullptr;
};
}  // namespace

OffloadCopier::OffloadCopier(const at::Device& device) : dev_(Device::services()), device_(device) {
  check(dev_->stream_create(dev_->ctx, from_device(device), /*priority=*/0, &stream_));
  check(dev_->event_create(dev_->ctx, &ready_));
}

OffloadCopier::~OffloadCopier() {
  // Bounded waits: a copy that never completes is an error logged by the host, not a hang.
  for (Copy& c : pending_) {
    dtk_status_release(dev_->event_synchronize(dev_->ctx, c.done, 0));
    dev_->event_destroy(dev_->ctx, c.done);
  }
  for (dtk_event* e : spare_events_) dev_->event_destroy(dev_->ctx, e);
  if (ready_) dev_->event_destroy(dev_->ctx, ready_);
  if (stream_) dev_->stream_destroy(dev_->ctx, stream_);
}

dtk_event* OffloadCopier::take_event() {
  if (!spare_events_.empty()) {
    dtk_event* e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  dtk_event* e = nullptr;
  check(dev_->event_create(dev_->ctx, &e));
  return e;
}

void OffloadCopier::to_host(const at::Tensor& device_values, std::function<void(const at::Tensor&)> landed) {
  at::NoGradGuard no_grad;
  // The copy stream starts where the compute stream is now (the reduction that produced the values).
  check(dev_->event_record(dev_->ctx, ready_, Device::current_stream(device_)));
  check(dev_->stream_wait_event(dev_->ctx, stream_, ready_));
  // LibTorch's caching pinned allocator: a chunk's buffer is reused for later chunks instead of a
  // cudaHostAlloc / cudaFreeHost per chunk (the latter can synchronise the device).
  Copy c{take_event(), device_values,
         at::empty(device_values.sizes(), device_values.options().device(at::kCPU).pinned_memory(true)),
         std::move(landed)};
  {
    OnStream on(dev_, stream_);
    c.host_values.copy_(device_values, /*non_blocking=*/true);
  }
  check(dev_->event_record(dev_->ctx, c.done, stream_));
  pending_.push_back(std::move(c));
}

void OffloadCopier::drain(size_t keep) {
  while (pending_.size() > keep) {
    Copy c = std::move(pending_.front());
    pending_.pop_front();
    spare_events_.push_back(c.done);
    check(dev_->event_synchronize(dev_->ctx, c.done, 0));
    c.landed(c.host_values);
  }
}

}  // namespace dtk::zero
