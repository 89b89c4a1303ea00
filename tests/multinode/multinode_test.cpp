// Multi-host runs across a real network interface: two "hosts" are Linux network namespaces
// joined by a veth pair, 192.168.77.1 (host 1, the master) and 192.168.77.2 (host 2), each with
// only those addresses and its own loopback. The hostname still resolves to 127.0.0.1, as on
// Debian and in containers, and GLOO_SOCKET_IFNAME is never set: DTK must find the interface by
// itself. Each test builds its own pair of namespaces (names carry the test's pid, so parallel
// tests do not meet) and removes them, killing what still runs inside, when it ends.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "../distributed/spawn.hpp"

namespace {

using dtk_test::count;
using dtk_test::expect_same_losses;
using dtk_test::Result;

// Each command runs as `sh -c '...'` under its own timeout (compound commands stay bounded).
std::vector<Result> run_all(const std::vector<std::string>& cmds, int timeout_s) {
  std::vector<std::string> wrapped;
  for (const auto& c : cmds) wrapped.push_back("sh -c '" + c + "'");
  return dtk_test::run_all(wrapped, timeout_s);
}

int sh(const std::string& cmd) {
  const int status = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

const std::string kDtk = DTK_BIN;
const std::string kTrainArgs = std::string("train --config ") + DTK_SOURCE_DIR +
                               "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1"
                               " --set model.hidden_dropout=0 --set model.attention_dropout=0"
                               " --set model.vocab_size=512 --set dataset.vocab_size=512"
                               " --set train.train_iters=4 --set logging.log_interval=1 --set lr.lr_warmup_iters=1"
                               " --set eval.eval_iters=1 --set train.micro_batch_size=4 --set train.global_batch_size=8"
                               " --set distributed.timeout_seconds=";
// Runs that succeed wait generously (a loaded machine starts the ranks slowly); runs that lose a
// peer wait kTimeout, shorter, as each of them waits it out once or more.
const std::string kTrain = kTrainArgs + "20";
constexpr int kTimeout = 8;
const std::string kLosing = kTrainArgs + std::to_string(kTimeout);
// What a rank may take beyond the timeout to notice and report (the start-up watchdog's margin,
// process start and exit).
constexpr double kSlack = 12.0;

class TwoHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "multi-host tests need root (ip netns); skipped";
    const std::string id = std::to_string(::getpid());
    h1_ = "dtk" + id + "h1", h2_ = "dtk" + id + "h2";
    const std::string v1 = "dv" + id + "a", v2 = "dv" + id + "b";
    const std::vector<std::string> steps = {
        "ip netns add " + h1_,
        "ip netns add " + h2_,
        "ip link add " + v1 + " type veth peer name " + v2,
        "ip link set " + v1 + " netns " + h1_,
        "ip link set " + v2 + " netns " + h2_,
        "ip -n " + h1_ + " addr add 192.168.77.1/24 dev " + v1,
        "ip -n " + h2_ + " addr add 192.168.77.2/24 dev " + v2,
        "ip -n " + h1_ + " link set " + v1 + " up",
        "ip -n " + h2_ + " link set " + v2 + " up",
        "ip -n " + h1_ + " link set lo up",
        "ip -n " + h2_ + " link set lo up",
    };
    for (const auto& s : steps)
      if (sh(s) != 0) {
        TearDown();
        GTEST_SKIP() << "cannot build network namespaces here ('" << s << "' failed); skipped";
      }
    made_ = true;
  }
  void TearDown() override {
    for (const auto& ns : {h1_, h2_})
      if (!ns.empty()) {
        sh("ip netns pids " + ns + " | xargs -r kill -9");
        sh("ip netns del " + ns);
        sh("rm -rf /etc/netns/" + ns);
      }
  }

