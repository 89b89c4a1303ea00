// dtk/plugin.hpp — header-only C++ conveniences for writing a DTK plugin. No LibTorch needed.
//
// What it gives a plugin author:
//   * dtk::Error and dtk::guard(): throw ordinary C++ exceptions; guard() converts them into a
//     dtk_status* at the ABI boundary so no exception ever crosses it (abi.h rule 4).
//   * DTK_LOG(INFO) << ...: logs through the host (plugin output joins the host's log).
//   * dtk::Options: typed access to the plugin's validated options.
//   * dtk::opt_int/opt_float/... : option declarations for the entry struct.
//   * dtk::read_struct / write_struct: struct_size-aware copies of ABI structs (abi.h rule 2).
//   * DTK_PLUGIN(...): defines the single exported entry symbol.
// One header per plugin kind builds on it: dtk/dataset.hpp (data tier, no LibTorch), and on
// top of dtk/tensor.hpp (compute tier) dtk/model.hpp, dtk/step.hpp, dtk/optimizer.hpp,
// dtk/strategy.hpp.
#pragma once

#include <dtk/abi.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dtk {

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

// An exception carrying a dtk_status_code. Anything thrown inside a guarded plugin body ends
// up as a dtk_status with this code and message.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, int32_t code = DTK_ERR_INVALID_ARGUMENT)
      : std::runtime_error(message), code_(code) {}
  int32_t code() const { return code_; }

 private:
  int32_t code_;
};

namespace detail {
// The host services given to this plugin's init(). One per shared library: plugins are built
// with hidden visibility, so this inline variable is private to each plugin.
inline const dtk_host_services* g_host = nullptr;
inline const char* g_plugin_name = nullptr;

template <size_t N>
constexpr const dtk_option_spec* option_ptr(const dtk_option_spec (&specs)[N]) {
  return specs;
}
constexpr const dtk_option_spec* option_ptr(std::nullptr_t) { return nullptr; }
template <size_t N>
constexpr size_t option_count(const dtk_option_spec (&)[N]) {
  return N;
}
constexpr size_t option_count(std::nullptr_t) { return 0; }

inline void destroy_local_status(dtk_status* s) {
  if (!s) return;
  std::free(const_cast<char*>(s->message));
  delete s;
}
}  // namespace detail

inline const dtk_host_services* host_services() { return detail::g_host; }

// A new status. Uses the host's allocator when available, else a local one; either way the
// status carries its own destroy function so the receiver can free it.
inline dtk_status* make_status(int32_t code, const std::string& message) {
  if (detail::g_host && detail::g_host->make_status) return detail::g_host->make_status(code, message.c_str());
  auto* s = new dtk_status{};
  s->struct_size = dtk_status_STRUCT_SIZE;
  s->code = code;
  s->message = strdup(message.c_str());
  s->destroy = &detail::destroy_local_status;
  return s;
}

// One line for the user: LibTorch's c10::Error::what() appends "Exception raised from ..." and a
// C++ backtrace; keep the message before it and fold any remaining newlines.
inline std::string one_line(std::string message) {
  // The backtrace starts at "Exception raised from" or, for TORCH_CHECK/enforce failures, at
  // "frame #0:" (on its own line, or after "; " once another one_line folded the lines).
  for (const char* marker : {"Exception raised from", "frame #0:"}) {
    const size_t cut = message.find(marker);
    if (cut != std::string::npos) message.resize(cut);
  }
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ' || message.back() == ';'))
    message.pop_back();
  for (size_t i = 0; (i = message.find('\n', i)) != std::string::npos;) message.replace(i, 1, "; ");
  return message;
}

// Runs `body`, converting any exception into a status. Use at every ABI entry point.
template <class F>
dtk_status* guard(F&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const Error& e) {
    return make_status(e.code(), one_line(e.what()));
  } catch (const std::bad_alloc&) {
    return make_status(DTK_ERR_INTERNAL, "out of memory");
  } catch (const std::exception& e) {
    return make_status(DTK_ERR_INTERNAL, one_line(e.what()));
  } catch (...) {
    return make_status(DTK_ERR_INTERNAL, "unknown exception");
  }
}

// Throws dtk::Error for a non-NULL status (e.g. from a host service), releasing the status.
inline void check(dtk_status* s) {
  if (!s) return;
  std::string message = dtk_status_get_message(s);
  int32_t code = dtk_status_get_code(s);
  dtk_status_release(s);
  throw Error(message, code);
}

// ------------------------------------------------------------------------------------------
// Struct sizes (abi.h rule 2)
// ------------------------------------------------------------------------------------------

