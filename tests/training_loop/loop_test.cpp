// The training loop end to end through `dtk` (real processes; every wait bounded):
//   * dynamic loss scaling in fp32 with injected overflows: the scale follows Megatron's
//     algorithm iteration by iteration, overflowed iterations are skipped, and the losses equal
//     an unscaled run that skips the same iterations (power-of-two scales are exact in fp32);
//   * an overflow on one rank of two skips the iteration on both;
//   * the scaler's state survives a checkpoint: resumed == uninterrupted, scale included;
//   * SIGTERM (to `dtk train`, and to `dtk launch` with two ranks): the run finishes its
//     iteration, saves, exits 0 saying why; resuming gives the uninterrupted run's losses;
//   * exit_interval and exit_duration_in_mins stop the run with a checkpoint;
//   * bench mode prints the summary and writes --bench_out; the JSONL metrics file carries the
//     log's figures;
//   * optimizer groups from lr.param_rules and a weight-decay schedule reach the optimizer as
//     Megatron computes them (a recording optimizer), ZeRO == ddp with them, resume exactly;
//   * num zeros in the gradients, TensorBoard per iteration and vs samples, Megatron's labels;
//   * the per-token loss (train.calculate_per_token_loss) equals one micro-batch of the global
//     batch however it is split;
//   * full validation (eval.full_validation) reads each sample of the split once, at any layout;
//     eval.skip_train evaluates a loaded model as its training run did.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../common/curves.hpp"
#include "../common/background_dtk.hpp"
#include "../common/run_dtk.hpp"

namespace fs = std::filesystem;

namespace {

using dtk_test::Curve;
using dtk_test::Result;

std::string fresh_dir(const std::string& name) { return dtk_test::fresh_dir(DTK_TEST_TMP, name); }

// A small GPT on synthetic tokens: deterministic (no dropout), clipping active, one log line and
// one TensorBoard point per iteration.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 "
                           "--set model.hidden_dropout=0 --set model.attention_dropout=0 "
                           "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
                           "--set train.micro_batch_size=2 --set train.global_batch_size=4 "
                           "--set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 "
                           "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 ";

std::string iters(int n) { return " --set train.train_iters=" + std::to_string(n) + " "; }

std::string file_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs with DTK_TEST_NONFINITE_ITERS=`nonfinite` (apps/dtk/test_hooks.cpp) in the environment.
Curve curve_with_overflows(const std::string& args, const std::string& nonfinite, const std::string& name) {
  ::setenv("DTK_TEST_NONFINITE_ITERS", nonfinite.c_str(), 1);
  Curve c = dtk_test::run_curve(args, DTK_TEST_TMP, name);
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  return c;
}

std::map<std::string, std::map<int64_t, float>> run_scalars(const std::string& args, const std::string& name,
                                                            Result* result) {
  return dtk_test::run_scalars(args, DTK_TEST_TMP, "loop-" + name, result);
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

void expect_same(const std::map<int64_t, float>& want, const std::map<int64_t, float>& got, const std::string& what,
                 double tol = 1e-6) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (const auto& [it, v] : want) {
    ASSERT_TRUE(got.count(it)) << what << ": no value at iteration " << it;
    EXPECT_NEAR(got.at(it), v, tol * std::abs(v) + 1e-12) << what << " at iteration " << it;
  }
}

TEST(LossScaling, DynamicScaleFollowsMegatronAndSkipsOverflows) {
  const std::string args = kTrain + iters(13);
  const std::string overflows = "2,3,7,9,10";
  Result scaled_run, plain_run;
  ::setenv("DTK_TEST_NONFINITE_ITERS", overflows.c_str(), 1);
  auto scaled = run_scalars(args +
                                " --set train.dynamic_loss_scale=true --set train.initial_loss_scale=1024 "
                                "--set train.loss_scale_window=3 --set train.hysteresis=2",
                            "scaled", &scaled_run);
  auto plain = run_scalars(args, "plain", &plain_run);
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  ASSERT_EQ(scaled_run.code, 0) << scaled_run.out;
  ASSERT_EQ(plain_run.code, 0) << plain_run.out;
  // The scale after each iteration's update (the same script as the unit test).
  const std::vector<float> want = {1024, 1024, 512, 512, 512, 1024, 1024, 1024, 512, 256, 256, 256, 512};
  ASSERT_EQ(scaled["loss-scale"].size(), want.size()) << scaled_run.out;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_EQ(scaled["loss-scale"].at(static_cast<int64_t>(i + 1)), want[i]) << "iteration " << i + 1;
  EXPECT_NE(scaled_run.out.find("loss scale: 512.0 |"), std::string::npos) << scaled_run.out;
  // Skipped: no loss or norm logged for them, and the counts in the log line.
  EXPECT_EQ(scaled["lm loss"].size(), 13u - 5u);
  EXPECT_EQ(scaled["skipped-iterations"].at(10), 1);  // per window (one iteration here)
  EXPECT_EQ(count(scaled_run.out, "number of skipped iterations:   1 |"), 5) << scaled_run.out;
  EXPECT_EQ(count(scaled_run.out, "number of nan iterations:   1 |"), 0) << "the losses themselves were finite";
  // Scaling by powers of two is exact: the same losses, and norms up to clipping's epsilon.
  expect_same(plain["lm loss"], scaled["lm loss"], "lm loss, scaled vs unscaled");
  expect_same(plain["grad-norm"], scaled["grad-norm"], "grad norm, scaled vs unscaled", 1e-5);
  EXPECT_EQ(plain["loss-scale"].at(13), 1.0f);
}

// Without a dynamic scale a skipped step changes nothing: train.skipped_steps_limit of them in a
// row stop the run with one line, before anything is saved (an lr of 1e30 used to train on,
// every step skipped, and save the broken weights). Fewer than the limit (default 10) go on.
TEST(LossScaling, SkippedStepsInARowStopARunWithoutAScale) {
  const std::string dir = fresh_dir("skipped-in-a-row");
  ::setenv("DTK_TEST_NONFINITE_ITERS", "2,3,4", 1);
  const Result stopped =
      dtk_test::run_dtk(kTrain + iters(6) + " --set train.skipped_steps_limit=3 --set checkpoint.save=" + dir, 120);
  const Result goes_on = dtk_test::run_dtk(kTrain + iters(6), 120);
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  dtk_test::expect_one_line_error(stopped, "train: iterations 2-4 had gradients that are not finite (grad norm ");
  EXPECT_FALSE(std::filesystem::exists(dir + "/latest_checkpointed_iteration.txt")) << stopped.out;
  ASSERT_EQ(goes_on.code, 0) << goes_on.out;
  EXPECT_EQ(count(goes_on.out, "number of skipped iterations:   1 |"), 3) << goes_on.out;
}

TEST(LossScaling, AnOverflowOnOneRankSkipsOnEveryRank) {
  const std::string args = "launch --nproc_per_node 2 " + kTrain + iters(6) +
                           " --set train.dynamic_loss_scale=true --set train.initial_loss_scale=64 "
                           "--set train.hysteresis=1";
  const Curve one_rank = curve_with_overflows(args, "3@1", "overflow-on-rank-1");
  const Curve all_ranks = curve_with_overflows(args, "3", "overflow-everywhere");
  EXPECT_EQ(one_rank.loss.count(3), 0u) << "iteration 3 was not skipped:\n" << one_rank.run.out;
  EXPECT_EQ(count(one_rank.run.out, "number of skipped iterations:   1 |"), 1) << one_rank.run.out;
  EXPECT_NE(one_rank.run.out.find("loss scale: 32.0 |"), std::string::npos) << one_rank.run.out;
  expect_same(all_ranks.loss, one_rank.loss, "lm loss, overflow on rank 1 vs on both");
}

TEST(LossScaling, ScalerStateSurvivesResume) {
  const std::string scaling =
      " --set train.dynamic_loss_scale=true --set train.initial_loss_scale=1024 --set train.loss_scale_window=3 "
      "--set train.hysteresis=2 ";
  const std::string ckpt = fresh_dir("ckpt-scaler");
  Result full_run, first_run, rest_run;
  ::setenv("DTK_TEST_NONFINITE_ITERS", "2,3,7", 1);
  auto full = run_scalars(kTrain + iters(10) + scaling, "scaler-full", &full_run);
  // Stop at 5 (scale 512, growth 2 of 3, hysteresis 0): iteration 6 must grow it back to 1024.
  auto first = run_scalars(kTrain + iters(10) + scaling + " --set train.exit_interval=5 --set checkpoint.save=" + ckpt,
                           "scaler-first", &first_run);
  auto rest = run_scalars(kTrain + iters(10) + scaling + " --set checkpoint.load=" + ckpt, "scaler-rest", &rest_run);
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  ASSERT_EQ(full_run.code, 0) << full_run.out;
  ASSERT_EQ(first_run.code, 0) << first_run.out;
  ASSERT_EQ(rest_run.code, 0) << rest_run.out;
  for (const char* tag : {"lm loss", "loss-scale"}) {
    std::map<int64_t, float> joined = first[tag];
    for (const auto& [it, v] : rest[tag]) joined[it] = v;
    expect_same(full[tag], joined, std::string(tag) + ", resumed vs uninterrupted");
  }
  EXPECT_EQ(rest["loss-scale"].at(6), 1024.0f);
}

// ---- exit conditions ------------------------------------------------------------------------

using Background = dtk_test::BackgroundDtk;

int saved_iteration(const std::string& ckpt) {
  std::ifstream in(ckpt + "/latest_checkpointed_iteration.txt");
  int it = -1;
  in >> it;
  return it;
}

// Signal a run after its third iteration; it must save where it stopped and exit 0, and the
// resumed run must continue the uninterrupted run's losses.
void signal_then_resume(const std::string& prefix, int sig, const std::string& name) {
  const int total = 150;  // long enough that the signal lands mid-run on a loaded machine
  const std::string ckpt = fresh_dir("ckpt-" + name), tb = fresh_dir("tb-" + name);
  const Curve full = dtk_test::run_curve(prefix + kTrain + iters(total), DTK_TEST_TMP, name + "-full");
  Background run(prefix + kTrain + iters(total) + " --set checkpoint.save=" + ckpt +
                     " --set logging.tensorboard_dir=" + tb,
                 fresh_dir("log-" + name) + "/out.txt");
  ASSERT_TRUE(run.wait_for("iteration        3/", 120)) << run.output();
  ASSERT_EQ(::kill(run.pid, sig), 0);
  const int code = run.wait_exit(120);
  const std::string out = run.output();
  ASSERT_EQ(code, 0) << out;
  const std::string why = sig == SIGINT ? "SIGINT" : "SIGTERM";
  EXPECT_NE(out.find("exiting program after receiving " + why), std::string::npos) << out;
  const int stopped = saved_iteration(ckpt);
  ASSERT_GE(stopped, 3) << out;
  ASSERT_LT(stopped, total) << "the run ended before the signal took effect:\n" << out;
  EXPECT_EQ(out.find("validation loss"), std::string::npos) << "no final evaluation after an early exit";
  std::map<int64_t, float> joined = dtk_test::read_scalars(tb)["lm loss"];
  ASSERT_EQ(joined.size(), static_cast<size_t>(stopped)) << out;
  const Curve rest =
      dtk_test::run_curve(prefix + kTrain + iters(total) + " --set checkpoint.load=" + ckpt, DTK_TEST_TMP, name + "-rest");
  for (const auto& [it, v] : rest.loss) joined[it] = v;
  expect_same(full.loss, joined, name + ": resumed after the signal vs uninterrupted");
}

TEST(ExitConditions, SigtermSavesAndResumesExactly) { signal_then_resume("", SIGTERM, "sigterm"); }

TEST(ExitConditions, SigtermToLaunchStopsBothRanksTogether) {
  signal_then_resume("launch --nproc_per_node 2 ", SIGTERM, "sigterm-launch");
}

TEST(ExitConditions, SigintToOneRankOfTwoStopsBoth) {
  // The signal reaches rank 1 only (not the launcher): the ranks agree and stop together.
  const std::string ckpt = fresh_dir("ckpt-one-rank");
  Background run("launch --nproc_per_node 2 " + kTrain + iters(200) + " --set checkpoint.save=" + ckpt,
                 fresh_dir("log-one-rank") + "/out.txt");
  ASSERT_TRUE(run.wait_for("iteration        3/", 120)) << run.output();
  // The launcher's children: the ranks, in spawn order.
  std::ifstream children("/proc/" + std::to_string(run.pid) + "/task/" + std::to_string(run.pid) + "/children");
  pid_t rank0 = -1, rank1 = -1;
  children >> rank0 >> rank1;
  ASSERT_GT(rank1, 0) << "no second rank under the launcher";
  ASSERT_EQ(::kill(rank1, SIGINT), 0);
  ASSERT_EQ(run.wait_exit(120), 0) << run.output();
  EXPECT_NE(run.output().find("exiting program after receiving SIGINT"), std::string::npos) << run.output();
  EXPECT_GE(saved_iteration(ckpt), 3);
}

TEST(ExitConditions, ExitIntervalAndDurationSaveAndStop) {
  const std::string ckpt = fresh_dir("ckpt-interval");
  const Result r = dtk_test::run_dtk(kTrain + iters(20) + " --set train.exit_interval=4 --set checkpoint.save=" + ckpt);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("exiting program at train.exit_interval (every 4 iterations): stopped after iteration 4 of 20"), std::string::npos)
      << r.out;
  EXPECT_EQ(saved_iteration(ckpt), 4);
  const Result d = dtk_test::run_dtk("launch --nproc_per_node 2 " + kTrain + iters(200) +
                                     " --set train.exit_duration_in_mins=0.0001");
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("exiting program after "), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("(train.exit_duration_in_mins): stopped after iteration 1 of 200 (no checkpoint"), std::string::npos)
      << d.out;
}

