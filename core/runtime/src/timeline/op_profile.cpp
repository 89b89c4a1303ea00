#include "dtk/core/timeline/op_profile.hpp"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <unordered_map>
#include <vector>

#include "dtk/core/timeline/profile_events.hpp"
#include "dtk/core/timeline/trace.hpp"
#include "dtk/plugin.hpp"

namespace dtk::core::trace {

namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

namespace {

using Event = ProfileEvent;

// One recorded event, in microseconds, whatever the LibTorch version counts in.
Event event_of(const prof::KinetoEvent& e) {
  Event out;
  out.name = e.name();
  out.device = e.deviceType() != c10::DeviceType::CPU;
  out.thread = e.startThreadId();
  out.user_scope = e.scope() == static_cast<uint8_t>(at::RecordScope::USER_SCOPE);
  out.activity = e.activityType();
  out.correlation = e.correlationId();
  out.linked_correlation = e.linkedCorrelationId();
#if TORCH_VERSION_MAJOR >= 2
  out.start_us = static_cast<double>(e.startNs()) / 1e3;
  out.duration_us = static_cast<double>(e.durationNs()) / 1e3;
#else
  out.start_us = static_cast<double>(e.startUs());
  out.duration_us = static_cast<double>(e.durationUs());
#endif
  return out;
}

struct Row {
  int64_t calls = 0;
  double self_us = 0, total_us = 0;
};

// Per name: calls, total time and self time (a CPU op's time minus its children's on the same
// thread: ATen ops nest, aten::linear holds aten::addmm; kernels do not nest).
std::map<std::string, Row> summarise(std::vector<Event> events, bool device, double* top_level_us = nullptr) {
  std::map<std::string, Row> rows;
  if (top_level_us) *top_level_us = 0;
  // Kineto mirrors each user scope (DTK's phases) onto the GPU's timeline as an annotation that
  // spans the phase's kernels: not a kernel, so not counted as one.
  std::set<std::string> phases;
  for (const Event& e : events)
    if (e.user_scope && !e.device) phases.insert(e.name);
  std::unordered_map<uint64_t, std::vector<const Event*>> by_thread;
  for (const Event& e : events)
    if (e.device == device && !(device && phases.count(e.name))) by_thread[device ? 0 : e.thread].push_back(&e);
  for (auto& [thread, list] : by_thread) {
    std::sort(list.begin(), list.end(), [](const Event* a, const Event* b) {
      return a->start_us != b->start_us ? a->start_us < b->start_us : a->duration_us > b->duration_us;
    });
    std::vector<std::pair<const Event*, double>> open;  // enclosing events and their children's time
    auto close_until = [&](double t) {
      while (!open.empty() && open.back().first->start_us + open.back().first->duration_us <= t) {
        auto [e, children] = open.back();
        open.pop_back();
        rows[e->name].self_us += std::max(0.0, e->duration_us - children);
        if (!open.empty()) open.back().second += e->duration_us;
      }
    };
    for (const Event* e : list) {
      Row& r = rows[e->name];
      ++r.calls;
      r.total_us += e->duration_us;
      if (device) {
        r.self_us += e->duration_us;
        continue;
      }
      close_until(e->start_us);
      if (open.empty() && top_level_us) *top_level_us += e->duration_us;
      open.emplace_back(e, 0.0);
    }
    close_until(1e300);
  }
  return rows;
}

// `width`: the name column; kernels get a wide one (templated elementwise kernels differ only in
// their functor, far into the name).
std::string table(const std::map<std::string, Row>& rows, const char* what, double wall_ms, int top, int width = 48) {
  std::vector<std::pair<std::string, Row>> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.self_us > b.second.self_us; });
  char buf[512];
  std::snprintf(buf, sizeof buf, " %-*s %8s %11s %11s %8s\n", width, what, "calls", "self ms", "total ms", "of wall");
  std::string out = buf;
  for (int i = 0; i < top && i < static_cast<int>(sorted.size()); ++i) {
    const auto& [name, r] = sorted[static_cast<size_t>(i)];
    const size_t w = static_cast<size_t>(width);
    const std::string shown = name.size() > w ? name.substr(0, w - 3) + "..." : name;
    std::snprintf(buf, sizeof buf, " %-*s %8lld %11.2f %11.2f %7.1f%%\n", width, shown.c_str(),
                  static_cast<long long>(r.calls), r.self_us / 1e3, r.total_us / 1e3,
                  wall_ms > 0 ? 100.0 * r.self_us / 1e3 / wall_ms : 0.0);
    out += buf;
  }
  return out;
}

std::string json_escaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

// The recorded events as a Chrome trace (for a LibTorch without Kineto, which cannot save its own).
void write_chrome_trace(const std::string& path, const std::vector<Event>& events, int rank) {
  std::ofstream out(path);
  out << "{\"traceEvents\":[\n";
  bool first = true;
  for (const Event& e : events) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "\"ph\":\"X\",\"pid\":%d,\"tid\":%llu,\"ts\":%.3f,\"dur\":%.3f", rank,
                  static_cast<unsigned long long>(e.device ? 0 : e.thread), e.start_us, e.duration_us);
    out << (first ? "" : ",\n") << "{\"name\":\"" << json_escaped(e.name) << "\",\"cat\":\""
        << (e.device ? "kernel" : "cpu_op") << "\"," << buf << "}";
    first = false;
  }
  out << "\n]}\n";
  if (!out) throw dtk::Error("logging.profile_dir: cannot write " + path, DTK_ERR_IO);
}

