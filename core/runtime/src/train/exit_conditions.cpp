#include "dtk/core/train/exit_conditions.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace dtk::core {

namespace {

volatile sig_atomic_t g_received = 0;

void on_exit_signal(int sig) {
  if (g_received == sig) {
    // The second of its kind: stop now, with the signal's own exit status.
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_received = sig;
  // Only async-signal-safe calls here: one write(2).
  const char* msg = sig == SIGINT ? "dtk: received SIGINT: finishing this iteration, then saving and exiting "
                                    "(press Ctrl-C again to stop now)\n"
                                  : "dtk: received SIGTERM: finishing this iteration, then saving and exiting\n";
  ssize_t ignored = ::write(STDERR_FILENO, msg, std::strlen(msg));
  (void)ignored;
}

struct sigaction g_previous[2];

}  // namespace

int received_exit_signal() { return g_received; }
void clear_exit_signal() { g_received = 0; }

ExitConditions::ExitConditions(const config::TrainingConfig& train, const Topology& topo)
    : topo_(topo),
      interval_(train.exit_interval()),
      duration_minutes_(train.exit_duration_in_mins()),
      handle_signals_(!train.has_exit_signal_handler() || train.exit_signal_handler()),
      start_(std::chrono::steady_clock::now()) {
  if (!handle_signals_) return;
  g_received = 0;
  struct sigaction sa {};
  sa.sa_handler = on_exit_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a read or wait the signal interrupts carries on
  sigaction(SIGTERM, &sa, &g_previous[0]);
  sigaction(SIGINT, &sa, &g_previous[1]);
}

ExitConditions::~ExitConditions() {
  if (!handle_signals_) return;
  sigaction(SIGTERM, &g_previous[0], nullptr);
  sigaction(SIGINT, &g_previous[1], nullptr);
}

std::string ExitConditions::check(int64_t iteration) {
  const bool timed = duration_minutes_ > 0;
  if (handle_signals_ || timed) {
    const double minutes =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() / 60.0;
    const int64_t local = (static_cast<int64_t>(g_received) << 1) | (timed && minutes > duration_minutes_ ? 1 : 0);
    // MAX over the world: any rank's signal wins (a signal number is > 0), then any rank's clock.
    const int64_t agreed = world_max(local, topo_, "agreeing whether to exit");
    if (agreed >> 1) {
      const int sig = static_cast<int>(agreed >> 1);
      return std::string("after receiving ") + (sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal");
    }
    if (agreed & 1) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "after %.1f minutes (train.exit_duration_in_mins)", minutes);
      return buf;
    }
  }
  if (interval_ > 0 && iteration % interval_ == 0)
    return "at train.exit_interval (every " + std::to_string(interval_) + " iterations)";
  return "";
}

}  // namespace dtk::core