// ---- bench mode, metrics ----------------------------------------------------------------------

TEST(BenchMode, PrintsTheSummaryAndWritesJson) {
  const std::string out = fresh_dir("bench") + "/r.json";
  const Result r = dtk_test::run_dtk(kTrain + " --set train.bench_steps=6 --set train.perf_warmup_steps=2 "
                                              "--set logging.peak_tflops=0.5 --bench_out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("training: 8 iterations"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("performance summary: 6 measured iterations after 2 warm-up"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("of 0.5000 TFLOP/s per device (logging.peak_tflops)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("validation loss"), std::string::npos) << "bench mode evaluates nothing";
  const std::string json = file_text(out);
  EXPECT_NE(json.find("\"measured_iterations\": 6,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"warmup_iterations\": 2,"), std::string::npos) << json;
  EXPECT_NE(json.find("\"tokens_per_iteration\": 128,"), std::string::npos) << json;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(json, m, std::regex(R"("step_times_ms": \[([^\]]*)\])"))) << json;
  EXPECT_EQ(count(m[1].str(), ",") + 1, 6) << "one step time per measured iteration: " << json;
  ASSERT_TRUE(std::regex_search(json, m, std::regex(R"("tflops_per_device": ([0-9.e-]+), "peak_tflops_per_device": 0.5, "mfu": ([0-9.e-]+))")))
      << json;
  EXPECT_NEAR(std::stod(m[2]), std::stod(m[1]) / 0.5, 1e-6 * std::stod(m[2]));
}

// Without logging.peak_tflops a CPU bench run measures the matmul ceiling at the start (the log
// lines' MFU) and again after the steps; the summary keeps the higher, so its peak is at least
// the one the log lines used (a slow minute at the start must not put MFU above 100%).
TEST(BenchMode, MeasuresTheCeilingBeforeAndAfterAndKeepsTheHigher) {
  const std::string out = fresh_dir("bench_peak") + "/r.json";
  const Result r = dtk_test::run_dtk(kTrain + " --set train.bench_steps=2 --set train.perf_warmup_steps=1 "
                                              "--set logging.log_interval=1 --bench_out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sgemm on 1 threads, before and after the steps)"), std::string::npos) << r.out;
  std::smatch m;
  // The log lines' TFLOP/s and MFU against the start's ceiling, rounded as printed: the fastest
  // line, where the rounding weighs least.
  double tflops = 0, mfu = 0;
  const std::regex line(R"(throughput per device \(TFLOP/s\): ([0-9.]+) \| MFU: ([0-9.]+)%)");
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), line); it != std::sregex_iterator(); ++it)
    if (std::stod((*it)[1]) > tflops) tflops = std::stod((*it)[1]), mfu = std::stod((*it)[2]);
  ASSERT_GT(mfu, 0.0) << r.out;
  const std::string json = file_text(out);
  ASSERT_TRUE(std::regex_search(json, m, std::regex(R"("peak_tflops_per_device": ([0-9.e-]+), "mfu": ([0-9.e-]+))")))
      << json;
  const double start_peak = tflops / (mfu / 100.0), summary_peak = std::stod(m[1]);
  // 0.0005 TFLOP/s of print rounding on a ~0.01-0.05 TFLOP/s tiny model: up to ~5%.
  EXPECT_GE(summary_peak, 0.9 * start_peak) << "start ceiling ~" << start_peak << "\n" << r.out << json;
  EXPECT_LE(std::stod(m[2]), 1.0) << json;
}

TEST(Metrics, JsonlCarriesTheLogFigures) {
  const std::string dir = fresh_dir("jsonl"), path = dir + "/metrics.jsonl";
  Result r;
  auto tb = run_scalars(kTrain + iters(6) + " --set logging.log_interval=2 --set eval.eval_interval=3 "
                                              "--set logging.metrics_jsonl=" + path,
                        "jsonl", &r);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  // Iterations 2, 4, 6; validation after 3 and 6 (the loop's) and after training; test after training.
  ASSERT_EQ(lines.size(), 7u) << r.out;
  int train = 0;
  for (const auto& l : lines) {
    std::smatch m;
    if (l.find("\"kind\": \"train\"") == std::string::npos) continue;
    ++train;
    ASSERT_TRUE(std::regex_search(l, m, std::regex(R"("iteration": (\d+),.*"lm loss": ([0-9.e+-]+),)"))) << l;
    const int64_t it = std::stoll(m[1]);
    // The log's window of 2 iterations; TensorBoard has each iteration's own loss.
    const double mean = (tb["lm loss"].at(it - 1) + tb["lm loss"].at(it)) / 2.0;
    EXPECT_NEAR(std::stod(m[2]), mean, 1e-6 * mean) << l;
    for (const char* key : {"\"learning_rate\"", "\"grad_norm\"", "\"tokens_per_second\"", "\"eta_s\"",
                            "\"peak_rss_mb\"", "\"loss_scale\": 1,"})
      EXPECT_NE(l.find(key), std::string::npos) << key << " in " << l;
  }
  EXPECT_EQ(train, 3);
  EXPECT_NE(lines[1].find("{\"kind\": \"validation\", \"iteration\": 3, \"lm loss\": "), std::string::npos)
      << lines[1];
  EXPECT_NE(lines[4].find("{\"kind\": \"validation\", \"iteration\": 6, \"lm loss\": "), std::string::npos) << lines[4];
  EXPECT_NE(lines[5].find("{\"kind\": \"validation\", \"iteration\": 6, \"after_training\": true, \"lm loss\": "),
            std::string::npos)
      << lines[5];
  EXPECT_NE(lines[6].find("{\"kind\": \"test\", \"iteration\": 6, \"after_training\": true,"), std::string::npos)
      << lines[6];
}

TEST(Config, BadLoopSettingsAreOneLine) {
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set train.loss_scale=-1"), "train.loss_scale");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set train.exit_duration_in_mins=nan"),
                                  "train.exit_duration_in_mins");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set lr.lr_decay_style=WSD"), "lr.lr_wsd_decay_iters");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set lr.lr_wsd_decay_style=square"),
                                  "lr.lr_wsd_decay_style");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + " --set lr.lr_warmup_fraction=0.1"), "lr.lr_warmup_fraction and lr.lr_warmup_iters");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set lr.lr=nan"), "lr.lr must be a finite number");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + " --set train.bench_steps=3 --set checkpoint.load=/nonexistent"), "train.bench_steps");
}

}  // namespace

