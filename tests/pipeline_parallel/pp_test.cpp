// Pipeline parallelism (core/runtime/src/train/one_f_one_b.cpp and interleaved.cpp, Megatron's schedules) end to
// end through `dtk launch`, real processes over loopback (Gloo):
//   * PP=2 and PP=4 give one stage's lm loss and grad norm, iteration by iteration for 20
//     iterations (fp32, dropout 0, within 1e-5), with 1, 4 and 8 micro-batches per step; gpt
//     with tied embeddings (their gradients summed over the first and last stage) and llama;
//   * TP=2 x PP=2 and PP=2 x DP=2 (ddp and ZeRO stage 1), Domino inside each stage;
//   * resume is exact;
//   * bad layouts are refused before any work, in one line.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"

namespace {

using dtk_test::Curve;
using dtk_test::expect_same_curve;

// gpt-tiny with 4 layers on synthetic tokens, gradient clipping active, 20 iterations of 8
// samples; micro-batches of `micro` (so 8 / micro per step and data-parallel rank).
std::string train(const std::string& config, int micro) {
  return std::string("train --config ") + DTK_SOURCE_DIR + "/configs/" + config +
         " --dataset synthetic --threads 1 --set model.num_layers=4 "
         "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
         "--set model.hidden_dropout=0 --set model.attention_dropout=0 "
         "--set train.micro_batch_size=" +
         std::to_string(micro) +
         " --set train.global_batch_size=8 --set train.train_iters=20 --set train.clip_grad=0.3 "
         "--set lr.lr_warmup_iters=2 --set logging.log_interval=1 --set eval.eval_interval=10 --set eval.eval_iters=1 "
         "--set distributed.timeout_seconds=60 ";
}

Curve curve_of(int nproc, const std::string& args, const std::string& name) {
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  return dtk_test::run_curve(launch + args, DTK_TEST_TMP, name);
}

std::string pp(int n) { return "--set distributed.pipeline_model_parallel_size=" + std::to_string(n) + " "; }

// The validation losses a run printed ("validation loss at iteration N | lm loss value: X").
std::vector<double> validation_losses(const std::string& out) {
  std::vector<double> v;
  const std::regex re("validation loss at iteration [0-9]+ \\| lm loss value: ([-+0-9.eE]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    v.push_back(std::stod((*it)[1]));
  return v;
}

// A run resumed at iteration 10 of 20: its iterations 11 to 20 are the uninterrupted run's.
void expect_continues_run(const Curve& whole, const Curve& c, const std::string& what, double tolerance) {
  ASSERT_EQ(c.loss.size(), 10u) << what << "\n" << c.run.out;
  for (int64_t it = 11; it <= 20; ++it) {
    EXPECT_NEAR(c.loss.at(it), whole.loss.at(it), tolerance * whole.loss.at(it)) << what << ", iteration " << it;
    EXPECT_NEAR(c.norm.at(it), whole.norm.at(it), tolerance * whole.norm.at(it)) << what << ", iteration " << it;
  }
}

void expect_same_validation(const Curve& want, const Curve& got, const std::string& what) {
  const std::vector<double> a = validation_losses(want.run.out), b = validation_losses(got.run.out);
  ASSERT_FALSE(a.empty()) << what << ": no validation loss printed\n" << want.run.out;
  ASSERT_EQ(a.size(), b.size()) << what << "\n" << got.run.out;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << what << ", validation " << i;
}

}  // namespace

// gpt-tiny ties its output layer to the word embedding: the first and the last stage each hold a
// copy, their gradients summed after every backward, so the copies stay equal.
TEST(Pipeline, TwoStagesEqualOneForOneFourAndEightMicroBatches) {
  for (int micro : {8, 2, 1}) {  // 1, 4 and 8 micro-batches per step
    const std::string what = std::to_string(8 / micro) + " micro-batches";
    const Curve one = curve_of(1, train("gpt-tiny.pbtxt", micro), "gpt-pp1-m" + std::to_string(micro));
    const Curve two = curve_of(2, train("gpt-tiny.pbtxt", micro) + pp(2), "gpt-pp2-m" + std::to_string(micro));
    expect_same_curve(one, two, 20, "gpt PP2 vs PP1, " + what);
    expect_same_validation(one, two, "gpt PP2 vs PP1, " + what);
  }
}

// Four stages of one layer each: two stages in the middle pass activations and gradients on and
// add zeros to the tied embedding's sum. llama (untied output layer, rotary positions at every
// stage) as well.
TEST(Pipeline, FourStagesEqualOneForGptAndLlama) {
  for (const char* config : {"gpt-tiny.pbtxt", "llama-tiny.pbtxt"}) {
    const std::string name = std::string(config).substr(0, std::string(config).find('-'));
    const Curve one = curve_of(1, train(config, 2), name + "-pp1");
    const Curve four = curve_of(4, train(config, 2) + pp(4), name + "-pp4");
    expect_same_curve(one, four, 20, name + " PP4 vs PP1, 4 micro-batches");
    expect_same_validation(one, four, name + " PP4 vs PP1");
  }
}

// The grid in Megatron's rank order (tensor fastest, then data, then pipeline).
TEST(Pipeline, WithTensorAndDataParallelismAndDominoInsideTheStages) {
  const Curve one = curve_of(1, train("gpt-tiny.pbtxt", 2), "grid-one");
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  expect_same_curve(one, curve_of(4, train("gpt-tiny.pbtxt", 2) + pp(2) + tp2, "tp2pp2"), 20, "TP2 x PP2");
  expect_same_curve(one,
                    curve_of(4, train("gpt-tiny.pbtxt", 2) + pp(2) + tp2 + "--set model.domino_chunks=2 ",
                             "tp2pp2-domino"),
                    20, "TP2 x PP2, Domino 2 chunks in each stage");
  expect_same_curve(one, curve_of(4, train("gpt-tiny.pbtxt", 2) + pp(2) + "--strategy ddp ", "pp2dp2"), 20,
                    "PP2 x DP2, ddp");
  // ZeRO stage 1 holds the tied weight whole at data-parallel size 1: summed like ddp's.
  expect_same_curve(one,
                    curve_of(2, train("gpt-tiny.pbtxt", 2) + pp(2) + "--strategy zero --set strategy.stage=1 ",
                             "pp2-zero1"),
                    20, "PP2, ZeRO stage 1, tied embeddings");
  // ZeRO stage 1 sharding the tied weight over data-parallel ranks: a bucket of its own on the first
  // and the last stage, so each rank sums the same shard of both copies (Megatron's distributed
  // optimizer with --pipeline-model-parallel-size and tied embeddings, its GPT default).
  expect_same_curve(
      one, curve_of(4, train("gpt-tiny.pbtxt", 2) + pp(2) + "--strategy zero --set strategy.stage=1 ", "pp2dp2-zero1"),
      20, "PP2 x DP2, ZeRO stage 1, tied embeddings sharded");
  expect_same_curve(one,
                    curve_of(4,
                             train("gpt-tiny.pbtxt", 2) + pp(2) +
                                 "--strategy zero --set strategy.stage=1 --set strategy.overlap_comm=true "
                                 "--set strategy.overlap_param_gather=true --set strategy.offload_optimizer=cpu ",
                             "pp2dp2-zero1-overlap-offload"),
                    20, "PP2 x DP2, ZeRO stage 1 overlapped, optimizer on the host, tied embeddings sharded");
  // ZeRO stage 1 over each stage's data-parallel group (llama: its output layer is its own).
  const Curve llama = curve_of(1, train("llama-tiny.pbtxt", 2), "grid-llama");
  expect_same_curve(llama,
                    curve_of(4, train("llama-tiny.pbtxt", 2) + pp(2) + "--strategy zero --set strategy.stage=1 ",
                             "llama-pp2dp2-zero1"),
                    20, "llama PP2 x DP2, ZeRO stage 1");
}

// bf16: activations and their gradients travel as bf16, the tied gradients are summed in fp32;
// the stages compute what one stage computes, so the curves agree to bf16's resolution or better.
TEST(Pipeline, Bf16FollowsOneStage) {
  const std::string bf16 = "--set train.params_dtype=bf16 ";
  expect_same_curve(curve_of(1, train("gpt-tiny.pbtxt", 2) + bf16, "bf16-pp1"),
                    curve_of(2, train("gpt-tiny.pbtxt", 2) + bf16 + pp(2), "bf16-pp2"), 20, "bf16 PP2 vs PP1", 2e-3);
}

// Every stage saves its own mp_rank_TT_PPP directory; a resumed run continues as the
// uninterrupted one; `dtk checkpoint convert` moves it to one stage and to TP 2 x PP 2, each
// resuming as the uninterrupted run continues.
TEST(Pipeline, ResumeIsExact) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "pp-ckpt");
  const Curve whole = curve_of(2, train("gpt-tiny.pbtxt", 2) + pp(2), "resume-whole");
  const Curve first = curve_of(2,
                               train("gpt-tiny.pbtxt", 2) + pp(2) +
                                   "--set train.train_iters=10 --set lr.lr_decay_iters=20 --set checkpoint.save=" + dir,
                               "resume-first");
  ASSERT_EQ(first.run.code, 0) << first.run.out;
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/iter_0000010/mp_rank_00_000")) << first.run.out;
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/iter_0000010/mp_rank_00_001")) << first.run.out;
  const Curve second = curve_of(2, train("gpt-tiny.pbtxt", 2) + pp(2) + "--set checkpoint.load=" + dir, "resume-second");
  ASSERT_EQ(second.loss.size(), 10u) << second.run.out;
  for (int64_t it = 11; it <= 20; ++it) {
    EXPECT_NEAR(second.loss.at(it), whole.loss.at(it), 1e-6 * whole.loss.at(it)) << "iteration " << it;
    EXPECT_NEAR(second.norm.at(it), whole.norm.at(it), 1e-6 * whole.norm.at(it)) << "iteration " << it;
  }
  // Another pipeline size loads it after `dtk checkpoint convert`, and is told so before.
  const dtk_test::Result one = dtk_test::run_dtk(train("gpt-tiny.pbtxt", 2) + "--set checkpoint.load=" + dir, 120);
  EXPECT_NE(one.code, 0);
  EXPECT_NE(one.out.find("was saved with pipeline stages (mp_rank_00_000), this run has pipeline-parallel size 1 "
                         "(dtk checkpoint convert SRC DST --pipeline_model_parallel_size 1 makes one for it)"),
            std::string::npos)
      << one.out;
  // PP 2 -> 1 stage: resumed on one process, the uninterrupted run's losses.
  const dtk_test::Result to_one =
      dtk_test::run_dtk("checkpoint convert " + dir + " " + dir + "-pp1 --pipeline_model_parallel_size 1", 120);
  ASSERT_EQ(to_one.code, 0) << to_one.out;
  EXPECT_NE(to_one.out.find("from tensor-parallel size 1, pipeline-parallel size 2 to 1, 1"), std::string::npos)
      << to_one.out;
  const Curve on_one = curve_of(1, train("gpt-tiny.pbtxt", 2) + "--set checkpoint.load=" + dir + "-pp1", "resume-pp1");
  // 1 stage -> TP 2 x PP 2: resumed on four processes.
  const dtk_test::Result to_grid = dtk_test::run_dtk(
      "checkpoint convert " + dir + "-pp1 " + dir + "-tp2pp2 --tensor_model_parallel_size 2 "
      "--pipeline_model_parallel_size 2", 120);
  ASSERT_EQ(to_grid.code, 0) << to_grid.out;
  // A run of another tensor- and pipeline-parallel size is told to convert both.
  const dtk_test::Result grid_on_one =
      dtk_test::run_dtk(train("gpt-tiny.pbtxt", 2) + "--set checkpoint.load=" + dir + "-tp2pp2", 120);
  EXPECT_NE(grid_on_one.code, 0);
  EXPECT_NE(
      grid_on_one.out.find("was saved with pipeline stages (mp_rank_00_000) at tensor-parallel size 2, this run "
                           "has pipeline-parallel size 1 and tensor-parallel size 1 (dtk checkpoint convert SRC "
                           "DST --tensor_model_parallel_size 1 --pipeline_model_parallel_size 1 makes one for it)"),
      std::string::npos)
      << grid_on_one.out;
  const Curve on_grid = curve_of(4,
                                 train("gpt-tiny.pbtxt", 2) + pp(2) +
                                     "--set distributed.tensor_model_parallel_size=2 --set checkpoint.load=" + dir + "-tp2pp2",
                                 "resume-tp2pp2");
  for (const auto* c : {&on_one, &on_grid}) {
    ASSERT_EQ(c->loss.size(), 10u) << c->run.out;
    for (int64_t it = 11; it <= 20; ++it) {
      EXPECT_NEAR(c->loss.at(it), whole.loss.at(it), 1e-5 * whole.loss.at(it)) << "converted, iteration " << it;
      EXPECT_NEAR(c->norm.at(it), whole.norm.at(it), 1e-5 * whole.norm.at(it)) << "converted, iteration " << it;
    }
  }
  // Inspect reads every stage's files.
  const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + dir + "-tp2pp2", 120);
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  EXPECT_NE(inspect.out.find("layout: tensor-parallel 2, pipeline-parallel 2 (stage 0 shown)"), std::string::npos)
      << inspect.out;
}