  // Gives the hosts their own /etc/hosts (ip netns exec mounts /etc/netns/<ns>/hosts over it):
  // on host 1 `name` is the host itself at 127.0.1.1, as Debian writes it; on host 2 it is
  // 192.168.77.1.
  void name_master(const std::string& name) const {
    for (const auto& [ns, address] : {std::pair{h1_, "127.0.1.1"}, std::pair{h2_, "192.168.77.1"}}) {
      sh("mkdir -p /etc/netns/" + ns);
      std::ofstream("/etc/netns/" + ns + "/hosts") << "127.0.0.1 localhost\n" << address << " " << name << "\n";
    }
  }

  // `cmd` run on host 1 or 2 with a clean environment for the network (no GLOO_SOCKET_IFNAME)
  // and the torchrun variables in `vars`.
  std::string on(int host, const std::string& vars, const std::string& cmd) const {
    return "ip netns exec " + (host == 1 ? h1_ : h2_) + " env -u GLOO_SOCKET_IFNAME " + vars + " " + cmd;
  }
  static std::string rank(int r, int world, const std::string& master = "192.168.77.1") {
    return "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(world) +
           " LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=" + master + " MASTER_PORT=29500";
  }

  std::string h1_, h2_;
  bool made_ = false;
};

}  // namespace

// One rank per host, data parallel: equal to one process, each rank on the veth's address,
// found without GLOO_SOCKET_IFNAME although the hostname resolves to the loopback.
TEST_F(TwoHosts, DataParallelAcrossHostsMatchesOneProcess) {
  const Result one = run_all({kDtk + " " + kTrain}, 120)[0];
  const auto r = run_all({on(1, rank(0, 2), kDtk + " " + kTrain), on(2, rank(1, 2), kDtk + " " + kTrain)}, 120);
  expect_same_losses(one, r[0]);
  EXPECT_EQ(r[1].code, 0) << r[1].out;
  EXPECT_NE(r[0].out.find("[rank 0] > distributed: Gloo listens on 192.168.77.1 (dv"), std::string::npos) << r[0].out;
  EXPECT_NE(r[0].out.find("the route to MASTER_ADDR 192.168.77.1\n"), std::string::npos) << r[0].out;
  EXPECT_NE(r[1].out.find("[rank 1] > distributed: Gloo listens on 192.168.77.2 (dv"), std::string::npos) << r[1].out;
}

// MASTER_ADDR as the master's name, which its own /etc/hosts maps to 127.0.1.1 (Debian): the
// master binds to its outward interface, not to the loopback the route leads to.
TEST_F(TwoHosts, MasterNamedByAHostnameThatIsLoopbackOnTheMaster) {
  const std::string name = "dtkmaster" + std::to_string(::getpid());
  name_master(name);
  const Result one = run_all({kDtk + " " + kTrain}, 120)[0];
  const auto r =
      run_all({on(1, rank(0, 2, name), kDtk + " " + kTrain), on(2, rank(1, 2, name), kDtk + " " + kTrain)}, 120);
  expect_same_losses(one, r[0]);
  EXPECT_EQ(r[1].code, 0) << r[1].out;
  EXPECT_NE(r[0].out.find("[rank 0] > distributed: Gloo listens on 192.168.77.1 (dv"), std::string::npos) << r[0].out;
  EXPECT_NE(r[0].out.find("this host's outward interface (MASTER_ADDR " + name + " resolves to the loopback here)"),
            std::string::npos)
      << r[0].out;
  EXPECT_NE(r[1].out.find("[rank 1] > distributed: Gloo listens on 192.168.77.2 (dv"), std::string::npos) << r[1].out;
}

// Tensor parallel across the hosts: every layer's all-reduce crosses the veth.
TEST_F(TwoHosts, TensorParallelAcrossHostsMatchesOneProcess) {
  const std::string tp2 = " --set distributed.tensor_model_parallel_size=2";
  const Result one = run_all({kDtk + " " + kTrain}, 120)[0];
  const auto r = run_all(
      {on(1, rank(0, 2), kDtk + " " + kTrain + tp2), on(2, rank(1, 2), kDtk + " " + kTrain + tp2)}, 120);
  expect_same_losses(one, r[0]);
  EXPECT_EQ(r[1].code, 0) << r[1].out;
}

