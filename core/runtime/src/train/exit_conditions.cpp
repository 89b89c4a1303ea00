#include "dtk/core/train/exit_conditions.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>

#include "dtk/core/train/exit_signals.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

namespace {

constexpr const auto& kCatchable = kCatchableExitSignals;  // exit_signals.hpp
constexpr const char* kDefaultSignals = "SIGTERM,SIGINT,SIGHUP,SIGUSR1,SIGUSR2";

// Where the process is: before the loop a signal ends it at once (there is nothing to save), in
// the loop it is recorded and the iteration's end saves and stops, after the loop it ends it.
enum Phase : int { kStartup = 0, kTraining = 1, kAfter = 2 };
volatile sig_atomic_t g_phase = kStartup;
volatile sig_atomic_t g_received = 0;

// Only async-signal-safe calls in the handler: strlen, write(2), signal, raise.
void say(const char* a, const char* b = "", const char* c = "") {
  for (const char* s : {a, b, c}) {
    ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
    (void)ignored;
  }
}

const char* name_of(int sig) {
  for (const NamedSignal& s : kCatchable)
    if (s.number == sig) return s.name;
  return "a signal";
}

void on_exit_signal(int sig) {
  if (g_phase != kTraining || g_received == sig) {
    // Before training there is nothing to save; after it, nothing left to save. The second of its
    // kind in training: stop now. Either way with the signal's own exit status (128 + its number).
    if (g_phase == kStartup)
      say("dtk: received ", name_of(sig), " before training started: exiting, nothing was saved\n");
    else if (g_phase == kAfter)
      say("dtk: received ", name_of(sig), " after training: exiting now\n");
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_received = sig;
  if (sig == SIGINT)
    say("dtk: received SIGINT: finishing this iteration, then saving and exiting (press Ctrl-C again to stop now)\n");
  else
    say("dtk: received ", name_of(sig), ": finishing this iteration, then saving and exiting\n");
}

}  // namespace

int received_exit_signal() { return g_received; }
void clear_exit_signal() { g_received = 0; }

std::vector<int> save_on_signals(const config::TrainingConfig& train) {
  if (train.has_exit_signal_handler() && !train.exit_signal_handler()) return {};
  std::string text = train.has_save_on_signals() ? train.save_on_signals() : kDefaultSignals;
  std::replace(text.begin(), text.end(), ',', ' ');
  std::vector<int> out;
  size_t at = 0;
  std::string word;
  auto next = [&] {
    while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at;
    const size_t from = at;
    while (at < text.size() && !std::isspace(static_cast<unsigned char>(text[at]))) ++at;
    word = text.substr(from, at - from);
    return !word.empty();
  };
  bool none = false;
  while (next()) {
    std::string upper = word;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (upper == "NONE") {
      none = true;
      continue;
    }
    if (upper.rfind("SIG", 0) != 0) upper = "SIG" + upper;
    const auto* found = std::find_if(std::begin(kCatchable), std::end(kCatchable),
                                     [&](const NamedSignal& s) { return upper == s.name; });
    if (found == std::end(kCatchable)) {
      std::string names;
      for (const NamedSignal& s : kCatchable) names += std::string(names.empty() ? "" : ", ") + s.name;
      throw host::HostError("config: train.save_on_signals: '" + word.substr(0, 40) +
                            "' is not a signal DTK saves on (" + names + ", or none)");
    }
    if (std::find(out.begin(), out.end(), found->number) == out.end()) out.push_back(found->number);
  }
  if (none && !out.empty())
    throw host::HostError("config: train.save_on_signals: 'none' and signal names together; give one or the other");
  if (!none && out.empty())
    throw host::HostError("config: train.save_on_signals is empty: name the signals (SIGTERM,SIGHUP,...) or say none");
  return out;
}

StartupSignals::StartupSignals(const config::TrainingConfig& train) : signals_(save_on_signals(train)) {
  g_phase = kStartup;
  g_received = 0;
  previous_.resize(signals_.size());
  struct sigaction sa {};
  sa.sa_handler = on_exit_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a read or wait the signal interrupts carries on
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &sa, &previous_[i]);
  // What was held since the process started (exit_signals.hpp) is delivered now.
  unblock_exit_signals();
}

StartupSignals::~StartupSignals() {
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  g_phase = kStartup;
}

ExitConditions::ExitConditions(const config::TrainingConfig& train, const Topology& topo)
    : topo_(topo),
      interval_(train.exit_interval()),
      duration_minutes_(train.exit_duration_in_mins()),
      start_(std::chrono::steady_clock::now()) {
  // A run built without pretrain() (tests) installs the handlers here; pretrain() installed them
  // at its start, so that a signal during start-up is handled too.
  const std::vector<int> signals = save_on_signals(train);
  handle_signals_ = !signals.empty();
  if (!handle_signals_) return;
  struct sigaction current {};
  sigaction(signals.front(), nullptr, &current);
  if (current.sa_handler != on_exit_signal) own_.emplace(train);
  // A signal recorded before this point ended the process; from here one is recorded.
  g_received = 0;
  g_phase = kTraining;
}

ExitConditions::~ExitConditions() {
  if (!handle_signals_) return;
  g_phase = kAfter;
  own_.reset();
}

std::string ExitConditions::check(int64_t iteration) {
  const bool timed = duration_minutes_ > 0;
  if (handle_signals_ || timed) {
    const double minutes =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() / 60.0;
    const int64_t local = (static_cast<int64_t>(g_received) << 1) | (timed && minutes > duration_minutes_ ? 1 : 0);
    // MAX over the world: any rank's signal wins (a signal number is > 0), then any rank's clock.
    const int64_t agreed = world_max(local, topo_, "agreeing whether to exit");
    if (agreed >> 1) return std::string("after receiving ") + name_of(static_cast<int>(agreed >> 1));
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
