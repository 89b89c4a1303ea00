// Runs the `dtk` binary (DTK_BIN) for end-to-end tests: stdout and stderr together, the exit code,
// and always bounded by `timeout` so a hang fails the test instead of CI.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace dtk_test {

struct Result {
  int code;
  std::string out;  // stdout + stderr
};

inline Result run_dtk(const std::string& args, int timeout_s = 300) {
  const std::string cmd = "timeout " + std::to_string(timeout_s) + " " + DTK_BIN + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  if (!p) return r;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) r.out += buf;
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace dtk_test
