// dtk/plugin.hpp — header-only C++ conveniences for writing a DTK plugin. No LibTorch needed.
//
// What it gives a plugin author:
//   * dtk::Error and dtk::guard(): throw ordinary C++ exceptions; guard() converts them into a
//     dtk_status* at the ABI boundary so no exception ever crosses it (abi.h rule 4).
//   * DTK_LOG(INFO) << ...: logs through the host (plugin output joins the host's log).
//   * dtk::Options: typed access to the plugin's validated options.
//   * dtk::opt_int/opt_float/... : option declarations for the entry struct.
//   * DTK_PLUGIN(...): defines the single exported entry symbol.
//   * dtk::Dataset + DTK_DATASET_API(Class): a data-tier dataset plugin in plain C++.
// Compute-tier plugins (models, steps, optimizers, strategies) also include dtk/tensor.hpp.
#pragma once

#include <dtk/abi.h>

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
  s->struct_size = sizeof(dtk_status);
  s->code = code;
  s->message = strdup(message.c_str());
  s->destroy = &detail::destroy_local_status;
  return s;
}

// One line for the user: LibTorch's c10::Error::what() appends "Exception raised from ..." and a
// C++ backtrace; keep the message before it and fold any remaining newlines.
inline std::string one_line(std::string message) {
  const size_t cut = message.find("\nException raised from");
  if (cut != std::string::npos) message.resize(cut);
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
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
  return {sizeof(dtk_option_spec), name, DTK_OPT_BOOL, def, help, nullptr};
}
constexpr dtk_option_spec opt_int(const char* name, const char* def, const char* help) {
  return {sizeof(dtk_option_spec), name, DTK_OPT_INT, def, help, nullptr};
}
constexpr dtk_option_spec opt_float(const char* name, const char* def, const char* help) {
  return {sizeof(dtk_option_spec), name, DTK_OPT_FLOAT, def, help, nullptr};
}
constexpr dtk_option_spec opt_string(const char* name, const char* def, const char* help) {
  return {sizeof(dtk_option_spec), name, DTK_OPT_STRING, def, help, nullptr};
}
// choices: '|'-separated, e.g. "none|full".
constexpr dtk_option_spec opt_enum(const char* name, const char* def, const char* choices, const char* help) {
  return {sizeof(dtk_option_spec), name, DTK_OPT_ENUM, def, help, choices};
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

// ------------------------------------------------------------------------------------------
// Data tier: buffers
// ------------------------------------------------------------------------------------------

namespace detail {
struct OwnedBuffer {
  dtk_buffer buffer{};
  std::vector<int64_t> shape;
  std::shared_ptr<void> keepalive;  // owns (or pins) the memory `buffer.data` points into
};
inline void delete_owned_buffer(dtk_buffer* b) { delete static_cast<OwnedBuffer*>(b->manager_ctx); }
}  // namespace detail

// A 1-D buffer over `count` elements at `data`, kept alive by `keepalive` (e.g. a shared
// pointer to a memory map or to a std::vector). Ownership: [new], deleter frees it.
inline dtk_buffer* make_buffer(void* data, int32_t dtype, int64_t count, std::shared_ptr<void> keepalive) {
  auto* owned = new detail::OwnedBuffer();
  owned->shape = {count};
  owned->keepalive = std::move(keepalive);
  owned->buffer.struct_size = sizeof(dtk_buffer);
  owned->buffer.data = data;
  owned->buffer.dtype = dtype;
  owned->buffer.ndim = 1;
  owned->buffer.shape = owned->shape.data();
  owned->buffer.strides = nullptr;
  owned->buffer.manager_ctx = owned;
  owned->buffer.deleter = &detail::delete_owned_buffer;
  return &owned->buffer;
}

// A buffer that owns a copy of `values` (int64 tokens).
inline dtk_buffer* make_buffer(std::vector<int64_t> values) {
  auto storage = std::make_shared<std::vector<int64_t>>(std::move(values));
  void* data = storage->data();
  const auto n = static_cast<int64_t>(storage->size());
  return make_buffer(data, DTK_DTYPE_INT64, n, std::move(storage));
}

inline void put(const dtk_buffer_sink* sink, const char* name, dtk_buffer* buffer) {
  check(sink->put(sink->ctx, name, buffer));
}

// C++ view of the dataset context.
struct DatasetContext {
  explicit DatasetContext(const dtk_dataset_context* c)
      : options(c->options),
        seq_length(c->seq_length),
        seed(c->seed),
        rank(c->rank),
        world_size(c->world_size),
        cache_dir(c->cache_dir ? c->cache_dir : "") {
    for (int i = 0; i < 3; ++i) num_samples[i] = c->num_samples[i];
  }
  Options options;
  int64_t seq_length;
  int64_t num_samples[3];
  uint64_t seed;
  int32_t rank, world_size;
  std::string cache_dir;
};

// Base class of a C++ dataset plugin. Constructor: Class(const dtk::DatasetContext&).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t num_samples(int32_t split) = 0;
  // Puts the sample's named buffers into `out` (GPT: "text", seq_length + 1 tokens).
  virtual void get_sample(int32_t split, int64_t index, const dtk_buffer_sink* out) = 0;
  virtual int64_t vocab_size() { return 0; }
};