// Two hosts x two ranks with one `dtk launch` per host (torchrun's flags): TP 2 within a host x
// DP 2 across the hosts == one process.
TEST_F(TwoHosts, LaunchTwoNodesTwoRanksEachMatchesOneProcess) {
  const std::string launch =
      kDtk + " launch --nnodes 2 --master_addr 192.168.77.1 --master_port 29500 --nproc_per_node 2 --node_rank ";
  const std::string train = kTrain + " --set distributed.tensor_model_parallel_size=2";
  const Result one = run_all({kDtk + " " + kTrain}, 120)[0];
  const auto r = run_all({on(1, "", launch + "0 " + train), on(2, "", launch + "1 " + train)}, 150);
  expect_same_losses(one, r[0]);
  EXPECT_EQ(r[1].code, 0) << r[1].out;
  for (int k : {0, 1}) EXPECT_NE(r[0].out.find("[rank " + std::to_string(k) + "] > distributed: Gloo listens on 192.168.77.1"), std::string::npos) << r[0].out;
  for (int k : {2, 3}) EXPECT_NE(r[1].out.find("[rank " + std::to_string(k) + "] > distributed: Gloo listens on 192.168.77.2"), std::string::npos) << r[1].out;
}

// A peer that never comes: the master gives up at the timeout, naming the missing rank.
TEST_F(TwoHosts, PeerThatNeverComesIsNamed) {
  const Result r = run_all({on(1, rank(0, 2), kDtk + " " + kLosing)}, 120)[0];
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_LT(r.seconds, kTimeout + kSlack) << r.out;
  EXPECT_NE(r.out.find("dtk: error: [rank 0] distributed: rendezvous at 192.168.77.1:29500 failed: 1 of 2 ranks "
                       "arrived within distributed.timeout_seconds = " +
                       std::to_string(kTimeout) + " s; missing: rank 1\n"),
            std::string::npos)
      << r.out;
}