// What a user looks at: the wait of rank 0's stage next to the theoretical bubble in each log
// line (m = 4 micro-batches, 2 stages: 1 / 5), Megatron's receive timers, and the timeline.
TEST(Pipeline, LogShowsTheWaitTheBubbleAndTheReceiveTimers) {
  const std::string trace = dtk_test::fresh_dir(DTK_TEST_TMP, "pp-trace") + "/trace.json";
  const dtk_test::Result r = dtk_test::run_dtk(
      "launch --nproc_per_node 2 " + train("gpt-tiny.pbtxt", 2) + pp(2) +
          "--set train.train_iters=4 --set logging.timing_log_level=2 --set logging.trace_file=" + trace +
          " --set logging.trace_iterations=3-3",
      120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(pipeline wait \(ms\): [0-9.]+ \(bubble in theory 20%\))")))
      << r.out;
  // Rank 0's stage sent 4 activations of [2, 32, 64] fp32 (0.06 MB) and took part in the tied
  // embedding's sum ([512, 64] fp32: 0.12 MB sent by a ring of 2).
  EXPECT_NE(r.out.find("pipeline-parallel traffic sent per iteration (MB) | point-to-point: 0.06 | collectives: 0.1"),
            std::string::npos)
      << r.out;
  for (const char* timer : {"    forward-recv ....", "    backward-recv ...."})
    EXPECT_NE(r.out.find(timer), std::string::npos) << timer << "\n" << r.out;
  // One timeline per rank, each with the schedule's spans and its receive waits.
  for (const std::string rank : {"0", "1"}) {
    std::ifstream in(trace.substr(0, trace.size() - 5) + ".rank" + rank + ".json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const char* span : {"\"forward 3\"", "\"backward 3\"", rank == "0" ? "receive gradients" : "receive activations"})
      EXPECT_NE(text.find(span), std::string::npos) << "rank " << rank << ": " << span;
  }
}

