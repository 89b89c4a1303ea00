// The zero strategy end to end through `dtk launch`, real processes over loopback (Gloo):
//   * stages 1, 2, 3, with and without CPU offload, equal the ddp strategy iteration by iteration
//     (lm loss and grad norm within 1e-5, clipping active) at DP=2, DP=4 and TP=2 x DP=2, in fp32
//     and bf16;
//   * checkpoints: exact resume at the same data-parallel size; a DP=4 checkpoint continues at
//     DP=2 and DP=1; state moves between ddp and zero; a missing shard file is one line;
//   * memory: the bytes each rank holds match the ZeRO formulas (12 Psi / N of optimizer state
//     and masters, + gradients / N, + parameters / N), the allocator's count agrees with the
//     strategy's, and offload moves optimizer state and gradients off the device;
//   * bad options are one-line errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "../common/curves.hpp"
#include "../common/memory_report.hpp"
#include "../common/printed_lines.hpp"
#include "../common/run_dtk.hpp"

namespace fs = std::filesystem;

namespace {

using dtk_test::Result;

std::string fresh_dir(const std::string& name) { return dtk_test::fresh_dir(DTK_TEST_TMP, name); }

// A small GPT on synthetic tokens, deterministic (no dropout), gradient clipping active (the
// norms are around 0.8), 20 iterations of 8 samples in micro-batches of 2.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 "
                           "--set model.hidden_dropout=0 --set model.attention_dropout=0 "
                           "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
                           "--set train.micro_batch_size=2 --set train.global_batch_size=8 "
                           "--set train.train_iters=20 --set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 "
                           "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 ";

Result launch(int nproc, const std::string& args, int timeout_s = 300) {
  return dtk_test::run_dtk("launch --nproc_per_node " + std::to_string(nproc) + " " + args, timeout_s);
}

using dtk_test::Curve;
using dtk_test::expect_same_curve;

Curve curve_of(int nproc, const std::string& args, const std::string& name) {
  return dtk_test::run_curve("launch --nproc_per_node " + std::to_string(nproc) + " " + kTrain + args, DTK_TEST_TMP,
                             name);
}

using dtk_test::expect_one_line_error;

using dtk_test::Memory;
using dtk_test::memory_of;

int64_t parameter_count(const std::string& log) {
  std::smatch m;
  return std::regex_search(log, m, std::regex(R"(model parallel rank \(0, 0\): (\d+))")) ? std::stoll(m[1]) : -1;
}

// ---------------------------------------------------------------------------------------------
// zero == ddp
// ---------------------------------------------------------------------------------------------

struct Parallel {
  int nproc;
  const char* name;
  const char* args;
};
const Parallel kLayouts[] = {
    {2, "DP2", ""},
    {4, "DP4", ""},
    {4, "TP2xDP2", "--set distributed.tensor_model_parallel_size=2 "},
};

class ZeroMatchesDdp : public ::testing::TestWithParam<std::tuple<Parallel, const char*>> {};

TEST_P(ZeroMatchesDdp, EveryStageWithAndWithoutOffload) {
  const Parallel& p = std::get<0>(GetParam());
  const std::string dtype = std::get<1>(GetParam());
  const std::string base = std::string(p.args) + "--set train.params_dtype=" + dtype + " ";
  const std::string tag = std::string(p.name) + "-" + dtype;
  const Curve ddp = curve_of(p.nproc, base + "--strategy ddp", tag + "-ddp");
  // Small buckets (several per model) and a persistence threshold that leaves the biases and norm
  // weights whole under stage 3 while the weights come and go.
  const std::string zero = base + "--strategy zero --set strategy.reduce_bucket_size=20000 ";
  const std::string stage3 = "--set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=100 ";
  const std::string offload = "--set strategy.offload_optimizer=cpu --set strategy.overlap_comm=true ";
  const std::pair<const char*, std::string> variants[] = {
      {"stage 1", "--set strategy.stage=1"},
      {"stage 1, reduced during the last backward", "--set strategy.stage=1 --set strategy.overlap_comm=true"},
      {"stage 1 + offload", "--set strategy.stage=1 " + offload},
      {"stage 2", "--set strategy.stage=2"},
      {"stage 2 + offload", "--set strategy.stage=2 " + offload},
      {"stage 3", stage3},
      {"stage 3 + offload of optimizer and parameters, recompute",
       stage3 + "--set strategy.offload_param=cpu --set model.recompute_activations=full " + offload},
  };
  for (const auto& [name, args] : variants) {
    const Curve z = curve_of(p.nproc, zero + args, tag + "-" + name);
    expect_same_curve(ddp, z, 20, tag + " " + name);
    // Stage 1 with overlap_comm issues its reduce-scatters from the hooks of the last backward.
    if (args.rfind("--set strategy.stage=1 ", 0) == 0 && args.find("overlap_comm=true") != std::string::npos)
      EXPECT_NE(z.run.out.find("gradients reduce-scattered during the last micro-batch's backward"), std::string::npos)
          << z.run.out;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ZeroMatchesDdp,
                         ::testing::Combine(::testing::ValuesIn(kLayouts), ::testing::Values("fp32", "bf16")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param);
                         });

// A step whose gradients are not finite is skipped by every stage as by ddp: the host's test hook
// makes iteration 3's gradients infinite; the runs skip it, and go on with equal losses.
TEST(ZeroSkippedSteps, NonFiniteGradientsAreSkippedAsUnderDdp) {
  ::setenv("DTK_TEST_NONFINITE_ITERS", "3", 1);
  const Curve ddp = curve_of(2, "--strategy ddp --set train.params_dtype=bf16", "skip-ddp");
  for (const std::string zero : {"--set strategy.stage=2 --set strategy.offload_optimizer=cpu",
                                 "--set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=0"}) {
    const Curve z = curve_of(2, "--strategy zero --set train.params_dtype=bf16 " + zero, "skip-zero");
    expect_same_curve(ddp, z, 19, "skipped step, zero " + zero);
    EXPECT_EQ(z.loss.count(3), 0u) << "iteration 3 was not skipped";
  }
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
}

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Makes `dir`'s checkpoint at iteration 4 the one to resume from.
void resume_from_4(const std::string& dir) {
  fs::remove_all(dir + "/iter_0000008");
  write(dir + "/latest_checkpointed_iteration.txt", "4\n");
}

const std::string kSave8 = "--set train.train_iters=8 --set checkpoint.save_interval=4 --set checkpoint.save=";

// Same data-parallel size: every rank reads back its own shard file; the printed losses and
// norms are those of the uninterrupted run, dropout included.
TEST(ZeroCheckpoint, ResumeAtTheSameDataParallelSizeIsExact) {
  const std::pair<const char*, std::string> cases[] = {
      {"stage2-offload", "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu "},
      {"stage3-bf16", "--strategy zero --set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=100 "
                      "--set train.params_dtype=bf16 "},
  };
  for (const auto& [name, args] : cases) {
    const std::string d = fresh_dir(std::string("exact-") + name);
    const std::string run = kTrain + args + "--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 ";
    const Result full = launch(2, run + kSave8 + d);
    ASSERT_EQ(full.code, 0) << full.out;
    const std::string rank_dir = d + "/iter_0000004/mp_rank_00/";
    EXPECT_TRUE(fs::is_regular_file(rank_dir + "model_optim_rng.pt"));
    EXPECT_TRUE(fs::is_regular_file(rank_dir + "optim_dp_rank_000.pt"));
    EXPECT_TRUE(fs::is_regular_file(rank_dir + "optim_dp_rank_001.pt"));
    resume_from_4(d);
    const Result resumed = launch(2, run + "--set train.train_iters=8 --set checkpoint.load=" + d);
    ASSERT_EQ(resumed.code, 0) << resumed.out;
    const auto a = dtk_test::printed_loss_and_norm(full.out), b = dtk_test::printed_loss_and_norm(resumed.out);
    ASSERT_EQ(b.size(), 4u) << resumed.out;
    for (int it = 5; it <= 8; ++it) EXPECT_EQ(a.at(it), b.count(it) ? b.at(it) : "") << name << " iteration " << it;
    // The loaded state sits where the trained state sat (offload: the optimizer's in host memory).
    // 0.1 MB: below the smallest state that could be misplaced (the 0.13 MB of parameters), above
    // the transient buffers the first step may still hold when the report is taken (0.06 MB seen
    // once in CI under stage-3 bf16).
    const Memory before = memory_of(full.out), after = memory_of(resumed.out);
    EXPECT_NEAR(after.allocated, before.allocated, 0.1) << name << "\n" << resumed.out;
    EXPECT_NEAR(after.host, before.host, 0.1) << name << "\n" << resumed.out;
  }
}

// A DP=4 checkpoint re-partitioned on load: DP=2 (stage 3 and stage 1) and DP=1 continue the
// uninterrupted DP=4 run (to 1e-5: the gradient averages are summed in another order).
TEST(ZeroCheckpoint, DataParallel4CheckpointContinuesAtOtherSizes) {
  const std::string d = fresh_dir("dp4");
  const std::string stage3 = "--strategy zero --set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=100 "
                             "--set strategy.reduce_bucket_size=20000 --set train.params_dtype=bf16 ";
  const Curve full = curve_of(4, stage3 + kSave8 + d, "dp4-full");
  ASSERT_TRUE(fs::is_regular_file(d + "/iter_0000004/mp_rank_00/optim_dp_rank_003.pt"));
  resume_from_4(d);
  auto tail = [](Curve c) {
    for (int64_t it = 1; it <= 4; ++it) c.loss.erase(it), c.norm.erase(it);
    return c;
  };
  const std::pair<int, std::string> resumes[] = {
      {2, stage3}, {2, "--strategy zero --set strategy.stage=1 --set train.params_dtype=bf16 "}, {1, stage3}};
  for (const auto& [n, args] : resumes)
    expect_same_curve(tail(full),
                      curve_of(n, args + "--set train.train_iters=8 --set checkpoint.load=" + d,
                               "dp4-to-" + std::to_string(n)),
                      4, "DP4 checkpoint resumed at DP" + std::to_string(n) + ": " + args);
}

// State moves between strategies: a ddp checkpoint continues under zero, and a zero one under ddp
// (DeepSpeed needs its offline zero_to_fp32 for the second).
TEST(ZeroCheckpoint, StateMovesBetweenDdpAndZero) {
  const std::string bf16 = "--set train.params_dtype=bf16 ";
  const std::string ddp_dir = fresh_dir("from-ddp"), zero_dir = fresh_dir("from-zero");
  const Curve ddp_full = curve_of(2, bf16 + "--strategy ddp " + kSave8 + ddp_dir, "ddp-full");
  const Curve zero_full =
      curve_of(2, bf16 + "--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=cpu " + kSave8 + zero_dir,
               "zero-full");
  resume_from_4(ddp_dir);
  resume_from_4(zero_dir);
  auto tail = [](Curve c) {
    for (int64_t it = 1; it <= 4; ++it) c.loss.erase(it), c.norm.erase(it);
    return c;
  };
  expect_same_curve(tail(ddp_full),
                    curve_of(4, bf16 + "--strategy zero --set strategy.stage=2 --set train.train_iters=8 "
                                       "--set checkpoint.load=" + ddp_dir,
                             "ddp-to-zero"),
                    4, "ddp DP2 checkpoint under zero stage 2 at DP4");
  expect_same_curve(tail(zero_full),
                    curve_of(1, bf16 + "--strategy ddp --set train.train_iters=8 --set checkpoint.load=" + zero_dir,
                             "zero-to-ddp"),
                    4, "zero stage 3 DP2 checkpoint under ddp at DP1");
}

TEST(ZeroCheckpoint, AMissingShardFileIsOneLineError) {
  const std::string d = fresh_dir("missing");
  const Result saved = launch(2, kTrain + "--strategy zero --set train.train_iters=4 --set checkpoint.save=" + d);
  ASSERT_EQ(saved.code, 0) << saved.out;
  const std::string gone = d + "/iter_0000004/mp_rank_00/optim_dp_rank_001.pt";
  ASSERT_TRUE(fs::remove(gone));
  expect_one_line_error(
      dtk_test::run_dtk(kTrain + "--strategy zero --set train.train_iters=8 --set checkpoint.load=" + d, 120),
      "checkpoint: iteration 4 of " + d + " is incomplete: " + gone + " is missing (listed in SHA256SUMS)");
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

// bf16 parameters, fp32 masters and Adam state: per rank, with Psi parameters and N ranks,
//   ddp      parameters 2 Psi,   gradients 4 Psi (fp32),         masters 4 Psi,   optimizer 8 Psi
//   stage 1  parameters 2 Psi,   gradients 4 Psi + 4 Psi / N,     masters 4 Psi/N, optimizer 8 Psi / N
//   stage 2  parameters 2 Psi,   gradients 4 Psi / N + B,         ...
//   stage 3  parameters 2 Psi/N, gradients 4 Psi / N + B,         ...
// so masters + optimizer state = 12 Psi / N from stage 1 on (the ZeRO paper's K = 12). B is the
// fp32 staging buffer kept for reuse: one gradient bucket, at most 4 x 262,144 bytes here (the
// largest parameter, the MLP's 256 x 1024 weights, is a bucket of its own). The allocator's device
// bytes equal the sum of what is on the device.
// One iteration and no evaluation: the report is taken after iteration 1.
const std::string kMemoryModel =
    "--set model.num_layers=4 --set model.hidden_size=256 --set train.params_dtype=bf16 "
    "--set train.train_iters=1 --set lr.lr_warmup_iters=0 --set eval.eval_iters=0 ";
const std::string kBuckets = " --set strategy.reduce_bucket_size=200000";
constexpr double kStagingMiB = 262144.0 * 4 / (1024 * 1024) + 0.01;

TEST(ZeroMemory, BytesPerRankFollowTheZeroFormulas) {
  const std::string& model = kMemoryModel;
  const double mib = 1024.0 * 1024.0;
  for (int n : {1, 2, 4}) {
    for (int stage : {0, 1, 2, 3}) {
      const std::string strategy =
          stage == 0 ? "--strategy ddp"
                     : "--strategy zero --set strategy.stage=" + std::to_string(stage) +
                           (stage == 3 ? " --set strategy.stage3_param_persistence_threshold=0" : "") + kBuckets;
      const Result r = launch(n, kTrain + model + strategy);
      ASSERT_EQ(r.code, 0) << r.out;
      const double psi = static_cast<double>(parameter_count(r.out)) / mib;  // Mi-parameters
      const Memory m = memory_of(r.out);
      ASSERT_GE(m.allocated, 0) << r.out;
      const std::string what = "DP" + std::to_string(n) + (stage ? " stage " + std::to_string(stage) : " ddp");
      const double by_n = stage == 0 ? 1.0 : 1.0 / n;
      // Bucket padding (N x 16 elements per bucket) and the log's rounding to 0.01 MiB.
      const double slack = 0.02;
      EXPECT_NEAR(m.parameters, stage == 3 ? 2 * psi / n : 2 * psi, slack) << what;
      EXPECT_NEAR(m.masters, 4 * psi * by_n, slack) << what;
      EXPECT_NEAR(m.optimizer, 8 * psi * by_n, slack) << what;
      EXPECT_NEAR(m.masters + m.optimizer, 12 * psi * by_n, 2 * slack) << what << ": 12 Psi / N";
      const double gradients = stage == 0 ? 4 * psi : stage == 1 ? 4 * psi + 4 * psi / n : 4 * psi / n;
      if (stage < 2) {
        EXPECT_NEAR(m.gradients, gradients, slack) << what;
      } else {
        EXPECT_GE(m.gradients, gradients - slack) << what;
        EXPECT_LE(m.gradients, gradients + kStagingMiB) << what;
      }
      EXPECT_NEAR(m.allocated, m.parameters + m.gradients + m.masters + m.optimizer, 0.1) << what << "\n" << r.out;
      EXPECT_NEAR(m.host, 0.0, 0.01) << what;
    }
  }
}

// Offload: the optimizer state, the fp32 masters and the gradient partition live in host memory;
// the device keeps the parameters (stage 1 also its whole fp32 gradient buffer). With
// offload_param the device keeps nothing between steps.
TEST(ZeroMemory, OffloadMovesOptimizerStateAndGradientsToTheHost) {
  const std::string& model = kMemoryModel;
  const double mib = 1024.0 * 1024.0;
  const int n = 2;
  for (int stage : {1, 2, 3}) {
    for (bool offload_param : {false, true}) {
      if (offload_param && stage != 3) continue;
      const Result r = launch(n, kTrain + model + "--strategy zero --set strategy.offload_optimizer=cpu " +
                                     (stage == 3 ? "--set strategy.stage3_param_persistence_threshold=0 " : "") +
                                     "--set strategy.stage=" + std::to_string(stage) +
                                     (offload_param ? " --set strategy.offload_param=cpu" : "") + kBuckets);
      ASSERT_EQ(r.code, 0) << r.out;
      const double psi = static_cast<double>(parameter_count(r.out)) / mib;
      const Memory m = memory_of(r.out);
      const std::string what = "stage " + std::to_string(stage) + (offload_param ? " + offload_param" : "");
      EXPECT_TRUE(m.optimizer_on_host) << what;
      const double host_expected = (8 + 4 + 4) * psi / n + (offload_param ? 2 * psi / n : 0);
      EXPECT_NEAR(m.host, host_expected, 0.05 + 0.01 * host_expected) << what << "\n" << r.out;
      // The device keeps the parameters, stage 1 its whole fp32 gradient, stages 2/3 a staging bucket.
      const double device_expected = (stage == 3 ? (offload_param ? 0 : 2 * psi / n) : 2 * psi) + (stage == 1 ? 4 * psi : 0);
      EXPECT_GE(m.allocated, device_expected - 0.02) << what << "\n" << r.out;
      EXPECT_LE(m.allocated, device_expected + (stage >= 2 ? kStagingMiB : 0) + 0.1) << what << "\n" << r.out;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Partitioned construction (DeepSpeed's zero.Init; strategy.zero_init, on by default for stage 3)
// ---------------------------------------------------------------------------------------------

// Built partitioned, each rank keeps only its shard of every initial value: the losses are the
// whole build's, exactly (the same values reach the same partitions), for gpt (with and without
// parameter offload) and llama.
TEST(ZeroInit, PartitionedConstructionTrainsAsTheWholeBuild) {
  const std::string stage3 = "--set train.params_dtype=bf16 --strategy zero --set strategy.stage=3 "
                             "--set strategy.reduce_bucket_size=20000 --set strategy.stage3_param_persistence_threshold=100 ";
  std::string llama_train = kTrain;
  llama_train.replace(llama_train.find("gpt-tiny.pbtxt"), 14, "llama-tiny.pbtxt");
  auto curve = [&](bool llama, const std::string& args, const std::string& name) {
    return dtk_test::run_curve("launch --nproc_per_node 2 " + (llama ? llama_train : kTrain) + args, DTK_TEST_TMP, name);
  };
  for (const bool llama : {false, true})
    for (const std::string offload : {"", "--set strategy.offload_param=cpu --set strategy.offload_optimizer=cpu "}) {
      if (llama && !offload.empty()) continue;  // the same code path as gpt's
      const std::string what = std::string(llama ? "llama" : "gpt") + (offload.empty() ? "" : " offload");
      const Curve whole = curve(llama, stage3 + offload + "--set strategy.zero_init=false", what + "-whole");
      const Curve parted = curve(llama, stage3 + offload + "--set strategy.zero_init=true", what + "-parted");
      expect_same_curve(whole, parted, 20, what, 0.0);
    }
}

// The point of it: a model whose fp32 parameters alone (38 MB) exceed the device budget (24 MB)
// trains under stage 3 with parameter and optimizer offload, because the device only ever holds a
// couple of gathered modules (max_live_parameters), their gradients, a staging bucket and the
// recomputed layers' inputs (19.4 MB at most here). Built whole first, the same run is refused
// before the model's creation (its parameters alone are over the budget), in one line naming it.
TEST(ZeroInit, AModelLargerThanTheDeviceBudgetTrainsWhenBuiltPartitioned) {
  const std::string run = kTrain +
                          "--set model.num_layers=12 --set model.hidden_size=256 --set train.train_iters=3 "
                          "--set train.memory_limit_mb=24 --optimizer cpu_adam --strategy zero --set strategy.stage=3 "
                          "--set strategy.offload_param=cpu --set strategy.offload_optimizer=cpu "
                          "--set strategy.reduce_bucket_size=1000000 --set model.recompute_activations=full "
                          "--set strategy.stage3_max_live_parameters=2000000 --set strategy.stage3_prefetch_bucket_size=1000000 ";
  const Result parted = dtk_test::run_dtk(run, 300);
  ASSERT_EQ(parted.code, 0) << parted.out;
  const int64_t params = parameter_count(parted.out);
  EXPECT_GT(params * 4, int64_t{24} << 20) << "the model must not fit the budget whole\n" << parted.out;
  EXPECT_NE(parted.out.find("built partitioned (zero_init)"), std::string::npos) << parted.out;
  const Memory m = memory_of(parted.out);
  EXPECT_LE(m.max_allocated, 24.0) << parted.out;
  const Result whole = dtk_test::run_dtk(run + "--set strategy.zero_init=false", 300);
  expect_one_line_error(whole, "of parameters on this rank before gradients, optimizer state or activations, more "
                               "than the 24 MB of train.memory_limit_mb");
}

// ---------------------------------------------------------------------------------------------
// Delayed parameter update (ZeRO-Offload's DPU)
// ---------------------------------------------------------------------------------------------

// strategy.delayed_param_update: iteration 1's step is immediate, from iteration 2 on the step of
// iteration t is applied during iteration t+1, so iteration t+1 computes on the parameters of t-1.
// Expected, exactly: iterations 1 and 2 equal the undelayed run; iteration 3 computes on the
// parameters after step 1 only, which is what an undelayed run whose step 2 is skipped computes
// there (the skipped-step hook). Checkpoints complete the step in flight, so a resumed run prints
// the uninterrupted run's lines.
TEST(ZeroDelayedUpdate, OneStepStaleAndResumesExactly) {
  const std::string zero = "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu "
                           "--set strategy.reduce_bucket_size=20000 --set train.train_iters=8 ";
  const std::string delayed = zero + "--set strategy.delayed_param_update=true ";
  const Curve plain = curve_of(2, zero, "dpu-plain");
  ::setenv("DTK_TEST_NONFINITE_ITERS", "2", 1);
  const Curve skip2 = curve_of(2, zero, "dpu-skip2");
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  const std::string d = fresh_dir("dpu-ckpt");
  const Curve dpu = curve_of(2, delayed + "--set checkpoint.save_interval=4 --set checkpoint.save=" + d, "dpu");
  ASSERT_EQ(dpu.loss.size(), 8u) << dpu.run.out;
  ASSERT_EQ(plain.loss.size(), 8u) << plain.run.out;
  EXPECT_NE(dpu.run.out.find("delayed parameter update"), std::string::npos) << dpu.run.out;
  for (int it : {1, 2}) {
    EXPECT_EQ(dpu.loss.at(it), plain.loss.at(it)) << "iteration " << it;
    EXPECT_EQ(dpu.norm.at(it), plain.norm.at(it)) << "iteration " << it;
  }
  EXPECT_NE(dpu.loss.at(3), plain.loss.at(3)) << "iteration 3 did not compute on stale parameters";
  ASSERT_EQ(skip2.loss.count(3), 1u) << skip2.run.out;
  EXPECT_EQ(dpu.loss.at(3), skip2.loss.at(3)) << "iteration 3: not the parameters after step 1";
  EXPECT_EQ(dpu.norm.at(3), skip2.norm.at(3));
  for (const auto& [it, loss] : dpu.loss) {
    EXPECT_TRUE(std::isfinite(loss)) << it;
    EXPECT_NEAR(loss, plain.loss.at(it), 0.05 * plain.loss.at(it)) << "iteration " << it;
  }
  resume_from_4(d);
  const Result resumed = launch(2, kTrain + delayed + "--set checkpoint.load=" + d);
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const auto a = dtk_test::printed_loss_and_norm(dpu.run.out), b = dtk_test::printed_loss_and_norm(resumed.out);
  ASSERT_EQ(b.size(), 4u) << resumed.out;
  for (int it = 5; it <= 8; ++it) EXPECT_EQ(a.at(it), b.count(it) ? b.at(it) : "") << "iteration " << it;
}

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

TEST(ZeroOptions, BadOptionsAreOneLineErrors) {
  const std::string run = kTrain + "--set train.train_iters=3 --strategy zero ";
  const std::pair<std::string, std::string> cases[] = {
      {"--set strategy.stage=0", "zero: stage 0 partitions nothing; use the ddp strategy (--strategy ddp)"},
      {"--set strategy.stage=4", "zero: option 'stage' must be 1, 2 or 3, got 4"},
      {"--set strategy.stage=2 --set strategy.offload_param=cpu",
       "strategy plugin 'zero': option offload_param=cpu does nothing without stage=3: drop it, or set stage=3"},
      {"--set strategy.contiguous_gradients=false", "zero: contiguous_gradients=false is not supported"},
      {"--set strategy.reduce_bucket_size=0", "zero: option 'reduce_bucket_size' must be positive, got 0"},
      {"--set strategy.offload_optimizer=nvme", "zero: offload_optimizer=nvme needs strategy.nvme_path"},
      {"--set strategy.delayed_param_update=true",
       "option delayed_param_update=true does nothing without offload_optimizer=cpu"},
      // Options that act only with another setting (DeepSpeed ignores them silently).
      {"--set strategy.stage=2 --set strategy.stage3_max_live_parameters=100",
       "option stage3_max_live_parameters=100 does nothing without stage=3"},
      {"--set strategy.stage=3 --set strategy.overlap_param_gather=true",
       "option overlap_param_gather=true does nothing without stage=1 or 2: drop it, or set stage=1 or 2"},
      {"--set strategy.zero_init=false", "option zero_init=false does nothing without stage=3"},
      {"--set strategy.reduce_in_flight_size=1000",
       "option reduce_in_flight_size=1000 does nothing without "
       "overlap_comm=true"},
      {"--set strategy.offload_optimizer=cpu --set strategy.nvme_buffer_mb=8",
       "option nvme_buffer_mb=8 does nothing without offload_optimizer=nvme"},
      {"--set strategy.stage=3 --set strategy.offload_optimizer=cpu --set strategy.offload_param=cpu "
       "--set strategy.param_buffer_count=3",
       "option param_buffer_count=3 does nothing without offload_param=nvme"},
      {"--set strategy.nvme_path=/tmp",
       "option nvme_path=/tmp does nothing without offload_optimizer=nvme or offload_param=nvme"},
  };
  for (const auto& [args, needle] : cases) expect_one_line_error(dtk_test::run_dtk(run + args, 60), needle);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ABI compatibility
// ---------------------------------------------------------------------------------------------

// A strategy table of ABI 2.0's size has no get_info, gather_parameters or memory_usage: the host
// treats its state as replicated (one checkpoint file, as before 2.1), never calls beyond the
// table, and the run equals the ddp plugin's; its checkpoint resumes exactly.
TEST(ZeroAbi, AStrategyOfAbi20StillTrainsAndCheckpoints) {
  const std::string plugin = "--plugin_path " DTK_ZERO_TEST_PLUGIN_DIR " --strategy strategy_v2_0 ";
  const Curve ddp = curve_of(2, "--strategy ddp", "v20-ddp");
  const Curve v20 = curve_of(2, plugin, "v20");
  expect_same_curve(ddp, v20, 20, "2.0-sized strategy table");
  const std::string d = fresh_dir("v20-ckpt");
  const Result full = launch(2, kTrain + plugin + kSave8 + d);
  ASSERT_EQ(full.code, 0) << full.out;
  EXPECT_TRUE(fs::is_regular_file(d + "/iter_0000004/mp_rank_00/model_optim_rng.pt"));
  EXPECT_FALSE(fs::exists(d + "/iter_0000004/mp_rank_00/optim_dp_rank_000.pt"));
  EXPECT_NE(full.out.find("parameters: 0.00 | gradients: 0.00 | fp32 masters: 0.00"), std::string::npos)
      << "a 2.0 strategy reports no memory of its own\n" << full.out;
  resume_from_4(d);
  const Result resumed = launch(2, kTrain + plugin + "--set train.train_iters=8 --set checkpoint.load=" + d);
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const auto a = dtk_test::printed_loss_and_norm(full.out), b = dtk_test::printed_loss_and_norm(resumed.out);
  for (int it = 5; it <= 8; ++it) EXPECT_EQ(a.at(it), b.count(it) ? b.at(it) : "") << "iteration " << it;
}
