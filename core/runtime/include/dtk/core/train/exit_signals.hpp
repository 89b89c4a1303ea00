// exit_signals.hpp — the signals `dtk train` can save on (train.save_on_signals), as a plain list
// with no LibTorch: the front executable (apps/dtk/front.cpp, which links no LibTorch) holds them
// before the host is even loaded, and exit_conditions.cpp names and handles them.
#pragma once

#include <signal.h>

#include <cstring>

namespace dtk::core {

struct NamedSignal {
  const char* name;
  int number;
};

// Those a scheduler, a terminal or a user sends to ask a process to stop (not SIGKILL/SIGSTOP,
// which cannot be caught, nor the ones a fault raises).
constexpr NamedSignal kCatchableExitSignals[] = {{"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},
                                                 {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGQUIT", SIGQUIT},
                                                 {"SIGXCPU", SIGXCPU}, {"SIGALRM", SIGALRM}};

inline sigset_t exit_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  for (const NamedSignal& s : kCatchableExitSignals) sigaddset(&set, s.number);
  return set;
}

// Blocks all of them in the calling thread: held, not fatal, until someone unblocks them
// (StartupSignals or dtk launch, once their handlers exist). The mask survives fork() and execve().
inline void block_exit_signals() {
  const sigset_t set = exit_signal_set();
  sigprocmask(SIG_BLOCK, &set, nullptr);
}

// What was held is delivered now (to the handlers, or with its default action).
inline void unblock_exit_signals() {
  const sigset_t set = exit_signal_set();
  sigprocmask(SIG_UNBLOCK, &set, nullptr);
}

// Whether the process inherited `sig` ignored (nohup's SIGHUP, a shell's background job's
// SIGINT): then it stays ignored, as in any program.
inline bool inherited_ignored(int sig) {
  struct sigaction current {};
  sigaction(sig, nullptr, &current);
  return current.sa_handler == SIG_IGN;
}

// The commands that hold them from their first instruction: `train` (saves on them) and `launch`
// (forwards them to its ranks).
inline bool holds_exit_signals(int argc, char** argv) {
  return argc > 1 && argv && argv[1] && (!std::strcmp(argv[1], "train") || !std::strcmp(argv[1], "launch"));
}

}  // namespace dtk::core
