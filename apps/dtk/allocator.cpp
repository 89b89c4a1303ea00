#include "allocator.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

bool tcmalloc_loaded() { return dlsym(RTLD_DEFAULT, "tc_malloc") != nullptr; }

std::string tcmalloc_path() {
  if (const char* p = std::getenv("DTK_TCMALLOC_PATH"); p && *p) return p;
#ifdef DTK_TCMALLOC_PATH
  return DTK_TCMALLOC_PATH;
#else
  return "";
#endif
}

}  // namespace

void use_caching_allocator(int argc, char** argv) {
#if defined(__SANITIZE_ADDRESS__)
  return;  // the sanitizers bring their own allocator
#endif
  const char* choice = std::getenv("DTK_ALLOCATOR");
  if (choice && *choice && std::strcmp(choice, "tcmalloc") != 0) {
    if (!std::strcmp(choice, "system")) return;
    std::fprintf(stderr, "dtk: error: DTK_ALLOCATOR='%s': expected 'tcmalloc' (the default) or 'system'\n", choice);
    std::exit(2);
  }
  if (tcmalloc_loaded()) return;
  // Once only: if the preload did not take (a broken file), carry on with malloc.
  if (std::getenv("DTK_ALLOCATOR_REEXEC")) return;
  // Only training allocates tensors in earnest: other commands start once (loading LibTorch
  // twice costs about half a second). `dtk launch` passes the preload on to its ranks.
  const bool train = argc >= 2 && !std::strcmp(argv[1], "train");
  const bool launch = argc >= 2 && !std::strcmp(argv[1], "launch");
  if (!train && !launch) return;
  const std::string path = tcmalloc_path();
  if (path.empty() || access(path.c_str(), R_OK) != 0) return;
  const char* old = std::getenv("LD_PRELOAD");
  const std::string preload = old && *old ? path + ":" + old : path;
  setenv("LD_PRELOAD", preload.c_str(), 1);
  setenv("DTK_ALLOCATOR_REEXEC", "1", 1);
  if (launch) return;  // the launcher itself allocates nothing; its children start preloaded
  execv("/proc/self/exe", argv);
  // execv failed: continue in this process, as it was.
  if (old)
    setenv("LD_PRELOAD", old, 1);
  else
    unsetenv("LD_PRELOAD");
}
