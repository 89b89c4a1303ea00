// Domino (sdk/include/dtk/layers/domino.hpp) end to end through `dtk launch`, real processes over
// loopback (Gloo):
//   * TP=2 with 2, 3 and 4 chunks gives plain TP=2's and one process's lm loss and grad norm,
//     iteration by iteration for 20 iterations (fp32, within 1e-5): dropout off, dropout on (the
//     same masks: drawn for the whole micro-batch and sliced), with full recompute; bf16 within
//     the rounding of bf16 products; TP=2 x DP=2 with ddp and with ZeRO stage 3;
//   * the llama plugin likewise (TP=2 with 2 and 4 chunks, dropout with recompute, ZeRO-3);
//   * checkpoints move between Domino and plain TP;
//   * the simulated link delays every tensor-parallel collective (a lower bound, not a timing);
//   * bad inputs are one-line errors.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <regex>
#include <string>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"

namespace {

using dtk_test::Curve;
using dtk_test::expect_same_curve;

// gpt-tiny on synthetic tokens, gradient clipping active, 20 iterations of 8 samples in
// micro-batches of 4 (so up to 4 chunks). The vocabulary is 512, padded alike at TP 1 and 2.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 "
                           "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
                           "--set train.micro_batch_size=4 --set train.global_batch_size=8 "
                           "--set train.train_iters=20 --set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 "
                           "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 ";
const std::string kNoDropout = "--set model.hidden_dropout=0 --set model.attention_dropout=0 ";
const std::string kTP2 = "--set distributed.tensor_model_parallel_size=2 ";

Curve curve_of(int nproc, const std::string& args, const std::string& name) {
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  return dtk_test::run_curve(launch + kTrain + args, DTK_TEST_TMP, name);
}

std::string chunks(int n) { return "--set model.domino_chunks=" + std::to_string(n) + " "; }

}  // namespace

TEST(Domino, EqualsPlainTensorParallelAndOneProcessForEveryChunkCount) {
  const Curve one = curve_of(1, kNoDropout, "tp1");
  const Curve plain = curve_of(2, kNoDropout + kTP2, "tp2");
  expect_same_curve(one, plain, 20, "plain TP2 vs TP1");
  for (int n : {2, 3, 4}) {
    const Curve domino = curve_of(2, kNoDropout + kTP2 + chunks(n), "domino" + std::to_string(n));
    expect_same_curve(plain, domino, 20, "Domino " + std::to_string(n) + " chunks vs plain TP2");
    expect_same_curve(one, domino, 20, "Domino " + std::to_string(n) + " chunks vs TP1");
  }
}

// The masks are drawn for the whole micro-batch in plain TP's order and sliced per chunk, so with
// dropout on Domino is not merely statistically equal: it computes the same thing.
TEST(Domino, EqualsPlainTensorParallelWithDropoutAndWithRecompute) {
  const Curve plain = curve_of(2, kTP2, "tp2-dropout");
  expect_same_curve(plain, curve_of(2, kTP2 + chunks(2), "domino2-dropout"), 20, "Domino 2, dropout");
  expect_same_curve(plain, curve_of(2, kTP2 + chunks(4), "domino4-dropout"), 20, "Domino 4, dropout");
  expect_same_curve(plain,
                    curve_of(2, kTP2 + chunks(3) + "--set model.recompute_activations=full ", "domino3-recompute"),
                    20, "Domino 3, dropout, full recompute");
}

// bf16: chunked products round differently from whole-batch ones (bf16 keeps 8 bits), so the
// curves agree to bf16's resolution rather than to 1e-5.
// bf16 keeps 8 significant bits (2^-8 = 0.4%): the two schedules round at different points, and
// on a CPU without native bf16 (LibTorch's fallback kernels, a Zen 3 VM) the gradient norms
// differed by 0.3-0.6% after 10 iterations, on the previous release as on this one. Within 1%; a
// missing or doubled chunk moves them by far more.
TEST(Domino, Bf16FollowsPlainTensorParallel) {
  const std::string bf16 = kNoDropout + kTP2 + "--set train.params_dtype=bf16 ";
  expect_same_curve(curve_of(2, bf16, "tp2-bf16"), curve_of(2, bf16 + chunks(2), "domino2-bf16"), 20,
                    "Domino 2 vs plain TP2, bf16", 1e-2);
}

