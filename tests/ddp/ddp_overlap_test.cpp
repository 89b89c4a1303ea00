// The ddp strategy's gradient buckets (plugins/strategies/ddp/ddp.cpp) end to end through
// `dtk launch`, real processes over loopback Gloo:
//   * overlapped (the default: each bucket all-reduced during the last micro-batch's backward) gives
//     exactly the losses and gradient norms of the same buckets reduced after the backward
//     (strategy.overlap_grad_reduce=false), iteration by iteration, with gradient accumulation, at
//     DP 4, TP 2 x DP 2 with Domino and bf16, PP 2 x DP 2;
//   * the timeline shows the buckets' all-reduces issued inside the last backward, and a resumed
//     overlapped run continues exactly;
//   * the zero strategy's stages 1 and 2 with overlap_param_gather (the updated parameters'
//     all-gathers in flight from the step to the module that first reads them in the next forward)
//     give exactly the losses, gradient norms and parameter norms of the gather after the step, and
//     the timeline shows the gathers issued before the forward and waited in it;
//   * ZeRO stage 2's reduce-scatters left in flight during the backward (overlap_comm, up to
//     reduce_in_flight_size elements) give exactly the losses of the waited ones;
//   * ddp's overlap_param_gather (each bucket reduce-scattered in the backward, its reduced
//     gradients all-gathered and its update applied in the next forward) gives the losses and
//     gradient norms of the all-reduce in the grid, the timeline shows both halves where they
//     belong, a resumed run continues exactly, and what it cannot give is refused;
//   * gradients are views of their buckets: DP 2 peaks within a fraction of a gradient of DP 1, and
//     a parameter no backward reaches keeps no gradient;
//   * bad options are one-line errors.
// Small buckets (bucket_size_mb=0.05: 7 buckets of gpt-tiny) so that several are in flight.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>

#include "../common/curves.hpp"
#include "../common/memory_report.hpp"
#include "../common/run_dtk.hpp"

namespace {

using dtk_test::Curve;
using dtk_test::expect_same_curve;

// gpt-tiny on synthetic tokens, no dropout, 2 micro-batches of 4 per data-parallel rank and
// iteration (accumulation), clipping active, 4 iterations.
std::string train(int dp, const std::string& strategy = "--set strategy.bucket_size_mb=0.05 ") {
  return std::string("train --config ") + DTK_SOURCE_DIR +
         "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.vocab_size=512 "
         "--set dataset.vocab_size=512 --set train.seq_length=32 --set model.hidden_dropout=0 "
         "--set model.attention_dropout=0 --set train.micro_batch_size=4 --set train.global_batch_size=" +
         std::to_string(8 * dp) +
         " --set train.train_iters=4 --set train.clip_grad=0.3 --set lr.lr_warmup_iters=1 "
         "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=0 " +
         strategy;
}
const std::string kOff = "--set strategy.overlap_grad_reduce=false ";
const std::string kSplit = "--set strategy.overlap_param_gather=true ";

Curve curve_of(int nproc, const std::string& args, const std::string& name) {
  return dtk_test::run_curve("launch --nproc_per_node " + std::to_string(nproc) + " " + args, DTK_TEST_TMP, name);
}

// The start times (us) of the data-parallel `collective`s in a rank's trace, the last "backward N"
// span's [start, end] and the first "forward N" span's start.
struct Timeline {
  std::vector<double> issued;
  double backward_start = -1, backward_end = -1, forward_start = -1;
};
Timeline read_timeline(const std::string& path, const std::string& collective = "all_reduce") {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Timeline t;
  const std::regex issue("\"name\": \"" + collective +
                         R"re( on group 1", "cat": "comm", [^}]*"ph": "b", [^}]*"ts": (-?[0-9.]+))re");
  for (std::sregex_iterator it(text.begin(), text.end(), issue), end; it != end; ++it)
    t.issued.push_back(std::stod((*it)[1]));
  static const std::regex forward(R"re("name": "forward \d+", [^}]*"ts": (-?[0-9.]+))re");
  for (std::sregex_iterator it(text.begin(), text.end(), forward), end; it != end; ++it) {
    const double start = std::stod((*it)[1]);
    if (t.forward_start < 0 || start < t.forward_start) t.forward_start = start;
  }
  static const std::regex backward(R"re("name": "backward \d+", [^}]*"ts": ([0-9.]+), "dur": ([0-9.]+))re");
  for (std::sregex_iterator it(text.begin(), text.end(), backward), end; it != end; ++it) {
    const double start = std::stod((*it)[1]);
    if (start > t.backward_start) t.backward_start = start, t.backward_end = start + std::stod((*it)[2]);
  }
  return t;
}
// The most data-parallel `collective`s in flight at once in a rank's trace (issue to completion).
int most_in_flight(const std::string& path, const std::string& collective) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::regex event("\"name\": \"" + collective +
                         R"re( on group 1", "cat": "comm", [^}]*"ph": "([be])", [^}]*"ts": (-?[0-9.]+))re");
  std::vector<std::pair<double, int>> edges;  // (time, +1 issue / -1 completion); completions first
  for (std::sregex_iterator it(text.begin(), text.end(), event), end; it != end; ++it)
    edges.emplace_back(std::stod((*it)[2]), (*it)[1] == "b" ? 1 : -1);
  std::sort(edges.begin(), edges.end());
  int now = 0, most = 0;
  for (const auto& e : edges) most = std::max(most, now += e.second);
  return most;
}
int issued_inside_backward(const Timeline& t) {
  int n = 0;
  for (double ts : t.issued) n += ts > t.backward_start && ts < t.backward_end;
  return n;
}

}  // namespace

