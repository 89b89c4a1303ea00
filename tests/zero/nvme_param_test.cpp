// The zero strategy's parameter disk tier (strategy.offload_param=nvme, stage 3) end to end, real
// processes:
//   * losses and grad norms identical (tolerance 0) to offload_param=cpu at DP 2 (and DP 1): gpt in
//     fp32 and bf16, llama, with offload_optimizer=cpu and =nvme, with full recompute, built
//     partitioned and whole; the reads are prefetched ahead of use, the swap files gone at exit;
//   * a checkpoint saved at iteration 4 resumes to the uninterrupted run's lines, with parameters
//     on disk or in host memory; a killed run leaves its checkpoint loadable;
//   * the host memory the parameters take is the buffers', not the partition's (the strategy's
//     count and the allocator's agree);
//   * bad inputs are one-line errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
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

const std::string kTrain = small_gpt(12);

// Stage 3 in buckets of 20k elements (several per layer); on disk, three parameter buffers: chunks
// are evicted and read again within every forward and backward.
const std::string kStage3 =
    "--strategy zero --optimizer cpu_adam --set strategy.stage=3 --set strategy.reduce_bucket_size=20000 "
    "--set strategy.stage3_param_persistence_threshold=100 ";

std::string fresh_dir(const std::string& name) { return dtk_test::fresh_dir(DTK_TEST_TMP, name); }

std::string llama(std::string args) {
  args.replace(args.find("gpt-tiny.pbtxt"), 14, "llama-tiny.pbtxt");
  return args;
}

std::string params_on_disk(const std::string& dir) {
  return "--set strategy.offload_param=nvme --set strategy.nvme_path=" + dir + " --set strategy.param_buffer_count=3 ";
}
const std::string kParamsOnHost = "--set strategy.offload_param=cpu ";

// "parameter swap: R chunk reads (P of them ahead of use), ..." (rank 0, at exit).
std::pair<int, int> reads_of(const std::string& log) {
  std::smatch m;
  if (!std::regex_search(log, m, std::regex(R"(parameter swap: (\d+) chunk reads \((\d+) of them ahead of use\))")))
    return {-1, -1};
  return {std::stoi(m[1]), std::stoi(m[2])};
}

TEST(ZeroNvmeParams, LossesEqualParametersInHostMemory) {
  struct Case {
    int nproc;
    bool llama;
    std::string args;
  };
  const std::string recompute = "--set model.recompute_activations=full ";
  const std::string bf16 = "--set train.params_dtype=bf16 ";
  const Case cases[] = {
      {2, false, "--set strategy.offload_optimizer=cpu " + recompute},
      {2, false, bf16 + "--set strategy.offload_optimizer=cpu "},
      {2, false, bf16 + "--set strategy.offload_optimizer=cpu --set strategy.zero_init=false "},
      {2, false, bf16 + "--set strategy.offload_optimizer=nvme --set strategy.nvme_buffer_mb=1 " + recompute},
      {2, true, bf16 + "--set strategy.offload_optimizer=nvme --set strategy.nvme_buffer_mb=1 " + recompute},
      {1, false, "--set strategy.offload_optimizer=nvme --set strategy.nvme_buffer_mb=1 "},
  };
  for (const Case& c : cases) {
    const std::string what = "DP" + std::to_string(c.nproc) + (c.llama ? " llama " : " gpt ") + c.args;
    const std::string dir = fresh_dir("nvme-params-equal");
    const std::string train = "launch --nproc_per_node " + std::to_string(c.nproc) + " " +
                              (c.llama ? llama(kTrain) : kTrain) + kStage3 + c.args;
    // (offload_optimizer=nvme needs nvme_path in both runs: the same directory.)
    const bool optimizer_on_disk = c.args.find("offload_optimizer=nvme") != std::string::npos;
    const Curve host =
        dtk_test::run_curve(train + kParamsOnHost + (optimizer_on_disk ? "--set strategy.nvme_path=" + dir : ""),
                            DTK_TEST_TMP, "nvme-params-host");
    const Curve disk = dtk_test::run_curve(train + params_on_disk(dir), DTK_TEST_TMP, "nvme-params-disk");
    ASSERT_EQ(disk.run.code, 0) << what << "\n" << disk.run.out;
    EXPECT_NE(disk.run.out.find("on disk: " + dir + "/dtk-zero-params-"), std::string::npos) << disk.run.out;
    expect_identical(host, disk, what + ": parameters on disk against in host memory");
    const auto [reads, ahead] = reads_of(disk.run.out);
    EXPECT_GT(reads, 0) << what << "\n" << disk.run.out;
    EXPECT_GT(ahead, 0) << what << ": no read was prefetched\n" << disk.run.out;
    EXPECT_EQ(swap_files_in(dir), 0) << what << ": swap files left after a clean exit";
  }
}