// A copy of a struct another party wrote, refusing one smaller than `min_size` (the reader's
// required minor, e.g. dtk_optimizer_step_args_STRUCT_SIZE_2_0). Fields the writer did not have
// (it predates them) read as zero; fields the reader does not know are ignored.
template <class T>
T read_struct(const T* in, size_t min_size, const char* what) {
  if (!in) throw Error(std::string(what) + ": NULL", DTK_ERR_INVALID_ARGUMENT);
  if (in->struct_size < min_size)
    throw Error(std::string(what) + ": struct_size " + std::to_string(in->struct_size) + " is smaller than the " +
                    std::to_string(min_size) + " bytes this plugin requires",
                DTK_ERR_ABI);
  T out{};
  std::memcpy(static_cast<void*>(&out), in, std::min(in->struct_size, sizeof(T)));
  out.struct_size = std::min(in->struct_size, sizeof(T));
  return out;
}

// Writes `value` into an [out] struct whose room the caller declared in out->struct_size, and
// sets out->struct_size to the bytes written.
template <class T>
void write_struct(T* out, const T& value) {
  const size_t n = std::min(out->struct_size, value.struct_size);
  std::memcpy(static_cast<void*>(out), &value, n);
  out->struct_size = n;
}

// Element `i` of an array of versioned structs, walked with the elements' own struct_size.
template <class T>
const T& element(const T* array, size_t i) {
  return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(array) + i * array[0].struct_size);
}

// ------------------------------------------------------------------------------------------
// Logging through the host
// ------------------------------------------------------------------------------------------

class LogLine {
 public:
  LogLine(int32_t level, const char* file, int line) : level_(level), file_(file), line_(line) {}
  ~LogLine() {
    const std::string text = stream_.str();
    if (detail::g_host && detail::g_host->log) {
      detail::g_host->log(detail::g_host->ctx, level_, detail::g_plugin_name, file_, line_, text.c_str());
    } else {
      std::fprintf(stderr, "[%s] %s\n", detail::g_plugin_name ? detail::g_plugin_name : "plugin", text.c_str());
    }
  }
  std::ostream& stream() { return stream_; }

 private:
  int32_t level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace dtk

#define DTK_LOG_LEVEL_DEBUG DTK_LOG_DEBUG
#define DTK_LOG_LEVEL_INFO DTK_LOG_INFO
#define DTK_LOG_LEVEL_WARNING DTK_LOG_WARNING
#define DTK_LOG_LEVEL_ERROR DTK_LOG_ERROR
// DTK_LOG(INFO) << "built " << n << " layers";
#define DTK_LOG(severity) ::dtk::LogLine(DTK_LOG_LEVEL_##severity, __FILE__, __LINE__).stream()

namespace dtk {

// ------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------

constexpr dtk_option_spec opt_bool(const char* name, const char* def, const char* help) {
  return {dtk_option_spec_STRUCT_SIZE, name, DTK_OPT_BOOL, def, help, nullptr, nullptr};
}
constexpr dtk_option_spec opt_int(const char* name, const char* def, const char* help) {
  return {dtk_option_spec_STRUCT_SIZE, name, DTK_OPT_INT, def, help, nullptr, nullptr};
}
constexpr dtk_option_spec opt_float(const char* name, const char* def, const char* help) {
  return {dtk_option_spec_STRUCT_SIZE, name, DTK_OPT_FLOAT, def, help, nullptr, nullptr};
}
constexpr dtk_option_spec opt_string(const char* name, const char* def, const char* help) {
  return {dtk_option_spec_STRUCT_SIZE, name, DTK_OPT_STRING, def, help, nullptr, nullptr};
}
// choices: '|'-separated, e.g. "none|full".
constexpr dtk_option_spec opt_enum(const char* name, const char* def, const char* choices, const char* help) {
  return {dtk_option_spec_STRUCT_SIZE, name, DTK_OPT_ENUM, def, help, choices, nullptr};
}

// An option that does something only with other settings of the plugin (ABI 2.7's acts_with):
//   dtk::only_with("stage=3", dtk::opt_int("stage3_prefetch_bucket_size", "50000000", "..."))
// `settings` is "setting=value[|value...][,setting=value...]": the option acts while any one of
// the named options holds one of its values. The host refuses a value other than the default
// while none does, and `dtk plugins describe` shows the condition.
constexpr dtk_option_spec only_with(const char* settings, dtk_option_spec spec) {
  spec.acts_with = settings;
  return spec;
}

// Typed, validated view of the option values the host passed (every declared option is there).
class Options {
 public:
  Options() = default;
  explicit Options(const dtk_option_values* values) {
    if (!values) return;
    for (size_t i = 0; i < values->count; ++i)
      items_.emplace_back(values->items[i].key ? values->items[i].key : "",
                          values->items[i].value ? values->items[i].value : "");
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }
  const std::string& get_string(const std::string& key) const {
    const std::string* v = find(key);
    if (!v) throw Error("missing option '" + key + "'", DTK_ERR_INVALID_ARGUMENT);
    return *v;
  }
  int64_t get_int(const std::string& key) const {
    const std::string& v = get_string(key);
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno == ERANGE)
      throw Error("option '" + key + "': '" + v + "' is not an integer");
    return x;
  }
  double get_float(const std::string& key) const {
    const std::string& v = get_string(key);
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0') throw Error("option '" + key + "': '" + v + "' is not a number");
    return x;
  }
  bool get_bool(const std::string& key) const {
    const std::string& v = get_string(key);
    if (v == "true" || v == "1" || v == "True") return true;
    if (v == "false" || v == "0" || v == "False") return false;
    throw Error("option '" + key + "': '" + v + "' is not a boolean (true/false)");
  }
  const std::vector<std::pair<std::string, std::string>>& items() const { return items_; }

