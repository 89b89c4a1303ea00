// The Trainer's parts on their own: batch plan (Megatron's batch sizes and sampler), metric
// averaging, and the learning-rate schedule object over the config.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "dtk/core/config/config.hpp"
#include "dtk/core/device/step_capture.hpp"
#include "dtk/core/logging/progress_log.hpp"
#include "dtk/core/logging/training_log.hpp"
#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/sample_order.hpp"
#include "dtk/host/error.hpp"

using dtk::core::BatchPlan;
using dtk::core::Topology;

namespace {

dtk::config::RunConfig config(int64_t mbs, int64_t gbs, int64_t iters) {
  dtk::config::RunConfig cfg = dtk::core::default_config();
  cfg.mutable_train()->set_micro_batch_size(mbs);
  cfg.mutable_train()->set_global_batch_size(gbs);
  cfg.mutable_train()->set_train_iters(iters);
  return cfg;
}

// When this test program's static objects were made: after its exec, before any test ran.
const std::chrono::steady_clock::time_point kProgramLoaded = std::chrono::steady_clock::now();

Topology data_parallel(int rank, int size) {
  Topology t;
  t.world_rank = t.dp_rank = rank;
  t.world_size = t.dp_size = size;
  return t;
}

}  // namespace

// Megatron's MegatronPretrainingSampler: global batch k is samples [k*gbs, (k+1)*gbs); within it,
// micro-batch m of DP rank r is the rows m*mbs*dp + r*mbs + j.
TEST(BatchPlan, SamplerMatchesMegatron) {
  const auto cfg = config(/*mbs=*/2, /*gbs=*/8, /*iters=*/10);
  const BatchPlan plan(cfg, data_parallel(1, 2));
  EXPECT_EQ(plan.micro_batches_per_step(), 2);
  const dtk::core::SampleOrder rank1(dtk::core::SamplerChoice{}, 100, 2, /*dp_rank=*/1, /*dp_size=*/2);
  EXPECT_EQ(rank1.index(0, 0, 0), 2);
  EXPECT_EQ(rank1.index(0, 0, 1), 3);
  EXPECT_EQ(rank1.index(0, 1, 0), 6);
  EXPECT_EQ(rank1.index(0, 2, 1), 11);                        // next global batch
  EXPECT_EQ(rank1.index(plan.consumed_before(6), 0, 0), 42);  // resumed after 5 global batches
  // Over one step the two ranks together take every sample of the global batch exactly once.
  const dtk::core::SampleOrder rank0(dtk::core::SamplerChoice{}, 100, 2, 0, 2);
  std::set<int64_t> seen;
  for (const dtk::core::SampleOrder* o : {&rank0, &rank1})
    for (int64_t k = 0; k < plan.micro_batches_per_step(); ++k)
      for (int64_t j = 0; j < plan.micro_batch_size(); ++j)
        EXPECT_TRUE(seen.insert(o->index(plan.consumed_before(4), k, j)).second);
  EXPECT_EQ(seen.size(), 8u);
  EXPECT_EQ(*seen.begin(), 24);
  EXPECT_EQ(*seen.rbegin(), 31);
}

TEST(BatchPlan, SampleCountsPerSplit) {
  auto cfg = config(2, 8, 10);
  cfg.mutable_eval()->set_eval_interval(4);
  cfg.mutable_eval()->set_eval_iters(3);
  const BatchPlan plan(cfg, data_parallel(0, 1));
  EXPECT_EQ(plan.train_samples(), 80);
  EXPECT_EQ(plan.valid_samples(), (10 / 4 + 1) * 3 * 8);  // every eval_interval, and at the end
  EXPECT_EQ(plan.test_samples(), 3 * 8);
  // No global batch given: one micro-batch per data-parallel rank.
  const BatchPlan implicit(config(4, 0, 1), data_parallel(0, 2));
  EXPECT_EQ(implicit.global_batch_size(), 8);
  EXPECT_EQ(implicit.micro_batches_per_step(), 1);
  EXPECT_EQ(plan.requested_train_samples(), 80);
  // Sized in samples: 100 samples are 12 global batches of 8 (96 read); the train split is asked
  // for the 100 (Megatron's train_val_test_num_samples, part of its dataset caches' names).
  auto samples = config(2, 8, 0);
  samples.mutable_train()->set_train_samples(100);
  const BatchPlan by_samples(samples, data_parallel(0, 1));
  EXPECT_EQ(by_samples.train_iters(), 12);
  EXPECT_EQ(by_samples.train_samples(), 96);
  EXPECT_EQ(by_samples.requested_train_samples(), 100);
}

