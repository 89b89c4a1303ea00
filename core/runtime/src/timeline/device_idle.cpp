// device_idle_report (dtk/core/timeline/profile_events.hpp): the GPU's busy time is the union of
// its kernels' intervals (kernels on several streams overlap); whatever of the recorded span it
// does not cover is idle, split into the gaps between busy intervals and the span's two ends.
#include <algorithm>
#include <cstdio>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtk/core/timeline/profile_events.hpp"

namespace dtk::core::trace {
namespace {

// A stretch of time the GPU had nothing running, with the kernels on either side (null at the
// span's ends).
struct Gap {
  double start_us = 0, length_us = 0;
  const ProfileEvent* before = nullptr;
  const ProfileEvent* after = nullptr;
};

std::vector<Gap> idle_gaps(const std::vector<const ProfileEvent*>& kernels, double span_start, double span_end) {
  std::vector<Gap> gaps;
  double busy_until = span_start;
  const ProfileEvent* last = nullptr;
  for (const ProfileEvent* k : kernels) {
    if (k->start_us > busy_until) gaps.push_back({busy_until, k->start_us - busy_until, last, k});
    if (k->start_us + k->duration_us >= busy_until) {
      busy_until = k->start_us + k->duration_us;
      last = k;
    }
  }
  if (span_end > busy_until) gaps.push_back({busy_until, span_end - busy_until, last, nullptr});
  return gaps;
}

bool is_kernel(const ProfileEvent& e) {
  return e.device && (e.activity == kConcurrentKernel || e.activity == kGpuMemcpy || e.activity == kGpuMemset);
}

// The innermost user scope (DTK phase) that encloses `e`'s start: on its thread, else on any (the
// autograd engine runs a GPU's backward ops on a thread of its own, the phase is the training
// thread's).
std::string phase_of(const std::vector<ProfileEvent>& events, const ProfileEvent& e) {
  for (const bool same_thread : {true, false}) {
    const ProfileEvent* phase = nullptr;
    for (const ProfileEvent& s : events)
      if (s.user_scope && !s.device && (!same_thread || s.thread == e.thread) && s.start_us <= e.start_us &&
          s.start_us + s.duration_us >= e.start_us && (!phase || s.duration_us < phase->duration_us))
        phase = &s;
    if (phase) return phase->name;
  }
  return "outside the timed phases";
}

std::string shortened(const std::string& name, size_t width) {
  return name.size() > width ? name.substr(0, width - 3) + "..." : name;
}

}  // namespace

std::string device_idle_report(const std::vector<ProfileEvent>& events, int64_t iterations, int top) {
  std::vector<const ProfileEvent*> kernels;
  double span_start = 1e300, span_end = -1e300;
  for (const ProfileEvent& e : events) {
    span_start = std::min(span_start, e.start_us);
    span_end = std::max(span_end, e.start_us + e.duration_us);
    // Kineto mirrors each user scope onto the GPU's timeline as an annotation: not a kernel.
    if (is_kernel(e)) kernels.push_back(&e);
  }
  if (kernels.empty()) return "";
  std::sort(kernels.begin(), kernels.end(),
            [](const ProfileEvent* a, const ProfileEvent* b) { return a->start_us < b->start_us; });
  std::vector<Gap> gaps = idle_gaps(kernels, span_start, span_end);
  double short_us = 0, long_us = 0;
  int64_t short_gaps = 0, long_gaps = 0;
  for (const Gap& g : gaps) {
    if (g.length_us < kShortGapUs) {
      ++short_gaps;
      short_us += g.length_us;
    } else {
      ++long_gaps;
      long_us += g.length_us;
    }
  }
  const double n = static_cast<double>(std::max<int64_t>(1, iterations));
  const double span_ms = (span_end - span_start) / 1e3;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                " GPU idle: %.2f ms per iteration of %.2f ms recorded (%.1f%%): %.2f ms in %.0f gaps under %.0f us "
                "(launches: what train.cuda_graphs removes), %.2f ms in %.0f longer ones\n",
                (short_us + long_us) / 1e3 / n, span_ms / n,
                span_ms > 0 ? 100.0 * (short_us + long_us) / 1e3 / span_ms : 0.0, short_us / 1e3 / n,
                static_cast<double>(short_gaps) / n, kShortGapUs, long_us / 1e3 / n,
                static_cast<double>(long_gaps) / n);
  std::string out = buf;
  std::sort(gaps.begin(), gaps.end(), [](const Gap& a, const Gap& b) { return a.length_us > b.length_us; });
  // The CPU ops by their correlation (PyTorch's numbers; the CUDA runtime's events, in CUPTI's,
  // would collide with them).
  std::unordered_map<uint64_t, const ProfileEvent*> ops;
  for (const ProfileEvent& e : events)
    if (!e.device && e.correlation != 0 && (e.activity == kCpuOp || e.activity == kUserAnnotation))
      ops[e.correlation] = &e;
  int shown = 0;
  for (const Gap& g : gaps) {
    if (shown == top || g.length_us < kShortGapUs) break;
    if (shown++ == 0)
      out +=
          " longest GPU idle gaps: ms, at ms into the span, the kernel before -> the kernel after [its CPU op, "
          "phase]\n";
    std::string launched = "not linked";
    if (g.after) {
      const auto op = ops.find(g.after->linked_correlation);
      if (op != ops.end()) launched = op->second->name + ", " + phase_of(events, *op->second);
    }
    std::snprintf(buf, sizeof buf, " %8.3f %9.3f  %s -> %s [%s]\n", g.length_us / 1e3, (g.start_us - span_start) / 1e3,
                  g.before ? shortened(g.before->name, 60).c_str() : "(the span's start)",
                  g.after ? shortened(g.after->name, 60).c_str() : "(the span's end)",
                  g.after ? launched.c_str() : "-");
    out += buf;
  }
  return out;
}

}  // namespace dtk::core::trace