// fp32 and bf16, with accumulation, in the grid: overlapped == reduced after the backward, exactly.
TEST(DdpOverlap, EqualsTheReductionAfterTheBackwardInTheGrid) {
  struct Case {
    int nproc;
    std::string args, name;
  };
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  const std::vector<Case> cases = {
      {4, train(4), "dp4"},
      {4, train(2) + tp2 + "--set model.domino_chunks=2 --set train.params_dtype=bf16 ", "tp2dp2-domino-bf16"},
      {4, train(2) + "--set distributed.pipeline_model_parallel_size=2 ", "pp2dp2"},
  };
  for (const Case& c : cases) {
    const Curve on = curve_of(c.nproc, c.args, c.name + "-overlap");
    const Curve off = curve_of(c.nproc, c.args + kOff, c.name + "-after");
    expect_same_curve(off, on, 4, c.name + ": overlapped vs after the backward", 0.0);
    EXPECT_NE(on.run.out.find("reduced during the last micro-batch's backward"), std::string::npos) << on.run.out;
    EXPECT_NE(off.run.out.find("reduced after the backward (overlap_grad_reduce=false)"), std::string::npos)
        << off.run.out;
  }
}

// DP 2: the buckets' all-reduces start inside the last backward (the timeline, iteration 3); and a
// run resumed from the overlapped run's checkpoint of iteration 2 continues with its exact losses.
TEST(DdpOverlap, BucketsInFlightDuringTheBackwardAndAnExactResume) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "ddp-overlap");
  const Curve whole = curve_of(2,
                               train(2) + "--set logging.trace_iterations=3 --set logging.trace_file=" + dir +
                                   "/on.json --set checkpoint.save=" + dir + "/ck --set checkpoint.save_interval=2 ",
                               "whole");
  ASSERT_EQ(whole.run.code, 0) << whole.run.out;
  const Timeline line = read_timeline(dir + "/on.rank0.json");
  ASSERT_GT(line.backward_end, 0) << "no backward span in " << dir << "/on.rank0.json";
  // 7 buckets, all issued: all but those holding the first layer and the embedding (complete at
  // the very end) inside the backward.
  EXPECT_GE(line.issued.size(), 7u) << whole.run.out;
  EXPECT_GE(issued_inside_backward(line), 3) << whole.run.out;

  // Resume from iteration 2 (the run saved 2 and 4; the tracker names the one to load).
  std::ofstream(dir + "/ck/latest_checkpointed_iteration.txt") << "2";
  const Curve resumed = curve_of(2, train(2) + "--set checkpoint.load=" + dir + "/ck ", "resumed");
  ASSERT_EQ(resumed.loss.size(), 2u) << resumed.run.out;
  for (int64_t it = 3; it <= 4; ++it) {
    EXPECT_EQ(resumed.loss.at(it), whole.loss.at(it)) << "iteration " << it;
    EXPECT_EQ(resumed.norm.at(it), whole.norm.at(it)) << "iteration " << it;
  }
}