namespace {

TEST(Timers, PrintMegatronsBlockWithMinAndMaxAcrossRanks) {
  const Result r = dtk_test::run_dtk("launch --nproc_per_node 2 " + kTrain + iters(4) +
                                     " --set logging.log_interval=2 --set logging.timing_log_level=2 "
                                     "--set checkpoint.save=" + fresh_dir("ckpt-timers") +
                                     " --set checkpoint.save_interval=2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(count(r.out, "(min, max) time across ranks (ms):"), 2) << r.out;
  for (const char* name : {"forward-backward", "batch-generator", "forward-compute", "backward-compute",
                           "all-grads-sync", "optimizer-clip-main-grad", "optimizer-inner-step", "optimizer"}) {
    std::string label = std::string(name) + " ";
    label.append(48 - label.size(), '.');
    const std::regex row("\n    " + label + R"(: \(([0-9.]+), ([0-9.]+)\))");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, row)) << name << "\n" << r.out;
    EXPECT_LE(std::stod(m[1]), std::stod(m[2])) << name;
  }
  // The save after iteration 2 shows in the next window.
  EXPECT_NE(r.out.find("    save-checkpoint ......"), std::string::npos) << r.out;
  // Level 1 leaves out the per-micro-batch compute timers.
  const Result one = dtk_test::run_dtk(kTrain + iters(3) + " --set logging.timing_log_level=1");
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_NE(one.out.find("    forward-backward ...."), std::string::npos) << one.out;
  EXPECT_EQ(one.out.find("forward-compute"), std::string::npos) << one.out;
  const Result none = dtk_test::run_dtk(kTrain + iters(3));
  EXPECT_EQ(none.out.find("time across ranks"), std::string::npos) << none.out;
}

}  // namespace

namespace {

// ---- resuming with another schedule, no_load_optim, finetune ----------------------------------

TEST(Resume, AnotherScheduleIsRefusedUnlessTheConfigSaysWhichWins) {
  const std::string ckpt = fresh_dir("ckpt-schedule");
  const std::string base = kTrain + " --set lr.lr_decay_style=linear --set lr.min_lr=0 ";
  Result full_run, first_run;
  auto full = run_scalars(base + iters(8), "schedule-full", &full_run);
  auto first = run_scalars(base + iters(8) + " --set train.exit_interval=4 --set checkpoint.save=" + ckpt,
                           "schedule-first", &first_run);
  ASSERT_EQ(full_run.code, 0) << full_run.out;
  ASSERT_EQ(first_run.code, 0) << first_run.out;
  // Twice the iterations: the decay (train_iters) changes.
  dtk_test::expect_one_line_error(dtk_test::run_dtk(base + iters(16) + " --set checkpoint.load=" + ckpt),
                                  "decay iterations (lr.lr_decay_iters, or train.train_iters when 0) 8 (checkpoint) "
                                  "vs 16 (this run); set checkpoint.override_opt_param_scheduler=true");
  Result kept_run, overridden_run;
  auto kept = run_scalars(base + iters(8) + " --set lr.lr=0.002 --set checkpoint.use_checkpoint_opt_param_scheduler=true "
                                            "--set checkpoint.load=" + ckpt,
                          "schedule-kept", &kept_run);
  ASSERT_EQ(kept_run.code, 0) << kept_run.out;
  EXPECT_NE(kept_run.out.find("learning-rate schedule from the checkpoint"), std::string::npos) << kept_run.out;
  for (int64_t it = 5; it <= 8; ++it)
    EXPECT_EQ(kept["learning-rate"].at(it), full["learning-rate"].at(it)) << "iteration " << it;
  auto overridden = run_scalars(base + iters(8) + " --set lr.lr=0.002 --set checkpoint.override_opt_param_scheduler=true "
                                                  "--set checkpoint.load=" + ckpt,
                                "schedule-overridden", &overridden_run);
  ASSERT_EQ(overridden_run.code, 0) << overridden_run.out;
  EXPECT_NEAR(overridden["learning-rate"].at(5), 2 * full["learning-rate"].at(5), 1e-9);
}

// OneCycle (its momentum cycling through adamw) resumes exactly: the checkpoint keeps its
// settings, a resume with others is refused naming them, and with the checkpoint's schedule
// (use_checkpoint_opt_param_scheduler) the run follows the checkpoint's momenta, not this run's.
TEST(Resume, OneCycleResumesExactlyWithItsMomentum) {
  const std::string ckpt = fresh_dir("ckpt-one-cycle");
  const std::string base = kTrain + iters(8) +
                           " --optimizer adamw --set lr.lr_decay_style=OneCycle --set lr.min_lr=1e-4 "
                           "--set lr.cycle_first_step_size=3 --set lr.decay_step_size=1 --set lr.decay_lr_rate=0.5 "
                           "--set lr.decay_mom_rate=0.01 --set lr.cycle_min_mom=0.5 ";
  Result full_run, first_run, resumed_run, kept_run;
  auto full = run_scalars(base, "one-cycle-full", &full_run);
  auto first =
      run_scalars(base + " --set train.exit_interval=4 --set checkpoint.save=" + ckpt, "one-cycle-first", &first_run);
  ASSERT_EQ(full_run.code, 0) << full_run.out;
  ASSERT_EQ(first_run.code, 0) << first_run.out;
  auto resumed = run_scalars(base + " --set checkpoint.load=" + ckpt, "one-cycle-resumed", &resumed_run);
  ASSERT_EQ(resumed_run.code, 0) << resumed_run.out;
  ASSERT_EQ(resumed["lm loss"].size(), 4u) << resumed_run.out;
  for (int64_t it = 5; it <= 8; ++it) {
    EXPECT_EQ(resumed["lm loss"].at(it), full["lm loss"].at(it)) << "iteration " << it;
    EXPECT_EQ(resumed["learning-rate"].at(it), full["learning-rate"].at(it)) << "iteration " << it;
  }
  // A longer run resumes: OneCycle reads no decay length (DeepSpeed resumes it too).
  Result longer_run;
  auto longer =
      run_scalars(base + " --set train.train_iters=10 --set checkpoint.load=" + ckpt, "one-cycle-longer", &longer_run);
  ASSERT_EQ(longer_run.code, 0) << longer_run.out;
  for (int64_t it = 5; it <= 8; ++it) EXPECT_EQ(longer["lm loss"].at(it), full["lm loss"].at(it)) << "iteration " << it;
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(base + " --set lr.cycle_max_mom=0.7 --set checkpoint.load=" + ckpt),
      "lr.cycle_max_mom 0.9 (checkpoint) vs 0.7 (this run); set checkpoint.override_opt_param_scheduler=true");
  auto kept = run_scalars(base +
                              " --set lr.cycle_max_mom=0.7 --set checkpoint.use_checkpoint_opt_param_scheduler=true "
                              "--set checkpoint.load=" +
                              ckpt,
                          "one-cycle-kept", &kept_run);
  ASSERT_EQ(kept_run.code, 0) << kept_run.out;
  EXPECT_NE(kept_run.out.find("cycles beta1 from 0.9 to 0.5"), std::string::npos) << kept_run.out;
  for (int64_t it = 5; it <= 8; ++it) EXPECT_EQ(kept["lm loss"].at(it), full["lm loss"].at(it)) << "iteration " << it;
}

TEST(Resume, NoLoadOptimRestartsTheScheduleAndFinetuneStartsAtZero) {
  const std::string ckpt = fresh_dir("ckpt-finetune");
  const Result first = dtk_test::run_dtk(kTrain + iters(8) + " --set train.exit_interval=4 --set checkpoint.save=" + ckpt);
  ASSERT_EQ(first.code, 0) << first.out;
  Result fresh_run, no_optim_run, finetune_run;
  auto fresh = run_scalars(kTrain + iters(8), "fresh", &fresh_run);
  auto no_optim = run_scalars(kTrain + iters(8) + " --set checkpoint.no_load_optim=true --set checkpoint.load=" + ckpt,
                              "no-optim", &no_optim_run);
  ASSERT_EQ(no_optim_run.code, 0) << no_optim_run.out;
  EXPECT_NE(no_optim_run.out.find("loaded checkpoint from " + ckpt + " at iteration 4"), std::string::npos);
  // The scheduler starts again at step 0: iteration 5 logs the rate after one step, as a fresh
  // run's iteration 1 does.
  EXPECT_EQ(no_optim["learning-rate"].at(5), fresh["learning-rate"].at(1));
  auto finetune = run_scalars(kTrain + iters(8) + " --set checkpoint.finetune=true --set checkpoint.load=" + ckpt,
                              "finetune", &finetune_run);
  ASSERT_EQ(finetune_run.code, 0) << finetune_run.out;
  EXPECT_NE(finetune_run.out.find("training starts at iteration 0"), std::string::npos) << finetune_run.out;
  ASSERT_EQ(finetune["lm loss"].size(), 8u) << finetune_run.out;
  // Same batch and rate as the fresh run's first iteration, but trained weights: a lower loss.
  EXPECT_EQ(finetune["learning-rate"].at(1), fresh["learning-rate"].at(1));
  EXPECT_LT(finetune["lm loss"].at(1), fresh["lm loss"].at(1) - 0.01);
}

// A run continued from its weights alone (as one converted from Megatron arrives: `dtk import hf`,
// then checkpoint.finetune) with train.consumed_samples picks up the iteration count, the
// learning rate, the training batches and the validation batches where the run stood. Plain SGD
// keeps no optimizer state, so the continuation must give the uninterrupted run's numbers exactly.
TEST(Resume, ConsumedSamplesContinuesARunFromItsWeightsAlone) {
  const std::string ckpt = fresh_dir("ckpt-consumed");
  const std::string base = kTrain + iters(6) +
                           " --set optimizer.name=sgd --set optimizer.momentum=0 --set eval.eval_interval=2 ";
  const Result first = dtk_test::run_dtk(base + " --set train.exit_interval=3 --set checkpoint.save=" + ckpt);
  ASSERT_EQ(first.code, 0) << first.out;
  Result full_run, continued_run;
  auto full = run_scalars(base, "consumed-full", &full_run);
  ASSERT_EQ(full_run.code, 0) << full_run.out;
  const std::string weights = " --set checkpoint.finetune=true --set checkpoint.load=" + ckpt;
  auto continued = run_scalars(base + weights + " --set train.consumed_samples=12", "consumed-continued",
                               &continued_run);
  ASSERT_EQ(continued_run.code, 0) << continued_run.out;
  EXPECT_NE(continued_run.out.find("training starts after iteration 3"), std::string::npos) << continued_run.out;
  ASSERT_EQ(continued["lm loss"].size(), 3u) << continued_run.out;
  for (const std::string name : {"lm loss", "learning-rate", "grad-norm", "lm loss validation"})
    for (const auto& [it, value] : continued[name]) {
      ASSERT_TRUE(full[name].count(it)) << name << " at iteration " << it << " is not in the uninterrupted run";
      EXPECT_EQ(value, full[name].at(it)) << name << " at iteration " << it;
    }
  EXPECT_EQ(continued["lm loss validation"].count(4), 1u) << "the periodic validation at iteration 4";
  // Between two iterations, past the run, or over a DTK checkpoint's own count: one line each.
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(base + weights + " --set train.consumed_samples=10"),
      "train.consumed_samples 10 is not at an iteration boundary: iteration 2 ends at 8 samples, iteration 3 at 12");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(base + " --set train.consumed_samples=28"),
                                  "train.consumed_samples 28 is beyond this run's 24 training samples");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(base + " --set train.consumed_samples=12 --set checkpoint.load=" + ckpt),
      "resumes on its own count of consumed samples");
}

