// offload.hpp — ZeRO-Offload's gradient copies on a GPU run (offload_optimizer=cpu): each reduced
// gradient chunk goes device -> page-locked host memory on a copy stream of its own, so the copy
// engine moves it while the compute stream runs the rest of backward, and the host adds it into
// the fp32 partition once the copy landed (DeepSpeed's async D2H of the averaged gradients).
//
// Streams and events go through the host's device services (dtk_device_services), the host buffers
// come from LibTorch's caching pinned allocator; no CUDA header is needed here. On a CPU run nothing
// of this is used.
#pragma once

#include <dtk/tensor.hpp>

#include <deque>
#include <functional>

namespace dtk::zero {

class OffloadCopier {
 public:
  explicit OffloadCopier(const at::Device& device);
  ~OffloadCopier();
  OffloadCopier(const OffloadCopier&) = delete;
  OffloadCopier& operator=(const OffloadCopier&) = delete;

  // Copies `device_values` (ready once the work queued so far on the current stream ran) into a
  // pinned host buffer on the copy stream; `landed(host_values)` runs on this thread from a later
  // drain(), once the copy completed. The device tensor stays alive until then (the caching
  // allocator must not hand its memory to the compute stream while the copy reads it).
  void to_host(const at::Tensor& device_values, std::function<void(const at::Tensor&)> landed);
  // Completes copies (oldest first) until at most `keep` are in flight.
  void drain(size_t keep);
  size_t in_flight() const { return pending_.size(); }

 private:
  struct Copy {
    dtk_event* done;
    at::Tensor device_values, host_values;
    std::function<void(const at::Tensor&)> landed;
  };
  dtk_event* take_event();
  const dtk_device_services* dev_;
  at::Device device_;
  dtk_stream* stream_ = nullptr;
  dtk_event* ready_ = nullptr;  // the compute stream's position at each copy
  std::deque<Copy> pending_;
  std::vector<dtk_event*> spare_events_;
};

}  // namespace dtk::zero