// ZeRO stages 1 and 2, DP 2: overlap_param_gather equals the gather after the step (losses and
// gradient norms). Stage 1 logs the parameter norm, which the host reads between the step and the
// next forward (it waits for the gathers: gather_parameters), so it must see the gathered values;
// stage 2 shows on the timeline the gathers of iteration 2's step in flight when iteration 3 begins.
TEST(ZeroOverlapParamGather, Stages1And2EqualTheGatherAfterTheStep) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "zero-gather");
  static const std::regex norm_re(R"(params norm: [0-9.]+)");
  for (int stage : {1, 2}) {
    const std::string name = "stage " + std::to_string(stage), base = dir + "/s" + std::to_string(stage);
    auto args = [&](const std::string& run) {
      return train(2, "--strategy zero --set strategy.stage=" + std::to_string(stage) + " ") +
             "--set strategy.reduce_bucket_size=20000 " +
             (stage == 1 ? std::string("--set logging.log_params_norm=true ")
                         : "--set logging.trace_iterations=3 --set logging.trace_file=" + base + "-" + run + ".json ");
    };
    const Curve on = curve_of(2, args("on") + "--set strategy.overlap_param_gather=true ", name + " overlap");
    const Curve off = curve_of(2, args("off"), name + " after the step");
    expect_same_curve(off, on, 4, name + ": gathers overlapped vs after the step", 0.0);
    EXPECT_NE(on.run.out.find("updated parameters gathered during the next forward"), std::string::npos) << on.run.out;
    if (stage == 1) {
      std::vector<std::string> norms[2];
      for (int k = 0; k < 2; ++k) {
        const std::string& out = (k ? off : on).run.out;
        for (std::sregex_iterator it(out.begin(), out.end(), norm_re), end; it != end; ++it)
          norms[k].push_back(it->str());
      }
      EXPECT_EQ(norms[0].size(), 4u) << on.run.out;
      EXPECT_EQ(norms[0], norms[1]) << name;
      continue;
    }
    const Timeline gathered = read_timeline(base + "-on.rank0.json", "all_gather"),
                   after = read_timeline(base + "-off.rank0.json", "all_gather");
    ASSERT_GT(gathered.forward_start, 0) << base;
    auto before_forward = [](const Timeline& t) {
      int n = 0;
      for (double ts : t.issued) n += ts < t.forward_start;
      return n;
    };
    EXPECT_GE(before_forward(gathered), 3) << name;  // the buckets, issued by iteration 2's step
    EXPECT_EQ(before_forward(after), 0) << name;
  }
}

// ZeRO stage 2 with overlap_comm: the reduce-scatters left in flight during the backward (up to
// reduce_in_flight_size elements, two buckets at least) give exactly the losses and gradient norms
// of the reduce-scatters waited one by one, with accumulation (every micro-batch reduces) and the
// parameter gathers overlapped too; over a slow simulated link the timeline shows a layer's
// buckets in flight together under the default budget, and at most three (two left, one issued
// before the oldest is waited) under the smallest.
TEST(ZeroOverlapComm, ReduceScattersInFlightEqualTheWaitedOnes) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "zero-overlap-comm");
  const std::string zero = "--strategy zero --set strategy.stage=2 --set strategy.reduce_bucket_size=2000 ";
  auto traced = [&](const std::string& run) {
    return "--set distributed.simulated_link=10us,0.01GBps --set logging.trace_iterations=3 --set logging.trace_file=" +
           dir + "/" + run + ".json ";
  };
  const Curve waited = curve_of(2, train(2, zero + "--set strategy.overlap_comm=false "), "waited");
  const Curve budget =
      curve_of(2, train(2, zero + "--set strategy.overlap_comm=true ") + traced("budget"), "default budget");
  const Curve two = curve_of(2,
                             train(2, zero + "--set strategy.overlap_comm=true --set strategy.reduce_in_flight_size=1 "
                                             "--set strategy.overlap_param_gather=true ") +
                                 traced("two"),
                             "two in flight");
  expect_same_curve(waited, budget, 4, "reduce-scatters in flight (default budget) vs waited", 0.0);
  expect_same_curve(waited, two, 4, "reduce-scatters in flight (two buckets) vs waited", 0.0);
  EXPECT_GE(most_in_flight(dir + "/budget.rank0.json", "reduce_scatter"), 6) << budget.run.out;
  const int least = most_in_flight(dir + "/two.rank0.json", "reduce_scatter");
  EXPECT_GE(least, 2) << two.run.out;
  EXPECT_LE(least, 3) << two.run.out;
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(train(1, zero + "--set strategy.overlap_comm=true --set strategy.reduce_in_flight_size=0 "),
                        60),
      "zero: option 'reduce_in_flight_size' must be positive, got 0");
}

