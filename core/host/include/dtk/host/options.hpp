// dtk/host/options.hpp — a plugin's declared options: the declarations checked when it loads, a
// user's values resolved against them, and the settings an option acts with (ABI 2.7).
#pragma once

#include <dtk/abi.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtk::host {

struct Plugin;

// A plugin or option name: [a-z0-9_]+, not empty.
bool valid_name(const char* name);

// The entry's option specs. They may grow in later minors: the array is walked with its elements'
// own struct_size (check_option_specs checks it covers every field this host reads).
std::vector<const dtk_option_spec*> option_specs(const dtk_plugin_entry* e);

// The entry's option table, checked when the plugin loads, before a user ever sets an option: one
// struct_size, named, typed, defaults of their own type, and each acts_with naming other declared
// options and values they take. Returns "" or the problem.
std::string check_option_specs(const dtk_plugin_entry* e);

// Checks user options against the plugin's declarations and returns every declared option with
// defaults filled in, in declaration order. Throws HostError naming plugin and key: an unknown
// key, an ill-typed value, a required option not set, or a value other than the default for an
// option whose settings leave it idle ("option X=V does nothing without stage=3").
std::vector<std::pair<std::string, std::string>> resolve_options(const Plugin& plugin,
                                                                 const std::map<std::string, std::string>& user);

// Two values of an option of type `type` (dtk_option_type) that mean the same: numbers by value,
// booleans by truth ("1" == "true"), strings item by item as comma-separated lists (spaces around
// an item ignored, an item that is a number on both sides by value: "1e-2, 0" == "0.01,0.0"),
// enums as written.
bool same_option_value(int32_t type, const std::string& a, const std::string& b);

// The settings without which the option does nothing (its acts_with) as a user reads them:
// "stage=3", "stage=1 or 2", "offload_optimizer=nvme or offload_param=nvme"; "" when it always
// acts (no condition, or a plugin built before ABI 2.7).
std::string acts_with_text(const dtk_option_spec& spec);

// Removes from `options` every option that the others (the plugin's defaults for those missing)
// leave idle, except those named in `keep`, so the plugin's default stands in. For configurations
// recorded in checkpoints before idle values were refused: they did nothing then.
void drop_idle_options(const Plugin& plugin, std::map<std::string, std::string>* options,
                       const std::vector<std::string>& keep = {});

// Owns strings for a dtk_option_values view.
class OptionValues {
 public:
  explicit OptionValues(std::vector<std::pair<std::string, std::string>> kv);
  const dtk_option_values* get() const { return &values_; }
  const std::vector<std::pair<std::string, std::string>>& items() const { return kv_; }

 private:
  std::vector<std::pair<std::string, std::string>> kv_;
  std::vector<dtk_key_value> items_;
  dtk_option_values values_{};
};

}  // namespace dtk::host
