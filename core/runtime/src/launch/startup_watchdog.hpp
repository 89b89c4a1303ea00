// The bound on every start-up step of a multi-process run.
//
// Each step (store connect, rendezvous, configuration check, process-group creation, the first
// collective) has its own timeout, but not every wait inside c10d and Gloo honours one: a Gloo
// pair whose peer advertised an address nobody can reach, or died between two handshakes, can
// wait forever. The watchdog is the backstop: when a step runs past distributed.timeout_seconds
// plus a margin, it prints the one-line error (the step, the ranks it still waits for, the
// timeout) and ends the process with exit code 1. The step's own, more precise error normally
// comes first. It also polls, once a second, whether the start-up is already lost (a peer
// reported its failure, or rank 0's store is gone): then it ends the process at once instead of
// waiting out the timeout.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace dtk::core {

class StartupWatchdog {
 public:
  // `diagnose(key)` (may be empty) says, for the error line, whom the step of that key still
  // waits for; it runs on the watchdog's thread and must bound its own waits.
  // `lost()` (may be empty), polled every second on the same thread, returns why the start-up
  // cannot succeed any more, or "".
  StartupWatchdog(std::chrono::milliseconds timeout, std::function<std::string(const std::string&)> diagnose,
                  std::function<std::string()> lost = {});
  ~StartupWatchdog();  // stops watching
  StartupWatchdog(const StartupWatchdog&) = delete;
  StartupWatchdog& operator=(const StartupWatchdog&) = delete;

  // A new step begins: its deadline is now + timeout + margin. `name` is for the error line,
  // `key` for diagnose().
  void step(const std::string& name, const std::string& key = "");

  static constexpr std::chrono::seconds kMargin{5};

 private:
  void watch();
  [[noreturn]] void fail(const std::string& step, const std::string& why, bool timed_out);

  std::chrono::milliseconds timeout_;
  std::function<std::string(const std::string&)> diagnose_;
  std::function<std::string()> lost_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string step_, key_;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool done_ = false;
  std::thread thread_;
};

}  // namespace dtk::core
