// Helpers of the distributed (and multi-host) tests: run several processes at once, each bounded
// by `timeout`, collect exit codes and output, and compare the losses their logs print.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <regex>
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

// The "lm loss" of every Megatron-style iteration line of `log`, in order.
inline std::vector<double> iteration_losses(const std::string& log) {
  std::vector<double> out;
  std::regex re("iteration +[0-9]+/ +[0-9]+ \\|.* lm loss: ([0-9.E+-]+) \\|");
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it) out.push_back(std::stod((*it)[1]));
  return out;
}

// Both runs succeeded and printed the same 4 losses (to 1e-5; only rank 0 prints them).
inline void expect_same_losses(const Result& one, const Result& many) {
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_EQ(many.code, 0) << many.out;
  const auto a = iteration_losses(one.out), b = iteration_losses(many.out);
  ASSERT_EQ(a.size(), 4u) << one.out;
  ASSERT_EQ(b.size(), 4u) << many.out;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "iteration " << i + 1 << "\n" << many.out;
}

inline int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

}  // namespace dtk_test
