// dtk/trace.hpp — marks spans of a plugin's work on the run's timeline (logging.trace_file):
// the host's dtk.ext.trace.v1 extension (abi.h). Costs one call when no traced iteration runs,
// and nothing at all when the host does not provide the extension.
//
//   { dtk::TraceSpan span("compute", [&] { return "layer " + std::to_string(i); });
//     ... work ... }   // the span ends with the scope
#pragma once

#include <dtk/plugin.hpp>

#include <string>
#include <utility>

namespace dtk {

// The host's trace table, or nullptr (looked up once per plugin).
inline const dtk_trace_ext* trace_extension() {
  static const dtk_trace_ext* ext = [] {
    const dtk_host_services* h = host_services();
    if (!h || !h->get_extension) return static_cast<const dtk_trace_ext*>(nullptr);
    const auto* e = static_cast<const dtk_trace_ext*>(h->get_extension(DTK_EXT_TRACE_V1));
    return e && e->struct_size >= dtk_trace_ext_STRUCT_SIZE_2_1 ? e : nullptr;
  }();
  return ext;
}

class TraceSpan {
 public:
  // `name` (a callable returning a std::string) is called only while a traced iteration runs.
  template <class NameFn>
  TraceSpan(const char* category, NameFn&& name) {
    const dtk_trace_ext* e = trace_extension();
    if (!e || !e->active()) return;
    ext_ = e;
    category_ = category;
    name_ = std::forward<NameFn>(name)();
    start_ = e->now_ns();
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  ~TraceSpan() {
    if (ext_) ext_->span(name_.c_str(), category_, start_, ext_->now_ns());
  }

 private:
  const dtk_trace_ext* ext_ = nullptr;
  const char* category_ = "";
  std::string name_;
  int64_t start_ = 0;
};

}  // namespace dtk
