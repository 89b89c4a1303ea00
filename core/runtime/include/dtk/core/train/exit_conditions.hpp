// dtk/core/train/exit_conditions.hpp — when a run stops before train_iters, as Megatron's
// --exit-interval, --exit-duration-in-mins and --exit-signal-handler: checked after every
// iteration, decided by every rank together (one bounded world collective), so that a signal
// that reached one rank stops them all at the same iteration and none waits for the others.
#pragma once

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtk/core/comm/comm.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

// The signals that save and exit (train.save_on_signals; unset: SIGTERM, SIGINT, SIGHUP, SIGUSR1,
// SIGUSR2; none when train.exit_signal_handler is false), as signal numbers. One HostError line
// for a name that is not one of them.
std::vector<int> save_on_signals(const config::TrainingConfig& train);

// `dtk train` holds every signal save_on_signals can name from its first instruction
// (exit_signals.hpp: bin/dtk's front, dtk launch's ranks, the host's .preinit_array) until
// StartupSignals takes them (its watcher thread), so that one arriving while the
// process starts (LibTorch loads, the allocator's re-exec keeps the mask, config and plugins load)
// is handled as any start-up signal is, with its line, instead of ending the process silently.
// Signals the run does not list get their default action at that point.

// The handling of save_on_signals, from the start of a run (pretrain()) to its end: the signals
// stay held in every thread and one watcher thread takes them (sigtimedwait), so that no signal
// interrupts what the run computes. Before the training loop (ExitConditions) a signal ends the
// process at once with one line saying nothing was saved and the signal's own status (128 + its
// number); in the loop it is recorded; after the loop it ends the process. Construct it on the
// thread that trains, before that thread starts others (they inherit the held signals).
class StartupSignals {
 public:
  explicit StartupSignals(const config::TrainingConfig& train);
  ~StartupSignals();
  StartupSignals(const StartupSignals&) = delete;
  StartupSignals& operator=(const StartupSignals&) = delete;

 private:
  void watch();
  sigset_t listed_set() const;  // signals_ as a set

  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

class ExitConditions {
 public:
  // Handles the signals of train.save_on_signals (with its own StartupSignals unless pretrain()'s
  // is there). A signal is only recorded; a second one of the same kind ends the process at once
  // (the default action), as a user pressing Ctrl-C twice expects.
  ExitConditions(const config::TrainingConfig& train, const Topology& topo);
  ~ExitConditions();
  ExitConditions(const ExitConditions&) = delete;
  ExitConditions& operator=(const ExitConditions&) = delete;

  // After `iteration`: empty to go on, else why the run stops ("after receiving SIGTERM",
  // "after 5.0 minutes (train.exit_duration_in_mins)", "at train.exit_interval (every 40 iterations)"). Collective when a signal or
  // a duration can stop the run and the world has more than one rank.
  std::string check(int64_t iteration);

 private:
  const Topology& topo_;
  const int64_t interval_;
  const double duration_minutes_;
  bool handle_signals_ = false;
  const std::chrono::steady_clock::time_point start_;
  std::optional<StartupSignals> own_;  // when no StartupSignals was installed before
};

// For tests: the signal the handler recorded (0 if none) and a reset.
int received_exit_signal();
void clear_exit_signal();

}  // namespace dtk::core