// overlap_param_gather == the all-reduce (the default overlap), iteration by iteration, with
// accumulation and clipping: exactly at DP 2 (a sum of two addends rounds once, in either order),
// with the parameter norm read between the step and the next forward (gather_parameters lands the
// pending updates first); within fp32 rounding at DP 4 (DTK's ring reduce-scatter adds in another
// order than Gloo's all-reduce); exactly with TP 2, sequence parallelism, Domino and bf16 (the
// sequence-parallel norms are reduced whole, in the step) and with PP 2 (the tied embedding too).
TEST(DdpOverlapParamGather, EqualsTheAllReduceInTheGrid) {
  struct Case {
    int nproc;
    std::string args, name;
    double tol;
  };
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  const std::vector<Case> cases = {
      {2, train(2) + "--set logging.log_params_norm=true ", "dp2", 0.0},
      {4, train(4), "dp4", 2e-6},
      {4,
       train(2) + tp2 +
           "--set distributed.sequence_parallel=true --set model.domino_chunks=2 --set train.params_dtype=bf16 ",
       "tp2dp2-sp-domino-bf16", 0.0},
      {4, train(2) + "--set distributed.pipeline_model_parallel_size=2 ", "pp2dp2", 0.0},
  };
  static const std::regex norm_re(R"(params norm: [0-9.]+)");
  auto params_norms = [](const std::string& out) {
    std::vector<std::string> norms;
    for (std::sregex_iterator it(out.begin(), out.end(), norm_re), end; it != end; ++it) norms.push_back(it->str());
    return norms;
  };
  for (const Case& c : cases) {
    const Curve split = curve_of(c.nproc, c.args + kSplit, c.name + "-split");
    const Curve whole = curve_of(c.nproc, c.args, c.name + "-all-reduce");
    expect_same_curve(whole, split, 4, c.name + ": split across the step vs all-reduced", c.tol);
    EXPECT_NE(split.run.out.find("gathered and applied during the next forward (overlap_param_gather"),
              std::string::npos)
        << split.run.out;
    EXPECT_EQ(params_norms(split.run.out), params_norms(whole.run.out)) << c.name;
  }
}

