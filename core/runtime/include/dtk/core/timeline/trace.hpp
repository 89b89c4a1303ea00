// dtk/core/timeline/trace.hpp — the run's timeline (logging.trace_file): a Chrome/Perfetto trace per rank
// (chrome://tracing, ui.perfetto.dev) of the traced iterations. Tracks: the training thread's
// compute spans (plugins mark them through the host extension dtk.ext.trace.v1, abi.h) with the
// waits for collectives nested in them, and one track per process group whose collectives show
// from issue to completion. Off unless configured; recording is one mutex-guarded append.
#pragma once

#include <dtk/abi.h>

#include <cstdint>
#include <string>

namespace dtk::core::trace {

struct Settings {
  std::string path;  // empty: off. With several ranks "<stem>.rank<R><ext>" per rank.
  int64_t first = 0, last = -1;  // the traced iterations [first, last]
  int rank = 0, world_size = 1;
};
void configure(const Settings& settings);
// Parses an iteration range ("A-B" or "A", 1-based) given as option `field` (e.g.
// "logging.trace_iterations"); throws a one-line error naming the field.
void parse_iterations(const std::string& field, const std::string& spec, int64_t* first, int64_t* last);

// Around each training iteration: spans are kept while a traced iteration runs; the file is
// written after the last traced iteration (or by flush(), e.g. a run that ends earlier).
void begin_iteration(int64_t iteration);
void end_iteration(int64_t iteration);
void flush();
// The trace file that could not be written (empty: none), for the run to fail on at its end.
std::string failed_write();
bool active();
int64_t now_ns();

// A span of the training thread's work (category "compute", "wait", ...).
void span(const char* name, const char* category, int64_t start_ns, int64_t end_ns);
// A collective on `group` (dtk_group) from issue to completion, on the group's track.
void collective(const std::string& name, int32_t group, int64_t start_ns, int64_t end_ns);

// The dtk.ext.trace.v1 table the host hands to plugins.
const dtk_trace_ext* extension();

}  // namespace dtk::core::trace
