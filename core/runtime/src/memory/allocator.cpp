#include "dtk/core/memory/allocator.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dtk::core {
namespace {

bool tcmalloc_loaded() { return dlsym(RTLD_DEFAULT, "tc_malloc") != nullptr; }

// Whether `path` is a readable 64-bit little-endian ELF shared library: type ET_DYN and no
// program interpreter (a position-independent program is ET_DYN too, but names its loader in a
// PT_INTERP header, and ld.so refuses to preload it).
bool shared_library(const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (!f) return false;
  unsigned char h[64] = {};
  static const unsigned char kMagic[4] = {0x7f, 'E', 'L', 'F'};
  bool ok = std::fread(h, 1, sizeof h, f) == sizeof h && std::memcmp(h, kMagic, 4) == 0 && h[4] == 2 && h[5] == 1 &&
            (h[16] | h[17] << 8) == 3;  // ELFCLASS64, ELFDATA2LSB, ET_DYN
  uint64_t phoff = 0;
  for (int i = 7; i >= 0; --i) phoff = phoff << 8 | h[32 + i];
  const unsigned entry = h[54] | h[55] << 8, count = h[56] | h[57] << 8;
  for (unsigned i = 0; ok && i < count; ++i) {
    unsigned char type[4] = {};
    ok = std::fseek(f, static_cast<long>(phoff + uint64_t{i} * entry), SEEK_SET) == 0 &&
         std::fread(type, 1, 4, f) == 4 && !(type[0] == 3 && type[1] == 0 && type[2] == 0 && type[3] == 0);
  }
  std::fclose(f);
  return ok;
}

std::string tcmalloc_path() {
  if (const char* p = std::getenv("DTK_TCMALLOC_PATH"); p && *p) {
    // The user's choice is checked: a wrong one would leave training on glibc malloc, several
    // times slower, with the loader's own message at best.
    if (!shared_library(p)) {
      std::fprintf(stderr,
                   "dtk: error: DTK_TCMALLOC_PATH='%s': not a readable shared library (unset it for the default)\n", p);
      std::exit(2);
    }
    return p;
  }
#ifdef DTK_TCMALLOC_PATH
  return DTK_TCMALLOC_PATH;
#else
  return "";
#endif
}

// Returns when no re-exec is wanted or possible; `children_only` sets the environment for child
// processes without re-executing this one.
void preload_tcmalloc(char** argv, bool children_only) {
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
  const std::string path = tcmalloc_path();
  if (path.empty() || access(path.c_str(), R_OK) != 0) return;
  const char* old = std::getenv("LD_PRELOAD");
  const std::string saved = old ? old : "";
  const std::string preload = old && *old ? path + ":" + old : path;
  setenv("LD_PRELOAD", preload.c_str(), 1);
  setenv("DTK_ALLOCATOR_REEXEC", "1", 1);
  if (children_only) return;
  execv("/proc/self/exe", argv);
  // execv failed: continue in this process, as it was.
  if (old)
    setenv("LD_PRELOAD", saved.c_str(), 1);
  else
    unsetenv("LD_PRELOAD");
}

// Only training allocates tensors in earnest: other commands start on malloc, once.
bool trains(int argc, char** argv) { return argc >= 2 && !std::strcmp(argv[1], "train"); }
bool launches(int argc, char** argv) { return argc >= 2 && !std::strcmp(argv[1], "launch"); }

}  // namespace

void use_caching_allocator(int argc, char** argv) {
  // `dtk launch` passes the preload on to its ranks. bin/dtk has usually set it already
  // (pass_caching_allocator_on): then nothing is left to do.
  if (trains(argc, argv) || launches(argc, argv)) preload_tcmalloc(argv, /*children_only=*/launches(argc, argv));
}

void pass_caching_allocator_on(int argc, char** argv) {
  if (trains(argc, argv) || launches(argc, argv)) preload_tcmalloc(argv, /*children_only=*/true);
}

void reexec_with_caching_allocator(char** argv) { preload_tcmalloc(argv, /*children_only=*/false); }

std::string malloc_name() { return tcmalloc_loaded() ? "tcmalloc" : "glibc malloc"; }

}  // namespace dtk::core
