// command_line.cpp — see command_line.hpp.
#include "command_line.hpp"

#include <gflags/gflags.h>
#include <glog/logging.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>

#include "dtk/host/error.hpp"
#include "dtk/host/plugin_host.hpp"  // did_you_mean
#include "flags/flags.hpp"

namespace {

// glog's flags (--v, --logtostderr, ...) belong to every dtk command line. This reference links
// libglog, whose load registers them, into bin/dtk too, which otherwise calls nothing of it.
[[gnu::used]] const void* const kGlogFlags = &FLAGS_v;

}  // namespace

const std::vector<std::string>& command_names() {
  static const std::vector<std::string> names = {"train",  "config", "plugins",  "preprocess", "checkpoint",
                                                 "export", "import", "generate", "version"};
  return names;
}

bool is_command(const std::string& name) {
  const auto& names = command_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

void check_flags(int argc, char** argv) {
  // Flags whose second value reads as one more, not as a replacement: gflags would keep the last
  // without a word, and the run would not be the one asked for (a second config, a second prompt,
  // a blend or a list written as two flags). Any other flag given again overrides, as argparse
  // does (a script's defaults, then the user's); --set appends.
  static const std::map<std::string, std::string> kOnce = {
      {"config", "a run reads one; merge them, or change single values with --set"},
      {"megatron_args", "a run reads one; merge them, or change single values with --set"},
      {"deepspeed_config", "a run reads one; merge them, or change single values with --set"},
      {"prompt", "dtk generate continues one; several go one per line in a --prompts_file"},
      {"prompts_file", "dtk generate reads one; put the prompts in one file"},
      {"data_path", "a blend is one value: --data_path 'W1 PREFIX1 W2 PREFIX2'"},
      {"input", "several files are one value, comma-separated"},
      {"json_keys", "several keys are one value, comma-separated"}};
  std::map<std::string, std::string> once;
  std::vector<gflags::CommandLineFlagInfo> all;
  gflags::GetAllFlags(&all);
  std::vector<std::string> names;
  for (const auto& f : all) names.push_back(f.name);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a.size() < 2 || a[0] != '-') continue;
    // "-1:3", "-5": a negative number where an argument goes (a flag's value was taken above).
    if (std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.')
      throw dtk::host::HostError("'" + a + "' reads as a flag, not as an argument: arguments cannot start with '-'");
    std::string name = a.substr(a[1] == '-' ? 2 : 1);
    name = name.substr(0, name.find('='));
    gflags::CommandLineFlagInfo info;
    if (gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      // Check the value here: gflags would print its own multi-word message and exit.
      if (info.type == "bool") continue;
      const size_t eq = a.find('=');
      std::string value;
      if (eq != std::string::npos) {
        value = a.substr(eq + 1);
      } else if (i + 1 < argc) {
        value = argv[++i];  // the value, even if it starts with '-' ("--threads -1")
      } else {
        throw dtk::host::HostError("--" + name + " needs a value (" + info.type + ")");
      }
      if (const auto first = once.find(name); first != once.end() && first->second != value)
        throw dtk::host::HostError("--" + name + " given twice ('" + first->second + "' and '" + value +
                                   "'): " + kOnce.at(name));
      if (kOnce.count(name)) once.emplace(name, value);
      if (info.type == "string") continue;
      char* end = nullptr;
      errno = 0;
      if (info.type == "double") {
        const double v = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0' || !std::isfinite(v))
          throw dtk::host::HostError("--" + name + " expects a finite number, got '" + value + "'");
        continue;
      }
      // gflags reads "-1" as an unsigned flag's value with its own "illegal value" line.
      if ((info.type == "uint32" || info.type == "uint64") && value.find('-') != std::string::npos)
        throw dtk::host::HostError("--" + name + " expects a non-negative integer (" + info.type + "), got '" + value +
                                   "'");
      // uint64 takes the whole unsigned range (a seed of 2^63 and above).
      const long long v = info.type == "uint64" ? static_cast<long long>(std::strtoull(value.c_str(), &end, 10))
                                                : std::strtoll(value.c_str(), &end, 10);
      const bool fits = info.type == "int32" ? v >= INT32_MIN && v <= INT32_MAX : true;
      if (value.empty() || *end != '\0' || errno == ERANGE || !fits)
        throw dtk::host::HostError("--" + name + " expects an integer (" + info.type + "), got '" + value + "'");
      continue;
    }
    if (name.rfind("no", 0) == 0 && gflags::GetCommandLineFlagInfo(name.substr(2).c_str(), &info) &&
        info.type == "bool")
      continue;
    std::string msg = "unknown flag '--" + name + "'";
    const std::string guess = dtk::host::did_you_mean(name, names);
    if (!guess.empty()) msg += "; did you mean '--" + guess + "'?";
    throw dtk::host::HostError(msg + " (see --help)");
  }
}

std::vector<std::string> extract_sets(int* argc, char** argv) {
  std::vector<std::string> sets;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--set") == 0 || std::strcmp(a, "-set") == 0) {
      if (i + 1 >= *argc) throw dtk::host::HostError("--set needs a key=value argument");
      sets.emplace_back(argv[++i]);
    } else if (std::strncmp(a, "--set=", 6) == 0) {
      sets.emplace_back(a + 6);
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  return sets;
}

std::string rank_command(int argc, char** argv) {
  std::vector<char*> line = {const_cast<char*>("dtk")};
  line.insert(line.end(), argv, argv + argc);
  int n = static_cast<int>(line.size());
  extract_sets(&n, line.data());
  check_flags(n, line.data());
  // gflags takes the flags wherever they stand: the command is the first word that is neither a
  // flag nor a flag's value.
  for (int i = 1; i < n; ++i) {
    const std::string a = line[i];
    if (a.empty()) throw dtk::host::HostError("launch: an empty argument where the dtk command goes");
    if (a == "--") return i + 1 < n ? line[i + 1] : "";
    if (a[0] != '-' || a == "-") return a;
    if (a.find('=') != std::string::npos) continue;
    gflags::CommandLineFlagInfo info;
    if (gflags::GetCommandLineFlagInfo(a.substr(a.find_first_not_of('-')).c_str(), &info) && info.type != "bool")
      ++i;  // its value
  }
  return "";
}
