// `dtk launch --nproc_per_node N [--nnodes M --node_rank K --master_addr A] [--master_port P]
//  <dtk args...>`
//
// Spawns N children running /proc/self/exe <dtk args...> with the torchrun variables set: on node
// K of M, ranks K*N .. K*N+N-1 of a world of M*N, rank 0 on node 0 (at --master_addr) serving the
// store. One launcher runs on each node, as torchrun's static rendezvous does. The
// children inherit stdout/stderr (their lines reach the user as they are written). The launcher
// waits for all of them; when one fails (non-zero exit or a signal), the others get SIGTERM
// and, after a grace period, SIGKILL, and the launcher exits with the failed child's code
// (128 + signal for a signal). SIGINT/SIGTERM/SIGHUP/SIGUSR1/SIGUSR2 sent to the launcher are
// forwarded: the ranks finish their iteration, save and exit 0 together (those of
// train.save_on_signals, core/exit_conditions.hpp), and the
// launcher exits with their codes; they get kForwardedGrace to do it, and a second signal to the
// launcher kills them at once.
#include "launch.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gflags/gflags.h>

#include "command_line.hpp"
#include "dtk/core/launch/reserved_port.hpp"
#include "dtk/core/train/exit_signals.hpp"
#include "dtk/host/error.hpp"
#include "dtk/host/error_line.hpp"
#include "dtk/plugin.hpp"  // one_line

namespace {

using dtk::host::HostError;

// Forwarded to the ranks: what a user, a closed terminal (SIGHUP) or a scheduler's warning (SLURM's
// --signal: SIGUSR1/SIGUSR2) sends.
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2};

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

constexpr auto kGrace = std::chrono::seconds(5);             // after a rank failed
constexpr auto kForwardedGrace = std::chrono::seconds(300);  // to finish an iteration and save

int parse_int(const std::string& flag, const std::string& v, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || errno || *end || x < lo || x > hi)
    throw HostError("launch: " + flag + " needs an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                    "], got '" + v + "'");
  return static_cast<int>(x);
}

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw HostError("launch: cannot resolve /proc/self/exe");
  buf[n] = '\0';
  return buf;
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

struct LaunchArgs {
  bool help = false;  // --help before the command: the usage, nothing launched
  int nproc = 0, port = 0;
  int nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  bool master_addr_given = false;
  int command = 0;  // index of the dtk command the children run
};

constexpr const char* kUsage =
    "usage: dtk launch --nproc_per_node N [--nnodes M --node_rank K --master_addr HOST] [--master_port P] <dtk "
    "command and flags>";

constexpr const char* kLaunchFlags[] = {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr",
                                        "--master_port"};

// Launch's number flags: the field each sets and its range.
struct NumberFlag {
  const char* name;
  int lo, hi;
  int LaunchArgs::*field;
};
constexpr NumberFlag kNumberFlags[] = {{"--nproc_per_node", 1, 1024, &LaunchArgs::nproc},
                                       {"--master_port", 1, 65535, &LaunchArgs::port},
                                       {"--nnodes", 1, 65536, &LaunchArgs::nnodes},
                                       {"--node_rank", 0, 65535, &LaunchArgs::node_rank}};

// torchrun's flags may be spelt with '-' for '_' (--nproc-per-node): launch's own flags in its
// spelling, anything else as given.
std::string launch_spelling(const std::string& arg) {
  if (arg.rfind("--", 0) != 0) return arg;
  const size_t eq = std::min(arg.find('='), arg.size());
  std::string name = arg.substr(0, eq);
  std::replace(name.begin() + 2, name.end(), '-', '_');
  for (const char* f : kLaunchFlags)
    if (name == f) return name + arg.substr(eq);
  return arg;
}

// Whether `arg` ("--threads", "--threads=2", "--nofoo") is one of dtk's own flags: those may come
// before the command in the ranks' command line (dtk --threads 1 train ...).
bool is_dtk_flag(const std::string& arg) {
  if (arg.find_first_not_of('-') == std::string::npos) return false;  // "-", "--"
  std::string name = arg.substr(arg.find_first_not_of('-'));
  name = name.substr(0, name.find('='));
  gflags::CommandLineFlagInfo info;
  if (gflags::GetCommandLineFlagInfo(name.c_str(), &info)) return true;
  return name.rfind("no", 0) == 0 && gflags::GetCommandLineFlagInfo(name.substr(2).c_str(), &info) &&
         info.type == "bool";
}