// A read of a device value by the host: `item()` (ATen's _local_scalar_dense). On a GPU each is a
// synchronisation, and so are the CUDA runtime's blocking calls, counted apart (a read is one
// cudaMemcpyAsync + cudaStreamSynchronize; a blocking copy to the host is a synchronisation with
// no read).
bool is_host_read(const Event& e) { return !e.device && e.name == "aten::_local_scalar_dense"; }
bool is_cuda_sync(const Event& e) {
  static const std::set<std::string> kBlocking = {"cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                  "cudaEventSynchronize", "cudaMemcpy"};
  return !e.device && kBlocking.count(e.name) != 0;
}

// "N per iteration (phase n, phase m)": the events `counted` picks, per iteration, by the DTK
// phase (timer scope) that encloses each, so that a user sees which part of the step waits.
std::string per_iteration_by_phase(const std::vector<Event>& events, bool (*counted)(const Event&),
                                   int64_t iterations) {
  std::map<std::string, int64_t> by_phase;
  int64_t total = 0;
  for (const Event& e : events) {
    if (!counted(e)) continue;
    ++total;
    const Event* phase = nullptr;  // the innermost enclosing scope on the same thread
    for (const Event& s : events)
      if (s.user_scope && s.thread == e.thread && s.start_us <= e.start_us &&
          s.start_us + s.duration_us >= e.start_us + e.duration_us &&
          (!phase || s.duration_us < phase->duration_us))
        phase = &s;
    ++by_phase[phase ? phase->name : "outside the timed phases"];
  }
  const double n = static_cast<double>(std::max<int64_t>(1, iterations));
  char buf[96];
  std::snprintf(buf, sizeof buf, "%g per iteration", static_cast<double>(total) / n);
  std::string out = buf;
  std::string sep = " (";
  for (const auto& [phase, count] : by_phase) {
    std::snprintf(buf, sizeof buf, "%s %g", phase.c_str(), static_cast<double>(count) / n);
    out += sep + buf;
    sep = ", ";
  }
  return total ? out + ")" : out;
}

}  // namespace

OpProfile::OpProfile(Settings settings) : s_(std::move(settings)) {}

OpProfile::~OpProfile() {
  if (on_) {
    try {
      prof::disableProfiler();
    } catch (...) {
    }
  }
}

void OpProfile::before_iteration(int64_t iteration) {
  if (done_ || on_ || iteration < s_.first || iteration > s_.last) return;
  impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (s_.cuda) activities.insert(impl::ActivityType::CUDA);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  on_ = true;
}

void OpProfile::after_iteration(int64_t iteration, double seconds) {
  if (!on_) return;
  seconds_ += seconds;
  ++iterations_;
  if (iteration >= s_.last) stop_and_report();
}

void OpProfile::finish() {
  if (on_) stop_and_report();
}

void OpProfile::stop_and_report() {
  // The result is kept until the process exits, never destroyed: LibTorch 1.13's ProfilerResult
  // destructor crashed (SIGSEGV inside it) on the second rank of a two-process bf16 zero run with
  // the per-token loss (tests/megatron MegatronRecipe.LlamaAndMixtralExampleScriptsMapAndTrain).
  // One per run (profile_steps is one window).
  prof::ProfilerResult* result = prof::disableProfiler().release();
  on_ = false;
  done_ = true;
  std::vector<Event> events;
  for (const prof::KinetoEvent& e : result->events()) events.push_back(event_of(e));
  std::error_code ec;
  std::filesystem::create_directories(s_.dir, ec);
  const std::string path = s_.dir + "/rank" + std::to_string(s_.rank) + ".json";
  std::string how = "LibTorch's Kineto trace";
  try {
    result->save(path);
  } catch (const c10::Error&) {  // a LibTorch without Kineto (Debian's): the ops DTK recorded
    write_chrome_trace(path, events, s_.rank);
    how = "the recorded ops";
  }
  if (!s_.print) return;
  const double wall_ms = seconds_ * 1e3;
  char head[256];
  std::snprintf(head, sizeof head, " profile of iterations %lld-%lld (%lld iterations, %.1f ms wall), rank %d: %s in %s\n",
                static_cast<long long>(s_.first), static_cast<long long>(s_.first + iterations_ - 1),
                static_cast<long long>(iterations_), wall_ms, s_.rank, how.c_str(), path.c_str());
  double top_level_us = 0;
  std::string out = head + table(summarise(events, /*device=*/false, &top_level_us), "op (CPU, by self time)", wall_ms, 15);
  // What no recorded op or phase covers (DTK's timers' phases are recorded as user scopes).
  char tail[160];
  std::snprintf(tail, sizeof tail, " recorded ops and phases cover %.1f ms of the %.1f ms wall (%.0f%%)\n",
                top_level_us / 1e3, wall_ms, wall_ms > 0 ? 100.0 * top_level_us / 1e3 / wall_ms : 0.0);
  out += tail;
  const auto kernels = summarise(events, /*device=*/true);
  if (!kernels.empty()) out += table(kernels, "kernel (GPU)", wall_ms, 30, 160);
  // Each read stalls the host until the device has run all it was given (issue 33: no hidden
  // synchronisation); docs/cuda.md keeps the count.
  out += " host reads of device values (item()): " + per_iteration_by_phase(events, is_host_read, iterations_) + "\n";
  if (s_.cuda)
    out += " blocking CUDA calls (synchronisations): " + per_iteration_by_phase(events, is_cuda_sync, iterations_) + "\n";
  // Where the GPU waited for the host, and for what (issue 33: the launch gaps against a stall).
  out += device_idle_report(events, iterations_, 10);
  if (!out.empty() && out.back() == '\n') out.pop_back();
  s_.print(out);
}

}  // namespace dtk::core::trace
