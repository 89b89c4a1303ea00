// See startup_watchdog.hpp.
#include "startup_watchdog.hpp"

#include <cstdio>
#include <cstdlib>

#include "dtk/core/launch/distributed.hpp"

namespace dtk::core {

StartupWatchdog::StartupWatchdog(std::chrono::milliseconds timeout,
                                 std::function<std::string(const std::string&)> diagnose,
                                 std::function<std::string()> lost)
    : timeout_(timeout), diagnose_(std::move(diagnose)), lost_(std::move(lost)), thread_([this] { watch(); }) {}

StartupWatchdog::~StartupWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StartupWatchdog::step(const std::string& name, const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    step_ = name, key_ = key;
    deadline_ = std::chrono::steady_clock::now() + timeout_ + kMargin;
  }
  cv_.notify_all();
}

void StartupWatchdog::watch() {
  using Clock = std::chrono::steady_clock;
  constexpr auto kPoll = std::chrono::seconds(1);
  std::unique_lock<std::mutex> lock(mu_);
  auto next_poll = Clock::now() + kPoll;
  while (!done_) {
    if (!lost_ && deadline_ == Clock::time_point::max()) {
      cv_.wait(lock);
      continue;
    }
    cv_.wait_until(lock, lost_ ? std::min(deadline_, next_poll) : deadline_);
    if (done_) break;
    const std::string step = step_, key = key_;
    if (Clock::now() >= deadline_) {
      const auto deadline = deadline_;
      lock.unlock();
      std::string why;
      try {
        if (diagnose_) why = diagnose_(key);
      } catch (...) {
      }
      lock.lock();
      // The step may have finished (or the watch ended) while the diagnosis asked the store.
      if (done_ || deadline_ != deadline) continue;
      fail(step, why, true);
    }
    if (lost_ && Clock::now() >= next_poll) {
      lock.unlock();
      std::string why;
      try {
        why = lost_();
      } catch (...) {
      }
      lock.lock();
      next_poll = Clock::now() + kPoll;
      if (!why.empty() && !done_) fail(step, why, false);
    }
  }
}

void StartupWatchdog::fail(const std::string& step, const std::string& why, bool timed_out) {
  // The main thread is stuck inside c10d or Gloo: no exception can reach it, so the watchdog
  // reports and ends the process itself (the launcher then stops this node's other ranks).
  std::fflush(stdout);
  if (timed_out)
    std::fprintf(stderr, "dtk: error: %sdistributed: %s did not finish within distributed.timeout_seconds = %lld s%s%s\n",
                 rank_prefix().c_str(), step.c_str(), static_cast<long long>(timeout_.count() / 1000),
                 why.empty() ? "" : ": ", why.c_str());
  else
    std::fprintf(stderr, "dtk: error: %sdistributed: %s stopped: %s\n", rank_prefix().c_str(), step.c_str(),
                 why.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

}  // namespace dtk::core
