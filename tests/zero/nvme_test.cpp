// The zero strategy's disk tier (strategy.offload_optimizer=nvme) end to end, real processes:
//   * losses and norms equal offload_optimizer=cpu's exactly and ddp's (to 1e-5) at DP 1 and 2,
//     with the state streamed in several slices, and with a parameter larger than a slice
//     stepped in pieces (its optimizer state alone larger than the buffer);
//   * checkpoints hold the state in the usual format: a run saved with nvme resumes exactly with
//     cpu offload and the reverse; the swap files are gone after a clean exit, and one left by a
//     killed run (a process that is gone) is removed by the next run, which resumes from the
//     killed run's last checkpoint;
//   * optimizer state larger than a host-memory budget trains with the state on disk: the host
//     memory the optimizer holds (the allocator's count, less the gradient partition) stays under
//     the buffer while a cpu-offload run of the same model holds all of it;
//   * bad inputs are one-line errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "../common/curves.hpp"
#include "../common/printed_lines.hpp"
#include "../common/run_dtk.hpp"
#include "nvme_common.hpp"

namespace fs = std::filesystem;

namespace {

using dtk_test::Curve;
using dtk_test::Result;
using namespace zero_nvme_test;

const std::string kTrain = small_gpt(6);

std::string fresh_dir(const std::string& name) { return dtk_test::fresh_dir(DTK_TEST_TMP, name); }

// nvme with a 1 MiB buffer: the tiny GPT's 135k parameters stream in several slices.
std::string nvme(const std::string& dir, int buffer_mb = 1) {
  return "--set strategy.offload_optimizer=nvme --set strategy.nvme_path=" + dir +
         " --set strategy.nvme_buffer_mb=" + std::to_string(buffer_mb) + " ";
}
const std::string kCpu = "--set strategy.offload_optimizer=cpu ";

Curve curve_of(int nproc, const std::string& args, const std::string& name) {
  return dtk_test::run_curve("launch --nproc_per_node " + std::to_string(nproc) + " " + kTrain + args, DTK_TEST_TMP,
                             name);
}

int slices_of(const std::string& log) {
  std::smatch m;
  return std::regex_search(log, m, std::regex(R"(host buffer in (\d+) slice)")) ? std::stoi(m[1]) : -1;
}

TEST(ZeroNvme, LossesEqualCpuOffloadAndDdp) {
  const std::string zero = "--strategy zero --optimizer cpu_adam --set strategy.reduce_bucket_size=20000 ";
  const std::pair<int, std::string> cases[] = {
      {1, "--set strategy.stage=1 "},
      {2, "--set strategy.stage=2 --set strategy.overlap_comm=true "},
      {2,
       "--set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=100 "
       "--set strategy.offload_param=cpu "},
  };
  for (const auto& [n, stage] : cases) {
    const std::string what = "DP" + std::to_string(n) + " " + stage;
    const std::string dir = fresh_dir("nvme-equal");
    static std::map<int, Curve> ddp_of;  // one ddp run per DP size
    if (!ddp_of.count(n)) ddp_of[n] = curve_of(n, "--strategy ddp --optimizer cpu_adam", "nvme-ddp");
    const Curve& ddp = ddp_of[n];
    const Curve cpu = curve_of(n, zero + stage + kCpu, "nvme-cpu");
    const Curve disk = curve_of(n, zero + stage + nvme(dir), "nvme-disk");
    EXPECT_GT(slices_of(disk.run.out), 1) << what << "\n" << disk.run.out;
    EXPECT_NE(disk.run.out.find("on disk: " + dir + "/dtk-zero-optimizer-"), std::string::npos) << disk.run.out;
    expect_identical(cpu, disk, what + ": nvme against cpu offload");
    dtk_test::expect_same_curve(ddp, disk, 6, what + ": nvme against ddp");
    EXPECT_EQ(swap_files_in(dir), 0) << what << ": swap files left after a clean exit";
  }
}

// A buffer smaller than the largest parameters' state (hidden 256: the MLP's weights of 262k
// elements, the attention's 196k, the embedding's 131k, against a part of 43k elements in each
// half of a 1 MiB buffer): each such parameter is stepped in pieces, one per slice it spans, and the run equals cpu
// offload's exactly; with the parameters on disk too (stage 3, DP 2), each piece's new values go into the parameters'
// swap file at its offset.
TEST(ZeroNvme, ParametersLargerThanASliceStepInPieces) {
  const std::string wide = "--set model.hidden_size=256 --strategy zero --optimizer cpu_adam ";
  const std::string stage3 = "--set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=100 ";
  const std::pair<int, std::string> cases[] = {{1, "--set strategy.stage=1 "}, {2, stage3}};
  for (const auto& [n, stage] : cases) {
    const std::string what = "DP" + std::to_string(n) + " " + stage;
    const bool stage_3 = n == 2;
    const std::string dir = fresh_dir("nvme-pieces");
    const Curve cpu =
        curve_of(n, wide + stage + kCpu + (stage_3 ? "--set strategy.offload_param=cpu " : ""), "nvme-pieces-cpu");
    const Curve disk =
        curve_of(n,
                 wide + stage + nvme(dir) +
                     (stage_3 ? "--set strategy.offload_param=nvme --set strategy.param_buffer_count=3 " : ""),
                 "nvme-pieces-disk");
    EXPECT_NE(disk.run.out.find("larger than a slice, in pieces)"), std::string::npos) << what << "\n" << disk.run.out;
    expect_identical(cpu, disk, what + ": nvme in pieces against cpu offload");
    EXPECT_EQ(swap_files_in(dir), 0) << what << ": swap files left after a clean exit";
  }
}

// A pid that no process has now: a child that has exited and been reaped.
long gone_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

std::string host_name() {
  char h[256] = {0};
  ::gethostname(h, sizeof h - 1);
  return h;
}

// bf16 parameters (fp32 masters saved by the strategy, the moments by the optimizer), stage 2,
// DP 2, hidden 256 (the larger shards stepped in pieces): saved with one offload tier, resumed
// with the other, the printed lines are the uninterrupted run's.
TEST(ZeroNvme, ResumeAcrossCpuAndNvmeOffloadIsExact) {
  const std::string run = kTrain +
                          "--strategy zero --optimizer cpu_adam --set strategy.stage=2 "
                          "--set train.params_dtype=bf16 --set strategy.reduce_bucket_size=20000 "
                          "--set train.train_iters=8 --set model.hidden_size=256 ";  // shards stepped in pieces
  const std::string save = "--set checkpoint.save_interval=4 --set checkpoint.save=";
  const std::string swap = fresh_dir("nvme-resume-swap");
  // A swap file of a killed run on this host (its process is gone) and one of a live process.
  const std::string stale =
      swap + "/dtk-zero-optimizer-" + host_name() + "-" + std::to_string(gone_pid()) + "-dp0-tp0-pp0.swap";
  const std::string live =
      swap + "/dtk-zero-optimizer-" + host_name() + "-" + std::to_string(::getpid()) + "-dp0-tp0-pp0.swap";
  std::ofstream(stale) << "stale";
  std::ofstream(live) << "live";
  const std::string by_nvme = fresh_dir("nvme-saved"), by_cpu = fresh_dir("cpu-saved");
  const Result a = dtk_test::run_dtk("launch --nproc_per_node 2 " + run + nvme(swap) + save + by_nvme);
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_NE(a.out.find("larger than a slice, in pieces)"), std::string::npos) << a.out;
  EXPECT_FALSE(fs::exists(stale)) << "the killed run's swap file is still there";
  // (Which rank removes it is a race, and only rank 0 logs: AKilledRun... checks the log line.)
  EXPECT_TRUE(fs::exists(live)) << "a live process's swap file was removed";
  fs::remove(live);
  EXPECT_EQ(swap_files_in(swap), 0);
  const Result b = dtk_test::run_dtk("launch --nproc_per_node 2 " + run + kCpu + save + by_cpu);
  ASSERT_EQ(b.code, 0) << b.out;
  const auto la = dtk_test::printed_loss_and_norm(a.out), lb = dtk_test::printed_loss_and_norm(b.out);
  ASSERT_EQ(la.size(), 8u) << a.out;
  EXPECT_EQ(la, lb) << "nvme and cpu offload differ";
  resume_from_4(by_nvme);
  resume_from_4(by_cpu);
  const std::pair<std::string, std::string> resumes[] = {
      {"nvme checkpoint, cpu offload", kCpu + "--set checkpoint.load=" + by_nvme},
      {"cpu checkpoint, nvme offload", nvme(swap) + "--set checkpoint.load=" + by_cpu},
      {"nvme checkpoint, nvme offload", nvme(swap) + "--set checkpoint.load=" + by_nvme},
  };
  for (const auto& [what, args] : resumes) {
    const Result r = dtk_test::run_dtk("launch --nproc_per_node 2 " + run + args);
    ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
    const auto lr = dtk_test::printed_loss_and_norm(r.out);
    ASSERT_EQ(lr.size(), 4u) << what << "\n" << r.out;
    for (int it = 5; it <= 8; ++it) EXPECT_EQ(la.at(it), lr.count(it) ? lr.at(it) : "") << what << ", iteration " << it;
  }
}

// A run killed (SIGKILL, mid-training) leaves its last checkpoint loadable and its swap file
// behind; the next run resumes from the checkpoint and removes the file (its process is gone).
TEST(ZeroNvme, AKilledRunLeavesItsCheckpointLoadable) {
  const std::string swap = fresh_dir("nvme-killed-swap"), save = fresh_dir("nvme-killed-save");
  const std::string log = save + "/../nvme-killed.log";
  const std::string args =
      kTrain + "--strategy zero --optimizer cpu_adam --set strategy.stage=2 " + nvme(swap) +
      "--set lr.lr_decay_iters=1000 --set train.train_iters=100000 --set checkpoint.save_interval=2 "
      "--set checkpoint.save=" +
      save;
  const pid_t child = ::fork();
  if (child == 0) {
    ::execl("/bin/sh", "sh", "-c", ("exec " + std::string(DTK_BIN) + " " + args + " > " + log + " 2>&1").c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(child, 0);
  // Killed once a checkpoint is published (bounded: 120 s).
  const std::string tracker = save + "/latest_checkpointed_iteration.txt";
  for (int i = 0; i < 1200 && !fs::exists(tracker); ++i) ::usleep(100 * 1000);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ASSERT_TRUE(fs::exists(tracker)) << "no checkpoint within 120 s";
  ASSERT_EQ(swap_files_in(swap), 1) << "the killed run's swap file";
  const Result r =
      dtk_test::run_dtk(kTrain + "--strategy zero --optimizer cpu_adam --set strategy.stage=2 " + nvme(swap) +
                        "--set lr.lr_decay_iters=1000 --set checkpoint.load=" + save + " --set train.train_iters=12");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("removed " + swap + "/dtk-zero-optimizer-"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("iteration       12/"), std::string::npos) << r.out;
  EXPECT_EQ(swap_files_in(swap), 0);
}

struct HostMemory {
  double gradients = -1, host = -1, host_max = -1;
};

// Rank 0's memory report (MiB).
HostMemory host_memory(const std::string& log) {
  std::smatch m;
  HostMemory out;
  if (std::regex_search(log, m,
                        std::regex(R"(gradients: (\S+) \|.*\| host allocated: (\S+) \| host max allocated: (\S+))"))) {
    out.gradients = std::stod(m[1]), out.host = std::stod(m[2]), out.host_max = std::stod(m[3]);
  }
  return out;
}

int64_t parameter_count(const std::string& log) {
  std::smatch m;
  return std::regex_search(log, m, std::regex(R"(model parallel rank \(0, 0\): (\d+))")) ? std::stoll(m[1]) : -1;
}

// fp32, 3.3 M parameters: 12 bytes of optimizer state per parameter (master, exp_avg, exp_avg_sq)
// are about 38 MiB against a budget of 8 MiB of host buffer. The cpu-offload run of the same
// model holds all of it in host memory; the nvme run holds the gradient partition (which both
// keep) and the buffer. Its peak adds, on the first step only, the moments the optimizer creates
// for one slice before they move into the buffer: two fp32 values per element of a slice, which
// is at most a third of a buffer half (master + exp_avg + exp_avg_sq), so 1/3 of the buffer.
TEST(ZeroNvme, OptimizerStateLargerThanTheHostBudgetTrainsFromDisk) {
  const int budget_mb = 8;
  const std::string model =
      "--strategy zero --optimizer cpu_adam --set strategy.stage=2 --set model.num_layers=4 "
      "--set model.hidden_size=256 --set train.train_iters=3 ";
  const std::string dir = fresh_dir("nvme-budget");
  const Result cpu = dtk_test::run_dtk(kTrain + model + kCpu);
  const Result disk = dtk_test::run_dtk(kTrain + model + nvme(dir, budget_mb));
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  ASSERT_EQ(disk.code, 0) << disk.out;
  const double mib = 1024.0 * 1024.0;
  const double state = 12.0 * static_cast<double>(parameter_count(disk.out)) / mib;
  ASSERT_GT(state, 4.0 * budget_mb) << "the state must exceed the budget well\n" << disk.out;
  const HostMemory c = host_memory(cpu.out), d = host_memory(disk.out);
  ASSERT_GE(c.host, 0) << cpu.out;
  ASSERT_GE(d.host, 0) << disk.out;
  // The gradient partition (fp32, host) is in both; what else the host holds is the optimizer's.
  const double grads = 4.0 * static_cast<double>(parameter_count(disk.out)) / mib;
  EXPECT_GT(c.host - grads, state - 0.1) << "cpu offload holds the whole state\n" << cpu.out;
  EXPECT_LE(d.host - grads, budget_mb + 0.05) << disk.out;
  EXPECT_LE(d.host_max - grads, budget_mb * 4.0 / 3.0 + 0.05) << disk.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(disk.out, m, std::regex(R"(\.swap \((\S+) MB\))"))) << disk.out;
  EXPECT_GE(std::stod(m[1]) + 0.05, state) << "the swap file (MiB) holds the state";
  EXPECT_EQ(dtk_test::printed_loss_and_norm(disk.out), dtk_test::printed_loss_and_norm(cpu.out));
}

TEST(ZeroNvme, BadInputsAreOneLineErrors) {
  const std::string run = kTrain + "--set train.train_iters=3 --strategy zero --optimizer cpu_adam ";
  const std::string dir = fresh_dir("nvme-bad");
  const std::string file = dir + "/a-file";
  std::ofstream(file) << "x";
  const std::pair<std::string, std::string> cases[] = {
      {"--set strategy.offload_optimizer=nvme",
       "zero: offload_optimizer=nvme needs strategy.nvme_path, the directory of the swap files"},
      {"--set strategy.offload_optimizer=cpu --set strategy.nvme_path=" + dir,
       "strategy plugin 'zero': option nvme_path=" + dir +
           " does nothing without offload_optimizer=nvme or offload_param=nvme: drop it, or set "
           "offload_optimizer=nvme or offload_param=nvme"},
      {nvme(dir + "/missing"), "zero: strategy.nvme_path '" + dir + "/missing' does not exist"},
      {nvme(file), "zero: strategy.nvme_path '" + file + "' is not a directory"},
      {nvme("/proc"), "zero: offload_optimizer=nvme: cannot create swap file /proc/dtk-zero-optimizer-"},
      {nvme(dir) + "--set strategy.nvme_buffer_mb=0", "zero: option 'nvme_buffer_mb' must be positive, got 0"},
      {nvme(dir) + "--set strategy.delayed_param_update=true",
       "option delayed_param_update=true does nothing without offload_optimizer=cpu"},
  };
  for (const auto& [args, needle] : cases) dtk_test::expect_one_line_error(dtk_test::run_dtk(run + args, 60), needle);
  // An optimizer without Adam's state cannot be stepped slice by slice: refused at its first step.
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + "--set train.train_iters=3 --strategy zero --optimizer sgd " + nvme(dir), 60),
      "zero: offload_optimizer=nvme steps the optimizer one slice of parameters at a time and needs the Adam "
      "plugins' state (cpu_adam): its state has no 'step'");
  // A disk that cannot hold the swap file (here: a file-size limit of 100 KiB against 1.7 MB).
  dtk_test::expect_one_line_error(run_with_file_limit(run + nvme(dir), 100),
                                  "zero: offload_optimizer=nvme: cannot reserve ");
  EXPECT_EQ(swap_files_in(dir), 0) << "a refused run left its swap file";
}

}  // namespace