// bf16, DP 2, parameters and optimizer on disk: saved at 4 and 8; resumed from 4 with the same
// tiers and with everything in host memory, iterations 5-8 print the uninterrupted run's lines.
TEST(ZeroNvmeParams, ResumeIsExact) {
  const std::string swap = fresh_dir("nvme-params-resume-swap"), saved = fresh_dir("nvme-params-saved");
  const std::string run =
      "launch --nproc_per_node 2 " + kTrain + kStage3 +
      "--set train.params_dtype=bf16 --set train.train_iters=8 --set model.recompute_activations=full ";
  const std::string disk =
      params_on_disk(swap) + "--set strategy.offload_optimizer=nvme --set strategy.nvme_buffer_mb=1 ";
  const Result a = dtk_test::run_dtk(run + disk + "--set checkpoint.save_interval=4 --set checkpoint.save=" + saved);
  ASSERT_EQ(a.code, 0) << a.out;
  const auto full = dtk_test::printed_loss_and_norm(a.out);
  ASSERT_EQ(full.size(), 8u) << a.out;
  resume_from_4(saved);
  const std::pair<std::string, std::string> resumes[] = {
      {"parameters and optimizer on disk", disk},
      {"parameters and optimizer in host memory", kParamsOnHost + "--set strategy.offload_optimizer=cpu "},
  };
  for (const auto& [what, args] : resumes) {
    const Result r = dtk_test::run_dtk(run + args + "--set checkpoint.load=" + saved);
    ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
    const auto lr = dtk_test::printed_loss_and_norm(r.out);
    ASSERT_EQ(lr.size(), 4u) << what << "\n" << r.out;
    for (int it = 5; it <= 8; ++it)
      EXPECT_EQ(full.at(it), lr.count(it) ? lr.at(it) : "") << what << ", iteration " << it;
  }
  EXPECT_EQ(swap_files_in(swap), 0);
}

// Killed (SIGKILL) after its first checkpoint: the checkpoint loads, the swap file left behind is
// removed by the next run (its process is gone), which trains on.
TEST(ZeroNvmeParams, AKilledRunLeavesItsCheckpointLoadable) {
  const std::string swap = fresh_dir("nvme-params-killed-swap"), save = fresh_dir("nvme-params-killed-save");
  const std::string log = save + "/../nvme-params-killed.log";
  const std::string run = kTrain + kStage3 + "--set strategy.offload_optimizer=cpu " + params_on_disk(swap) +
                          "--set lr.lr_decay_iters=1000 ";
  const std::string args =
      run + "--set train.train_iters=100000 --set checkpoint.save_interval=2 --set checkpoint.save=" + save;
  const pid_t child = ::fork();
  if (child == 0) {
    ::execl("/bin/sh", "sh", "-c", ("exec " + std::string(DTK_BIN) + " " + args + " > " + log + " 2>&1").c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(child, 0);
  const std::string tracker = save + "/latest_checkpointed_iteration.txt";
  for (int i = 0; i < 1200 && !fs::exists(tracker); ++i) ::usleep(100 * 1000);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ASSERT_TRUE(fs::exists(tracker)) << "no checkpoint within 120 s";
  ASSERT_EQ(swap_files_in(swap), 1) << "the killed run's swap file";
  const Result r = dtk_test::run_dtk(run + "--set checkpoint.load=" + save + " --set train.train_iters=12");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("removed " + swap + "/dtk-zero-params-"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("iteration       12/"), std::string::npos) << r.out;
  EXPECT_EQ(swap_files_in(swap), 0);
}

struct Memory {
  double parameters = -1, host = -1, host_max = -1;
};

Memory memory_of(const std::string& log) {
  Memory m;
  std::smatch s;
  if (std::regex_search(log, s, std::regex(R"(\| parameters: (\S+) \|)"))) m.parameters = std::stod(s[1]);
  if (std::regex_search(log, s, std::regex(R"(host allocated: (\S+) \| host max allocated: (\S+))")))
    m.host = std::stod(s[1]), m.host_max = std::stod(s[2]);
  return m;
}

// bf16, 3.3 M parameters, one process: the partition is 6.3 MiB of bf16 values; with
// offload_param=nvme the host holds three buffers of one 200k-element chunk (1.1 MiB) instead. The
// strategy's count (`parameters`) is the buffers', and the allocator's host bytes are lower than
// the offload_param=cpu run's by the partition less the buffers, at the end of a step and at peak.
TEST(ZeroNvmeParams, HostMemoryOfTheParametersIsTheBuffers) {
  const std::string dir = fresh_dir("nvme-params-memory");
  const std::string run =
      kTrain +
      "--strategy zero --optimizer cpu_adam --set strategy.stage=3 --set model.num_layers=4 "
      "--set model.hidden_size=256 --set train.params_dtype=bf16 --set train.train_iters=3 "
      "--set strategy.reduce_bucket_size=200000 --set strategy.stage3_param_persistence_threshold=0 "
      "--set strategy.offload_optimizer=cpu ";
  const Result host = dtk_test::run_dtk(run + kParamsOnHost);
  const Result disk = dtk_test::run_dtk(run + params_on_disk(dir));
  ASSERT_EQ(host.code, 0) << host.out;
  ASSERT_EQ(disk.code, 0) << disk.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      disk.out, m,
      std::regex(R"(parameters \(this rank's partition, (\S+) MB\) on disk: .* MB of host buffer \((\S+) MB\))")))
      << disk.out;
  const double partition = std::stod(m[1]), buffers = std::stod(m[2]);
  EXPECT_GT(partition, 6.0) << disk.out;
  EXPECT_LT(buffers, partition / 4) << "the buffers must be well under the partition\n" << disk.out;
  const Memory h = memory_of(host.out), d = memory_of(disk.out);
  ASSERT_GE(h.host, 0) << host.out;
  ASSERT_GE(d.host, 0) << disk.out;
  EXPECT_NEAR(h.parameters, partition, 0.02) << host.out;
  EXPECT_NEAR(d.parameters, buffers, 0.02) << "the strategy's count of parameter bytes\n" << disk.out;
  EXPECT_NEAR(h.host - d.host, partition - buffers, 0.05) << host.out << "\n" << disk.out;
  EXPECT_GE(h.host_max - d.host_max, partition - buffers - 0.05) << host.out << "\n" << disk.out;
  EXPECT_EQ(dtk_test::printed_loss_and_norm(disk.out), dtk_test::printed_loss_and_norm(host.out));
}