// logging.profile_steps: LibTorch's profiler over iterations 2-3, a Chrome trace per rank and a
// table of the top ops (Debian's LibTorch has no Kineto: DTK writes the recorded ops itself).
TEST(Profile, ProfileStepsWritesATraceAndPrintsTheTopOps) {
  const std::string dir = fresh_dir("profile");
  const Result run = dtk_test::run_dtk(kTrain + iters(4) + " --set logging.profile_steps=3-4 --set logging.profile_dir=" + dir);
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("profile of iterations 3-4 (2 iterations, "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("op (CPU, by self time)"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find(" aten::"), std::string::npos) << run.out;
  const std::string trace = file_text(dir + "/rank0.json");
  EXPECT_EQ(trace.rfind("{\"traceEvents\":[", 0), 0u) << trace.substr(0, 200);
  EXPECT_GT(count(trace, "\"ph\":\"X\""), 100) << "ops of two iterations";
  EXPECT_NE(trace.find("\"name\":\"aten::"), std::string::npos);
  // The host reads of device values (each a synchronisation on a GPU), per iteration of two
  // micro-batches: per micro-batch the forward's id checks (one read for tokens, positions and
  // labels) and the output layer's backward (whether any token's gradient differs); once the
  // clipping's norm. The loss is not read in the step (a tensor metric, ABI 2.5): the log reads
  // the iteration's losses once, after the step. Iterations 3-4: the loop's batch checks (host
  // data) are over.
  EXPECT_NE(run.out.find(" host reads of device values (item()): 5 per iteration (backward-compute 2, "
                         "forward-compute 2, optimizer-clip-main-grad 1)\n"),
            std::string::npos)
      << run.out;
  // Llama: one more per micro-batch (the rotary table's size: the largest position), none per
  // layer (its grouped-query attention repeats keys without a host read).
  const std::string llama = std::string("train --config ") + DTK_SOURCE_DIR + "/configs/llama-tiny.pbtxt" +
                            kTrain.substr(kTrain.find(" --dataset"));
  const Result llama_run = dtk_test::run_dtk(llama + iters(4) + " --set logging.profile_steps=3-4 --set logging.profile_dir=" + dir);
  ASSERT_EQ(llama_run.code, 0) << llama_run.out;
  EXPECT_NE(llama_run.out.find(" host reads of device values (item()): 7 per iteration (backward-compute 2, "
                               "forward-compute 4, optimizer-clip-main-grad 1)\n"),
            std::string::npos)
      << llama_run.out;
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + iters(4) + " --set logging.profile_steps=0-2"),
                                  "logging.profile_steps: '0-2' is not an iteration 'A' or a range 'A-B'");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + iters(4) + " --set logging.profile_steps=9"),
                                  "logging.profile_steps '9' starts after the last iteration");
}

}  // namespace

namespace {

TEST(BatchConfig, DeepSpeedAccumulationStepsAndMegatronTrainSamples) {
  // micro 2 x DP 1 x 2 accumulation steps = global 4; 20 samples = 5 iterations.
  const std::string base = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.vocab_size=512 "
                           "--set dataset.vocab_size=512 --set train.seq_length=32 --set train.micro_batch_size=2 "
                           "--set train.global_batch_size=0 "
                           "--set logging.log_interval=1 --set eval.eval_iters=1 ";
  const Result r = dtk_test::run_dtk(base + "--set train.gradient_accumulation_steps=2 --set train.train_iters=0 "
                                            "--set train.train_samples=20 --set lr.lr_warmup_iters=1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("training: 5 iterations, global batch 4 (2 micro-batches of 2)"), std::string::npos) << r.out;
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(base + "--set train.gradient_accumulation_steps=3 --set train.global_batch_size=4"),
      "train.gradient_accumulation_steps is 3");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(base + "--set train.train_samples=20"),
                                  "train.train_iters and train.train_samples cannot both be set");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(base + "--set train.train_iters=0 --set train.train_samples=40 --set lr.lr_warmup_iters=20"),
      "the warm-up (20 iterations) is not shorter than the decay, 20 iterations (train.train_samples / global batch 2");
}

}  // namespace

namespace {

TEST(Logging, ParamsNormIsTheSameUnderTensorParallelismAndZero3) {
  const std::string args = kTrain + iters(3) + " --set logging.log_params_norm=true ";
  Result one_run, tp_run, zero_run;
  auto one = run_scalars(args, "params-norm-1", &one_run);
  auto tp = run_scalars("launch --nproc_per_node 2 " + args + " --set distributed.tensor_model_parallel_size=2",
                        "params-norm-tp2", &tp_run);
  auto zero = run_scalars("launch --nproc_per_node 2 " + args + " --strategy zero --set strategy.stage=3",
                          "params-norm-zero3", &zero_run);
  for (const Result* r : {&one_run, &tp_run, &zero_run}) ASSERT_EQ(r->code, 0) << r->out;
  EXPECT_NE(one_run.out.find(" params norm: "), std::string::npos) << one_run.out;
  ASSERT_EQ(one["params-norm"].size(), 3u);
  EXPECT_GT(one["params-norm"].at(1), 1.0f);
  for (int64_t it = 1; it <= 3; ++it) {
    EXPECT_NEAR(tp["params-norm"].at(it), one["params-norm"].at(it), 1e-5 * one["params-norm"].at(it)) << it;
    EXPECT_NEAR(zero["params-norm"].at(it), one["params-norm"].at(it), 1e-5 * one["params-norm"].at(it)) << it;
  }
  // Not asked for: not there.
  EXPECT_EQ(run_scalars(kTrain + iters(3), "params-norm-off", &one_run).count("params-norm"), 0u);
}

}  // namespace

namespace {

// ---- optimizer groups, weight-decay schedule, num zeros, TensorBoard, evaluation labels ------
// (issue 12's second half: Megatron's get_param_groups rules, get_wd, --log-num-zeros-in-grad,
// --tensorboard-log-interval and the "vs samples" tags, the end-of-training labels)

const std::string kPlugins = std::string(" --plugin_path ") + DTK_LOOP_TEST_PLUGIN_DIR + " ";

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// The host hands recording_sgd its groups in the fixed order and, per step, Megatron's rate and
// weight decay: linear 0.02 -> 0.1 over the run (get_wd counts samples: train_iters x global
// batch), the scheduler (and with it the decay) not advancing over a skipped iteration.
TEST(OptimizerGroups, RulesAndTheWeightDecayScheduleReachTheOptimizer) {
  const std::string record = fresh_dir("groups") + "/record.txt";
  const std::string args =
      kTrain + iters(10) + kPlugins + " --optimizer recording_sgd --set optimizer.record=" + record +
      " --set lr.lr_decay_style=constant --set lr.weight_decay_incr_style=linear --set lr.start_weight_decay=0.02 "
      "--set lr.end_weight_decay=0.1 --set 'lr.param_rules=match: \"position_embeddings\" lr_mult: 0.5' "
      "--set 'lr.param_rules={match: \"final_layernorm\" wd_mult: 2}'";
  ::setenv("DTK_TEST_NONFINITE_ITERS", "4", 1);
  const Result r = dtk_test::run_dtk(args);
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto lines = read_lines(record);
  ASSERT_GE(lines.size(), 6u) << r.out;
  // Groups: 0 decay, 1 no decay, 2/3 rule 0 (lr x 0.5), 4/5 rule 1 (wd x 2 for its biases too).
  EXPECT_EQ(lines[0].rfind("group 0 wd 0.1 lr_scale 1 language_model.embedding.word_embeddings.weight ", 0), 0u)
      << lines[0];
  EXPECT_EQ(lines[0].find("position_embeddings"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1].rfind("group 1 wd 0 lr_scale 1 language_model.encoder.layers.0.input_layernorm.weight ", 0), 0u)
      << lines[1];
  EXPECT_EQ(lines[2], "group 2 wd 0.1 lr_scale 0.5 language_model.embedding.position_embeddings.weight");
  EXPECT_EQ(lines[3], "group 3 wd 0 lr_scale 0.5");
  EXPECT_EQ(lines[4], "group 4 wd 0.2 lr_scale 1");
  EXPECT_EQ(lines[5],
            "group 5 wd 0.2 lr_scale 1 language_model.encoder.final_layernorm.weight "
            "language_model.encoder.final_layernorm.bias");
  EXPECT_NE(r.out.find(" > optimizer group 2, rule 0 \"position_embeddings\" (weight decay 0.1, lr x 0.5): 1 tensors"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("language_model.encoder.layers.*.mlp.dense_h_to_4h.weight (x2)"), std::string::npos) << r.out;
  // Steps: iteration 4 overflowed (no optimizer call); scheduler step k uses wd 0.02 + 0.08 k / 10.
  std::vector<std::pair<int, double>> steps;
  for (size_t i = 6; i < lines.size(); ++i) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[i], m, std::regex(R"(step (\d+) lr (\S+) wd_scale (\S+)( g\d+ \S+)*)")))
        << lines[i];
    steps.emplace_back(std::stoi(m[1]), std::stod(m[3]));
    // gpt-tiny's lr 1e-3, constant after kTrain's 2 warm-up steps (the scheduler's step, as wd's).
    const double k = static_cast<double>(steps.size() - 1);
    EXPECT_NEAR(std::stod(m[2]), 1e-3 * std::min(k, 2.0) / 2.0, 1e-18) << lines[i];
  }
  ASSERT_EQ(steps.size(), 9u) << r.out;
  int scheduler_step = 0;
  for (const auto& [iteration, scale] : steps) {
    EXPECT_NE(iteration, 4);
    const double megatron_wd = 0.02 + (0.1 - 0.02) * (scheduler_step * 4.0) / (10 * 4.0);  // samples
    EXPECT_NEAR(scale * 0.1, megatron_wd, 1e-15) << "iteration " << iteration;
    ++scheduler_step;
  }
}

