// timing.hpp — what collectives.cpp records about each collective (comm.hpp: CommTiming,
// SimulatedLink): the simulated link's schedule and the per-group in-flight intervals and blocked
// waits. Times are trace::now_ns() (dtk/core/timeline/trace.hpp), so collectives land on the timeline as
// measured.
#pragma once

#include <cstdint>

namespace dtk::core::comm_timing_detail {

// Reserves the simulated link of `group` for `bytes` issued at `issued_ns`; returns when the
// message has crossed it, or 0 without a simulated link.
int64_t reserve_link(int32_t group, int64_t bytes, int64_t issued_ns);
// One collective on `group`: in flight over [start_ns, end_ns], of which `blocked_ns` the caller
// spent waiting in wait().
void record(int32_t group, int64_t start_ns, int64_t end_ns, int64_t blocked_ns);

}  // namespace dtk::core::comm_timing_detail