// A slow simulated link delays the stages' messages (a study tool) and changes no number.
TEST(Pipeline, SimulatedLinkDelaysTheMessagesNotTheLosses) {
  const Curve plain = curve_of(2, train("gpt-tiny.pbtxt", 2) + pp(2) + "--set train.train_iters=6 ", "link-plain");
  const Curve slow = curve_of(
      2, train("gpt-tiny.pbtxt", 2) + pp(2) + "--set train.train_iters=6 --set distributed.simulated_link=2ms,1GBps ",
      "link-slow");
  expect_same_curve(plain, slow, 6, "PP2 over a simulated 2 ms link");
}

// Refused before any work, in one line naming what is wrong.
TEST(Pipeline, BadLayoutsAreRefused) {
  struct Case {
    int nproc;
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {3, train("gpt-tiny.pbtxt", 2) + pp(2),
       "world size 3 is not divisible by tensor x pipeline model parallel size 2"},
      {3, train("gpt-tiny.pbtxt", 2) + pp(3), "num_layers 4 is not divisible by the pipeline stages 3"},
      {2, train("gpt-tiny.pbtxt", 2) + pp(2) + "--strategy zero --set strategy.stage=2 ",
       "zero: stage 2 cannot run with pipeline parallelism"},
  };
  for (const Case& c : cases) {
    const dtk_test::Result r =
        dtk_test::run_dtk("launch --nproc_per_node " + std::to_string(c.nproc) + " " + c.args, 120);
    EXPECT_NE(r.code, 0) << c.args;
    EXPECT_NE(r.out.find(c.needle), std::string::npos) << "expected: " << c.needle << "\n" << r.out;
  }
}