LaunchArgs parse_args(int argc, char** argv) {
  LaunchArgs args;
  std::set<std::string> given;
  int i = 0;
  for (; i < argc; ++i) {
    const std::string a = launch_spelling(argv[i]);
    // A flag given twice would silently keep one value.
    auto value = [&](const std::string& flag) -> std::string {
      if (!given.insert(flag).second) throw HostError("launch: " + flag + " is given twice");
      if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) return a.substr(flag.size() + 1);
      if (i + 1 >= argc) throw HostError("launch: " + flag + " needs a value");
      return argv[++i];
    };
    // A number where the command stands was forgotten: named as such (a host may be called "train").
    auto number = [&](const std::string& flag, int lo, int hi) {
      const std::string v = value(flag);
      if (is_command(v))
        throw HostError("launch: " + flag + " has no value ('" + v + "' is the dtk command to run; " + kUsage + ")");
      return parse_int(flag, v, lo, hi);
    };
    if (a == "--help" || a == "-h") {
      args.help = true;
      return args;
    }
    const auto is = [&](const char* flag) { return a == flag || a.rfind(std::string(flag) + "=", 0) == 0; };
    const auto number_flag =
        std::find_if(std::begin(kNumberFlags), std::end(kNumberFlags), [&](const NumberFlag& f) { return is(f.name); });
    if (number_flag != std::end(kNumberFlags))
      args.*(number_flag->field) = number(number_flag->name, number_flag->lo, number_flag->hi);
    else if (is("--master_addr")) {
      args.master_addr = value("--master_addr"), args.master_addr_given = true;
      if (args.master_addr.empty()) throw HostError("launch: --master_addr needs a host name or address");
    } else if (a == "--")
      ++i;
    else if (a.rfind("-", 0) == 0 && !is_dtk_flag(a)) {
      // Neither launch's flag nor dtk's: refused here once, not by every rank.
      std::string names;
      for (const char* f : kLaunchFlags) names += std::string(names.empty() ? "" : ", ") + f;
      throw HostError("launch: unknown flag '" + a + "' (launch takes " + names +
                      ", then a dtk command and its flags)");
    } else
      break;  // the ranks' command line: a command, or dtk's flags before it
    if (a == "--") break;
  }
  if (args.nproc <= 0) throw HostError(kUsage);
  if (args.node_rank >= args.nnodes)
    throw HostError("launch: --node_rank " + std::to_string(args.node_rank) + " is not below --nnodes " +
                    std::to_string(args.nnodes));
  if (args.nnodes > 1 && !args.master_addr_given)
    throw HostError("launch: --nnodes " + std::to_string(args.nnodes) +
                    " needs --master_addr (the host of node 0, reachable from every node)");
  if (static_cast<long>(args.nnodes) * args.nproc > (1L << 24))
    throw HostError("launch: --nnodes x --nproc_per_node is too large");
  // The ranks' command line is checked once here, as each rank would check it.
  const std::string command = rank_command(argc - i, argv + i);
  if (command.empty()) throw HostError("launch: no dtk command to run (e.g. dtk launch --nproc_per_node 2 train ...)");
  if (command == "launch") throw HostError("launch: cannot launch 'launch'");
  if (!is_command(command))
    throw HostError("launch: '" + command + "' is not a dtk command (e.g. dtk launch --nproc_per_node 2 train ...)");
  args.command = i;
  return args;
}

// The ranks of one launch: spawned with the torchrun variables, signals forwarded, the others
// stopped (SIGTERM, then SIGKILL after a grace period) as soon as one fails.
class Ranks {
 public:
  // The ranks first_rank .. first_rank + nproc - 1 (this node's).
  Ranks(int nproc, int first_rank) : pids_(nproc, -1), running_(nproc, false), first_rank_(first_rank) {}

  void spawn(const std::string& exe, std::vector<char*>& child_argv, const LaunchArgs& args);
  int supervise();  // returns the launcher's exit code

 private:
  void kill_all(int sig) {
    for (size_t r = 0; r < pids_.size(); ++r)
      if (running_[r]) ::kill(pids_[r], sig);
  }
  void stop_others() {
    stopping_ = true;
    kill_all(SIGTERM);
    kill_at_ = std::chrono::steady_clock::now() + kGrace;
  }
  void exited(int local_rank, int status);

  std::vector<pid_t> pids_;
  std::vector<bool> running_;
  int first_rank_ = 0;
  int alive_ = 0, result_ = 0;
  bool stopping_ = false;
  bool forwarded_ = false;  // a signal to the launcher was passed on
  int started_ = 0;         // ranks spawned: fewer than asked when a signal came while spawning
  int forwarded_signal_ = 0;
  std::chrono::steady_clock::time_point kill_at_{};
};