TEST(ZeroNvmeParams, BadInputsAreOneLineErrors) {
  const std::string run = kTrain + "--set train.train_iters=3 --strategy zero --optimizer cpu_adam ";
  const std::string stage3 =
      "--set strategy.stage=3 --set strategy.offload_optimizer=cpu --set "
      "strategy.stage3_param_persistence_threshold=0 ";
  const std::string dir = fresh_dir("nvme-params-bad");
  const std::string file = dir + "/a-file";
  std::ofstream(file) << "x";
  const std::pair<std::string, std::string> cases[] = {
      {stage3 + "--set strategy.offload_param=nvme",
       "zero: offload_param=nvme needs strategy.nvme_path, the directory of the swap files"},
      {"--set strategy.stage=2 --set strategy.offload_optimizer=cpu " + params_on_disk(dir),
       "strategy plugin 'zero': option offload_param=nvme does nothing without stage=3: drop it, or set stage=3"},
      {"--set strategy.stage=3 " + params_on_disk(dir), "zero: offload_param=nvme needs offload_optimizer=cpu or nvme"},
      {stage3 + params_on_disk(dir) + "--set strategy.param_buffer_count=1",
       "zero: option 'param_buffer_count' must be at least 2, got 1"},
      {stage3 + params_on_disk(dir) + "--set strategy.delayed_param_update=true",
       "zero: delayed_param_update is not available with offload_param=nvme"},
      {stage3 + params_on_disk(dir + "/missing"), "zero: strategy.nvme_path '" + dir + "/missing' does not exist"},
      {stage3 + params_on_disk(file), "zero: strategy.nvme_path '" + file + "' is not a directory"},
      {stage3 + params_on_disk("/proc"), "zero: offload_param=nvme: cannot create swap file /proc/dtk-zero-params-"},
      {stage3 + "--set strategy.nvme_path=" + dir,
       "option nvme_path=" + dir + " does nothing without offload_optimizer=nvme or offload_param=nvme"},
  };
  for (const auto& [args, needle] : cases) dtk_test::expect_one_line_error(dtk_test::run_dtk(run + args, 60), needle);
  // A disk that cannot hold the partition (a file-size limit of 100 KiB against 0.5 MB).
  dtk_test::expect_one_line_error(run_with_file_limit(run + stage3 + params_on_disk(dir), 100),
                                  "zero: offload_param=nvme: cannot reserve ");
  EXPECT_EQ(swap_files_in(dir), 0) << "a refused run left its swap file";
}

}  // namespace