// The dtk_dataset_api table for a dtk::Dataset subclass.
template <class T>
const dtk_dataset_api* dataset_api() {
  static const dtk_dataset_api api = {
      sizeof(dtk_dataset_api),
      [](const dtk_dataset_context* ctx, dtk_dataset** out) {
        return guard([&] { *out = reinterpret_cast<dtk_dataset*>(new T(DatasetContext(ctx))); });
      },
      [](dtk_dataset* d) { delete reinterpret_cast<T*>(d); },
      [](dtk_dataset* d, int32_t split, int64_t* out) {
        return guard([&] { *out = reinterpret_cast<T*>(d)->num_samples(split); });
      },
      [](dtk_dataset* d, int32_t split, int64_t index, const dtk_buffer_sink* out) {
        return guard([&] { reinterpret_cast<T*>(d)->get_sample(split, index, out); });
      },
      [](dtk_dataset* d, int64_t* out) { return guard([&] { *out = reinterpret_cast<T*>(d)->vocab_size(); }); },
  };
  return &api;
}

}  // namespace dtk

// ------------------------------------------------------------------------------------------
// The entry point. Use once per plugin, at namespace scope:
//
//   static const dtk_option_spec kOptions[] = { dtk::opt_int("vocab_size", "50257", "...") };
//   DTK_PLUGIN("synthetic", DTK_KIND_DATASET, "1.0.0", "Random tokens", DTK_NO_TORCH,
//              dtk::dataset_api<Synthetic>(), kOptions)
//
// TORCH_VERSION_STRING: DTK_TORCH_VERSION (from dtk/tensor.hpp) for compute plugins,
// DTK_NO_TORCH for data-tier plugins.
// ------------------------------------------------------------------------------------------
#define DTK_NO_TORCH nullptr

#define DTK_PLUGIN(NAME, KIND, VERSION, DESCRIPTION, TORCH_VERSION_STRING, API_EXPR, OPTIONS) \
  namespace {                                                                                 \
  dtk_status* dtk_plugin_init_(const dtk_host_services* host) {                               \
    ::dtk::detail::g_host = host;                                                             \
    ::dtk::detail::g_plugin_name = NAME;                                                      \
    return nullptr;                                                                           \
  }                                                                                           \
  void dtk_plugin_deinit_() { ::dtk::detail::g_host = nullptr; }                              \
  const void* dtk_plugin_get_api_() { return static_cast<const void*>(API_EXPR); }            \
  const dtk_plugin_entry dtk_plugin_entry_struct_ = {sizeof(dtk_plugin_entry),                \
                                                     DTK_ABI_MAJOR,                           \
                                                     DTK_ABI_MINOR,                           \
                                                     TORCH_VERSION_STRING,                    \
                                                     NAME,                                    \
                                                     KIND,                                    \
                                                     VERSION,                                 \
                                                     DESCRIPTION,                             \
                                                     &dtk_plugin_init_,                       \
                                                     &dtk_plugin_deinit_,                     \
                                                     &dtk_plugin_get_api_,                    \
                                                     ::dtk::detail::option_ptr(OPTIONS),      \
                                                     ::dtk::detail::option_count(OPTIONS)};   \
  }                                                                                           \
  extern "C" DTK_EXPORT const dtk_plugin_entry* dtk_plugin_get_entry(void) { return &dtk_plugin_entry_struct_; }

// For a plugin without options.
#define DTK_NO_OPTIONS nullptr
