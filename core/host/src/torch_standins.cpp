#include "dtk/host/torch_standins.hpp"

#include <link.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dtk::host {
namespace {

// Where bin/dtk keeps the user's LD_LIBRARY_PATH for the host: "=" and the value, or "" when it
// was unset (an empty value and no value are different things to the loader).
constexpr const char* kSaved = "DTK_USER_LD_LIBRARY_PATH";
constexpr const char* kFolder = "/torch-standins/";

}  // namespace

bool torch_standins_wanted() {
  const char* choice = std::getenv("DTK_TORCH_STANDINS");
  if (!choice || !*choice || !std::strcmp(choice, "on")) return true;
  if (!std::strcmp(choice, "off")) return false;
  std::fprintf(stderr, "dtk: error: DTK_TORCH_STANDINS='%s': expected 'on' (the default) or 'off'\n", choice);
  std::exit(2);
}

void pass_torch_standins_on(const std::string& standins_dir) {
  if (!torch_standins_wanted()) return;
  struct stat st {};
  if (::stat(standins_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return;
  const char* old = std::getenv("LD_LIBRARY_PATH");
  setenv(kSaved, old ? (std::string("=") + old).c_str() : "", 1);
  setenv("LD_LIBRARY_PATH", (old && *old ? standins_dir + ":" + old : standins_dir).c_str(), 1);
}

void restore_library_path() {
  const char* saved = std::getenv(kSaved);
  if (!saved) return;
  if (*saved == '=')
    setenv("LD_LIBRARY_PATH", saved + 1, 1);
  else
    unsetenv("LD_LIBRARY_PATH");
  unsetenv(kSaved);
}

int torch_standins_loaded() {
  int found = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        if (info->dlpi_name && std::strstr(info->dlpi_name, kFolder)) ++*static_cast<int*>(data);
        return 0;
      },
      &found);
  return found;
}

}  // namespace dtk::host