// ---------------------------------------------------------------------------------------------
// The interleaved schedule (distributed.virtual_pipeline_model_parallel_size v): each rank holds
// v model chunks, chunk k of rank r being stage k x p + r of p x v.

namespace {
std::string vpp(int v) { return "--set distributed.virtual_pipeline_model_parallel_size=" + std::to_string(v) + " "; }
const char* kEightLayers = "--set model.num_layers=8 ";
}  // namespace

// 2 micro-batches (= p: every forward before the first backward, as Megatron runs it), 4 and 8
// (warm-up, steady 1F1B, cool-down), and 4 chunks of 2 layers per rank.
TEST(PipelineInterleaved, TwoStagesEqualOneForTwoFourAndEightMicroBatches) {
  for (int micro : {4, 2, 1}) {
    const std::string what = std::to_string(8 / micro) + " micro-batches";
    const Curve one = curve_of(1, train("gpt-tiny.pbtxt", micro), "vpp-pp1-m" + std::to_string(micro));
    const Curve two = curve_of(2, train("gpt-tiny.pbtxt", micro) + pp(2) + vpp(2), "vpp-pp2-m" + std::to_string(micro));
    expect_same_curve(one, two, 20, "gpt PP2 x 2 chunks vs PP1, " + what);
    expect_same_validation(one, two, "gpt PP2 x 2 chunks vs PP1, " + what);
  }
  const Curve one = curve_of(1, train("gpt-tiny.pbtxt", 2) + kEightLayers, "vpp-8l-pp1");
  const Curve four = curve_of(2, train("gpt-tiny.pbtxt", 2) + kEightLayers + pp(2) + vpp(4), "vpp-8l-pp2v4");
  expect_same_curve(one, four, 20, "gpt 8 layers, PP2 x 4 chunks vs PP1");
  expect_same_validation(one, four, "gpt 8 layers, PP2 x 4 chunks vs PP1");
}

// Four ranks of two one-layer chunks: activations go round the ranks twice. llama too.
TEST(PipelineInterleaved, FourStagesEqualOneForGptAndLlama) {
  for (const auto& [config, micro] : {std::pair<const char*, int>{"gpt-tiny.pbtxt", 1}, {"llama-tiny.pbtxt", 2}}) {
    const std::string name = std::string(config).substr(0, std::string(config).find('-'));
    const Curve one = curve_of(1, train(config, micro) + kEightLayers, name + "-vpp-pp1");
    const Curve four = curve_of(4, train(config, micro) + kEightLayers + pp(4) + vpp(2), name + "-vpp-pp4");
    expect_same_curve(one, four, 20, name + " PP4 x 2 chunks vs PP1, " + std::to_string(8 / micro) + " micro-batches");
    expect_same_validation(one, four, name + " PP4 x 2 chunks vs PP1");
  }
}

TEST(PipelineInterleaved, WithTensorAndDataParallelismDominoAndZero) {
  const Curve one = curve_of(1, train("gpt-tiny.pbtxt", 2), "vpp-grid-one");
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  expect_same_curve(one,
                    curve_of(4, train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(2) + tp2 + "--set model.domino_chunks=2 ",
                             "vpp-tp2pp2-domino"),
                    20, "TP2 x PP2 x 2 chunks, Domino 2 chunks in each");
  expect_same_curve(one, curve_of(4, train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(2) + "--strategy ddp ", "vpp-pp2dp2"), 20,
                    "PP2 x 2 chunks x DP2, ddp");
  expect_same_curve(one,
                    curve_of(4, train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(2) + "--strategy zero --set strategy.stage=1 ",
                             "vpp-pp2dp2-zero1"),
                    20, "PP2 x 2 chunks x DP2, ZeRO stage 1, tied embeddings sharded");
  const Curve llama = curve_of(1, train("llama-tiny.pbtxt", 2), "vpp-grid-llama");
  expect_same_curve(
      llama,
      curve_of(4, train("llama-tiny.pbtxt", 2) + pp(2) + vpp(2) + "--strategy zero --set strategy.stage=1 ",
               "vpp-llama-pp2dp2-zero1"),
      20, "llama PP2 x 2 chunks x DP2, ZeRO stage 1");
}

