// Plugin loading and validation. Every refusal is one line naming the file and the reason.
#include "dtk/host/plugin_host.hpp"

#include "dtk/host/torch_standins.hpp"
#include "elf_check.hpp"

#define BOOST_DLL_USE_STD_FS 1
#include <dlfcn.h>
#include <boost/dll/shared_library.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>

namespace fs = std::filesystem;

namespace dtk::host {

namespace {

// Minimum api table sizes per kind: the ABI 2.0 table, every function the host may call.
size_t min_api_size(int32_t kind) {
  switch (kind) {
    case DTK_KIND_MODEL:
      return dtk_model_api_STRUCT_SIZE_2_0;
    case DTK_KIND_DATASET:
      return dtk_dataset_api_STRUCT_SIZE_2_0;
    case DTK_KIND_STEP:
      return dtk_step_api_STRUCT_SIZE_2_0;
    case DTK_KIND_STRATEGY:
      return dtk_strategy_api_STRUCT_SIZE_2_0;
    case DTK_KIND_OPTIMIZER:
      return dtk_optimizer_api_STRUCT_SIZE_2_0;
    default:
      return 0;
  }
}

// The functions of each kind's ABI 2.0 table that the host calls without asking: a NULL one
// would crash the run at its first call, so the plugin is refused at load instead. (A strategy's
// state_save/state_load may be NULL: the host then saves no state for it.)
struct RequiredFunction {
  size_t offset;
  const char* name;
};
#define DTK_REQUIRED(api, fn) \
  RequiredFunction { offsetof(api, fn), #fn }
std::vector<RequiredFunction> required_functions(int32_t kind) {
  switch (kind) {
    case DTK_KIND_MODEL:
      return {DTK_REQUIRED(dtk_model_api, create),
              DTK_REQUIRED(dtk_model_api, destroy),
              DTK_REQUIRED(dtk_model_api, forward),
              DTK_REQUIRED(dtk_model_api, visit_parameters),
              DTK_REQUIRED(dtk_model_api, visit_buffers),
              DTK_REQUIRED(dtk_model_api, set_training),
              DTK_REQUIRED(dtk_model_api, to),
              DTK_REQUIRED(dtk_model_api, state_save),
              DTK_REQUIRED(dtk_model_api, state_load),
              DTK_REQUIRED(dtk_model_api, get_info),
              DTK_REQUIRED(dtk_model_api, visit_modules),
              DTK_REQUIRED(dtk_model_api, set_module_hooks)};
    case DTK_KIND_DATASET:
      return {DTK_REQUIRED(dtk_dataset_api, create), DTK_REQUIRED(dtk_dataset_api, destroy),
              DTK_REQUIRED(dtk_dataset_api, num_samples), DTK_REQUIRED(dtk_dataset_api, get_sample),
              DTK_REQUIRED(dtk_dataset_api, vocab_size)};
    case DTK_KIND_STEP:
      return {DTK_REQUIRED(dtk_step_api, create), DTK_REQUIRED(dtk_step_api, destroy),
              DTK_REQUIRED(dtk_step_api, forward_step)};
    case DTK_KIND_STRATEGY:
      return {DTK_REQUIRED(dtk_strategy_api, create),          DTK_REQUIRED(dtk_strategy_api, destroy),
              DTK_REQUIRED(dtk_strategy_api, setup),           DTK_REQUIRED(dtk_strategy_api, optimizer_params),
              DTK_REQUIRED(dtk_strategy_api, before_backward), DTK_REQUIRED(dtk_strategy_api, reduce_gradients),
              DTK_REQUIRED(dtk_strategy_api, clip_and_norm),   DTK_REQUIRED(dtk_strategy_api, optimizer_step),
              DTK_REQUIRED(dtk_strategy_api, zero_grad),       DTK_REQUIRED(dtk_strategy_api, module_hooks)};
    case DTK_KIND_OPTIMIZER:
      return {DTK_REQUIRED(dtk_optimizer_api, create), DTK_REQUIRED(dtk_optimizer_api, destroy),
              DTK_REQUIRED(dtk_optimizer_api, step), DTK_REQUIRED(dtk_optimizer_api, state_save),
              DTK_REQUIRED(dtk_optimizer_api, state_load)};
    default:
      return {};
  }
}
#undef DTK_REQUIRED

void destroy_host_status(dtk_status* s) {
  if (!s) return;
  std::free(const_cast<char*>(s->message));
  delete s;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

}  // namespace

const char* kind_name(int32_t kind) {
  switch (kind) {
    case DTK_KIND_MODEL:
      return "model";
    case DTK_KIND_DATASET:
      return "dataset";
    case DTK_KIND_STEP:
      return "step";
    case DTK_KIND_STRATEGY:
      return "strategy";
    case DTK_KIND_OPTIMIZER:
      return "optimizer";
    default:
      return "unknown";
  }
}

int32_t kind_from_name(const std::string& s) {
  for (int32_t k = DTK_KIND_MODEL; k <= DTK_KIND_OPTIMIZER; ++k)
    if (s == kind_name(k)) return k;
  return 0;
}

dtk_status* make_status(int32_t code, const char* message) {
  auto* s = new dtk_status{};
  s->struct_size = dtk_status_STRUCT_SIZE;
  s->code = code;
  s->message = strdup(message ? message : "");
  s->destroy = &destroy_host_status;
  return s;
}

void check_status(dtk_status* s, const std::string& context) {
  if (!s) return;
  std::string message = dtk_status_get_message(s);
  dtk_status_release(s);
  throw HostError(context + ": " + message);
}

const void* Plugin::extension(const char* id) const {
  if (!id || !DTK_HAS_FIELD(dtk_plugin_entry, entry, get_extension) || !entry->get_extension) return nullptr;
  try {
    return entry->get_extension(id);
  } catch (...) {
    return nullptr;  // a C function cannot throw; a broken C++ plugin gets no extension
  }
}

std::vector<const dtk_option_spec*> Plugin::options() const { return option_specs(entry); }

namespace {

// Maps the file (RTLD_NOW: unresolved symbols fail here, not mid-training; RTLD_LOCAL: plugins
// cannot interpose each other's symbols) and returns its entry struct. The library is never
// unloaded (abi.h rule 13).
const dtk_plugin_entry* open_entry(const std::string& path, const std::string& where) {
  check_elf_file(path, where);  // a truncated file would map, then SIGBUS (elf_check.hpp)
  auto* lib = new boost::dll::shared_library();  // leaked on purpose: never unloaded
  boost::dll::fs::error_code load_ec;
  lib->load(fs::path(path), load_ec, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  if (load_ec || !lib->is_loaded()) {
    // dlopen's own reason (an undefined symbol, a missing dependency); Boost.DLL reports only
    // "Bad file descriptor" for every failure.
    const char* why = ::dlerror();
    std::string detail = why ? std::string(why) : load_ec.message();
    // A symbol of a library LibTorch links but never calls, which this process stands in for
    // with an empty one (dtk/host/torch_standins.hpp).
    if (detail.find("undefined symbol") != std::string::npos && torch_standins_loaded() > 0)
      detail += "; if it is defined in one of the libraries in lib/dtk/torch-standins, run with DTK_TORCH_STANDINS=off";
    delete lib;
    throw HostError(where + ": not a loadable shared library (" + detail + ")");
  }
  if (!lib->has(DTK_PLUGIN_ENTRY_SYMBOL))
    throw HostError(where + ": not a DTK plugin (no '" DTK_PLUGIN_ENTRY_SYMBOL "' symbol)");
  auto entry_fn = lib->get<const dtk_plugin_entry*()>(DTK_PLUGIN_ENTRY_SYMBOL);
  const dtk_plugin_entry* e = nullptr;
  try {
    e = entry_fn();
  } catch (...) {
    throw HostError(where + ": entry function threw an exception");
  }
  if (!e) throw HostError(where + ": entry function returned NULL");
  return e;
}

// ABI version and struct size of the entry (before any other field is read).
void check_abi_version(const dtk_plugin_entry* e, const std::string& where) {
  if (!DTK_HAS_FIELD(dtk_plugin_entry, e, abi_minor))
    throw HostError(where + ": entry struct_size " + std::to_string(e->struct_size) +
                    " is too small to hold an ABI version");
  if (e->abi_major != DTK_ABI_MAJOR)
    throw HostError(where + ": built for DTK ABI " + std::to_string(e->abi_major) + "." + std::to_string(e->abi_minor) +
                    ", this host speaks ABI " + std::to_string(DTK_ABI_MAJOR) +
                    ".x (major version mismatch; rebuild the plugin)");
  if (e->abi_minor > DTK_ABI_MINOR)
    throw HostError(where + ": plugin is newer than the host (built for ABI " + std::to_string(e->abi_major) + "." +
                    std::to_string(e->abi_minor) + ", host supports up to " + std::to_string(DTK_ABI_MAJOR) + "." +
                    std::to_string(DTK_ABI_MINOR) + "; upgrade dtk)");
  if (!DTK_STRUCT_COVERS(dtk_plugin_entry, e, 2_0))
    throw HostError(where + ": entry struct_size " + std::to_string(e->struct_size) + " is smaller than ABI 2.0's " +
                    std::to_string(dtk_plugin_entry_STRUCT_SIZE_2_0) + " bytes");
}

// Kind, LibTorch version, functions and option table of a versioned entry. `who` names it.
void check_entry(const dtk_plugin_entry* e, const std::string& who, const std::string& host_torch) {
  if (min_api_size(e->kind) == 0) throw HostError(who + ": unknown plugin kind " + std::to_string(e->kind));
  const bool compute = e->kind != DTK_KIND_DATASET;
  if (compute && !e->torch_version)
    throw HostError(who + ": a " + std::string(kind_name(e->kind)) +
                    " plugin must record the LibTorch version it was built with");
  if (e->torch_version) {
    if (host_torch.empty()) throw HostError(who + ": needs LibTorch " + e->torch_version + " but this host has none");
    if (host_torch != e->torch_version)
      throw HostError(who + ": built against LibTorch " + std::string(e->torch_version) + ", host runs LibTorch " +
                      host_torch + " (rebuild the plugin)");
  }
  if (!e->init || !e->get_api) throw HostError(who + ": entry has no init or get_api function");
  if (e->num_options > 0 && !e->options) throw HostError(who + ": declares options but the option table is NULL");
  if (const std::string bad = check_option_specs(e); !bad.empty()) throw HostError(who + ": " + bad);
}

// init() and the kind's function table. A refusal after a successful init gives the plugin its
// deinit().
const void* initialise(const dtk_plugin_entry* e, const dtk_host_services* services, const std::string& who) {
  dtk_status* init_status = nullptr;
  try {
    init_status = e->init(services);
  } catch (...) {
    throw HostError(who + ": init threw an exception across the ABI boundary");
  }
  check_status(init_status, who + ": init failed");
  auto refuse = [&](const std::string& message) {
    try {
      if (e->deinit) e->deinit();
    } catch (...) {
    }
    throw HostError(message);
  };
  const void* api = nullptr;
  try {
    api = e->get_api();
  } catch (...) {
    refuse(who + ": get_api threw an exception across the ABI boundary");
  }
  if (!api) refuse(who + ": get_api returned NULL");
  const size_t api_size = *static_cast<const size_t*>(api);
  if (api_size < min_api_size(e->kind))
    refuse(who + ": " + kind_name(e->kind) + " api struct_size " + std::to_string(api_size) +
           " is smaller than ABI 2.0's " + std::to_string(min_api_size(e->kind)) + " bytes");
  for (const RequiredFunction& f : required_functions(e->kind)) {
    void* fn = nullptr;
    std::memcpy(&fn, static_cast<const char*>(api) + f.offset, sizeof fn);
    if (!fn) refuse(who + ": its " + kind_name(e->kind) + " api has no " + f.name + " function (NULL)");
  }
  return api;
}

}  // namespace

PluginHost::PluginHost(std::string host_torch_version, const dtk_host_services* services)
    : torch_version_(std::move(host_torch_version)), services_(services) {}

const Plugin& PluginHost::load_file(const std::string& path) {
  const std::string where = "plugin " + quote(path);
  std::error_code ec;
  if (!fs::exists(path, ec)) throw HostError(where + ": file not found");
  if (fs::is_directory(path, ec)) throw HostError(where + ": is a directory, not a plugin file");
  // The same file reached twice (a directory listed in DTK_PLUGIN_PATH and --plugin_path, say)
  // is the same plugin, not a duplicate.
  const std::string canonical = fs::weakly_canonical(fs::path(path), ec).string();
  for (const Plugin* p : plugins_)
    if (!canonical.empty() && p->canonical_path == canonical) return *p;

  const dtk_plugin_entry* e = open_entry(path, where);
  check_abi_version(e, where);
  if (!valid_name(e->name)) throw HostError(where + ": invalid plugin name (want [a-z0-9_]+)");
  const std::string name = e->name;
  const std::string who = "plugin " + quote(name) + " (" + path + ")";
  check_entry(e, who, torch_version_);
  if (const Plugin* dup = find(e->kind, name)) {
    // Which of the two a run would get depends on the search order: neither may be used.
    ambiguous_.emplace_back(e->kind, name);
    throw HostError("two " + std::string(kind_name(e->kind)) + " plugins named " + quote(name) + ": " + dup->path +
                    " and " + path);
  }
  const void* api = initialise(e, services_, who);

  auto* p = new Plugin();
  p->path = path;
  p->canonical_path = canonical;
  p->entry = e;
  p->api = api;
  plugins_.push_back(p);
  return *p;
}

void PluginHost::load_directory(const std::string& dir, bool required) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    if (required) throw HostError("plugin directory " + quote(dir) + " does not exist");
    return;
  }
  std::vector<std::string> files;
  for (const auto& de : fs::directory_iterator(dir, ec))
    if (de.path().extension() == ".so") files.push_back(de.path().string());
  std::sort(files.begin(), files.end());  // deterministic order (and duplicate reports)
  for (const auto& f : files) {
    try {
      load_file(f);
    } catch (const HostError& e) {
      broken_.push_back({f, e.what()});
    }
  }
}

void PluginHost::discover(const std::string& exe_dir, const std::vector<std::string>& extra) {
  std::vector<std::string> entries;
  entries.push_back((fs::path(exe_dir) / ".." / "lib" / "dtk" / "plugins").lexically_normal().string());
  load_directory(entries.back(), false);
  auto add = [&](const std::string& p, const std::string& origin) {
    if (p.empty()) return;
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      load_directory(p, true);
    } else if (fs::exists(p, ec)) {
      load_file(p);
    } else {
      throw HostError(origin + " entry " + quote(p) + " does not exist");
    }
  };
  if (const char* env = std::getenv("DTK_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string item;
    while (std::getline(ss, item, ':')) add(item, "DTK_PLUGIN_PATH");
  }
  for (const auto& p : extra) {
    std::stringstream ss(p);
    std::string item;
    while (std::getline(ss, item, ':')) add(item, "--plugin_path");
  }
}

const Plugin* PluginHost::find(int32_t kind, const std::string& name) const {
  for (const Plugin* p : plugins_)
    if (p->kind() == kind && name == p->entry->name) return p;
  return nullptr;
}

const Plugin* PluginHost::find_any(const std::string& name) const {
  for (const Plugin* p : plugins_)
    if (name == p->entry->name) return p;
  return nullptr;
}

const Plugin& PluginHost::get(int32_t kind, const std::string& name) const {
  for (const auto& [k, n] : ambiguous_)
    if (k == kind && n == name)
      for (const Broken& b : broken_)
        if (b.reason.find("plugins named " + quote(name)) != std::string::npos)
          throw HostError(b.reason + " (both on the plugin path: remove one)");
  if (const Plugin* p = find(kind, name)) return *p;
  std::vector<std::string> names;
  for (const Plugin* p : plugins_)
    if (p->kind() == kind) names.push_back(p->entry->name);
  std::string msg = "unknown " + std::string(kind_name(kind)) + " plugin " + quote(name);
  std::string guess = did_you_mean(name, names);
  if (!guess.empty()) {
    msg += "; did you mean " + quote(guess) + "?";
  } else if (names.empty()) {
    msg += " (no " + std::string(kind_name(kind)) + " plugins were found; see `dtk plugins list`)";
  } else {
    std::string all;
    for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
    msg += " (available: " + all + ")";
  }
  throw HostError(msg + broken_hint());
}

std::string PluginHost::broken_hint() const {
  if (broken_.empty()) return "";
  return "; " + std::to_string(broken_.size()) + " plugin file" + (broken_.size() > 1 ? "s" : "") +
         " could not be loaded, the first: " + broken_.front().reason + " (see `dtk plugins list`)";
}

std::vector<const Plugin*> PluginHost::list() const {
  std::vector<const Plugin*> out(plugins_.begin(), plugins_.end());
  std::sort(out.begin(), out.end(), [](const Plugin* a, const Plugin* b) {
    return std::make_pair(a->kind(), a->name()) < std::make_pair(b->kind(), b->name());
  });
  return out;
}

void PluginHost::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  for (Plugin* p : plugins_) {
    try {
      if (p->entry->deinit) p->entry->deinit();
    } catch (...) {
    }
  }
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= b.size(); ++j)
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      std::swap(prev, cur);
    }
    return prev[b.size()];
  };
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    size_t d = distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  // Accept typos up to a third of the word (at least 2 edits), or a prefix/substring match.
  if (!best.empty() && best_d <= std::max<size_t>(2, word.size() / 3)) return best;
  for (const auto& c : candidates)
    if (!word.empty() && (c.find(word) != std::string::npos || word.find(c) != std::string::npos)) return c;
  return "";
}

}  // namespace dtk::host