void Ranks::spawn(const std::string& exe, std::vector<char*>& child_argv, const LaunchArgs& args) {
  // Signals stay blocked across fork(): one arriving between fork and the child's reset would
  // otherwise run the launcher's handler in the child and be lost.
  sigset_t forwarded, previous;
  sigemptyset(&forwarded);
  for (int sig : kForwardedSignals) sigaddset(&forwarded, sig);
  sigprocmask(SIG_BLOCK, &forwarded, &previous);
  const pid_t launcher = ::getpid();
  const int nproc = static_cast<int>(pids_.size());
  // Test hook: a pause after each fork, so that a test can signal the launcher mid-spawn.
  const char* pause_env = std::getenv("DTK_TEST_LAUNCH_SPAWN_PAUSE_MS");
  const int pause_ms = pause_env ? std::atoi(pause_env) : 0;
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      const std::string err = std::strerror(errno);
      sigprocmask(SIG_SETMASK, &previous, nullptr);
      kill_all(SIGKILL);
      while (alive_ > 0 && ::wait(nullptr) > 0) --alive_;
      throw HostError("launch: fork failed: " + err);
    }
    if (pid == 0) {
      for (int sig : kForwardedSignals)
        if (!dtk::core::inherited_ignored(sig)) signal(sig, SIG_DFL);
      // A rank never outlives its launcher (kill -9, OOM killer, a harness's timeout -s KILL).
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) std::_Exit(1);
      // A `train` rank keeps them held through exec: the host's StartupSignals handles what
      // arrived while LibTorch loaded, as bin/dtk's front does for a run started by hand. One
      // change of mask: a signal forwarded right after the fork finds them held, never unblocked
      // with their default action for an instant.
      sigset_t rank_mask = previous;
      if (child_argv.size() > 1 && child_argv[1] && !std::strcmp(child_argv[1], "train"))
        for (const auto& s : dtk::core::kCatchableExitSignals) sigaddset(&rank_mask, s.number);
      sigprocmask(SIG_SETMASK, &rank_mask, nullptr);
      setenv("RANK", std::to_string(args.node_rank * nproc + r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(args.nnodes * nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(args.node_rank).c_str(), 1);
      // What this launcher was told, for the ranks to compare before they wait for each other.
      setenv("DTK_LAUNCH_WORLD",
             ("--nnodes " + std::to_string(args.nnodes) + " --nproc_per_node " + std::to_string(nproc)).c_str(), 1);
      setenv("MASTER_ADDR", args.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(args.port).c_str(), 1);
      ::execv(exe.c_str(), child_argv.data());
      std::fprintf(stderr, "dtk: error: launch: exec %s failed: %s\n", exe.c_str(), std::strerror(errno));
      std::_Exit(127);
    }
    pids_[r] = pid, running_[r] = true, ++alive_, ++started_;
    if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    // Forking many ranks takes a while (in the host's launcher each fork copies a LibTorch-sized
    // address space): a Ctrl-C or a timeout's SIGTERM meanwhile stops the spawning instead of
    // waiting for the last rank.
    sigset_t pending;
    sigpending(&pending);
    bool interrupted = false;
    for (int sig : kForwardedSignals) interrupted = interrupted || sigismember(&pending, sig) == 1;
    if (interrupted) break;
  }
  sigprocmask(SIG_SETMASK, &previous, nullptr);  // a signal that came meanwhile is delivered now
  if (started_ < nproc) {
    std::fprintf(stderr, "dtk: launch: interrupted while starting the ranks (%d of %d started); stopping them\n",
                 started_, nproc);
    std::fflush(stderr);
  }
}

void Ranks::exited(int local_rank, int status) {
  running_[local_rank] = false, --alive_;
  const int rank = first_rank_ + local_rank;
  const int code = exit_code(status);
  if (code != 0 && result_ == 0) {
    result_ = code;
    std::fprintf(stderr, "dtk: launch: rank %d exited with code %d; stopping the other ranks\n", rank, code);
    std::fflush(stderr);
  } else if (code != 0 && code != 128 + SIGTERM && code != 128 + SIGKILL) {
    // Several ranks can fail at once and waitpid reports the oldest first: name them all.
    std::fprintf(stderr, "dtk: launch: rank %d exited with code %d\n", rank, code);
    std::fflush(stderr);
  }
  if (code != 0 && !stopping_) stop_others();
}

