// A TCP port on 127.0.0.1 that stays this process's until it is dropped, for a run's store.
//
// Picking a port by binding port 0 and closing the socket leaves a window between the close and
// rank 0's listen (LibTorch's load, seconds): another launch can be given the same port, and a
// rank then meets the other run's store (or connects to itself). A ReservedPort keeps the socket
// bound, never listening, with SO_REUSEADDR: Linux lets rank 0's store listen on the port (it
// sets SO_REUSEADDR too, and this socket does not listen), while no bind(0) and no outgoing
// connection is given the port as long as it is held. Header-only: `dtk launch` and the tests'
// own launches share it without linking the runtime.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace dtk::core {

class ReservedPort {
 public:
  // Throws std::runtime_error naming the failing call when no port can be had.
  ReservedPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // not inherited by the ranks
    if (fd_ < 0) fail("socket");
    const int on = 1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0) fail("setsockopt");
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail("bind");
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) fail("getsockname");
    port_ = ntohs(a.sin_port);
  }
  ~ReservedPort() {
    if (fd_ >= 0) ::close(fd_);
  }
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;

  int number() const { return port_; }

 private:
  [[noreturn]] void fail(const char* call) {
    const std::string err = std::strerror(errno);
    if (fd_ >= 0) ::close(fd_);
    throw std::runtime_error(std::string("no free port on 127.0.0.1: ") + call + ": " + err);
  }

  int fd_ = -1;
  int port_ = 0;
};

}  // namespace dtk::core
