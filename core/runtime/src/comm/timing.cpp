// timing.cpp — see timing.hpp and comm.hpp (CommTiming, SimulatedLink).
#include "timing.hpp"

#include <dtk/plugin.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>
#include <utility>
#include <vector>

#include "dtk/core/comm/comm.hpp"

namespace dtk::core {
namespace comm_timing_detail {
namespace {

constexpr size_t kGroups = kNumGroups;

struct PerGroup {
  std::vector<std::pair<int64_t, int64_t>> intervals;  // since the last reset
  int64_t blocked_ns = 0;
  int64_t link_free_ns = 0;  // the simulated link is busy until then
};

struct TimingState {
  std::mutex mu;
  std::array<PerGroup, kGroups> groups;
  SimulatedLink link;
};

TimingState& state() {
  static TimingState* s = new TimingState();  // never destroyed: worker threads may outlive main
  return *s;
}

}  // namespace

int64_t reserve_link(int32_t group, int64_t bytes, int64_t issued_ns) {
  TimingState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.link.enabled() || group < 0 || static_cast<size_t>(group) >= kGroups) return 0;
  PerGroup& g = s.groups[static_cast<size_t>(group)];
  const int64_t start = std::max(issued_ns, g.link_free_ns);
  // Capped at a day: the wait that sleeps on it is bounded by the collective timeout anyway.
  const double seconds = std::min(86400.0, s.link.latency_s + static_cast<double>(bytes) / s.link.bytes_per_s);
  g.link_free_ns = start + static_cast<int64_t>(std::llround(seconds * 1e9));
  return g.link_free_ns;
}

void record(int32_t group, int64_t start_ns, int64_t end_ns, int64_t blocked_ns) {
  if (group < 0 || static_cast<size_t>(group) >= kGroups) return;
  TimingState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  PerGroup& g = s.groups[static_cast<size_t>(group)];
  g.intervals.emplace_back(start_ns, std::max(start_ns, end_ns));
  g.blocked_ns += blocked_ns;
}

}  // namespace comm_timing_detail

CommTiming comm_timing(int32_t group) { return comm_timing(std::vector<int32_t>{group}); }

CommTiming comm_timing(const std::vector<int32_t>& groups) {
  CommTiming t;
  auto& s = comm_timing_detail::state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::pair<int64_t, int64_t>> intervals;
  int64_t blocked_ns = 0;
  for (int32_t group : groups) {
    if (group < 0 || static_cast<size_t>(group) >= comm_timing_detail::kGroups) continue;
    const auto& g = s.groups[static_cast<size_t>(group)];
    intervals.insert(intervals.end(), g.intervals.begin(), g.intervals.end());
    blocked_ns += g.blocked_ns;
  }
  std::sort(intervals.begin(), intervals.end());
  int64_t total = 0, cur_start = 0, cur_end = -1;
  for (const auto& [a, b] : intervals) {
    if (a > cur_end) {
      if (cur_end >= cur_start) total += cur_end - cur_start;
      cur_start = a;
      cur_end = b;
    } else {
      cur_end = std::max(cur_end, b);
    }
  }
  if (cur_end >= cur_start) total += cur_end - cur_start;
  t.in_flight_ms = static_cast<double>(total) / 1e6;
  t.exposed_ms = static_cast<double>(blocked_ns) / 1e6;
  t.collectives = static_cast<int64_t>(intervals.size());
  return t;
}

void reset_comm_timing() {
  auto& s = comm_timing_detail::state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& g : s.groups) {
    g.intervals.clear();
    g.blocked_ns = 0;
  }
}

namespace {

// "<number><unit>" with the unit among `units` (name, factor); throws naming `what`.
double parse_quantity(const std::string& text, const std::vector<std::pair<const char*, double>>& units,
                      const std::string& what) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = used ? text.substr(used) : "";
  for (const auto& [name, factor] : units)
    if (used && unit == name && std::isfinite(value) && value >= 0) return value * factor;
  std::string names;
  for (const auto& u : units) names += std::string(names.empty() ? "" : "|") + u.first;
  throw dtk::Error("distributed.simulated_link: " + what + " '" + text + "' is not a non-negative number with a unit (" +
                       names + ")",
                   DTK_ERR_INVALID_ARGUMENT);
}

}  // namespace

SimulatedLink parse_simulated_link(const std::string& spec) {
  SimulatedLink link;
  if (spec.empty() || spec == "off") return link;
  const size_t comma = spec.find(',');
  if (comma == std::string::npos || spec.find(',', comma + 1) != std::string::npos)
    throw dtk::Error("distributed.simulated_link: '" + spec + "' is not '<latency>,<bandwidth>' (e.g. 25us,50GBps)",
                     DTK_ERR_INVALID_ARGUMENT);
  link.latency_s = parse_quantity(spec.substr(0, comma), {{"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1.0}},
                                  "latency");
  link.bytes_per_s = parse_quantity(spec.substr(comma + 1),
                                    {{"Bps", 1.0},
                                     {"KBps", 1e3},
                                     {"MBps", 1e6},
                                     {"GBps", 1e9},
                                     {"bps", 0.125},
                                     {"Kbps", 125.0},
                                     {"Mbps", 1.25e5},
                                     {"Gbps", 1.25e8}},
                                    "bandwidth");
  if (link.bytes_per_s <= 0)
    throw dtk::Error("distributed.simulated_link: the bandwidth must be positive", DTK_ERR_INVALID_ARGUMENT);
  return link;
}

void set_simulated_link(const SimulatedLink& link) {
  auto& s = comm_timing_detail::state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.link = link;
  for (auto& g : s.groups) g.link_free_ns = 0;
}

}  // namespace dtk::core
