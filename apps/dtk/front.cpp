// front.cpp — `bin/dtk`, the command users run: it holds the signals `dtk train` saves on (and
// `dtk launch` forwards), then executes the host, `libexec/dtk` (main.cpp), with the same
// arguments and environment. `dtk launch` it runs itself (launch.cpp): the launcher needs no
// LibTorch, and each rank it starts is bin/dtk again.
//
// Why a second executable: the host links LibTorch, whose libraries the dynamic loader maps and
// relocates for about 0.3 s before any code of dtk runs (not even the host's .preinit_array hook),
// and whose operators then register for about as long again before main(); a SIGTERM, or the
// SIGHUP of a closing terminal, in the first window ended the process with no line. This one
// links no LibTorch (the C and C++ runtimes, gflags and glog), so the signals are held before any
// library's initialiser runs (its own .preinit_array hook); the mask survives execve, and the
// host's StartupSignals delivers what was held, with its line (exit_conditions.hpp), or dtk launch
// forwards it to its ranks. Other commands neither save on signals nor forward them: they run
// with the mask they got. It also puts the caching allocator's preload in place for the commands
// that train, so the host is executed once on it, not re-executed (memory/allocator.hpp), and the
// empty stand-ins for the libraries LibTorch links but never calls (dtk/host/torch_standins.hpp).
#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "dtk/core/memory/allocator.hpp"
#include "dtk/core/train/exit_signals.hpp"
#include "dtk/host/torch_standins.hpp"
#include "launch.hpp"

namespace {
// Held before gflags' and glog's static initialisers run too (glibc passes argc, argv, envp to
// preinit functions); main() holds them again, harmlessly, for a front linked otherwise.
void hold_exit_signals_first(int argc, char** argv, char**) {
  if (dtk::core::holds_exit_signals(argc, argv)) dtk::core::block_exit_signals();
}
__attribute__((section(".preinit_array"), used)) void (*const kHoldExitSignals)(int, char**,
                                                                                char**) = &hold_exit_signals_first;
}  // namespace

int main(int argc, char** argv) {
  if (dtk::core::holds_exit_signals(argc, argv)) dtk::core::block_exit_signals();
  // The host then starts on tcmalloc at once instead of re-executing itself (allocator.hpp).
  dtk::core::pass_caching_allocator_on(argc, argv);
  dtk::host::torch_standins_wanted();  // a bad DTK_TORCH_STANDINS is one line, not one per rank
  // The launcher itself needs no LibTorch: its ranks run bin/dtk again, hence the host. What only
  // a process with LibTorch can check (one of LibTorch's own flags) goes to the host's launcher.
  if (argc >= 2 && !std::strcmp(argv[1], "launch") && launcher_can_check(argc - 2, argv + 2))
    return launch_command(argc - 2, argv + 2);
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) {
    std::fprintf(stderr, "dtk: error: cannot resolve /proc/self/exe to find the dtk host: %s\n", std::strerror(errno));
    return 127;
  }
  self[n] = '\0';
  std::string bin(self);
  bin.erase(bin.rfind('/'));
  // LibTorch's unused dependencies stood in by empty libraries (dtk/host/torch_standins.hpp).
  dtk::host::pass_torch_standins_on(bin + "/../lib/dtk/torch-standins");
  const std::string host = bin + "/../libexec/dtk";
  ::execv(host.c_str(), argv);
  std::fprintf(stderr, "dtk: error: cannot run the dtk host %s: %s (bin/dtk needs libexec/dtk beside its bin/)\n",
               host.c_str(), std::strerror(errno));
  return 127;
}