TEST(OptimizerGroups, LrMultAndWdMultEqualAScaledSchedule) {
  // Every weight at lr x 0.5 and wd x 0.5 == a run at half the rates (the biases and norms keep
  // no decay: the rule names the weights that decay).
  const std::string base = kTrain + iters(6) + " --set lr.weight_decay=0.1 ";
  const std::string rule =
      " --set 'lr.param_rules=match: \"(query_key_value|dense|dense_h_to_4h|dense_4h_to_h|word_embeddings|"
      "position_embeddings)[.]weight$\" lr_mult: 0.5 wd_mult: 0.5' --set 'lr.param_rules=match: \".\" lr_mult: 0.5'";
  const Curve scaled = dtk_test::run_curve(base + rule, DTK_TEST_TMP, "lr-mult");
  const Curve halved = dtk_test::run_curve(base + " --set lr.lr=5e-4 --set lr.min_lr=5e-5 --set lr.weight_decay=0.05",
                                           DTK_TEST_TMP, "half-lr");
  const Curve plain = dtk_test::run_curve(base, DTK_TEST_TMP, "lr-plain");
  expect_same(halved.loss, scaled.loss, "lm loss, rules x 0.5 vs half rates", 1e-5);
  EXPECT_GT(std::abs(plain.loss.at(6) - scaled.loss.at(6)), 1e-4) << "the rules changed nothing";
}

// The host groups the strategy's optimizer tensors by name: ZeRO's 1-D shards land in the same
// groups as ddp's whole parameters, so ZeRO == ddp holds with rules and a weight-decay schedule;
// the schedule is saved with the checkpoint, resumes exactly, and another one is refused.
TEST(OptimizerGroups, ZeroEqualsDdpAndResumesWithRulesAndAWeightDecaySchedule) {
  const std::string args =
      "launch --nproc_per_node 2 " + kTrain + iters(8) +
      " --set train.micro_batch_size=1 --set lr.weight_decay_incr_style=cosine --set lr.start_weight_decay=0.01 "
      "--set lr.end_weight_decay=0.2 --set 'lr.param_rules=match: \"word_embeddings\" lr_mult: 3 wd_mult: 0.5' ";
  const Curve ddp = dtk_test::run_curve(args, DTK_TEST_TMP, "rules-ddp");
  const Curve zero = dtk_test::run_curve(args + " --strategy zero --set strategy.stage=2", DTK_TEST_TMP, "rules-zero2");
  dtk_test::expect_same_curve(ddp, zero, 8, "zero-2 vs ddp with rules and a weight-decay schedule");
  const Curve plain = dtk_test::run_curve("launch --nproc_per_node 2 " + kTrain + iters(8) +
                                              " --set train.micro_batch_size=1",
                                          DTK_TEST_TMP, "rules-none");
  EXPECT_GT(std::abs(plain.loss.at(8) - ddp.loss.at(8)), 1e-4) << "rules and schedule changed nothing";
  // Stop at 4, resume: the same curve (the decay follows the restored scheduler step).
  const std::string ckpt = fresh_dir("ckpt-wd");
  const Result first = dtk_test::run_dtk(args + " --set train.exit_interval=4 --set checkpoint.save=" + ckpt);
  ASSERT_EQ(first.code, 0) << first.out;
  const Curve rest = dtk_test::run_curve(args + " --set checkpoint.load=" + ckpt, DTK_TEST_TMP, "rules-rest");
  for (int64_t it = 5; it <= 8; ++it)
    EXPECT_NEAR(rest.loss.at(it), ddp.loss.at(it), 1e-6 * ddp.loss.at(it)) << "resumed, iteration " << it;
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(args.substr(args.find("train ")) + " --set lr.end_weight_decay=0.3 --set checkpoint.load=" + ckpt),
      "end weight decay (lr.end_weight_decay, or lr.weight_decay when constant) 0.2 (checkpoint) vs 0.3 (this run)");
}

TEST(OptimizerGroups, BadRulesAndScheduleNeedsAreOneLine) {
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set 'lr.param_rules=match: \"(\"'"),
                                  "lr.param_rules[0]: 'match' \"(\" is not a valid regular expression");
  // Nested quantifiers: a backtracking matcher takes time exponential in a name's length here
  // (dtk hung at start); the rules' matcher runs in polynomial time and says the rule matches
  // nothing. It takes no back-references.
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set 'lr.param_rules=match: \"(.+)+nomatch\"'"),
                                  "lr.param_rules[0]: '(.+)+nomatch' matches no parameter of the model");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set 'lr.param_rules=match: \"(a)\\\\1\"'"),
                                  "is not a valid regular expression (Unexpected back-reference");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set 'lr.param_rules=lr_mul: 2'"),
                                  "not a valid ParamRule entry");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set 'lr.param_rules=match: \"x\" lr_mult: -1'"),
                                  "lr.param_rules[0]: lr_mult must be a finite number >= 0");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set lr.weight_decay_incr_style=linear"),
                                  "needs lr.start_weight_decay and lr.end_weight_decay");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set lr.end_weight_decay=0.1"),
                                  "need lr.weight_decay_incr_style linear or cosine");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + " --set lr.weight_decay_incr_style=cosine --set lr.start_weight_decay=0.2 "
                                 "--set lr.end_weight_decay=0.1"),
      "0 <= start <= end");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set lr.weight_decay_incr_style=exp"),
                                  "lr.weight_decay_incr_style must be constant, linear or cosine");
  // An optimizer built for ABI 2.1 never sees weight_decay_scale: refused for a schedule...
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + kPlugins + " --optimizer sgd_v2_1 --set lr.weight_decay_incr_style=linear "
                                            "--set lr.start_weight_decay=0 --set lr.end_weight_decay=0.1"),
      "needs optimizer plugin 'sgd_v2_1' built for DTK ABI 2.2 or later (it is 2.1");
  // ...and trains with a constant weight decay.
  const Result old = dtk_test::run_dtk(kTrain + iters(3) + kPlugins + " --optimizer sgd_v2_1");
  EXPECT_EQ(old.code, 0) << old.out;
  // A group's own peak and floor reach only an optimizer built for ABI 2.8 (group_lr).
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + kPlugins +
                        " --optimizer sgd_v2_1 --set 'lr.param_rules=match: \"word_embeddings\" max_lr: 1e-2'"),
      "config: an lr.param_rules entry with max_lr or min_lr needs optimizer plugin 'sgd_v2_1' built for DTK ABI 2.8 "
      "or later (it is 2.1");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set 'lr.param_rules=match: \"x\" max_lr: -1'"),
                                  "lr.param_rules[0]: max_lr must be a finite number >= 0");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set 'lr.param_rules=match: \"x\" max_lr: 5e-5'"),
                                  "lr.param_rules[0]: min_lr 0.0001 (lr.min_lr) is above max_lr 5e-05 (the rule's)");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + " --set lr.lr_decay_style=WarmupDecayLR --set lr.lr_decay_iters=300 --set "
                                 "'lr.param_rules=match: \"x\" max_lr: 1'"),
      "lr.param_rules[0]: max_lr and min_lr follow Megatron's schedules; DeepSpeed's WarmupDecayLR has one");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain +
                        " --set lr.lr_warmup_init=5e-4 --set 'lr.param_rules=match: \"x\" max_lr: 4e-4 min_lr: 0'"),
      "lr.param_rules[0]: lr.lr_warmup_init 0.0005 is above its max_lr 0.0004: its warm-up would fall");
}

// A rule's own max_lr and min_lr (Megatron-LM's param-group overrides; --decoupled-lr): its groups
// follow Megatron's get_lr between them, times lr_mult, while the others keep the schedule's; the
// optimizer gets every group's rate (recording_sgd writes them). Warm-up 2 steps from 0, cosine
// to the floor at scheduler step 8, a skipped iteration not advancing the scheduler.
TEST(OptimizerGroups, AGroupsOwnPeakAndFloorFollowMegatronsGetLr) {
  const std::string record = fresh_dir("group-lr") + "/record.txt";
  const std::string args = kTrain + iters(10) + kPlugins +
                           " --optimizer recording_sgd --set optimizer.record=" + record +
                           " --set lr.lr_decay_iters=8 --set 'lr.param_rules=match: \"word_embeddings\" max_lr: 3e-3 "
                           "min_lr: 2e-4 lr_mult: 0.5'";
  ::setenv("DTK_TEST_NONFINITE_ITERS", "4", 1);
  const Result r = dtk_test::run_dtk(args);
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rule 0 \"word_embeddings\" (weight decay 0.01, lr x 0.5, max_lr 0.003, min_lr 0.0002)"),
            std::string::npos)
      << r.out;
  const auto megatron_get_lr = [](int k, double max_lr, double min_lr) {  // warm-up 2, decay 8, init 0
    if (k <= 2) return max_lr * k / 2.0;
    if (k > 8) return min_lr;
    const double ratio = (k - 2) / 6.0;
    return min_lr + 0.5 * (std::cos(M_PI * ratio) + 1.0) * (max_lr - min_lr);
  };
  const auto lines = read_lines(record);
  int k = 0;
  for (const std::string& line : lines) {
    std::smatch m;
    if (!std::regex_match(line, m,
                          std::regex(R"(step (\d+) lr (\S+) wd_scale \S+ g0 (\S+) g1 (\S+) g2 (\S+) g3 (\S+))")))
      continue;
    EXPECT_NE(m[1], "4") << "the skipped iteration stepped";
    const double lr = megatron_get_lr(k, 1e-3, 1e-4), own = 0.5 * megatron_get_lr(k, 3e-3, 2e-4);
    EXPECT_NEAR(std::stod(m[2]), lr, 1e-15) << line;
    EXPECT_NEAR(std::stod(m[3]), lr, 1e-15) << line;
    EXPECT_NEAR(std::stod(m[4]), lr, 1e-15) << line;
    EXPECT_NEAR(std::stod(m[5]), own, 1e-15) << line;
    EXPECT_NEAR(std::stod(m[6]), own, 1e-15) << line;
    ++k;
  }
  EXPECT_EQ(k, 9) << r.out;
}

