// Helpers of the distributed tests: run several processes at once, each bounded by `timeout`,
// and collect exit codes and output.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "../common/free_port.hpp"

namespace dtk_test {

struct Result {
  int code;
  std::string out;  // stdout + stderr
  double seconds;
};

// Runs each shell command concurrently (each under `timeout timeout_s`) and waits for all.
inline std::vector<Result> run_all(const std::vector<std::string>& cmds, int timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<FILE*> pipes;
  for (const auto& c : cmds)
    pipes.push_back(popen(("timeout -k 10 " + std::to_string(timeout_s) + " " + c + " 2>&1").c_str(), "r"));
  std::vector<Result> out;
  for (FILE* p : pipes) {
    Result r{-1, "", 0};
    if (p) {
      char buf[4096];
      while (fgets(buf, sizeof buf, p)) r.out += buf;
      const int status = pclose(p);
      r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    out.push_back(r);
  }
  return out;
}

inline Result run(const std::string& cmd, int timeout_s) { return run_all({cmd}, timeout_s)[0]; }

inline std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  buf[n > 0 ? n : 0] = '\0';
  return buf;
}

}  // namespace dtk_test
