// trace.cpp — see dtk/core/timeline/trace.hpp. Chrome's Trace Event Format: complete events ("X") for the
// training thread's spans (properly nested: a wait inside the compute span that waited), async
// begin/end pairs ("b"/"e") for collectives, which overlap each other on a group's track.
#include "dtk/core/timeline/trace.hpp"

#include <dtk/plugin.hpp>
#include <glog/logging.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <vector>

namespace dtk::core::trace {
namespace {

struct Event {
  std::string name, category;
  int64_t start_ns, end_ns;
  int track;  // 0: training thread; 1 + group: the group's collectives
  bool async;
};

struct State {
  std::mutex mu;
  Settings settings;
  bool on = false, written = false, started = false;  // started: a traced iteration ran
  std::string failed;                                 // the file that could not be written, and why
  int64_t origin_ns = -1;
  std::vector<Event> events;
};

State& state() {
  static State* s = new State();  // never destroyed: worker threads may outlive main
  return *s;
}

// By dtk_group.
const char* const kGroupNames[] = {"world",          "data-parallel",   "tensor-parallel",      "pipeline-parallel",
                                   "model-parallel", "expert-parallel", "expert-data-parallel", "context-parallel"};
constexpr int kGroups = static_cast<int>(sizeof kGroupNames / sizeof kGroupNames[0]);

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
      continue;
    }
    out += c;
  }
  return out;
}

std::string rank_path(const Settings& s) {
  if (s.world_size <= 1) return s.path;
  std::filesystem::path p(s.path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(s.rank) + p.extension().string())).string();
}

void write_locked(State& s) {
  if (s.written || s.settings.path.empty()) return;
  s.written = true;
  const std::string path = rank_path(s.settings);
  errno = 0;
  std::ofstream out(path);
  const int pid = s.settings.rank;
  auto us = [&](int64_t ns) { return static_cast<double>(ns - s.origin_ns) / 1000.0; };
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  out << "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " << pid << ", \"args\": {\"name\": \"rank " << pid
      << "\"}},\n";
  out << "{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " << pid
      << ", \"tid\": 0, \"args\": {\"name\": \"training thread\"}}";
  for (int g = 0; g < kGroups; ++g)
    out << ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " << pid << ", \"tid\": " << g + 1
        << ", \"args\": {\"name\": \"" << kGroupNames[g] << " collectives\"}}";
  char buf[160];
  int64_t id = 0;
  for (const Event& e : s.events) {
    const std::string head = "{\"name\": \"" + escape(e.name) + "\", \"cat\": \"" + escape(e.category) +
                             "\", \"pid\": " + std::to_string(pid) + ", \"tid\": " + std::to_string(e.track);
    if (!e.async) {
      std::snprintf(buf, sizeof buf, ", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f}", us(e.start_ns),
                    static_cast<double>(e.end_ns - e.start_ns) / 1000.0);
      out << ",\n" << head << buf;
    } else {
      ++id;
      std::snprintf(buf, sizeof buf, ", \"ph\": \"b\", \"id\": %lld, \"ts\": %.3f}", static_cast<long long>(id),
                    us(e.start_ns));
      out << ",\n" << head << buf;
      std::snprintf(buf, sizeof buf, ", \"ph\": \"e\", \"id\": %lld, \"ts\": %.3f}", static_cast<long long>(id),
                    us(e.end_ns));
      out << ",\n" << head << buf;
    }
  }
  out << "\n]}\n";
  out.close();
  if (!out) {
    // Reported once, as the run ends (pretrain.cpp), with the reason.
    s.failed = path + (errno != 0 ? std::string(": ") + std::strerror(errno) : std::string());
    return;
  }
  LOG(INFO) << "trace: wrote " << s.events.size() << " events of iterations " << s.settings.first << "-"
            << s.settings.last << " to " << path;
  s.events.clear();
}

int32_t ext_active() { return active() ? 1 : 0; }
int64_t ext_now() { return now_ns(); }
void ext_span(const char* name, const char* category, int64_t start, int64_t end) {
  span(name ? name : "", category ? category : "", start, end);
}

}  // namespace

void configure(const Settings& settings) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.settings = settings;
  s.on = s.written = s.started = false;
  s.origin_ns = -1;
  s.events.clear();
}

void parse_iterations(const std::string& field, const std::string& spec, int64_t* first, int64_t* last) {
  auto bad = [&] {
    return dtk::Error(field + ": '" + spec + "' is not an iteration 'A' or a range 'A-B' (1 <= A <= B)",
                      DTK_ERR_INVALID_ARGUMENT);
  };
  const size_t dash = spec.find('-');
  try {
    size_t used = 0;
    *first = std::stoll(spec.substr(0, dash), &used);
    if (used != (dash == std::string::npos ? spec.size() : dash)) throw bad();
    *last = *first;
    if (dash != std::string::npos) {
      *last = std::stoll(spec.substr(dash + 1), &used);
      if (used != spec.size() - dash - 1) throw bad();
    }
  } catch (const dtk::Error&) {
    throw;
  } catch (const std::exception&) {
    throw bad();
  }
  if (*first < 1 || *last < *first) throw bad();
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void begin_iteration(int64_t iteration) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.on = !s.settings.path.empty() && !s.written && iteration >= s.settings.first && iteration <= s.settings.last;
  if (s.on) s.started = true;
  if (s.on && s.origin_ns < 0) s.origin_ns = now_ns();
}

void end_iteration(int64_t iteration) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.on = false;
  if (iteration >= s.settings.last && s.started) write_locked(s);  // a resumed run past the range writes nothing
}

std::string failed_write() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.failed;
}

void flush() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.on = false;
  if (s.started) write_locked(s);
}

bool active() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.on;
}

void span(const char* name, const char* category, int64_t start_ns, int64_t end_ns) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.on) s.events.push_back({name, category, start_ns, end_ns, 0, false});
}

void collective(const std::string& name, int32_t group, int64_t start_ns, int64_t end_ns) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.on && group >= 0 && group < kGroups) s.events.push_back({name, "comm", start_ns, end_ns, group + 1, true});
}

const dtk_trace_ext* extension() {
  static const dtk_trace_ext table{dtk_trace_ext_STRUCT_SIZE, &ext_active, &ext_now, &ext_span};
  return &table;
}

}  // namespace dtk::core::trace