// DeepSpeed's OneCycle reaches the optimizer: each update's rate and Adam betas (recording_sgd
// declares beta1, so the host hands it betas) are DeepSpeed's own lr_schedules.py's (commit
// edaa722) for the same parameters, driven as deepspeed.initialize drives it (the values each
// update used, scheduler stepped after it): cycle 1e-4 -> 2e-3 over 4 updates and back over 6,
// then decay by 0.5 and momentum by 0.01 every 2. Iteration 4 overflows: no update, no scheduler
// step. An optimizer built before ABI 2.14 cannot take the betas: refused; one without betas
// (sgd) trains with a line saying momentum does not cycle.
TEST(OptimizerGroups, OneCyclesRatesAndBetasReachTheOptimizer) {
  const std::string record = fresh_dir("one-cycle") + "/record.txt";
  const std::string cycle =
      " --set lr.lr_decay_style=OneCycle --set lr.min_lr=1e-4 --set lr.lr=2e-3 --set lr.cycle_first_step_size=4 "
      "--set lr.cycle_second_step_size=6 --set lr.decay_step_size=2 --set lr.decay_lr_rate=0.5 "
      "--set lr.decay_mom_rate=0.01 --set lr.cycle_min_mom=0.85 --set lr.cycle_max_mom=0.95";
  ::setenv("DTK_TEST_NONFINITE_ITERS", "4", 1);
  const Result r = dtk_test::run_dtk(kTrain + iters(14) + kPlugins +
                                     " --optimizer recording_sgd --set optimizer.record=" + record + cycle);
  ::unsetenv("DTK_TEST_NONFINITE_ITERS");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(" > lr: OneCycle cycles beta1 from 0.95 to 0.85 and back against the rate, with beta2 0.99"),
            std::string::npos)
      << r.out;
  const std::vector<std::pair<double, double>> deepspeed = {{0.0001, 0.85},
                                                            {0.0005750000000000004, 0.9249999999999999},
                                                            {0.0010499999999999997, 0.9},
                                                            {0.0015250000000000003, 0.875},
                                                            {0.0019999999999999996, 0.85},
                                                            {0.0016833333333333333, 0.8666666666666667},
                                                            {0.0013666666666666664, 0.8833333333333333},
                                                            {0.0010500000000000002, 0.8999999999999999},
                                                            {0.0007333333333333332, 0.9166666666666666},
                                                            {0.00041666666666666696, 0.9333333333333332},
                                                            {0.0001, 0.95},
                                                            {8e-05, 0.9547499999999999},
                                                            {6.666666666666667e-05, 0.9594999999999999}};
  std::vector<std::string> steps, betas;
  for (const std::string& line : read_lines(record)) {
    if (line.rfind("step ", 0) == 0) steps.push_back(line);
    if (line.rfind("betas ", 0) == 0) betas.push_back(line);
  }
  ASSERT_EQ(steps.size(), deepspeed.size()) << r.out;
  ASSERT_EQ(betas.size(), deepspeed.size()) << r.out;
  for (size_t k = 0; k < deepspeed.size(); ++k) {
    std::smatch s, b;
    ASSERT_TRUE(std::regex_search(steps[k], s, std::regex(R"(^step (\d+) lr (\S+))"))) << steps[k];
    ASSERT_TRUE(std::regex_match(betas[k], b, std::regex(R"(betas (\d+) (\S+) (\S+))"))) << betas[k];
    EXPECT_EQ(s[1], b[1]) << "the betas of another update";
    EXPECT_NE(s[1], "4") << "the skipped iteration stepped";
    EXPECT_EQ(std::stod(s[2]), deepspeed[k].first) << steps[k];
    EXPECT_EQ(std::stod(b[2]), deepspeed[k].second) << betas[k];
    EXPECT_EQ(std::stod(b[3]), 0.99) << betas[k];
  }
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + iters(14) + kPlugins + " --optimizer sgd_v2_1" + cycle),
                                  "config: lr.lr_decay_style=OneCycle with lr.cycle_momentum (Adam's betas per update) "
                                  "needs optimizer plugin 'sgd_v2_1' built for DTK ABI 2.14 or later (it is 2.1");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + " --set lr.decay_step_size=3"),
                                  "lr.decay_step_size/decay_lr_rate/decay_mom_rate do nothing without "
                                  "lr.lr_decay_style=OneCycle (it is cosine)");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + cycle + " --set lr.cycle_max_mom=1"),
                                  "config: lr.cycle_max_mom is Adam's beta1, in [0, 1); got 1");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + iters(100) + cycle + " --set lr.decay_mom_rate=0.1"),
                                  "config: lr.decay_mom_rate 0.1 takes OneCycle's beta1 to 5.1775 by update 100 of "
                                  "the run's 100; Adam needs it in [0, 1)");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + " --set lr.lr_decay_style=LRRangeTest --set lr.lr_range_test_step_size=0"),
      "config: lr.lr_range_test_step_size must be >= 1, got 0");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + iters(100) + cycle + " --set lr.decay_lr_rate=-0.1"),
      "config: lr.decay_lr_rate -0.1 takes OneCycle's rate to -2.89855e-05 by update 100 of the run's 100: make it "
      "positive, or end the run sooner");
  // Without betas nothing cycles: the momentum decay is not checked (DeepSpeed trains it too).
  EXPECT_EQ(dtk_test::run_dtk(kTrain + iters(100) + " --optimizer sgd" + cycle +
                              " --set lr.decay_mom_rate=0.1 --set train.exit_interval=1")
                .code,
            0);
  const Result sgd = dtk_test::run_dtk(kTrain + iters(2) + " --optimizer sgd" + cycle);
  EXPECT_EQ(sgd.code, 0) << sgd.out;
  EXPECT_NE(sgd.out.find(" > lr.cycle_momentum does nothing: optimizer 'sgd' has no Adam betas"), std::string::npos)
      << sgd.out;
}

// Through the shipped Adam and the strategies that keep the step's arguments past the call (ddp's
// overlap_param_gather) or hand shards to the optimizer (ZeRO): every parameter at twice the peak
// and floor (init 0) is the run at twice the rates, and ddp == ddp overlapped == ZeRO-2 with a rule
// for the word embeddings only.
TEST(OptimizerGroups, OwnPeakAndFloorEqualScaledRatesThroughEveryStrategy) {
  const std::string base = kTrain + iters(6);
  const Curve doubled =
      dtk_test::run_curve(base + " --set lr.lr=2e-3 --set lr.min_lr=2e-4", DTK_TEST_TMP, "lr-doubled");
  const Curve own = dtk_test::run_curve(base + " --set 'lr.param_rules=match: \".\" max_lr: 2e-3 min_lr: 2e-4'",
                                        DTK_TEST_TMP, "lr-own-everywhere");
  dtk_test::expect_same_curve(doubled, own, 6, "every group's own peak and floor x2 vs the schedule's x2");
  const std::string dp2 = "launch --nproc_per_node 2 " + base + " --set train.micro_batch_size=1 " +
                          "--set 'lr.param_rules=match: \"word_embeddings\" max_lr: 5e-3 min_lr: 1e-3' ";
  const Curve ddp = dtk_test::run_curve(dp2, DTK_TEST_TMP, "own-lr-ddp");
  dtk_test::expect_same_curve(
      ddp, dtk_test::run_curve(dp2 + " --set strategy.overlap_param_gather=true", DTK_TEST_TMP, "own-lr-ddp-overlap"),
      6, "ddp overlap_param_gather vs ddp with a group's own peak");
  dtk_test::expect_same_curve(
      ddp, dtk_test::run_curve(dp2 + " --strategy zero --set strategy.stage=2", DTK_TEST_TMP, "own-lr-zero2"), 6,
      "zero-2 vs ddp with a group's own peak");
  const Curve plain = dtk_test::run_curve("launch --nproc_per_node 2 " + base + " --set train.micro_batch_size=1",
                                          DTK_TEST_TMP, "own-lr-none");
  EXPECT_GT(std::abs(plain.loss.at(6) - ddp.loss.at(6)), 1e-4) << "the rule changed nothing";
}

// OneCycle's betas reach the optimizer through every strategy that hands it the step's arguments
// (ddp's overlap_param_gather keeps them past the call; ZeRO hands shards, its offload steps
// cpu_adam on the host and its disk tier steps slice by slice): DP2 runs equal ddp's, which
// differs from the run whose momentum does not cycle.
TEST(OptimizerGroups, OneCyclesBetasReachTheOptimizerThroughEveryStrategy) {
  const std::string dp2 =
      "launch --nproc_per_node 2 " + kTrain + iters(6) +
      " --set train.micro_batch_size=1 --set lr.lr_decay_style=OneCycle --set lr.lr=1e-2 --set lr.min_lr=1e-4 "
      "--set lr.cycle_first_step_size=2 --set lr.decay_step_size=1 --set lr.decay_lr_rate=0.5 "
      "--set lr.decay_mom_rate=0.02 --set lr.cycle_min_mom=0.5 ";
  const Curve ddp = dtk_test::run_curve(dp2, DTK_TEST_TMP, "cycle-ddp");
  const std::string swap = fresh_dir("cycle-swap");
  const std::pair<std::string, std::string> others[] = {
      {"--set strategy.overlap_param_gather=true", "ddp overlap_param_gather"},
      {"--strategy zero --set strategy.stage=2", "zero-2"},
      {"--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu --optimizer cpu_adam",
       "zero-2, the optimizer on the host (cpu_adam)"},
      {"--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=nvme --set strategy.nvme_buffer_mb=1 "
       "--optimizer cpu_adam --set strategy.nvme_path=" +
           swap,
       "zero-3, the optimizer state on disk"}};
  for (const auto& [args, what] : others)
    dtk_test::expect_same_curve(ddp, dtk_test::run_curve(dp2 + args, DTK_TEST_TMP, "cycle-other"), 6,
                                what + " vs ddp under OneCycle's momentum cycling");
  const Curve fixed = dtk_test::run_curve(dp2 + " --set lr.cycle_momentum=false", DTK_TEST_TMP, "cycle-fixed");
  ASSERT_TRUE(fixed.loss.count(6) && ddp.loss.count(6));
  EXPECT_GT(std::abs(fixed.loss.at(6) - ddp.loss.at(6)), 1e-4) << "the betas changed nothing";
}

