#include "dtk/core/train/exit_conditions.hpp"

#include <signal.h>
#include <unistd.h>

#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <atomic>
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
// Lock-free atomics: read and written by the watcher thread, the training thread and (as a
// fallback) a signal handler.
std::atomic<int> g_phase{kStartup};
std::atomic<int> g_received{0};
std::atomic<int64_t> g_received_ns{0};  // when (CLOCK_MONOTONIC) g_received was recorded
// A copy of the recorded signal this soon after it is the same event, not a user asking again: a
// signal to a whole process group (a terminal's Ctrl-C, a job scheduler) reaches a launched rank
// directly and once more through dtk launch.
constexpr int64_t kSameEventNs = 1000 * 1000 * 1000;
std::atomic<bool> g_watching{false};  // a StartupSignals exists
static_assert(std::atomic<int>::is_always_lock_free, "the handler needs lock-free atomics");

// One write(2), so that the lines of ranks sharing a terminal do not interleave.
void say(const char* a, const char* b = "", const char* c = "") {
  char line[256];
  size_t n = 0;
  for (const char* s : {a, b, c})
    for (; *s && n < sizeof line; ++s) line[n++] = *s;
  ssize_t ignored = ::write(STDERR_FILENO, line, n);
  (void)ignored;
}

int64_t monotonic_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000 * 1000 * 1000 + t.tv_nsec;
}

const char* name_of(int sig) {
  for (const NamedSignal& s : kCatchable)
    if (s.number == sig) return s.name;
  return "a signal";
}

// Only async-signal-safe calls here (it also runs as a handler): write(2), clock_gettime, signal,
// pthread_sigmask, raise.
void on_exit_signal(int sig) {
  const bool again = g_phase == kTraining && g_received == sig;
  if (again && monotonic_ns() - g_received_ns.load() < kSameEventNs) return;
  if (g_phase != kTraining || again) {
    // Before training there is nothing to save; after it, nothing left to save. The second of its
    // kind in training: stop now. Either way with the signal's own exit status (128 + its number).
    if (g_phase == kStartup)
      say("dtk: received ", name_of(sig), " before training started: exiting, nothing was saved\n");
    else if (g_phase == kAfter)
      say("dtk: received ", name_of(sig), " after training: exiting now\n");
    // The default action, from a thread that holds the signal (the watcher) or a handler.
    ::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);
    return;
  }
  g_received_ns = monotonic_ns();
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

// The listed signals stay held in every thread; this thread takes them with sigtimedwait and
// handles them outside any signal context. Nothing the run computes is ever interrupted by them:
// no EINTR in its system calls, no signal frame over a JIT kernel's registers (on AVX-512 CPUs
// oneDNN's sgemm has crashed when a handler ran in the middle of it).
void StartupSignals::watch() {
  const sigset_t set = listed_set();
  const timespec poll{0, 50 * 1000 * 1000};  // how soon the destructor's stop is seen
  while (!stop_.load()) {
    const int sig = sigtimedwait(&set, nullptr, &poll);
    if (sig > 0) on_exit_signal(sig);
  }
}

StartupSignals::StartupSignals(const config::TrainingConfig& train) : signals_(save_on_signals(train)) {
  g_phase = kStartup;
  g_received = 0;
  // A handler as well: a thread that started before the signals were held (none of DTK's) records
  // them as the watcher would.
  struct sigaction sa {};
  sa.sa_handler = on_exit_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  // A listed signal the process inherited ignored (nohup's SIGHUP) stays ignored, as in any program.
  signals_.erase(std::remove_if(signals_.begin(), signals_.end(), inherited_ignored), signals_.end());
  previous_.resize(signals_.size());
  const sigset_t listed = listed_set();
  sigset_t others = exit_signal_set();
  for (size_t i = 0; i < signals_.size(); ++i) {
    sigaction(signals_[i], &sa, &previous_[i]);
    sigdelset(&others, signals_[i]);
  }
  // Held since the process started (exit_signals.hpp): the listed ones stay held (the watcher
  // takes what arrived meanwhile), the others get their own action (default or ignored) from here.
  pthread_sigmask(SIG_BLOCK, &listed, nullptr);
  pthread_sigmask(SIG_UNBLOCK, &others, nullptr);
  if (!signals_.empty()) watcher_ = std::thread([this] { watch(); });
  g_watching = true;
}

StartupSignals::~StartupSignals() {
  g_watching = false;
  if (watcher_.joinable()) {
    stop_ = true;
    watcher_.join();
  }
  for (size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  g_phase = kStartup;
  // From here the listed signals have their earlier action in this thread (one that arrived
  // since the watcher stopped is delivered now).
  const sigset_t listed = listed_set();
  pthread_sigmask(SIG_UNBLOCK, &listed, nullptr);
}

sigset_t StartupSignals::listed_set() const {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : signals_) sigaddset(&set, sig);
  return set;
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
  if (!g_watching) own_.emplace(train);
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
