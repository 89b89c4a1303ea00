// tests/common/background_dtk.hpp — `dtk` started in the background, its output in a file, for
// tests that signal or kill a run while it trains (exit conditions, signals). Every wait is
// bounded; the process is killed at the end if it still runs. Needs DTK_BIN.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace dtk_test {

// A `dtk` process started in the background, its output in a file.
struct BackgroundDtk {
  pid_t pid = -1;
  std::string log;
  int code = -1;  // the exit code once reaped (128 + the signal for one)

  static int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

  // new_group: the process leads a process group of its own (as a job under a shell or a
  // scheduler), so that a test can signal the whole group (::kill(-pid, sig)).
  BackgroundDtk(const std::string& args, const std::string& log_path, bool new_group = false) : log(log_path) {
    pid = ::fork();
    if (pid == 0) {
      if (new_group) ::setpgid(0, 0);
      const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1), ::dup2(fd, 2);
      const std::string cmd = std::string("exec ") + DTK_BIN + " " + args;
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~BackgroundDtk() {
    if (pid > 0) ::kill(pid, SIGKILL), ::waitpid(pid, nullptr, 0);
  }
  std::string output() const {
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  // Waits (bounded) until the output holds `needle`; false if the process ended or time ran out.
  bool wait_for(const std::string& needle, int timeout_s) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    while (std::chrono::steady_clock::now() < end) {
      if (output().find(needle) != std::string::npos) return true;
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        code = exit_code_of(status);
        return output().find(needle) != std::string::npos;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }
  // The exit code, waiting at most timeout_s (then -1, and the process is killed).
  int wait_exit(int timeout_s) {
    if (pid <= 0) return code;  // ended (and reaped) during wait_for
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    while (pid > 0 && std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return code = exit_code_of(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
};

}  // namespace dtk_test