 private:
  const std::string* find(const std::string& key) const {
    for (const auto& kv : items_)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
  std::vector<std::pair<std::string, std::string>> items_;
};

}  // namespace dtk

// ------------------------------------------------------------------------------------------
// The entry point. Use once per plugin, at namespace scope:
//
//   static const dtk_option_spec kOptions[] = { dtk::opt_int("vocab_size", "50257", "...") };
//   DTK_PLUGIN("synthetic", DTK_KIND_DATASET, "1.0.0", "Random tokens", DTK_NO_TORCH,
//              dtk::dataset_api<Synthetic>(), kOptions)          // dtk/dataset.hpp
//
// TORCH_VERSION_STRING: DTK_TORCH_VERSION (from dtk/tensor.hpp) for compute plugins,
// DTK_NO_TORCH for data-tier plugins.
// ------------------------------------------------------------------------------------------
#define DTK_NO_TORCH nullptr

// Plugins with extensions (abi.h rule 8) use DTK_PLUGIN_WITH_EXTENSIONS with a function
// `const void* get_extension(const char* id)` returning a static table or nullptr.
#define DTK_PLUGIN(NAME, KIND, VERSION, DESCRIPTION, TORCH_VERSION_STRING, API_EXPR, OPTIONS) \
  DTK_PLUGIN_WITH_EXTENSIONS(NAME, KIND, VERSION, DESCRIPTION, TORCH_VERSION_STRING, API_EXPR, OPTIONS, nullptr)

#define DTK_PLUGIN_WITH_EXTENSIONS(NAME, KIND, VERSION, DESCRIPTION, TORCH_VERSION_STRING, API_EXPR, OPTIONS, \
                                   GET_EXTENSION)                                                             \
  namespace {                                                                                                 \
  dtk_status* dtk_plugin_init_(const dtk_host_services* host) {                                               \
    ::dtk::detail::g_host = host;                                                                             \
    ::dtk::detail::g_plugin_name = NAME;                                                                      \
    return nullptr;                                                                                           \
  }                                                                                                           \
  void dtk_plugin_deinit_() { ::dtk::detail::g_host = nullptr; }                                              \
  const void* dtk_plugin_get_api_() { return static_cast<const void*>(API_EXPR); }                            \
  const dtk_plugin_entry dtk_plugin_entry_struct_ = {dtk_plugin_entry_STRUCT_SIZE,                            \
                                                     DTK_ABI_MAJOR,                                           \
                                                     DTK_ABI_MINOR,                                           \
                                                     TORCH_VERSION_STRING,                                    \
                                                     NAME,                                                    \
                                                     KIND,                                                    \
                                                     VERSION,                                                 \
                                                     DESCRIPTION,                                             \
                                                     &dtk_plugin_init_,                                       \
                                                     &dtk_plugin_deinit_,                                     \
                                                     &dtk_plugin_get_api_,                                    \
                                                     ::dtk::detail::option_ptr(OPTIONS),                      \
                                                     ::dtk::detail::option_count(OPTIONS),                    \
                                                     GET_EXTENSION};                                          \
  }                                                                                                           \
  extern "C" DTK_EXPORT const dtk_plugin_entry* dtk_plugin_get_entry(void) { return &dtk_plugin_entry_struct_; }

// For a plugin without options.
#define DTK_NO_OPTIONS nullptr