TEST(Domino, WithDataParallelAndZero) {
  const Curve plain = curve_of(4, kNoDropout + kTP2 + "--strategy ddp ", "tp2dp2");
  expect_same_curve(plain, curve_of(4, kNoDropout + kTP2 + "--strategy ddp " + chunks(2), "tp2dp2-domino2"), 20,
                    "TP2 x DP2, Domino 2, ddp");
  expect_same_curve(plain,
                    curve_of(4,
                             kNoDropout + kTP2 + chunks(2) +
                                 "--strategy zero --set strategy.stage=3 --set strategy.reduce_bucket_size=20000 "
                                 "--set strategy.stage3_param_persistence_threshold=100 ",
                             "tp2dp2-domino2-zero3"),
                    20, "TP2 x DP2, Domino 2, ZeRO-3");
}

// A Domino checkpoint resumes as plain TP (and back): same parameters, same generator states.
// The llama plugin on the SDK's schedule (grouped-query attention, one key/value group per TP
// rank, SwiGLU's two column projections, rotary positions per chunk): Domino TP=2 == plain TP=2
// == one process, with dropout and full recompute as well, and with ZeRO-3 at TP=2 x DP=2.
TEST(Domino, LlamaEqualsPlainTensorParallelAndOneProcess) {
  const std::string llama = std::string("train --config ") + DTK_SOURCE_DIR +
                            "/configs/llama-tiny.pbtxt --dataset synthetic --threads 1 "
                            "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
                            "--set train.micro_batch_size=4 --set train.global_batch_size=8 "
                            "--set train.train_iters=20 --set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 "
                            "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 ";
  auto run = [&](int nproc, const std::string& args, const std::string& name) {
    const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
    return dtk_test::run_curve(launch + llama + args, DTK_TEST_TMP, "llama-" + name);
  };
  const Curve one = run(1, "", "tp1");
  const Curve plain = run(2, kTP2, "tp2");
  expect_same_curve(one, plain, 20, "llama plain TP2 vs TP1");
  for (int n : {2, 4}) {
    const Curve domino = run(2, kTP2 + chunks(n), "domino" + std::to_string(n));
    expect_same_curve(plain, domino, 20, "llama Domino " + std::to_string(n) + " chunks vs plain TP2");
    expect_same_curve(one, domino, 20, "llama Domino " + std::to_string(n) + " chunks vs TP1");
  }
  const std::string dropout = "--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 ";
  expect_same_curve(run(2, kTP2 + dropout, "tp2-dropout"),
                    run(2, kTP2 + dropout + chunks(3) + "--set model.recompute_activations=full ", "domino3-dropout"),
                    20, "llama Domino 3, dropout, full recompute vs plain TP2");
  // TP=2 x DP=2 with ZeRO stage 3: its per-module hooks fire around the interleaved chunks.
  expect_same_curve(run(4, kTP2 + "--strategy ddp ", "tp2dp2"),
                    run(4, kTP2 + chunks(2) +
                               "--strategy zero --set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=100 ",
                        "tp2dp2-domino2-zero3"),
                    20, "llama TP2 x DP2, Domino 2, ZeRO-3 vs plain TP2 x DP2 ddp");
}

TEST(Domino, CheckpointsMoveBetweenDominoAndPlainTensorParallel) {
  const std::string base = kTP2 + "--set train.train_iters=8 ";
  const Curve whole = curve_of(2, base + chunks(2), "whole");
  for (const auto& [first, second] : {std::pair<std::string, std::string>{chunks(2), ""},
                                      std::pair<std::string, std::string>{"", chunks(4)}}) {
    const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "ckpt" + std::to_string(first.size()));
    const Curve a = curve_of(2, base + first + "--set train.train_iters=4 --set lr.lr_decay_iters=8 --set checkpoint.save=" + dir,
                             "first-half");
    const Curve b = curve_of(2, base + second + "--set checkpoint.load=" + dir, "second-half");
    ASSERT_EQ(b.loss.size(), 4u) << b.run.out;
    for (int64_t it = 5; it <= 8; ++it) {
      EXPECT_NEAR(b.loss.at(it), whole.loss.at(it), 1e-5 * whole.loss.at(it)) << "iteration " << it;
      EXPECT_NEAR(b.norm.at(it), whole.norm.at(it), 1e-5 * whole.norm.at(it)) << "iteration " << it;
    }
  }
}