// Saved with two chunks per rank ("model0." and "model1." names in each mp_rank_00_PPP), resumed
// exactly; refused at another chunk count with the convert command named; converted to one stage
// and to 1F1B's layout, each resuming as the uninterrupted run continues. A ZeRO-sharded one is
// consolidated on the way.
TEST(PipelineInterleaved, ResumeAndConvertAreExact) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "vpp-ckpt");
  const std::string interleaved = train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(2);
  const Curve whole = curve_of(2, interleaved, "vpp-resume-whole");
  const Curve first =
      curve_of(2, interleaved + "--set train.train_iters=10 --set lr.lr_decay_iters=20 --set checkpoint.save=" + dir,
               "vpp-first");
  ASSERT_EQ(first.run.code, 0) << first.run.out;
  const Curve second = curve_of(2, interleaved + "--set checkpoint.load=" + dir, "vpp-second");
  expect_continues_run(whole, second, "resumed", 1e-6);
  const dtk_test::Result plain = dtk_test::run_dtk(
      "launch --nproc_per_node 2 " + train("gpt-tiny.pbtxt", 2) + pp(2) + "--set checkpoint.load=" + dir, 120);
  EXPECT_NE(plain.code, 0);
  EXPECT_NE(
      plain.out.find("model chunk(s) per pipeline rank (virtual_pipeline_model_parallel_size), this run has 1 "
                     "(dtk checkpoint convert SRC DST --virtual_pipeline_model_parallel_size 1 makes one for it)"),
      std::string::npos)
      << plain.out;
  const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + dir, 120);
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  EXPECT_NE(inspect.out.find("pipeline-parallel 2 with 2 model chunks per rank (interleaved)"), std::string::npos)
      << inspect.out;
  EXPECT_NE(inspect.out.find("model1."), std::string::npos) << inspect.out;
  // To one stage, and to two stages of the 1F1B schedule.
  const dtk_test::Result to_one =
      dtk_test::run_dtk("checkpoint convert " + dir + " " + dir + "-pp1 --pipeline_model_parallel_size 1", 120);
  ASSERT_EQ(to_one.code, 0) << to_one.out;
  EXPECT_NE(to_one.out.find("model chunks per rank 2 to 1, 1, 1"), std::string::npos) << to_one.out;
  expect_continues_run(whole,
                       curve_of(1, train("gpt-tiny.pbtxt", 2) + "--set checkpoint.load=" + dir + "-pp1", "vpp-to-pp1"),
                       "converted to one stage", 1e-5);
  const dtk_test::Result to_plain = dtk_test::run_dtk(
      "checkpoint convert " + dir + " " + dir + "-1f1b --virtual_pipeline_model_parallel_size 1", 120);
  ASSERT_EQ(to_plain.code, 0) << to_plain.out;
  expect_continues_run(
      whole, curve_of(2, train("gpt-tiny.pbtxt", 2) + pp(2) + "--set checkpoint.load=" + dir + "-1f1b", "vpp-to-1f1b"),
      "converted to 1F1B", 1e-5);
  // And back: one stage to four chunks on two ranks (8 layers would be needed for 4 x 2; 4 layers
  // split into 2 ranks x 2 chunks).
  const dtk_test::Result back = dtk_test::run_dtk("checkpoint convert " + dir + "-pp1 " + dir +
                                                      "-back --pipeline_model_parallel_size 2 "
                                                      "--virtual_pipeline_model_parallel_size 2",
                                                  120);
  ASSERT_EQ(back.code, 0) << back.out;
  expect_continues_run(whole, curve_of(2, interleaved + "--set checkpoint.load=" + dir + "-back", "vpp-back"),
                       "converted back", 1e-5);
}

TEST(PipelineInterleaved, ZeroShardsConsolidateOnConvert) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "vpp-zero-ckpt");
  const std::string zero = train("llama-tiny.pbtxt", 2) + "--strategy zero --set strategy.stage=1 ";
  const Curve whole = curve_of(1, train("llama-tiny.pbtxt", 2), "vpp-zero-whole");
  const Curve first = curve_of(
      4, zero + pp(2) + vpp(2) + "--set train.train_iters=10 --set lr.lr_decay_iters=20 --set checkpoint.save=" + dir,
      "vpp-zero-first");
  ASSERT_EQ(first.run.code, 0) << first.run.out;
  const dtk_test::Result to_one =
      dtk_test::run_dtk("checkpoint convert " + dir + " " + dir + "-pp1 --pipeline_model_parallel_size 1", 120);
  ASSERT_EQ(to_one.code, 0) << to_one.out;
  EXPECT_NE(to_one.out.find("consolidated"), std::string::npos) << to_one.out;
  const Curve on_one =
      curve_of(1, train("llama-tiny.pbtxt", 2) + "--set checkpoint.load=" + dir + "-pp1", "vpp-zero-one");
  ASSERT_EQ(on_one.loss.size(), 10u) << on_one.run.out;
  for (int64_t it = 11; it <= 20; ++it) {
    EXPECT_NEAR(on_one.loss.at(it), whole.loss.at(it), 1e-5 * whole.loss.at(it)) << "iteration " << it;
    EXPECT_NEAR(on_one.norm.at(it), whole.norm.at(it), 1e-5 * whole.norm.at(it)) << "iteration " << it;
  }
  // gpt's tied embedding, sharded on the first and the last stage alike: the two copies' state is
  // one after the conversion, and the run resumes at its own layout too.
  const std::string gpt = train("gpt-tiny.pbtxt", 2) + "--set train.train_iters=20 --set lr.lr_decay_iters=20 ";
  const std::string gpt_zero = gpt + pp(2) + "--strategy zero --set strategy.stage=1 ";
  const Curve gpt_whole = curve_of(1, gpt, "pp-zero-gpt-whole");
  ASSERT_EQ(
      curve_of(4, gpt_zero + "--set train.exit_interval=10 --set checkpoint.save=" + dir + "-gpt", "pp-zero-gpt-first")
          .run.code,
      0);
  const dtk_test::Result gpt_to_one =
      dtk_test::run_dtk("checkpoint convert " + dir + "-gpt " + dir + "-gpt-pp1 --pipeline_model_parallel_size 1", 120);
  ASSERT_EQ(gpt_to_one.code, 0) << gpt_to_one.out;
  for (const auto& [resumed, what] :
       {std::pair{curve_of(1, gpt + "--set checkpoint.load=" + dir + "-gpt-pp1", "pp-zero-gpt-one"), "converted"},
        std::pair{curve_of(4, gpt_zero + "--set checkpoint.load=" + dir + "-gpt", "pp-zero-gpt-resumed"), "resumed"}}) {
    ASSERT_EQ(resumed.loss.size(), 10u) << resumed.run.out;
    for (int64_t it = 11; it <= 20; ++it) {
      EXPECT_NEAR(resumed.loss.at(it), gpt_whole.loss.at(it), 1e-5 * gpt_whole.loss.at(it)) << what << ", " << it;
      EXPECT_NEAR(resumed.norm.at(it), gpt_whole.norm.at(it), 1e-5 * gpt_whole.norm.at(it)) << what << ", " << it;
    }
  }
}

