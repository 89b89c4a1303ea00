// dtk/core/device/clock.hpp — a device's own clock for Megatron's timers (logging/timers.hpp):
// on a GPU the host only queues kernels, so its wall time says little; CUDA events recorded on
// LibTorch's stream (device/cuda_glue) time each scope on the device instead.
#pragma once

namespace dtk::core {

// Marks on a device's timeline: mark() records one and returns its handle (-1 when it could not:
// never throws, scopes end during unwinding), seconds() the device time between two marks
// (waiting for the later one; 0 for a -1), reset() recycles every mark.
class DeviceClock {
 public:
  virtual ~DeviceClock() = default;
  virtual int mark() noexcept = 0;
  virtual double seconds(int from, int to) = 0;
  virtual void reset() = 0;
};

}  // namespace dtk::core
