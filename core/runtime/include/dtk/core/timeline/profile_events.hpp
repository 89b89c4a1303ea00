// dtk/core/timeline/profile_events.hpp — the events LibTorch's profiler recorded over
// logging.profile_steps (op_profile.hpp), and where the GPU waited among them.
//
// A GPU that idles between kernels is waiting for the host: for launches (a few microseconds
// each, what CUDA graphs remove), or for a host that stalled (a synchronisation, an allocation, a
// slow op on the CPU) while the device had nothing queued. The report says which: the idle time
// per iteration in short gaps and in long ones, and each longest gap with the kernels on either
// side, the CPU op that launched the one after it, and the DTK phase that op ran in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtk::core::trace {

// Kineto's kinds of event (libkineto's ActivityType; these six have kept their numbers since
// 2021, newer kinds are appended).
enum KinetoActivity : uint8_t {
  kCpuOp = 0,              // an ATen op (PyTorch's correlation numbers)
  kUserAnnotation = 1,     // a RecordFunction user scope: DTK's timers' phases
  kGpuUserAnnotation = 2,  // such a scope mirrored onto the GPU's timeline: not a kernel
  kGpuMemcpy = 3,
  kGpuMemset = 4,
  kConcurrentKernel = 5,  // a kernel
};

// One recorded event, in microseconds.
struct ProfileEvent {
  std::string name;
  bool device = false;      // on the GPU's timeline (kernels, copies, mirrored annotations)
  bool user_scope = false;  // a RecordFunction user scope: DTK's timers' phases
  uint8_t activity = kCpuOp;
  uint64_t thread = 0;
  double start_us = 0, duration_us = 0;
  // Kineto's links: a kernel's linked_correlation is the correlation of the CPU op (kCpuOp or
  // kUserAnnotation) that launched it; the CUDA runtime's events count in CUPTI's numbers
  // instead. 0 where the profiler recorded none.
  uint64_t correlation = 0, linked_correlation = 0;
};

// Gaps shorter than this are launch overheads (the device ran each kernel as it came).
constexpr double kShortGapUs = 20.0;

// Lines on the GPU's idle time over the recorded span (from the first event to the last end, all
// events; `iterations` of it): the idle time and gap counts per iteration, short and long, then
// the `top` longest gaps. Empty where no device event was recorded.
std::string device_idle_report(const std::vector<ProfileEvent>& events, int64_t iterations, int top);

}  // namespace dtk::core::trace