// DP 2: the reduce-scatters are issued inside the last backward, the all-gathers after the step and
// before the next forward, and the buckets' updates land inside that forward (the timeline of
// iteration 3); a run resumed from the checkpoint of iteration 2 (saved with the updates of its
// step pending: the save lands them) continues with the exact losses. log_num_zeros_in_grad, which
// needs whole reduced gradients, is refused.
TEST(DdpOverlapParamGather, GathersInTheNextForwardAndAnExactResume) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "ddp-split");
  const Curve whole = curve_of(2,
                               train(2) + kSplit + "--set logging.trace_iterations=4 --set logging.trace_file=" + dir +
                                   "/split.json --set checkpoint.save=" + dir + "/ck --set checkpoint.save_interval=2 ",
                               "split");
  ASSERT_EQ(whole.run.code, 0) << whole.run.out;
  const std::string trace = dir + "/split.rank0.json";
  const Timeline scattered = read_timeline(trace, "reduce_scatter"), gathered = read_timeline(trace, "all_gather");
  ASSERT_GT(scattered.backward_end, 0) << "no backward span in " << trace;
  EXPECT_GE(issued_inside_backward(scattered), 3) << whole.run.out;
  int before_forward = 0;
  for (double ts : gathered.issued) before_forward += ts < gathered.forward_start;
  EXPECT_GE(before_forward, 3) << trace;  // the buckets, issued by iteration 3's step
  std::ifstream in(trace);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  static const std::regex update(R"re("name": "ddp: update bucket \d+", [^}]*"ts": ([0-9.]+))re");
  int in_forward = 0;
  for (std::sregex_iterator it(text.begin(), text.end(), update), end; it != end; ++it) {
    const double ts = std::stod((*it)[1]);
    in_forward += ts > gathered.forward_start && ts < scattered.backward_start;
  }
  EXPECT_GE(in_forward, 3) << trace;

  std::ofstream(dir + "/ck/latest_checkpointed_iteration.txt") << "2";
  const Curve resumed = curve_of(2, train(2) + kSplit + "--set checkpoint.load=" + dir + "/ck ", "split-resumed");
  ASSERT_EQ(resumed.loss.size(), 2u) << resumed.run.out;
  for (int64_t it = 3; it <= 4; ++it) {
    EXPECT_EQ(resumed.loss.at(it), whole.loss.at(it)) << "iteration " << it;
    EXPECT_EQ(resumed.norm.at(it), whole.norm.at(it)) << "iteration " << it;
  }

  // (Each rank of a launch names its own error, as every launched error does.)
  const dtk_test::Result zeros = dtk_test::run_dtk(
      "launch --nproc_per_node 2 " + train(2) + kSplit + "--set logging.log_num_zeros_in_grad=true", 120);
  EXPECT_NE(zeros.code, 0) << zeros.out;
  EXPECT_NE(zeros.out.find("dtk: error: [rank 0] logging.log_num_zeros_in_grad: strategy plugin 'ddp' keeps the "
                           "reduced gradients sharded over data-parallel ranks until the next forward"),
            std::string::npos)
      << zeros.out;
  EXPECT_EQ(zeros.out.find("terminate called"), std::string::npos) << zeros.out;
  // An optimizer that counts its calls (a step per bucket) is refused after the first split update;
  // plain SGD, which counts nothing, gives the all-reduce's losses while called once per bucket.
  const std::string sgd = std::string("--plugin_path ") + DTK_LOOP_TEST_PLUGIN_DIR + " --optimizer recording_sgd ";
  const dtk_test::Result counting = dtk_test::run_dtk(
      "launch --nproc_per_node 2 " + train(2) + kSplit + sgd + "--set optimizer.count_calls=true", 120);
  EXPECT_NE(counting.code, 0) << counting.out;
  EXPECT_NE(counting.out.find("ddp: overlap_param_gather: the optimizer counted "), std::string::npos) << counting.out;
  EXPECT_NE(counting.out.find("it counts calls, not dtk_optimizer_step_args.iteration"), std::string::npos)
      << counting.out;
  const std::string record = dir + "/sgd-steps.txt";
  const Curve by_bucket = curve_of(2, train(2) + kSplit + sgd + "--set optimizer.record=" + record, "split-sgd");
  const Curve at_once = curve_of(2, train(2) + sgd, "all-reduce-sgd");
  expect_same_curve(at_once, by_bucket, 4, "recording_sgd: split vs all-reduced", 0.0);
  std::ifstream steps(record);
  int calls = 0;
  for (std::string line; std::getline(steps, line);) calls += line.rfind("step 2 ", 0) == 0;
  EXPECT_GE(calls, 7) << record;  // iteration 2's update: a call per bucket (7; both ranks append here)
}

