// The profile's GPU idle report (dtk/core/timeline/profile_events.hpp) on events made by hand, as
// Kineto records them: kernels on two streams that overlap, a launch gap, a stall, the span's two
// ends, the phase annotation Kineto mirrors onto the GPU's timeline (a device event, not a kernel),
// and the CPU op that launched the kernel after the stall, found by its correlation (not the CUDA
// runtime's event whose CUPTI number is the same) on the autograd engine's thread, its phase on
// the training thread.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtk/core/timeline/profile_events.hpp"

namespace {

using dtk::core::trace::device_idle_report;
using dtk::core::trace::kConcurrentKernel;
using dtk::core::trace::kCpuOp;
using dtk::core::trace::kGpuUserAnnotation;
using dtk::core::trace::kUserAnnotation;
using dtk::core::trace::ProfileEvent;

ProfileEvent kernel(const std::string& name, double start, double duration, uint64_t launched_by = 0) {
  ProfileEvent e;
  e.name = name;
  e.device = true;
  e.activity = kConcurrentKernel;
  e.start_us = start;
  e.duration_us = duration;
  e.linked_correlation = launched_by;
  return e;
}

ProfileEvent cpu(const std::string& name, double start, double duration, uint64_t correlation = 0,
                 bool user_scope = false, uint64_t thread = 1) {
  ProfileEvent e;
  e.name = name;
  e.activity = user_scope ? kUserAnnotation : kCpuOp;
  e.thread = thread;
  e.start_us = start;
  e.duration_us = duration;
  e.correlation = correlation;
  e.user_scope = user_scope;
  return e;
}

TEST(DeviceIdle, SplitsLaunchGapsFromStallsAndNamesWhatEndedEach) {
  std::vector<ProfileEvent> events = {
      cpu("forward", -5, 3000, 0, /*user_scope=*/true),
      cpu("backward", 4000, 1100, 0, /*user_scope=*/true),
      cpu("aten::mm", 5000, 20, /*correlation=*/7, false, /*thread=*/2),  // the autograd engine's thread
      kernel("k1", 0, 10),
      kernel("k2", 12, 8),                        // 2 us after k1: a launch gap
      kernel("k3", 15, 15),                       // another stream, overlapping k2: busy until 30
      kernel("k4", 5030, 10, /*launched_by=*/7),  // 5000 us after k3 ends: a stall
  };
  // The phase Kineto mirrors onto the GPU spans the whole backward: not a kernel.
  ProfileEvent annotation = kernel("backward", 4000, 1100);
  annotation.activity = kGpuUserAnnotation;
  events.push_back(annotation);
  // The CUDA runtime's launch call, its correlation in CUPTI's numbers (here the same 7).
  ProfileEvent launch = cpu("cudaLaunchKernel", 5010, 5, 7, false, 2);
  launch.activity = 7;  // CUDA_RUNTIME
  events.push_back(launch);
  // The span runs from -5 (forward's start) to 5100 (backward's end): 5 us idle before k1 and 60
  // after k4. Short: 5 + 2 us in 2 gaps; long: 5000 + 60 us in 2; over 2 iterations.
  const std::string report = device_idle_report(events, 2, 10);
  EXPECT_NE(report.find(" GPU idle: 2.53 ms per iteration of 2.55 ms recorded (99.3%): 0.00 ms in 1 gaps under 20 us "),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("2.53 ms in 1 longer ones"), std::string::npos) << report;
  EXPECT_NE(report.find("    5.000     0.035  k3 -> k4 [aten::mm, backward]\n"), std::string::npos) << report;
  EXPECT_NE(report.find("    0.060     5.045  k4 -> (the span's end) [-]\n"), std::string::npos) << report;
  // Only the gaps of 20 us or more are listed, longest first, at most `top` of them.
  EXPECT_EQ(report.find("k1 -> k2"), std::string::npos) << report;
  EXPECT_EQ(device_idle_report(events, 2, 1).find("k4 -> (the span's end)"), std::string::npos);
  // A kernel whose launch the profiler did not link.
  events[6].linked_correlation = 8;
  EXPECT_NE(device_idle_report(events, 2, 10).find("k3 -> k4 [not linked]"), std::string::npos);
  // No kernels (a CPU run): nothing to say.
  EXPECT_EQ(device_idle_report({cpu("aten::mm", 0, 5, 1)}, 1, 10), "");
}

}  // namespace