// Megatron-DeepSpeed's --train-tokens: the loop ends after the first iteration whose tokens
// reach it (its condition is checked before each iteration), with or without a ramp-up; the run's
// length (data, schedules) stays train_iters.
TEST(BatchPlan, TrainTokensEndTheRunAtTheIterationThatReachesThem) {
  auto cfg = config(2, 8, 10);
  cfg.mutable_train()->set_seq_length(16);  // 128 tokens per iteration
  EXPECT_EQ(BatchPlan(cfg, data_parallel(0, 1)).final_iteration(), 10);
  cfg.mutable_train()->set_train_tokens(640);  // exactly 5 iterations
  BatchPlan five(cfg, data_parallel(0, 1));
  EXPECT_EQ(five.final_iteration(), 5);
  EXPECT_TRUE(five.ends_on_tokens());
  EXPECT_EQ(five.train_iters(), 10);
  EXPECT_EQ(five.train_samples(), 80);
  EXPECT_EQ(five.tokens_before(6), 640);
  cfg.mutable_train()->set_train_tokens(641);  // one token more: one more iteration
  EXPECT_EQ(BatchPlan(cfg, data_parallel(0, 1)).final_iteration(), 6);
  cfg.mutable_train()->set_train_tokens(1);
  EXPECT_EQ(BatchPlan(cfg, data_parallel(0, 1)).final_iteration(), 1);
  cfg.mutable_train()->set_train_tokens(100000);  // beyond the run: train_iters ends it
  EXPECT_FALSE(BatchPlan(cfg, data_parallel(0, 1)).ends_on_tokens());
  // The loop validates after iteration 5, the last, as after any multiple of eval_interval (as
  // Megatron's loop); the run's final validation follows it.
  cfg.mutable_train()->set_train_tokens(640);
  cfg.mutable_eval()->set_eval_interval(5);
  EXPECT_TRUE(BatchPlan(cfg, data_parallel(0, 1)).validates_after(5));
  EXPECT_FALSE(BatchPlan(cfg, data_parallel(0, 1)).validates_after(4));
  EXPECT_EQ(BatchPlan(cfg, data_parallel(0, 1)).validations_through(5), 1);
  // During and after a ramp-up (Megatron's "2 2 12": global batches 2, 2, 4, 6, then 8): every token
  // count ends the run at the iteration whose tokens first reach it.
  auto ramp = config(2, 8, 0);
  ramp.mutable_train()->set_train_samples(60);
  ramp.mutable_train()->set_rampup_batch_size("2 2 12");
  ramp.mutable_train()->set_seq_length(10);
  for (int64_t tokens = 1; tokens <= 700; ++tokens) {
    ramp.mutable_train()->set_train_tokens(tokens);
    const BatchPlan plan(ramp, data_parallel(0, 1));
    const int64_t end = plan.final_iteration();
    EXPECT_LT(plan.tokens_before(end), tokens) << tokens << " tokens";
    if (end < plan.train_iters()) EXPECT_GE(plan.tokens_before(end + 1), tokens) << tokens << " tokens";
  }
  EXPECT_EQ(BatchPlan(ramp, data_parallel(0, 1)).global_batch_of(3), 4);
}

TEST(BatchPlan, InconsistentSizesAreOneLineErrors) {
  try {
    BatchPlan(config(3, 8, 1), data_parallel(0, 2));
    FAIL() << "expected a HostError";
  } catch (const dtk::host::HostError& e) {
    EXPECT_STREQ(e.what(), "config: global_batch_size 8 is not divisible by micro_batch_size x data-parallel size = 6");
  }
  EXPECT_THROW(BatchPlan(config(1, int64_t{1} << 35, int64_t{1} << 20), data_parallel(0, 1)), dtk::host::HostError);
}

TEST(MetricAverager, MeansAndMergeKeepFirstSeenOrder) {
  dtk::core::MetricAverager a, b;
  a.add({{"lm loss", 2.0}, {"aux", 1.0}});
  a.add({{"lm loss", 4.0}});
  b.add({{"aux", 3.0}, {"z", 5.0}});
  a.merge(b);
  EXPECT_DOUBLE_EQ(a.mean("lm loss"), 3.0);
  EXPECT_DOUBLE_EQ(a.mean("aux"), 2.0);
  EXPECT_DOUBLE_EQ(a.mean("z"), 5.0);
  EXPECT_TRUE(std::isnan(a.mean("missing")));
  EXPECT_EQ(a.names(), (std::vector<std::string>{"lm loss", "aux", "z"}));
  a.clear();
  EXPECT_TRUE(a.names().empty());
}

