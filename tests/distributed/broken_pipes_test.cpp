// SIGPIPE in a rank (dtk/core/launch/broken_pipes.hpp): a write to a socket whose peer has gone
// is an EPIPE error the backend reports, while a lost reader of stdout still ends the process as
// SIGPIPE's default action would. Each case runs in a forked child, so the test binary's own
// signal handling stays as it was.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "dtk/core/launch/broken_pipes.hpp"

namespace {

// Writes to a socket whose peer has closed; the child exits with 0 when the write failed with
// EPIPE, 1 on any other outcome (killed by SIGPIPE shows as a signal).
int write_to_lost_peer(bool route, bool lose_stdout) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(20);                 // bounded: a hang ends the child
    ::signal(SIGPIPE, SIG_DFL);  // whatever the test's harness set (an inherited ignore stays one)
    if (lose_stdout) {
      int p[2];
      if (::pipe(p) != 0) ::_exit(3);
      ::dup2(p[1], 1);
      ::close(p[0]);  // stdout's reader is gone
      ::close(p[1]);
    }
    if (route) dtk::core::route_broken_pipes();
    int s[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, s) != 0) ::_exit(3);
    ::close(s[1]);
    const char byte = 'x';
    const ssize_t n = ::write(s[0], &byte, 1);  // like Gloo's writev: no MSG_NOSIGNAL
    ::_exit(n == -1 && errno == EPIPE ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

TEST(BrokenPipes, ALostSocketPeerIsAnErrorNotADeath) {
  // Without the handler the write kills the process: the failure the test guards against.
  const int unrouted = write_to_lost_peer(false, false);
  ASSERT_TRUE(WIFSIGNALED(unrouted));
  EXPECT_EQ(WTERMSIG(unrouted), SIGPIPE);
  const int routed = write_to_lost_peer(true, false);
  ASSERT_TRUE(WIFEXITED(routed)) << "signal " << (WIFSIGNALED(routed) ? WTERMSIG(routed) : 0);
  EXPECT_EQ(WEXITSTATUS(routed), 0);
}

TEST(BrokenPipes, ALostStdoutReaderStillEndsTheProcess) {
  // `dtk train | head`: once head has gone, the rank ends as it always did, by SIGPIPE.
  const int status = write_to_lost_peer(true, true);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exited " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  EXPECT_EQ(WTERMSIG(status), SIGPIPE);
}

}  // namespace
