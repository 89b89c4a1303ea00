// Helpers of the distributed tests: run several processes at once, each bounded by `timeout`,
// and collect exit codes and output.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace dtk_test {

struct Result {
  int code;
  std::string out;  // stdout + stderr
  double seconds;
};

// A TCP port free on 127.0.0.1 right now.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

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