// Megatron's --log-num-zeros-in-grad: every element of the model counted once, so the count is
// the same with one process, data parallel (replicated gradients), ZeRO (sharded) and tensor
// parallel (TP shards, replicated norms once). With an untied output layer, the rows of the
// 512-token embedding that no token of the batch (4 x 33 tokens) used have exactly zero
// gradients: at least (512 - 132) x 64. Other exact zeros are accidents of float summation and
// may differ with the summation order of a layout by a few.
TEST(Logging, NumZerosInGradIsTheSameInEveryParallelLayout) {
  const std::string args = kTrain + iters(3) +
                           " --set logging.log_num_zeros_in_grad=true --set model.untie_embeddings_and_output_weights=true ";
  Result one_run, dp_run, zero_run, tp_run;
  auto one = run_scalars(args, "zeros-1", &one_run);
  auto dp = run_scalars("launch --nproc_per_node 2 " + args + " --set train.micro_batch_size=1",
                        "zeros-dp2", &dp_run);
  auto zero = run_scalars("launch --nproc_per_node 2 " + args +
                              " --set train.micro_batch_size=1 --strategy zero --set strategy.stage=2",
                          "zeros-zero2", &zero_run);
  auto tp = run_scalars("launch --nproc_per_node 2 " + args + " --set distributed.tensor_model_parallel_size=2",
                        "zeros-tp2", &tp_run);
  for (const Result* r : {&one_run, &dp_run, &zero_run, &tp_run}) ASSERT_EQ(r->code, 0) << r->out;
  EXPECT_NE(one_run.out.find(" num zeros: "), std::string::npos) << one_run.out;
  ASSERT_EQ(one["num-zeros"].size(), 3u) << one_run.out;
  for (int64_t it = 1; it <= 3; ++it) {
    EXPECT_GE(one["num-zeros"].at(it), (512.0f - 132) * 64) << "iteration " << it;
    EXPECT_LT(one["num-zeros"].at(it), 512.0f * 64) << "iteration " << it;
    EXPECT_NEAR(dp["num-zeros"].at(it), one["num-zeros"].at(it), 8) << "DP2, iteration " << it;
    EXPECT_NEAR(zero["num-zeros"].at(it), one["num-zeros"].at(it), 8) << "ZeRO-2, iteration " << it;
    EXPECT_NEAR(tp["num-zeros"].at(it), one["num-zeros"].at(it), 8) << "TP2, iteration " << it;
  }
}

// Megatron writes each iteration's own values every tensorboard_log_interval iterations, against
// the iteration and against consumed samples; the log line's window does not change them.
TEST(Logging, TensorBoardPointsPerIterationAndVsSamples) {
  Result every_run, sparse_run;
  auto every = run_scalars(kTrain + iters(6), "tb-every", &every_run);
  auto sparse = run_scalars(kTrain + iters(6) + " --set logging.log_interval=3 --set logging.tensorboard_log_interval=2",
                            "tb-sparse", &sparse_run);
  ASSERT_EQ(every_run.code, 0) << every_run.out;
  ASSERT_EQ(sparse_run.code, 0) << sparse_run.out;
  for (const char* tag : {"lm loss", "grad-norm", "learning-rate", "loss-scale", "batch-size", "world-size"}) {
    ASSERT_EQ(sparse[tag].size(), 3u) << tag;
    for (int64_t it : {2, 4, 6}) {
      EXPECT_EQ(sparse[tag].at(it), every[tag].at(it)) << tag << " at " << it;
      // Global batch 4: iteration it has consumed 4 it samples.
      EXPECT_EQ(sparse[std::string(tag) + " vs samples"].at(4 * it), every[tag].at(it)) << tag << " vs samples";
    }
  }
  EXPECT_EQ(every["lm loss validation vs samples"].size(), 1u);
}

TEST(Logging, FinalEvaluationIsLabelledAsMegatronLabelsIt) {
  const Result r = dtk_test::run_dtk(kTrain + iters(4) + " --set eval.eval_interval=2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(" validation loss at iteration 2 | lm loss value: "), std::string::npos) << r.out;
  // As Megatron: the loop validates after the last iteration too, then the final validation reads
  // the next samples.
  const std::string in_loop = " validation loss at iteration 4 | lm loss value: ",
                    final = " validation loss at iteration 4 on validation set | lm loss value: ";
  const size_t in_loop_at = r.out.find(in_loop), final_at = r.out.find(final);
  ASSERT_NE(in_loop_at, std::string::npos) << r.out;
  ASSERT_NE(final_at, std::string::npos) << r.out;
  EXPECT_LT(in_loop_at, final_at) << r.out;
  EXPECT_NE(r.out.substr(in_loop_at + in_loop.size(), 12), r.out.substr(final_at + final.size(), 12))
      << "the same samples twice\n"
      << r.out;
  EXPECT_NE(r.out.find(" validation loss at iteration 4 on test set | lm loss value: "), std::string::npos) << r.out;
}

// train.calculate_per_token_loss (Megatron-LM's --calculate-per-token-loss). With end-of-document
// tokens masked out of the loss, micro-batches count different tokens; the per-token loss, its
// gradients and the reported lm loss (training and validation) are then those of the global batch
// as one micro-batch, however it is split: over micro-batches, data-parallel ranks (ddp, ZeRO),
// tensor- or pipeline-parallel ranks. Each micro-batch's mean averaged (the default) differs.
TEST(Loss, PerTokenLossIsTheGlobalBatchsTokenMeanHoweverItIsSplit) {
  const std::string masked = kTrain + iters(4) +
                             " --set dataset.vocab_size=8 --set step.eod_token=1 --set step.eod_mask_loss=true "
                             "--set eval.eval_iters=1 ";
  const std::string per_token = " --set train.calculate_per_token_loss=true ";
  const Curve whole = dtk_test::run_curve(masked + " --set train.micro_batch_size=4", DTK_TEST_TMP, "token-mean-whole");
  const auto validation = [](const Result& r) {
    const std::string label = "on validation set | lm loss value: ";
    const size_t at = r.out.find(label);
    return at == std::string::npos ? NAN : std::stod(r.out.substr(at + label.size()));
  };
  const double whole_validation = validation(whole.run);
  ASSERT_TRUE(std::isfinite(whole_validation)) << whole.run.out;
  const std::string launch = "launch --nproc_per_node 2 ";
  const std::vector<std::pair<std::string, std::string>> splits = {
      {"2 micro-batches", masked + per_token},
      {"DP2, 2 micro-batches each", launch + masked + per_token + " --set train.micro_batch_size=1"},
      {"ZeRO-2 DP2",
       launch + masked + per_token + " --set train.micro_batch_size=1 --strategy zero --set strategy.stage=2"},
      {"TP2", launch + masked + per_token + " --set distributed.tensor_model_parallel_size=2"},
      {"PP2", launch + masked + per_token + " --set distributed.pipeline_model_parallel_size=2"},
  };
  for (const auto& [what, args] : splits) {
    const Curve split = dtk_test::run_curve(args, DTK_TEST_TMP, "token-mean " + what);
    dtk_test::expect_same_curve(whole, split, 4, "per-token loss, " + what + " vs one micro-batch");
    EXPECT_NEAR(validation(split.run), whole_validation, 1e-5 * whole_validation) << what << "\n" << split.run.out;
  }
  // SGD's update is linear in the gradient (Adam's nearly ignores a constant factor): the factor
  // itself reaches the optimizer.
  const std::string sgd = " --optimizer sgd --set lr.lr=0.05 --set lr.min_lr=0.005 ";
  dtk_test::expect_same_curve(
      dtk_test::run_curve(masked + sgd + " --set train.micro_batch_size=4", DTK_TEST_TMP, "token-mean-sgd-whole"),
      dtk_test::run_curve(launch + masked + sgd + per_token + " --set train.micro_batch_size=1", DTK_TEST_TMP,
                          "token-mean-sgd-dp2"),
      4, "per-token loss under sgd, DP2 x 2 micro-batches vs one micro-batch");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(masked + per_token + " --set strategy.average_gradients=false"),
                                  "config: train.calculate_per_token_loss divides the gradients by the global batch's "
                                  "tokens; strategy.average_gradients=false would make them");
  const Curve means = dtk_test::run_curve(masked, DTK_TEST_TMP, "token-mean-default");
  // At initialisation every token's loss is near log(vocab): the weighting shows in the gradient.
  EXPECT_GT(std::abs(means.norm.at(1) - whole.norm.at(1)), 1e-4 * whole.norm.at(1))
      << "the micro-batches counted the same tokens: the test shows nothing";
}

