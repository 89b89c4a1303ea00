// Runs the `dtk` binary (DTK_BIN) for end-to-end tests: stdout and stderr together, the exit code,
// and always bounded by `timeout` so a hang fails the test instead of CI.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>
#include <string>

namespace dtk_test {

struct Result {
  int code;
  std::string out;  // stdout + stderr
};

// Runs a shell command line and collects what it printed to stdout (redirect stderr in `cmd`)
// and its exit code (-1 when it did not exit: killed by a signal, or no shell).
inline Result run_shell(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  if (!p) return r;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) r.out += buf;
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline Result run_dtk(const std::string& args, int timeout_s = 300) {
  // SIGTERM asks dtk to finish its iteration and save; -k 10 kills one that cannot (a hang).
  return run_shell("timeout -k 10 " + std::to_string(timeout_s) + " " + DTK_BIN + " " + args + " 2>&1");
}

// A fresh, empty directory `base`/`name`-<pid> (per process, so parallel ctest runs do not
// collide).
inline std::string fresh_dir(const std::string& base, const std::string& name) {
  const std::filesystem::path d = std::filesystem::path(base) / (name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

// The one-line error contract: exit 1 and exactly one "dtk: error:" line, holding `needle`, and no
// uncaught exception.
inline void expect_one_line_error(const Result& r, const std::string& needle) {
  EXPECT_EQ(r.code, 1) << r.out;
  const size_t at = r.out.find("dtk: error: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("dtk: error: ", at + 1), std::string::npos) << r.out;
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_NE(line.find(needle), std::string::npos) << "line: " << line << "\nwanted: " << needle;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// iteration -> "lm loss: X" of every Megatron-style log line in `log`, as printed.
inline std::map<int, std::string> printed_losses(const std::string& log) {
  std::map<int, std::string> out;
  static const std::regex re(R"(iteration\s+(\d+)/\s*\d+ \|.*(lm loss: \S+) \|)");
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it)
    out[std::stoi((*it)[1])] = (*it)[2].str();
  return out;
}

}  // namespace dtk_test