// Each tensor-parallel collective lasts at least the link's latency: gpt-tiny (2 layers) makes at
// least 13 per micro-batch (plain TP's count: forward, the embedding, 2 per layer, 3 in the cross
// entropy; backward, 2 per layer and the output layer's input gradient; Domino's chunks make more),
// 26 per iteration, so at 2 ms each the in-flight time is at least 52 ms per iteration (the link
// carries one message at a time). A lower bound by construction, not a timing.
TEST(Domino, SimulatedLinkDelaysEveryCollective) {
  const dtk_test::Result r =
      dtk_test::run_dtk("launch --nproc_per_node 2 " + kTrain + kNoDropout + kTP2 + chunks(2) +
                        "--set train.bench_steps=1 --set train.perf_warmup_steps=1 --set lr.lr_warmup_iters=1 "
                        "--set distributed.simulated_link=2ms,10GBps");
  ASSERT_EQ(r.code, 0) << r.out;
  std::smatch m;
  const std::string& out = r.out;
  // The log line of each iteration, and bench mode's summary of the measured one (iteration 2).
  for (const char* pattern : {R"(tensor-parallel comm \(ms\) in flight: (\S+) \| exposed: (\S+) \|)",
                              R"(tensor-parallel comm per iteration \(ms\): in flight (\S+) \| exposed (\S+) \()"}) {
    ASSERT_TRUE(std::regex_search(out, m, std::regex(pattern))) << pattern << "\n" << out;
    const double in_flight = std::stod(m[1]), exposed = std::stod(m[2]);
    EXPECT_GE(in_flight, 52.0) << out;
    EXPECT_GE(exposed, 0.0) << out;
    EXPECT_LE(exposed, in_flight + 5.0) << "a wait ends at most with its collective (+ copy-back): " << out;
  }

  // The link's delay is a wait like any other: bounded by the collective timeout.
  const dtk_test::Result slow =
      dtk_test::run_dtk("launch --nproc_per_node 2 " + kTrain + kNoDropout + kTP2 +
                            "--set train.train_iters=1 --set lr.lr_warmup_iters=0 --set distributed.timeout_seconds=2 "
                            "--set distributed.simulated_link=0us,10Bps",
                        120);
  EXPECT_NE(slow.code, 0) << slow.out;
  EXPECT_NE(slow.out.find("the simulated link (distributed.simulated_link) needs"), std::string::npos) << slow.out;
}

// logging.trace_file: one Chrome trace per rank of the chosen iterations, with every (layer, stage,
// chunk) compute span forward and backward, each collective from issue to completion (async
// begin/end pairs on the group's track) and the waits.
TEST(Domino, TraceFileHoldsChunkSpansCollectivesAndWaitsPerRank) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "trace");
  const dtk_test::Result r = dtk_test::run_dtk("launch --nproc_per_node 2 " + kTrain + kTP2 + chunks(2) +
                                               "--set train.train_iters=3 --set logging.trace_file=" + dir +
                                               "/timeline.json --set logging.trace_iterations=2-3");
  ASSERT_EQ(r.code, 0) << r.out;
  auto count = [](const std::string& s, const std::string& what) {
    int n = 0;
    for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
    return n;
  };
  for (int rank : {0, 1}) {
    std::ifstream in(dir + "/timeline.rank" + std::to_string(rank) + ".json");
    ASSERT_TRUE(in) << "no trace of rank " << rank << "\n" << r.out;
    const std::string t((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(t.rfind("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [", 0), 0u);
    EXPECT_EQ(t.substr(t.size() - 4), "\n]}\n");
    // 2 iterations x 2 micro-batches: each (layer, stage, chunk) forward and backward once.
    EXPECT_EQ(count(t, "\"layer 1 mlp, chunk 1\""), 4) << t.substr(0, 2000);
    EXPECT_EQ(count(t, "\"layer 1 mlp, chunk 1 backward\""), 4);
    EXPECT_EQ(count(t, "\"forward 1\""), 2);
    EXPECT_EQ(count(t, "\"optimizer step\""), 2);
    EXPECT_GT(count(t, "\"ph\": \"b\""), 0);
    EXPECT_EQ(count(t, "\"ph\": \"b\""), count(t, "\"ph\": \"e\""));
    EXPECT_GT(count(t, "\"cat\": \"wait\""), 0);
    EXPECT_NE(t.find("\"name\": \"rank " + std::to_string(rank) + "\""), std::string::npos);
  }
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + "--set logging.trace_file=" DTK_TEST_TMP "/t.json --set logging.trace_iterations=3-2"),
      "logging.trace_iterations");
}

TEST(Domino, BadInputsAreOneLineErrors) {
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(kTrain + chunks(5) + "--set train.train_iters=1 --set lr.lr_warmup_iters=0"),
      "domino_chunks (5) exceeds the micro-batch size (4)");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + chunks(-1)), "domino_chunks");
  for (const char* bad : {"25us", "fast,50GBps", "25us,50GBs", "25us,0GBps", "25us,1GBps,1"})
    dtk_test::expect_one_line_error(dtk_test::run_dtk(kTrain + "--set distributed.simulated_link=" + bad),
                                    "distributed.simulated_link");
}