// eval.full_validation (Megatron's --full-validation): every evaluation reads the whole split,
// each of its 11 samples once, and reports the mean over their tokens, however the samples fall
// into micro-batches and ranks: DP1 and DP2 with a padded last global batch, several micro-batches
// per step, two pipeline stages, two tensor-parallel ranks. The reference reads the same 11 samples one per global
// batch with the per-token loss. lr 0 keeps the model the same across batch layouts; a wide init spreads the samples'
// losses, so a padding row counted (sample 0 twice) or a micro-batch mean shows.
TEST(FullValidation, EachSampleOnceHoweverTheBatchesFall) {
  const std::string base = kTrain + iters(2) +
                           " --set dataset.vocab_size=8 --set step.eod_token=1 --set step.eod_mask_loss=true "
                           "--set model.init_method_std=1.0 --set lr.lr=0 --set lr.min_lr=0 --set lr.lr_warmup_iters=0 "
                           "--set dataset.num_samples=11 ";
  const std::string full = base + " --set eval.full_validation=true --set eval.eval_interval=2 ";
  const auto loss_at = [](const Result& r, const std::string& label) {
    const std::string key = " validation loss at " + label + " | lm loss value: ";
    const size_t at = r.out.find(key);
    return at == std::string::npos ? NAN : std::stod(r.out.substr(at + key.size()));
  };
  const Result reference = dtk_test::run_dtk(base +
                                             " --set train.micro_batch_size=1 --set train.global_batch_size=1 "
                                             "--set train.calculate_per_token_loss=true --set eval.eval_iters=11");
  ASSERT_EQ(reference.code, 0) << reference.out;
  const double want = loss_at(reference, "iteration 2 on validation set");
  ASSERT_TRUE(std::isfinite(want)) << reference.out;
  const std::string launch = "launch --nproc_per_node 2 ";
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"DP1, micro-batches of 2 (one padding row)", full},
      {"DP2 (rank 1 pads)", launch + full},
      {"DP2, 2 micro-batches per step", launch + full + " --set train.micro_batch_size=1"},
      {"PP2", launch + full + " --set distributed.pipeline_model_parallel_size=2"},
      {"TP2 (the loss mask broadcast)", launch + full + " --set distributed.tensor_model_parallel_size=2"},
  };
  for (const auto& [what, args] : layouts) {
    const Result r = dtk_test::run_dtk(args);
    ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
    EXPECT_NE(r.out.find(" validation reads its whole split (eval.full_validation): 11 samples in 3 global batches, "
                         "each sample once"),
              std::string::npos)
        << what << "\n"
        << r.out;
    // In the loop and after training: from the split's start each time (lr 0: the same model).
    EXPECT_NEAR(loss_at(r, "iteration 2"), want, 1e-5 * want) << what << "\n" << r.out;
    EXPECT_NEAR(loss_at(r, "iteration 2 on validation set"), want, 1e-5 * want) << what << "\n" << r.out;
    EXPECT_TRUE(std::isfinite(loss_at(r, "iteration 2 on test set"))) << what << "\n" << r.out;
  }
  // The same 11 samples as micro-batch means (the default evaluation) differ: the check can fail.
  const Result means = dtk_test::run_dtk(base +
                                         " --set train.micro_batch_size=1 --set train.global_batch_size=1 "
                                         "--set eval.eval_iters=11");
  ASSERT_EQ(means.code, 0) << means.out;
  EXPECT_GT(std::abs(loss_at(means, "iteration 2 on validation set") - want), 1e-4 * want) << means.out;
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + iters(3) + " --set eval.full_validation=true"),
                                  "random data has no end; set the option num_samples");
}

// eval.validation_sets (Megatron's --multiple-validation-sets): validation reads each set whole, in
// place of the run's validation split, and reports each under its name (its position when
// unnamed), in the log, the metrics file and TensorBoard. Each set's figure equals a run that
// validates on that set alone; the test split is the run's own. At DP1 and DP2.
TEST(ValidationSets, EachSetReadWholeAsARunOfItsOwn) {
  const std::string base =
      kTrain + iters(2) +
      " --set model.init_method_std=1.0 --set lr.lr=0 --set lr.min_lr=0 --set lr.lr_warmup_iters=0 "
      "--set eval.full_validation=true --set eval.eval_interval=2 --set dataset.num_samples=11 ";
  const auto loss_at = [](const Result& r, const std::string& what, const std::string& label) {
    const std::string key = " " + what + " loss at " + label + " | lm loss value: ";
    const size_t at = r.out.find(key);
    return at == std::string::npos ? NAN : std::stod(r.out.substr(at + key.size()));
  };
  // The references (lr 0: the same model whatever it trained on): the run's own validation split
  // read whole, of tokens below 256, and of tokens below 512.
  std::map<std::string, double> want;
  for (const char* vocab : {"256", "512"}) {
    const Result alone = dtk_test::run_dtk(base + " --set dataset.vocab_size=" + vocab);
    ASSERT_EQ(alone.code, 0) << alone.out;
    want[vocab] = loss_at(alone, "validation", "iteration 2 on validation set");
    ASSERT_TRUE(std::isfinite(want[vocab])) << alone.out;
  }
  ASSERT_GT(std::abs(want["256"] - want["512"]), 1e-4 * want["512"])
      << "the sets hold the same: the test shows nothing";
  const std::string dir = fresh_dir("validation-sets"), metrics = dir + "/metrics.jsonl", tb = dir + "/tb";
  const std::string sets =
      base + " --set logging.metrics_jsonl=" + metrics + " --set logging.tensorboard_dir=" + tb +
      " --set 'eval.validation_sets=name: \"narrow\" options { key: \"vocab_size\" value: \"256\" }'"
      " --set 'eval.validation_sets=options { key: \"num_samples\" value: \"11\" }'";
  for (const char* launch : {"", "launch --nproc_per_node 2 "}) {
    const Result r = dtk_test::run_dtk(launch + sets);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(" validation-narrow reads its whole split (eval.full_validation): 11 samples in 3 global "
                         "batches, each sample once"),
              std::string::npos)
        << r.out;
    for (const char* label : {"iteration 2", "iteration 2 on validation set"}) {
      EXPECT_NEAR(loss_at(r, "validation-narrow", label), want["256"], 1e-5 * want["256"]) << launch << label << r.out;
      EXPECT_NEAR(loss_at(r, "validation-1", label), want["512"], 1e-5 * want["512"]) << launch << label << r.out;
      EXPECT_TRUE(std::isnan(loss_at(r, "validation", label))) << "the run's own validation split was read\n" << r.out;
    }
    EXPECT_TRUE(std::isfinite(loss_at(r, "validation", "iteration 2 on test set"))) << r.out;
  }
  const std::string jsonl = file_text(metrics);
  EXPECT_NE(jsonl.find("{\"kind\": \"validation-narrow\", \"iteration\": 2, \"after_training\": true, \"lm loss\": "),
            std::string::npos)
      << jsonl;
  EXPECT_NE(jsonl.find("{\"kind\": \"validation-1\", \"iteration\": 2, \"lm loss\": "), std::string::npos) << jsonl;
  auto scalars = dtk_test::read_scalars(tb);
  EXPECT_NEAR(scalars["lm loss validation-narrow"][2], want["256"], 1e-5 * want["256"]);
  EXPECT_NEAR(scalars["lm loss validation-1"][2], want["512"], 1e-5 * want["512"]);
  EXPECT_EQ(scalars.count("lm loss validation"), 0u) << "the run's own validation split was read";
  // Bad sets: one line each, before training.
  const std::string one = " --set 'eval.validation_sets=name: \"a\" options { key: \"num_samples\" value: \"5\" }'";
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + iters(3) + one),
                                  "eval.validation_sets (Megatron's --multiple-validation-sets) needs "
                                  "eval.full_validation=true");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(base + one + one),
                                  "eval.validation_sets[1]: name 'a' is given to an earlier set too");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(base +
                        " --set 'eval.validation_sets=name: \"b\" options { key: \"num_sample\" value: \"5\" }'"),
      "eval.validation_sets[0] 'b': ");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(base + " --set 'eval.validation_sets=name: \"two words\"'"),
                                  "eval.validation_sets[0]: name 'two words' is not one word");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(base + " --set 'eval.validation_sets=nme: \"x\"'"),
                                  "not a valid ValidationSet entry");
}

// eval.skip_train (Megatron's --skip-train): the loaded model's evaluations after training, as
// the training run printed them (validation from the split's first sample, labelled with the
// loaded iteration), without a training iteration or a save; with full validation too.
TEST(SkipTrain, EvaluatesTheLoadedModelAsTheTrainingRunDid) {
  const std::string ckpt = fresh_dir("skip-train");
  const auto value = [](const Result& r, const std::string& label) {
    const std::string key = " validation loss at " + label + " | lm loss value: ";
    const size_t at = r.out.find(key);
    return at == std::string::npos ? std::string() : r.out.substr(at + key.size(), 12);
  };
  const std::string run = kTrain + iters(4) + " --set dataset.num_samples=40 ";
  for (const std::string& full : {"", " --set eval.full_validation=true "}) {
    // The figures to match: a run that validated only after training, from sample 0.
    const Result trained = dtk_test::run_dtk(run + full);
    ASSERT_EQ(trained.code, 0) << trained.out;
    // The checkpoint of the same training that validated on the way (its validation position is
    // past sample 0 then): skip_train starts at 0 again.
    // Without the optimizer's state in one of them: skip_train loads the model alone.
    const Result saved = dtk_test::run_dtk(run + full + " --set eval.eval_interval=2 --set checkpoint.save=" + ckpt +
                                           (full.empty() ? " --set checkpoint.no_save_optim=true" : ""));
    ASSERT_EQ(saved.code, 0) << saved.out;
    const Result skipped = dtk_test::run_dtk(run + full + " --set eval.skip_train=true --set checkpoint.load=" + ckpt +
                                             " --set checkpoint.save=" + ckpt + " --set train.train_iters=9");
    ASSERT_EQ(skipped.code, 0) << skipped.out;
    EXPECT_NE(skipped.out.find(" skipping training (eval.skip_train is on) ..."), std::string::npos) << skipped.out;
    EXPECT_EQ(skipped.out.find("consumed samples:"), std::string::npos) << "it trained\n" << skipped.out;
    EXPECT_EQ(skipped.out.find("saved checkpoint"), std::string::npos) << skipped.out;
    for (const std::string& label : {"iteration 4 on validation set", "iteration 4 on test set"}) {
      ASSERT_FALSE(value(trained, label).empty()) << label << "\n" << trained.out;
      EXPECT_EQ(value(skipped, label), value(trained, label)) << full << label << "\n" << skipped.out;
    }
  }
  // Without a checkpoint: the model as initialised, at iteration 0.
  const Result fresh = dtk_test::run_dtk(run + " --set eval.skip_train=true");
  ASSERT_EQ(fresh.code, 0) << fresh.out;
  EXPECT_NE(fresh.out.find("evaluating the model as initialised (no checkpoint was loaded)"), std::string::npos)
      << fresh.out;
  EXPECT_FALSE(value(fresh, "iteration 0 on validation set").empty()) << fresh.out;
}

}  // namespace