// The log's bubble in theory is v times smaller in ideal time: (p - 1) / v / (m + (p - 1) / v),
// 0.5 / 4.5 = 11% for p = 2, v = 2, m = 4; the timeline names each span's chunk.
TEST(PipelineInterleaved, LogShowsTheSmallerBubbleAndTheTimelineTheChunks) {
  const std::string trace = dtk_test::fresh_dir(DTK_TEST_TMP, "vpp-trace") + "/trace.json";
  const dtk_test::Result r = dtk_test::run_dtk(
      "launch --nproc_per_node 2 " + train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(2) +
          "--set train.train_iters=4 --set logging.trace_file=" + trace + " --set logging.trace_iterations=3-3",
      120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(pipeline wait \(ms\): [0-9.]+ \(bubble in theory 11%\))")))
      << r.out;
  std::ifstream in(trace.substr(0, trace.size() - 5) + ".rank0.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* span :
       {"\"forward 3 chunk 1\"", "\"backward 0 chunk 0\"", "receive activations", "receive gradients"})
    EXPECT_NE(text.find(span), std::string::npos) << span;
}

TEST(PipelineInterleaved, BadLayoutsAreRefused) {
  struct Case {
    int nproc;
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {1, train("gpt-tiny.pbtxt", 2) + vpp(2),
       "distributed.virtual_pipeline_model_parallel_size 2 (the interleaved schedule) needs "
       "distributed.pipeline_model_parallel_size >= 2"},
      {1, train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(100000),
       "distributed.virtual_pipeline_model_parallel_size must be between 1 and 4096 (0 or 1: no interleaving), got "
       "100000"},
      {2, train("gpt-tiny.pbtxt", 8) + pp(2) + vpp(2),
       "needs the micro-batches per step (1: train.global_batch_size / (train.micro_batch_size x data-parallel size)) "
       "to be a multiple of distributed.pipeline_model_parallel_size 2"},
      {2, train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(4), "num_layers 4 is not divisible by the pipeline stages 8"},
      {2, train("gpt-tiny.pbtxt", 2) + pp(2) + vpp(2) + "--strategy zero --set strategy.stage=3 ",
       "zero: stage 3 cannot run with pipeline parallelism"},
  };
  for (const Case& c : cases) {
    const std::string launch = c.nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(c.nproc) + " ";
    const dtk_test::Result r = dtk_test::run_dtk(launch + c.args, 120);
    EXPECT_NE(r.code, 0) << c.args;
    EXPECT_NE(r.out.find(c.needle), std::string::npos) << "expected: " << c.needle << "\n" << r.out;
  }
}

// ---------------------------------------------------------------------------------------------
// An uneven split of the layers (Megatron's --decoder-first/last-pipeline-num-layers and
// --account-for-embedding/loss-in-pipeline-split; dtk/pipeline_split.hpp): each stage builds the
// layers the split gives it, and the run is the one-stage run.

namespace {
std::string split(const std::string& settings) {
  std::string out;
  size_t start = 0;
  while (start < settings.size()) {
    const size_t end = settings.find(',', start);
    out += "--set distributed." + settings.substr(start, end - start) + " ";
    start = end == std::string::npos ? settings.size() : end + 1;
  }
  return out;
}
const char* kSixLayers = "--set model.num_layers=6 ";
}  // namespace

// gpt, 2 stages of 1 and 3 layers (the first rank's count given) and of 4 and 2 (the last's);
// llama, 4 stages of 1, 2, 2 and 1 layers (6 layers with the embedding and the loss counted) and of
// 0, 1, 1 and 0 (2 layers); gpt, 2 ranks x 2 chunks of 1, 3, 1 and 3 layers (the first rank's 2
// spread over its chunks).
TEST(PipelineUneven, UnevenStagesEqualOneStage) {
  const Curve gpt = curve_of(1, train("gpt-tiny.pbtxt", 2), "uneven-gpt-one");
  expect_same_curve(
      gpt,
      curve_of(2, train("gpt-tiny.pbtxt", 2) + pp(2) + split("decoder_first_pipeline_num_layers=1"), "uneven-first1"),
      20, "gpt PP2, 1 + 3 layers");
  const Curve last = curve_of(
      2, train("gpt-tiny.pbtxt", 2) + kSixLayers + pp(2) + split("decoder_last_pipeline_num_layers=2"), "uneven-last2");
  expect_same_curve(curve_of(1, train("gpt-tiny.pbtxt", 2) + kSixLayers, "uneven-gpt6-one"), last, 20,
                    "gpt 6 layers PP2, 4 + 2 layers");
  EXPECT_NE(last.run.out.find("layers 0-3 of 6"), std::string::npos) << last.run.out;
  EXPECT_NE(last.run.out.find("layers 4-5 of 6"), std::string::npos) << last.run.out;
  const Curve llama = curve_of(4,
                               train("llama-tiny.pbtxt", 2) + kSixLayers + pp(4) +
                                   split("account_for_embedding_in_pipeline_split=true,"
                                         "account_for_loss_in_pipeline_split=true"),
                               "uneven-llama-pp4");
  expect_same_curve(curve_of(1, train("llama-tiny.pbtxt", 2) + kSixLayers, "uneven-llama-one"), llama, 20,
                    "llama 6 layers PP4, embedding and loss counted: 1 + 2 + 2 + 1 layers");
  expect_same_validation(curve_of(1, train("llama-tiny.pbtxt", 2) + kSixLayers, "uneven-llama-one-v"), llama,
                         "llama PP4 uneven");
  // 2 layers over 4 stages, the embedding and the loss counted: the first and last stages hold no
  // layer, only the embedding and the output layer.
  const std::string two_layers = "--set model.num_layers=2 ";
  const Curve bare = curve_of(4,
                              train("llama-tiny.pbtxt", 2) + two_layers + pp(4) +
                                  split("account_for_embedding_in_pipeline_split=true,"
                                        "account_for_loss_in_pipeline_split=true"),
                              "uneven-llama-bare");
  expect_same_curve(curve_of(1, train("llama-tiny.pbtxt", 2) + two_layers, "uneven-llama2-one"), bare, 20,
                    "llama 2 layers PP4, embedding and loss counted: 0 + 1 + 1 + 0 layers");
  EXPECT_NE(bare.run.out.find("pipeline rank 0 holds none of the 2 layers"), std::string::npos) << bare.run.out;
  EXPECT_NE(bare.run.out.find("pipeline rank 1 holds layer 0 of 2"), std::string::npos) << bare.run.out;
  // The same with TP 2 and Domino: a stage without layers runs its embedding or output layer plainly.
  const Curve domino = curve_of(8,
                                train("gpt-tiny.pbtxt", 2) + two_layers + pp(4) +
                                    "--set distributed.tensor_model_parallel_size=2 --set model.domino_chunks=2 " +
                                    split("account_for_embedding_in_pipeline_split=true,"
                                          "account_for_loss_in_pipeline_split=true"),
                                "uneven-domino-bare");
  expect_same_curve(curve_of(1, train("gpt-tiny.pbtxt", 2) + two_layers, "uneven-gpt2-one"), domino, 20,
                    "gpt 2 layers TP2 x PP4 with Domino, embedding and loss counted: 0 + 1 + 1 + 0 layers");
  const Curve interleaved = curve_of(
      2, train("gpt-tiny.pbtxt", 2) + kEightLayers + pp(2) + vpp(2) + split("decoder_first_pipeline_num_layers=2"),
      "uneven-vpp");
  expect_same_curve(curve_of(1, train("gpt-tiny.pbtxt", 2) + kEightLayers, "uneven-gpt8-one"), interleaved, 20,
                    "gpt 8 layers PP2 x 2 chunks, 1 + 3 + 1 + 3 layers");
}

// Saved with 1 + 3 layers, resumed exactly with that split; refused with the even one (each stage
// names its layers from 0), the convert command named; converted to one stage and from there to
// 3 + 1 layers, each resuming as the uninterrupted run continues.
TEST(PipelineUneven, ResumeAndConvertFollowTheSplit) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "uneven-ckpt");
  const std::string uneven = train("gpt-tiny.pbtxt", 2) + pp(2) + split("decoder_first_pipeline_num_layers=1");
  const Curve whole = curve_of(2, uneven, "uneven-resume-whole");
  const Curve first = curve_of(
      2, uneven + "--set train.train_iters=10 --set lr.lr_decay_iters=20 --set checkpoint.save=" + dir, "uneven-first");
  ASSERT_EQ(first.run.code, 0) << first.run.out;
  expect_continues_run(whole, curve_of(2, uneven + "--set checkpoint.load=" + dir, "uneven-second"), "resumed", 1e-6);
  // Other settings that place the layers alike (the last rank's 3 of 4 on 2 ranks) resume it.
  expect_continues_run(whole,
                       curve_of(2,
                                train("gpt-tiny.pbtxt", 2) + pp(2) + split("decoder_last_pipeline_num_layers=3") +
                                    "--set checkpoint.load=" + dir,
                                "uneven-alike"),
                       "resumed with last=3", 1e-6);
  const dtk_test::Result even = dtk_test::run_dtk(
      "launch --nproc_per_node 2 " + train("gpt-tiny.pbtxt", 2) + pp(2) + "--set checkpoint.load=" + dir, 120);
  EXPECT_NE(even.code, 0);
  EXPECT_NE(even.out.find("was saved with 1 layer on the first pipeline rank over the pipeline stages, this run asks "
                          "for the even split of the layers"),
            std::string::npos)
      << even.out;
  const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + dir, 120);
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  EXPECT_NE(inspect.out.find("layers over the pipeline stages: 1 layer on the first pipeline rank"), std::string::npos)
      << inspect.out;
  const dtk_test::Result to_one =
      dtk_test::run_dtk("checkpoint convert " + dir + " " + dir + "-pp1 --pipeline_model_parallel_size 1", 120);
  ASSERT_EQ(to_one.code, 0) << to_one.out;
  EXPECT_NE(to_one.out.find("--set distributed.decoder_first_pipeline_num_layers=0"), std::string::npos) << to_one.out;
  expect_continues_run(
      whole, curve_of(1, train("gpt-tiny.pbtxt", 2) + "--set checkpoint.load=" + dir + "-pp1", "uneven-to-one"),
      "converted to one stage", 1e-5);
  const dtk_test::Result to_last = dtk_test::run_dtk("checkpoint convert " + dir + "-pp1 " + dir +
                                                         "-last1 --pipeline_model_parallel_size 2 "
                                                         "--decoder_last_pipeline_num_layers 1",
                                                     120);
  ASSERT_EQ(to_last.code, 0) << to_last.out;
  EXPECT_NE(to_last.out.find("--set distributed.decoder_last_pipeline_num_layers=1"), std::string::npos) << to_last.out;
  expect_continues_run(whole,
                       curve_of(2,
                                train("gpt-tiny.pbtxt", 2) + pp(2) + split("decoder_last_pipeline_num_layers=1") +
                                    "--set checkpoint.load=" + dir + "-last1",
                                "uneven-last1"),
                       "converted to 3 + 1 layers", 1e-5);
  // A split that does not hold the layers is refused before anything is written.
  const dtk_test::Result bad = dtk_test::run_dtk("checkpoint convert " + dir + "-pp1 " + dir +
                                                     "-bad --pipeline_model_parallel_size 2 "
                                                     "--decoder_first_pipeline_num_layers 4",
                                                 120);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("checkpoint convert: the new layout: decoder_first_pipeline_num_layers 4 and "
                         "decoder_last_pipeline_num_layers 0 leave 0 of num_layers 4 for the 1 middle pipeline ranks"),
            std::string::npos)
      << bad.out;
  EXPECT_FALSE(std::filesystem::exists(dir + "-bad/latest_checkpointed_iteration.txt"));
}

