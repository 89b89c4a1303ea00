// dtk/host/plugin_host.hpp — discovery, loading, validation and registry of DTK plugins.
// Torch-free on purpose: the loader and its tests build in seconds and run under sanitizers.
#pragma once

#include <dtk/abi.h>

#include "dtk/host/error.hpp"
#include "dtk/host/options.hpp"

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dtk::host {

const char* kind_name(int32_t kind);           // "model", "dataset", ...; "unknown" otherwise
int32_t kind_from_name(const std::string& s);  // 0 when unknown

// A plugin that passed validation and init(). Never unloaded (ARCHITECTURE.md rule 10).
struct Plugin {
  std::string path;
  std::string canonical_path;  // to recognise the same file reached twice
  const dtk_plugin_entry* entry = nullptr;
  const void* api = nullptr;  // the kind's function table
  std::string name() const { return entry->name; }
  int32_t kind() const { return entry->kind; }
  template <class Api>
  const Api* api_as() const {
    return static_cast<const Api*>(api);
  }
  // A plugin-provided extension (abi.h rule 8) by id, or nullptr when the plugin provides none
  // (or predates get_extension). The pointer is static for the process lifetime.
  const void* extension(const char* id) const;
  // Declared options, only those the plugin's struct sizes cover.
  std::vector<const dtk_option_spec*> options() const;
};

class PluginHost {
 public:
  // `host_torch_version`: the LibTorch version compute plugins must match ("" = no LibTorch in
  // this process, compute plugins are refused). `services` are passed to every init().
  PluginHost(std::string host_torch_version, const dtk_host_services* services);

  // Loads one plugin file; throws HostError naming the file and the problem.
  const Plugin& load_file(const std::string& path);
  // Loads every *.so in a directory (a missing directory is an error only if `required`). A file
  // that cannot be loaded (not a plugin, truncated, another ABI, a duplicate name...) blocks
  // nothing else: it is recorded in broken() with its reason, and named when a plugin is asked
  // for that is not there.
  void load_directory(const std::string& dir, bool required);
  // Default discovery: <exe_dir>/../lib/dtk/plugins, then DTK_PLUGIN_PATH (':'-separated),
  // then `extra` (--plugin_path). Entries may be files or directories.
  void discover(const std::string& exe_dir, const std::vector<std::string>& extra);

  // Unknown names throw HostError with a "did you mean" suggestion.
  const Plugin& get(int32_t kind, const std::string& name) const;
  const Plugin* find(int32_t kind, const std::string& name) const;
  const Plugin* find_any(const std::string& name) const;  // by name across kinds
  std::vector<const Plugin*> list() const;
  struct Broken {
    std::string path, reason;  // reason: the one-line refusal, naming the file
  };
  const std::vector<Broken>& broken() const { return broken_; }
  // "; N plugin file(s) could not be loaded, the first: <reason> (see `dtk plugins list`)", or ""
  // when every file loaded: appended where a plugin asked for is not there.
  std::string broken_hint() const;

  // Calls deinit() of every plugin, once (plugins stay mapped).
  void shutdown();

 private:
  std::string torch_version_;
  const dtk_host_services* services_;
  std::vector<Plugin*> plugins_;  // leaked on purpose: never unloaded
  std::vector<Broken> broken_;
  std::vector<std::pair<int32_t, std::string>> ambiguous_;  // names found in two files (kind, name)
  bool shut_down_ = false;
};

// Closest candidate by edit distance, or "" when none is reasonably close.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

// A host-created status (what dtk_host_services.make_status returns).
dtk_status* make_status(int32_t code, const char* message);
// Converts a status into a HostError with context, releasing it. No-op for NULL.
void check_status(dtk_status* s, const std::string& context);

}  // namespace dtk::host