int Ranks::supervise() {
  while (alive_ > 0) {
    if (g_signal) {
      const int sig = g_signal;
      g_signal = 0;
      if (forwarded_) {
        kill_all(SIGKILL);  // the second: now
      } else {
        forwarded_ = true;
        forwarded_signal_ = sig;
        kill_all(sig);  // forward; ranks that do not finish in time are killed
        // An incomplete world never reaches an iteration to finish: a short grace, as for a failure.
        const bool complete = started_ == static_cast<int>(pids_.size());
        const auto deadline = std::chrono::steady_clock::now() + (complete ? kForwardedGrace : kGrace);
        if (!stopping_ || deadline < kill_at_) kill_at_ = deadline;
        stopping_ = true;
      }
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t r = 0; r < pids_.size(); ++r)
        if (pids_[r] == pid && running_[r]) exited(static_cast<int>(r), status);
      continue;
    }
    if (pid < 0 && errno != EINTR) break;  // no children left
    if (stopping_ && std::chrono::steady_clock::now() >= kill_at_) {
      kill_all(SIGKILL);
      kill_at_ = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Ranks of an incomplete world may exit 0 on the signal: the launch itself did not run.
  if (result_ == 0 && started_ < static_cast<int>(pids_.size()))
    return 128 + (forwarded_signal_ ? forwarded_signal_ : SIGTERM);
  return result_;
}

int run_launch(int argc, char** argv) {
  LaunchArgs args = parse_args(argc, argv);
  if (args.help) {
    std::printf(
        "%s\n  N copies of dtk on this machine (node K of M with --nnodes), each running the dtk command "
        "that follows with the torchrun variables set; `dtk --help` lists the commands.\n",
        kUsage);
    return 0;
  }
  // One node: a free port, held (not listening) until the launch ends so no other launch is given
  // it before rank 0's store listens on it. Several: every launcher must name the same one
  // (torchrun's default).
  std::unique_ptr<dtk::core::ReservedPort> reserved;
  if (args.port == 0 && args.nnodes == 1) {
    try {
      reserved = std::make_unique<dtk::core::ReservedPort>();
    } catch (const std::runtime_error& e) {
      throw HostError(std::string("launch: ") + e.what());
    }
    args.port = reserved->number();
  }
  if (args.port == 0) args.port = 29500;
  const std::string exe = self_exe();
  std::vector<char*> child_argv;
  child_argv.push_back(const_cast<char*>(exe.c_str()));
  for (int k = args.command; k < argc; ++k) child_argv.push_back(argv[k]);
  child_argv.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : kForwardedSignals)
    if (!dtk::core::inherited_ignored(sig)) sigaction(sig, &sa, nullptr);
  // Held since bin/dtk's first instruction (exit_signals.hpp): one that came meanwhile (while the
  // host loaded LibTorch, when the host runs the launch) is forwarded to the ranks once they exist,
  // like any later one.
  dtk::core::unblock_exit_signals();
  // One namespace for this run's rendezvous keys (two launches on one port cannot mix). The
  // launchers of several nodes must agree on it without talking: master address and port (or
  // the user's DTK_RUN_ID, as torchrun's --rdzv_id).
  if (args.nnodes == 1)
    setenv("DTK_RUN_ID", ("launch-" + std::to_string(::getpid()) + "-" + std::to_string(args.port)).c_str(), 1);
  else
    setenv("DTK_RUN_ID", ("launch-" + args.master_addr + "-" + std::to_string(args.port)).c_str(), 0);
  Ranks ranks(args.nproc, args.node_rank * args.nproc);
  ranks.spawn(exe, child_argv, args);
  return ranks.supervise();
}

}  // namespace

bool launcher_can_check(int argc, char** argv) {
  const char* gemm = std::getenv("DTK_CPU_GEMM");
  if (gemm && *gemm && std::strcmp(gemm, "auto") != 0 && std::strcmp(gemm, "aten") != 0) return false;
  for (int i = 0; i < argc; ++i) {
    const std::string a = launch_spelling(argv[i]);
    // A word that reads as a flag: one or two '-', then a letter ("-1" is a value). A flag's
    // value that reads so ("--prompt -x") is an unknown flag here: the host checks it then.
    const size_t at = a.find_first_not_of('-');
    if (at == std::string::npos || at == 0 || at > 2 || !std::isalpha(static_cast<unsigned char>(a[at]))) continue;
    const std::string name = a.substr(0, a.find('='));
    const bool launch_flag =
        std::find(std::begin(kLaunchFlags), std::end(kLaunchFlags), name) != std::end(kLaunchFlags);
    if (!launch_flag && !is_dtk_flag(a)) return false;
  }
  return true;
}

int launch_command(int argc, char** argv) {
  try {
    return run_launch(argc, argv);
  } catch (const std::exception& e) {
    dtk::host::print_error_line(dtk::one_line(e.what()));
    return 1;
  }
}