// Gradients are views of their buckets (gradient_as_bucket_view): a model whose gradients outweigh
// its activations (4 layers of hidden 512, 16 tokens per micro-batch) peaks at DP 2 within a
// fraction of the gradients of DP 1's peak (no buckets there); when each backward made its
// gradients anew beside the buckets kept from the step before, DP 2 peaked a whole gradient (50 MB)
// higher from the second iteration (the report after iteration 3 covers it). And a parameter no
// backward reaches still has no gradient after the reduction (the optimizers skip it, as without
// buckets): `num zeros` counts the same gradients at DP 2 as at DP 1, fp32 (autograd adds into the
// views) and bf16 (into the fp32 masters' views), with 2 micro-batches per rank, the buckets reduced
// after the backward (a model without modules) and during it (with modules). A gradient that
// arrives after its module's post_backward (the model reads a parameter outside the modules that
// list it) would be added into a buffer being all-reduced: one line.
TEST(DdpBuckets, GradientsAreViewsOfTheBuckets) {
  const std::string wide =
      std::string("train --config ") + DTK_SOURCE_DIR +
      "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=4 --set model.hidden_size=512 "
      "--set model.num_attention_heads=8 --set model.vocab_size=1024 --set dataset.vocab_size=1024 "
      "--set train.seq_length=16 --set train.micro_batch_size=1 --set train.train_iters=3 --set lr.lr_warmup_iters=1 "
      "--set logging.log_interval=3 --set eval.eval_interval=0 --set eval.eval_iters=0 --set train.global_batch_size=";
  const dtk_test::Result one = dtk_test::run_dtk("launch --nproc_per_node 1 " + wide + "1", 120);
  const dtk_test::Result two = dtk_test::run_dtk("launch --nproc_per_node 2 " + wide + "2", 120);
  ASSERT_EQ(one.code, 0) << one.out;
  ASSERT_EQ(two.code, 0) << two.out;
  const double gradients = dtk_test::memory_of(two.out).gradients,
               peak_one = dtk_test::memory_of(one.out).max_allocated,
               peak_two = dtk_test::memory_of(two.out).max_allocated;
  ASSERT_GT(gradients, 40.0) << two.out;
  ASSERT_GT(peak_one, gradients) << one.out;
  EXPECT_LT(peak_two - peak_one, gradients / 4) << "DP 1:\n" << one.out << "\nDP 2:\n" << two.out;

  const std::string contract = std::string("train --config ") + DTK_SOURCE_DIR +
                               "/configs/gpt-tiny.pbtxt --model contract_model --dataset contract_data --plugin_path " +
                               DTK_CONTRACT_PLUGIN_DIR +
                               " --threads 1 --set train.seq_length=16 --set train.micro_batch_size=2 "
                               "--set train.train_iters=3 --set lr.lr_warmup_iters=1 --set eval.eval_iters=0 "
                               "--set logging.log_interval=1 --set train.global_batch_size=8 ";
  for (const std::string dtype : {"fp32", "bf16"})
    for (const std::string modules : {"false", "true"}) {
      const std::string spare = contract +
                                "--set model.spare_parameter=true --set logging.log_num_zeros_in_grad=true " +
                                "--set train.params_dtype=" + dtype + " --set model.modules=" + modules;
      const std::string name = "spare-" + dtype + "-modules-" + modules;
      dtk_test::Result r1, r2;
      auto s1 = dtk_test::run_scalars("launch --nproc_per_node 1 " + spare, DTK_TEST_TMP, name + "-dp1", &r1);
      auto s2 = dtk_test::run_scalars("launch --nproc_per_node 2 " + spare, DTK_TEST_TMP, name + "-dp2", &r2);
      ASSERT_EQ(r1.code, 0) << r1.out;
      ASSERT_EQ(r2.code, 0) << r2.out;
      const bool hooked = r2.out.find("reduced during the last micro-batch's backward") != std::string::npos;
      EXPECT_EQ(hooked, modules == "true") << r2.out;
      ASSERT_EQ(s1["num-zeros"].size(), 3u) << r1.out;
      EXPECT_EQ(s2["num-zeros"], s1["num-zeros"]) << name << "\n" << r2.out;
      for (const auto& [it, loss] : s1["lm loss"])
        EXPECT_NEAR(s2["lm loss"].at(it), loss, 2e-3 * loss) << name << ", iteration " << it;
    }
  // (Each rank of a launch names its own error, as every launched error does.)
  const dtk_test::Result late = dtk_test::run_dtk(
      "launch --nproc_per_node 2 " + contract + "--set model.modules=true --set model.fault=late_gradient", 120);
  EXPECT_NE(late.code, 0) << late.out;
  EXPECT_NE(late.out.find("dtk: error: [rank 0] "), std::string::npos) << late.out;
  EXPECT_NE(late.out.find("ddp: the gradient of parameter 'hidden_bias' arrived after the post_backward hook of "
                          "module 1 (the first module listing it) marked it complete"),
            std::string::npos)
      << late.out;
  EXPECT_EQ(late.out.find("terminate called"), std::string::npos) << late.out;
}

TEST(DdpOverlap, ABadBucketSizeIsAOneLineError) {
  dtk_test::expect_one_line_error(dtk_test::run_dtk(train(1) + "--set strategy.bucket_size_mb=-0.5", 60),
                                  "ddp: option 'bucket_size_mb' must be a positive number of MB, got -0.5");
}