// ABI 2.5's metrics as tensors: summed where they are, read by the first mean, in order.
TEST(MetricAverager, TensorValuesAreSummedWhereTheyAreAndReadWhenAsked) {
  dtk::core::MetricAverager a, b;
  dtk::core::StepMetrics m1, m2, m3;
  m1.values = {{"aux", 1.0}};
  m1.tensors = {{"lm loss", at::tensor(2.0f)}};
  m2.tensors = {{"lm loss", at::tensor(4.5f)}};
  m3.tensors = {{"lm loss", at::tensor(0.5f)}, {"z", at::tensor(7.0)}};
  a.add(m1);
  a.add(m2);
  b.add(m3);
  EXPECT_DOUBLE_EQ(a.mean("lm loss"), 3.25);
  a.add(m2);  // after a read: summed on again
  a.merge(b);
  EXPECT_DOUBLE_EQ(a.mean("lm loss"), (2.0 + 4.5 + 4.5 + 0.5) / 4);
  EXPECT_DOUBLE_EQ(a.mean("aux"), 1.0);
  EXPECT_DOUBLE_EQ(a.mean("z"), 7.0);
  EXPECT_EQ(a.names(), (std::vector<std::string>{"aux", "lm loss", "z"}));
  a.clear();
  EXPECT_TRUE(a.names().empty());
}

// ABI 2.8's ratio metrics ([numerator, denominator]): the sum of the numerators over the sum of the
// denominators, through merge and next to plain values; any other size is refused by name.
TEST(MetricAverager, RatioMetricsDivideTheirSums) {
  dtk::core::MetricAverager a, b;
  dtk::core::StepMetrics m1, m2, m3;
  m1.tensors = {{"lm loss", at::tensor({6.0f, 2.0f})}, {"aux", at::tensor(1.0)}};
  m2.tensors = {{"lm loss", at::tensor({10.0f, 6.0f})}, {"aux", at::tensor(3.0)}};
  m3.tensors = {{"lm loss", at::tensor({4.0f, 0.0f})}};
  a.add(m1);
  a.add(m2);
  EXPECT_DOUBLE_EQ(a.mean("lm loss"), 16.0 / 8.0);  // not the mean of 3 and 5/3
  EXPECT_DOUBLE_EQ(a.mean("aux"), 2.0);
  b.add(m3);
  a.merge(b);
  EXPECT_DOUBLE_EQ(a.mean("lm loss"), 20.0 / 8.0);
  dtk::core::StepMetrics bad;
  bad.tensors = {{"lm loss", at::zeros({3})}};
  try {
    a.add(bad);
    FAIL() << "a 3-element metric was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("metric 'lm loss' as 3 values"), std::string::npos) << e.what();
  }
}

// train.cuda_graphs' CPU probe: a replay that reads a device value on the host fails, naming the
// count; capturing() is on while a Recording lives (the schedule's body holds one) and off after.
TEST(StepCaptureProbe, AReplayThatReadsOnTheHostFails) {
  auto probe = dtk::core::make_probe_recorder();
  bool seen = false;
  probe->replay([&] {
    dtk::core::capture::Recording recording;
    seen = dtk::core::capture::extension()->capturing() != 0;
    (void)(at::ones({4}) * 2).sum();  // device work without a read: fine
  });
  EXPECT_TRUE(seen);
  EXPECT_EQ(dtk::core::capture::extension()->capturing(), 0);
  try {
    probe->replay([] {
      dtk::core::capture::Recording recording;
      (void)at::ones({4}).sum().item<float>();
      (void)at::ones({4}).max().item<float>();
    });
    FAIL() << "expected a HostError";
  } catch (const dtk::host::HostError& e) {
    EXPECT_NE(std::string(e.what()).find("read device values on the host 2 time(s)"), std::string::npos) << e.what();
  }
}

TEST(LearningRateSchedule, DecaysOverTrainItersUnlessToldOtherwise) {
  auto cfg = dtk::core::default_config();
  cfg.mutable_lr()->set_lr(1.0);
  cfg.mutable_lr()->set_min_lr(0.0);
  cfg.mutable_lr()->set_lr_warmup_iters(0);
  cfg.mutable_lr()->set_lr_decay_style("linear");
  cfg.mutable_lr()->set_lr_decay_iters(0);
  const dtk::core::LearningRateSchedule by_iters(cfg.lr(), 100);
  EXPECT_DOUBLE_EQ(by_iters.rate(25), 0.75);
  cfg.mutable_lr()->set_lr_decay_iters(50);
  const dtk::core::LearningRateSchedule by_decay(cfg.lr(), 100);
  EXPECT_DOUBLE_EQ(by_decay.rate(25), 0.5);
  EXPECT_DOUBLE_EQ(by_decay.rate(60), 0.0);
}