TEST(PipelineUneven, BadSplitsAreRefused) {
  struct Case {
    int nproc;
    std::string args, needle;
  };
  const std::string gpt = train("gpt-tiny.pbtxt", 2);
  const std::vector<Case> cases = {
      {2, gpt + pp(2) + split("decoder_first_pipeline_num_layers=4"),
       "decoder_first_pipeline_num_layers 4 and decoder_last_pipeline_num_layers 0 leave 0 of num_layers 4 for the 1 "
       "middle pipeline ranks"},
      {2, gpt + pp(2) + split("decoder_first_pipeline_num_layers=1,decoder_last_pipeline_num_layers=2"),
       "leave 1 of num_layers 4 for the 0 middle pipeline ranks"},
      {2, gpt + pp(2) + vpp(2) + split("decoder_first_pipeline_num_layers=1"),
       "decoder_first_pipeline_num_layers 1 is not divisible by the model chunks of a pipeline rank (2, "
       "virtual_pipeline_model_parallel_size)"},
      {2, gpt + pp(2) + split("account_for_embedding_in_pipeline_split=true"),
       "num_layers 4 with the embedding and loss counted as layers (account_for_embedding/loss_in_pipeline_split) is "
       "5, not divisible by pipeline_model_parallel_size 2"},
      {1, gpt + pp(2) + split("decoder_first_pipeline_num_layers=-1"),
       "config: distributed.decoder_first_pipeline_num_layers must be at least 1 (0: unset), got -1"},
      {1, gpt + pp(2) + split("decoder_first_pipeline_num_layers=1,account_for_loss_in_pipeline_split=true"),
       "config: distributed.decoder_first/last_pipeline_num_layers cannot go with "
       "account_for_embedding/loss_in_pipeline_split"},
      {1, gpt + split("decoder_first_pipeline_num_layers=1,decoder_last_pipeline_num_layers=3"),
       "both name the one pipeline rank of pipeline_model_parallel_size 1"},
  };
  for (const Case& c : cases) {
    const std::string launch = c.nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(c.nproc) + " ";
    const dtk_test::Result r = dtk_test::run_dtk(launch + c.args, 120);
    EXPECT_NE(r.code, 0) << c.args;
    EXPECT_NE(r.out.find(c.needle), std::string::npos) << "expected: " << c.needle << "\n" << r.out;
  }
}