// A peer killed during start-up (before the world was formed) and a peer that advertises an
// address the master cannot reach (its GLOO_SOCKET_IFNAME names the loopback): the other rank
// ends within the bound with one line naming the rank it waited for; nobody hangs.
TEST_F(TwoHosts, PeerLostDuringStartUpEndsTheOthers) {
  {
    // Rank 1 is killed 1.5 s after its start; rank 0 starts 3 s later and finds it gone.
    const auto r = run_all({"sleep 3; " + on(1, rank(0, 2), kDtk + " " + kLosing),
                            on(2, rank(1, 2), "timeout -s KILL 1.5 " + kDtk + " " + kLosing)},
                           120);
    EXPECT_EQ(r[0].code, 1) << r[0].out;
    EXPECT_LT(r[0].seconds, 3 + kTimeout + kSlack) << r[0].out;
    EXPECT_EQ(count(r[0].out, "dtk: error:"), 1) << r[0].out;
    EXPECT_NE(r[0].out.find("missing: rank 1\n"), std::string::npos) << r[0].out;
  }
  {
    const auto r = run_all(
        {on(1, rank(0, 2), kDtk + " " + kLosing), on(2, "GLOO_SOCKET_IFNAME=lo " + rank(1, 2), kDtk + " " + kLosing)},
        120);
    for (const Result& x : r) {
      EXPECT_EQ(x.code, 1) << x.out;
      EXPECT_LT(x.seconds, kTimeout + kSlack) << x.out;
      EXPECT_EQ(count(x.out, "dtk: error:"), 1) << x.out;
      EXPECT_EQ(x.out.find("terminate called"), std::string::npos) << x.out;
    }
    EXPECT_NE(r[0].out.find("dtk: error: [rank 0] distributed: creating the world process group failed: "),
              std::string::npos)
        << r[0].out;
    EXPECT_NE(r[0].out.find("; waiting for rank 1 (rank 1 at 127.0.0.1 (lo))\n"), std::string::npos) << r[0].out;
    EXPECT_NE(r[1].out.find("dtk: error: [rank 1] distributed: creating the process groups "), std::string::npos)
        << r[1].out;
  }
  // Rank 1 killed (SIGKILL) once it has passed a start-up step: the rendezvous (its network line)
  // and the model build (its parameter count; TP 2 across the hosts so that rank 1 prints it).
  // Rank 0, in whatever step it is then, ends within the bound with one line.
  for (const std::string mark : {"Gloo listens on", "number of parameters"}) {
    const std::string train = kLosing +
                              " --set train.train_iters=1000 --set train.exit_signal_handler=false"
                              " --set distributed.tensor_model_parallel_size=2";
    const std::string log0 = ::testing::TempDir() + "dtk-lost0-" + std::to_string(::getpid()) + ".log";
    const std::string log1 = ::testing::TempDir() + "dtk-lost1-" + std::to_string(::getpid()) + ".log";
    const std::string script =
        "(" + on(1, rank(0, 2), kDtk + " " + train) + " > " + log0 + " 2>&1; echo rank0 rc=$? >> " + log0 + ") & " +
        on(2, rank(1, 2), kDtk + " " + train) + " > " + log1 + " 2>&1 & "
        "for i in $(seq 600); do grep -q \"" + mark + "\" " + log1 + " && break; sleep 0.05; done; "
        "ip netns pids " + h2_ + " | xargs -r kill -9; s=$(date +%s.%N); "
        "for i in $(seq 900); do grep -q \"rank0 rc=\" " + log0 + " && break; sleep 0.1; done; "
        "e=$(date +%s.%N); echo after_kill=$(awk -v a=$s -v b=$e \"BEGIN{print b-a}\"); cat " + log0;
    const Result r = run_all({script}, 150)[0];
    std::remove(log0.c_str());
    std::remove(log1.c_str());
    EXPECT_NE(r.out.find("rank0 rc=1\n"), std::string::npos) << mark << "\n" << r.out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex("after_kill=([0-9.]+)"))) << r.out;
    EXPECT_LT(std::stod(m[1]), kTimeout + kSlack) << r.out;
    EXPECT_EQ(count(r.out, "dtk: error: [rank 0]"), 1) << r.out;
    EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
    // The line names the peer: by its rank, or by its rank behind the address the backend saw.
    EXPECT_NE(r.out.find("rank 1"), std::string::npos) << r.out;
    const size_t at = r.out.find("dtk: error:");
    if (at != std::string::npos)
      std::printf("[ info ] rank 1 killed after '%s'; rank 0 ended %.1f s later: %s\n", mark.c_str(),
                  std::stod(m[1]), r.out.substr(at, r.out.find('\n', at) - at).c_str());
  }
}

