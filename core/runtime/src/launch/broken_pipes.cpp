// broken_pipes.cpp — SIGPIPE: fatal for a lost reader of stdout/stderr, an EPIPE for a lost
// socket peer (why: dtk/core/launch/broken_pipes.hpp).
#include "dtk/core/launch/broken_pipes.hpp"

#include <poll.h>
#include <signal.h>

#include <cerrno>

namespace dtk::core {
namespace {

// A pipe or socket whose reader has gone polls as POLLERR (a pipe) or POLLHUP (a socket); a
// terminal or a file never does. poll(), signal() and raise() are async-signal-safe.
bool output_lost(int fd) {
  struct pollfd p {};
  p.fd = fd;
  p.events = POLLOUT;
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLERR | POLLHUP)) != 0;
}

void on_sigpipe(int) {
  const int saved = errno;  // a SIGPIPE sent with kill() may interrupt any code
  if (output_lost(1) || output_lost(2)) {
    ::signal(SIGPIPE, SIG_DFL);
    ::raise(SIGPIPE);  // pending until this handler returns, then the default action
  }
  errno = saved;
}

}  // namespace

void route_broken_pipes() {
  struct sigaction current {};
  ::sigaction(SIGPIPE, nullptr, &current);
  if (current.sa_handler == SIG_IGN || current.sa_handler == &on_sigpipe) return;
  struct sigaction action {};
  action.sa_handler = &on_sigpipe;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGPIPE, &action, nullptr);
}

}  // namespace dtk::core