// progress.txt's cumulative throughput (Megatron's get_start_time_from_progress_log): the
// operations since the earliest "Starting job" of this world size, after the last line of another,
// over the wall time since it; an async save's operations count once it is published.
TEST(ProgressLog, CumulativeThroughputCountsFromTheEarliestJobOfThisWorldSize) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("dtk-progress-" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto stamp = [](int seconds_ago) {
    const std::time_t t = std::time(nullptr) - seconds_ago;
    std::tm local{};
    localtime_r(&t, &local);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &local);
    return std::string(buf);
  };
  {
    std::ofstream f(dir + "/progress.txt");
    const std::string saved =
        "\tIteration: 1\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\t";
    // A job of 2 ranks, then jobs of 1 from 200 s ago: 4e14 operations committed before them,
    // then 5e14 started async but never published, then 6e14 published (async).
    f << stamp(500) << "\tJob ID: 7\t# GPUs: 1\tStarting job\n";
    f << stamp(400) << "\tJob ID: 7\t# GPUs: 2\tStarting job\n";
    f << stamp(300) << "\tJob ID: 7\t# GPUs: 2\tSaved checkpoint" << saved
      << "Floating-point operations: 4.00e+14\tTokens (in billions): 0.00\n";
    // Started, never published: these operations never count (counted, the figure is 1.5).
    f << stamp(250) << "\tJob ID: 7\t# GPUs: 2\tSaving async checkpoint" << saved
      << "Floating-point operations: 5.00e+14\tTokens (in billions): 0.00\n";
    f << stamp(200) << "\tJob ID: 8\t# GPUs: 1\tStarting job\n";
    f << stamp(150) << "\tJob ID: 8\t# GPUs: 1\tSaving async checkpoint" << saved
      << "Floating-point operations: 5.00e+14\tTokens (in billions): 0.00\n";
    f << stamp(120) << "\tJob ID: 9\t# GPUs: 1\tStarting job\n";
    f << stamp(100) << "\tJob ID: 9\t# GPUs: 1\tSaving async checkpoint" << saved
      << "Floating-point operations: 6.00e+14\tTokens (in billions): 0.00\n";
    f << stamp(90) << "\tJob ID: 9\t# GPUs: 1\tSaved async checkpoint\tIteration: 2\n";
  }
  // This job has run 100 s (since its process start): 2e14 operations are 2.0 TFLOP/s.
  dtk::core::ProgressLog log(dir, 1, 6e14, 100.0);
  log.saved(3, 6e14 + 2e14, 2'000'000'000, false);
  std::ifstream in(dir + "/progress.txt");
  std::string line, last;
  int lines = 0;
  while (std::getline(in, line)) last = line, ++lines;
  ASSERT_EQ(lines, 11);
  // (8e14 - 4e14) / 200 s = 2.0 TFLOP/s (a second either way of the timestamps: 1.99 to 2.01).
  EXPECT_NE(last.find("\tSaved checkpoint\tIteration: 3\tJob throughput: 2.0 TFLOP/s/GPU\t"), std::string::npos)
      << last;
  EXPECT_NE(last.find("\tCumulative throughput: 2.0 TFLOP/s/GPU\tFloating-point operations: 8.00e+14\tTokens (in "
                      "billions): 2.00"),
            std::string::npos)
      << last;
  std::filesystem::remove_all(dir);
}

// A progress.txt without a start line of this world size (edited during the run): the cumulative
// figure is the job's own, this job's operations over its time.
TEST(ProgressLog, WithoutAStartLineOfThisWorldSizeTheCumulativeFigureIsTheJobs) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("dtk-progress-edited-" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  dtk::core::ProgressLog log(dir, 1, 1e14, 100.0);
  std::ofstream(dir + "/progress.txt") << "2026-01-01 00:00:00\tJob ID: 7\t# GPUs: 2\tStarting job\n";
  log.saved(3, 1e14 + 3e14, 0, false);
  std::ifstream in(dir + "/progress.txt");
  std::string line, last;
  while (std::getline(in, line)) last = line;
  EXPECT_NE(last.find("\tJob throughput: 3.0 TFLOP/s/GPU\tCumulative throughput: 3.0 TFLOP/s/GPU\t"), std::string::npos)
      << last;
  std::filesystem::remove_all(dir);
}

// The progress file's job clock starts at the process's exec (/proc/self/stat), which came before
// this program's static objects were made, and not long before (the kernel counts in 10 ms ticks).
TEST(ProgressLog, ProcessStartIsThisProgramsExec) {
  const double loaded = std::chrono::duration<double>(std::chrono::steady_clock::now() - kProgramLoaded).count();
  const double started = dtk::core::seconds_since_process_start();
  EXPECT_GE(started, loaded - 0.02);
  EXPECT_LT(started, loaded + 60.0);
}
