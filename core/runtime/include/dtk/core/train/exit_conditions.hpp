// dtk/core/train/exit_conditions.hpp — when a run stops before train_iters, as Megatron's
// --exit-interval, --exit-duration-in-mins and --exit-signal-handler: checked after every
// iteration, decided by every rank together (one bounded world collective), so that a signal
// that reached one rank stops them all at the same iteration and none waits for the others.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "dtk/core/comm/comm.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

class ExitConditions {
 public:
  // Installs the SIGTERM/SIGINT handler unless train.exit_signal_handler is false. The handler
  // only records the signal; a second one of the same kind ends the process at once (the
  // default action), as a user pressing Ctrl-C twice expects.
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
  const bool handle_signals_;
  const std::chrono::steady_clock::time_point start_;
};

// For tests: the signal the handler recorded (0 if none) and a reset.
int received_exit_signal();
void clear_exit_signal();

}  // namespace dtk::core