// A peer killed (SIGKILL) in the middle of training: the other rank ends within the bound with
// one line naming the peer, instead of waiting for the dead peer.
TEST_F(TwoHosts, PeerKilledMidRunEndsTheOther) {
  const std::string train = kLosing + " --set train.train_iters=100000 --set train.exit_signal_handler=false";
  const std::string log = ::testing::TempDir() + "dtk-midrun-" + std::to_string(::getpid()) + ".log";
  // Rank 1 is killed once rank 0 has logged iteration 3; the script prints how long rank 0 took
  // after that.
  const std::string script =
      "(" + on(1, rank(0, 2), kDtk + " " + train) + " > " + log + " 2>&1; echo rank0 rc=$? >> " + log + ") & " +
      on(2, rank(1, 2), kDtk + " " + train) + " > /dev/null 2>&1 & "
      "for i in $(seq 600); do grep -q \"iteration  *3/\" " + log + " && break; sleep 0.1; done; "
      "ip netns pids " + h2_ + " | xargs -r kill -9; s=$(date +%s.%N); "
      "for i in $(seq 600); do grep -q \"rank0 rc=\" " + log + " && break; sleep 0.1; done; "
      "e=$(date +%s.%N); echo after_kill=$(awk -v a=$s -v b=$e \"BEGIN{print b-a}\"); cat " + log;
  const Result r = run_all({script}, 150)[0];
  std::remove(log.c_str());
  EXPECT_NE(r.out.find("iteration        3/"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank0 rc=1\n"), std::string::npos) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("after_kill=([0-9.]+)"))) << r.out;
  std::printf("[ timing ] rank 0 ended %.1f s after its peer was killed\n", std::stod(m[1]));
  EXPECT_LT(std::stod(m[1]), kTimeout + kSlack) << r.out;
  EXPECT_EQ(count(r.out, "dtk: error: [rank 0]"), 1) << r.out;
  EXPECT_NE(r.out.find("(the peer: rank 1 at 192.168.77.2)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// A master address where nothing listens, and one where no host answers at all: bounded errors.
TEST_F(TwoHosts, MasterAddressWithoutStoreIsABoundedError) {
  for (const std::string master : {"192.168.77.1", "192.168.77.9"}) {
    const Result r = run_all({on(2, rank(1, 2, master), kDtk + " " + kLosing)}, 120)[0];
    EXPECT_EQ(r.code, 1) << master << "\n" << r.out;
    EXPECT_LT(r.seconds, kTimeout + kSlack) << master << "\n" << r.out;
    EXPECT_NE(r.out.find("dtk: error: [rank 1] distributed: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(master + ":29500"), std::string::npos) << r.out;
    EXPECT_EQ(count(r.out, "dtk: error:"), 1) << r.out;
  }
}

// A slow link (tc on the veth: a token-bucket rate limit, plus netem delay where the kernel has
// it) makes training slower, never wrong or hung: the same losses as one process, both ranks
// done. The times are printed for the reader, not asserted (machines differ).
TEST_F(TwoHosts, SlowLinkTrainsSlowerNeverWrong) {
  const Result one = run_all({kDtk + " " + kTrain}, 120)[0];
  const auto fast = run_all({on(1, rank(0, 2), kDtk + " " + kTrain), on(2, rank(1, 2), kDtk + " " + kTrain)}, 120);
  const std::string id = std::to_string(::getpid());
  const std::string devs[2] = {"dv" + id + "a", "dv" + id + "b"};
  // netem (delay and rate) is a kernel module some systems lack: then a token-bucket rate alone.
  auto shape = [&](const std::string& qdisc) {
    for (int h = 0; h < 2; ++h)
      if (sh("ip netns exec " + (h == 0 ? h1_ : h2_) + " tc qdisc replace dev " + devs[h] + " root " + qdisc) != 0)
        return false;
    return true;
  };
  const bool delay = shape("netem delay 5ms rate 8mbit");
  if (!delay && !shape("tbf rate 8mbit burst 32kbit latency 2s")) GTEST_SKIP() << "tc cannot shape the veth here; skipped";
  const auto slow = run_all({on(1, rank(0, 2), kDtk + " " + kTrain), on(2, rank(1, 2), kDtk + " " + kTrain)}, 300);
  expect_same_losses(one, fast[0]);
  expect_same_losses(one, slow[0]);
  EXPECT_EQ(slow[1].code, 0) << slow[1].out;
  std::printf("[ timing ] 2 hosts x 1 rank, 4 iterations: %.1f s on the bare veth, %.1f s at 8 Mbit/s%s\n",
              fast[0].seconds, slow[0].seconds, delay ? " + 5 ms delay" : " (no netem here: no added delay)");
}
