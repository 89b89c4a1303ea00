// Sequence parallelism (distributed.sequence_parallel, Megatron's --sequence-parallel) and the
// recompute choices, end to end through `dtk launch`, real processes over loopback (Gloo):
//   * gpt and llama at TP 2 with sequence parallelism give plain TP 2's lm loss and grad norm
//     iteration by iteration (fp32, within 1e-5), with dropout too: the hidden-dropout masks are
//     drawn for the whole sequence and each rank applies its rows, so the masks are the same ones;
//   * the same with TP 2 x PP 2 (the stages exchange sequence shards), Domino 2, 3 and 4 chunks, and
//     ZeRO stages 1-3 at TP 2 x DP 2; a resumed run equals an uninterrupted one;
//   * Qwen-style llama layers (query/key norms read by each rank's heads only) at TP 2, with
//     sequence parallelism, Domino and ZeRO-3 equal one process;
//   * selective (core attention; the MLPs), full uniform (groups of 1 and 2 layers) and full block
//     recomputation give the no-recompute losses, for gpt and llama; ZeRO-3 with recomputed MLPs
//     equals ddp;
//   * the memory report's measured activations per micro-batch shrink with sequence parallelism
//     and with selective recomputation (the MLPs' too) as the paper's formulas say they should;
//   * the traffic report: reduce-scatter and all-gather bytes each half of plain TP's all-reduce
//     bytes, plus the backward's second gather of each column-parallel input;
//   * bad inputs are one-line errors.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"

namespace {

using dtk_test::Curve;
using dtk_test::expect_same_curve;

constexpr size_t kIters = 10;

// A tiny model on synthetic tokens: 4 layers (so recompute groups and pipeline stages have room),
// 10 iterations of 8 samples in micro-batches of 4, gradient clipping active.
std::string train(const std::string& model) {
  return "train --config " + std::string(DTK_SOURCE_DIR) + "/configs/" + model +
         "-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=4 "
         "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
         "--set train.micro_batch_size=4 --set train.global_batch_size=8 --set train.train_iters=10 "
         "--set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 --set logging.log_interval=1 "
         "--set eval.eval_interval=0 --set eval.eval_iters=1 ";
}
const std::string kNoDropout = "--set model.hidden_dropout=0 --set model.attention_dropout=0 ";
const std::string kDropout = "--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 ";
const std::string kTP2 = "--set distributed.tensor_model_parallel_size=2 ";
const std::string kSP = "--set distributed.sequence_parallel=true ";

Curve curve_of(const std::string& model, int nproc, const std::string& args, const std::string& name) {
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  return dtk_test::run_curve(launch + train(model) + args, DTK_TEST_TMP, model + "-" + name);
}

// A figure of the memory report line, in MB.
double report_mb(const std::string& out, const std::string& field) {
  std::smatch m;
  const std::regex re(field + ": ([0-9.]+)");
  if (!std::regex_search(out, m, re)) return -1;
  return std::stod(m[1]);
}

}  // namespace

TEST(SequenceParallel, GptAndLlamaEqualPlainTensorParallelWithAndWithoutDropout) {
  for (const std::string model : {"gpt", "llama"}) {
    for (const auto& [dropout, what] : {std::pair{kNoDropout, "no dropout"}, std::pair{kDropout, "dropout"}}) {
      const std::string tag = dropout == kDropout ? "dropout" : "plain";
      const Curve tp = curve_of(model, 2, dropout + kTP2, "tp2-" + tag);
      const Curve sp = curve_of(model, 2, dropout + kTP2 + kSP, "tp2-sp-" + tag);
      expect_same_curve(tp, sp, kIters, model + " TP2 + sequence parallelism vs TP2, " + what);
    }
  }
}

TEST(SequenceParallel, WithPipelineStagesAndDomino) {
  for (const std::string model : {"gpt", "llama"}) {
    // Pipeline stages draw dropout from their own streams: compared with TP2 x PP2.
    const std::string pp2 = "--set distributed.pipeline_model_parallel_size=2 ";
    expect_same_curve(curve_of(model, 4, kDropout + kTP2 + pp2, "tp2-pp2"),
                      curve_of(model, 4, kDropout + kTP2 + kSP + pp2, "tp2-pp2-sp"), kIters,
                      model + " TP2 x PP2 + sequence parallelism vs TP2 x PP2");
    const Curve tp = curve_of(model, 2, kDropout + kTP2, "tp2-dropout");
    for (int n : model == "gpt" ? std::vector<int>{2, 4} : std::vector<int>{3}) {  // 3: unequal chunks
      const std::string chunks = "--set model.domino_chunks=" + std::to_string(n) + " ";
      expect_same_curve(tp, curve_of(model, 2, kDropout + kTP2 + kSP + chunks, "domino-sp" + std::to_string(n)), kIters,
                        model + " Domino " + std::to_string(n) + " chunks + sequence parallelism vs TP2");
    }
  }
}

// Qwen-style llama layers (per-head query/key norms, heads of 32 channels over hidden 64 / 4
// heads, query/key/value biases): each tensor-parallel rank normalises only its heads, so the
// norms' gradients are partial sums the host adds over the group; TP 2, with sequence
// parallelism, with Domino and under ZeRO-3 at TP 2 x DP 2 equal one process.
TEST(SequenceParallel, QwenStyleLlamaEqualsOneProcess) {
  const std::string qwen =
      kNoDropout + "--set model.qk_layernorm=true --set model.kv_channels=32 --set model.add_qkv_bias=true ";
  const Curve one = curve_of("llama", 1, qwen, "qwen-tp1");
  expect_same_curve(one, curve_of("llama", 2, qwen + kTP2, "qwen-tp2"), kIters, "Qwen-style llama TP2 vs TP1");
  expect_same_curve(one, curve_of("llama", 2, qwen + kTP2 + kSP, "qwen-tp2-sp"), kIters,
                    "Qwen-style llama TP2 + sequence parallelism vs TP1");
  expect_same_curve(one, curve_of("llama", 2, qwen + kTP2 + "--set model.domino_chunks=2 ", "qwen-domino2"), kIters,
                    "Qwen-style llama Domino 2 chunks vs TP1");
  expect_same_curve(
      one,
      curve_of("llama", 4,
               qwen + kTP2 + kSP +
                   "--strategy zero --set strategy.stage=3 --set strategy.stage3_param_persistence_threshold=100 ",
               "qwen-tp2dp2-sp-zero3"),
      kIters, "Qwen-style llama TP2 x DP2 + sequence parallelism, ZeRO-3 vs TP1");
}

TEST(SequenceParallel, WithZeroStages) {
  const Curve ddp = curve_of("gpt", 4, kNoDropout + kTP2 + "--strategy ddp ", "tp2dp2");
  for (int stage : {1, 2, 3}) {
    const std::string zero = "--strategy zero --set strategy.stage=" + std::to_string(stage) +
                             (stage == 3 ? " --set strategy.stage3_param_persistence_threshold=100 " : " ");
    expect_same_curve(ddp, curve_of("gpt", 4, kNoDropout + kTP2 + kSP + zero, "tp2dp2-sp-zero" + std::to_string(stage)),
                      kIters, "TP2 x DP2 + sequence parallelism, ZeRO stage " + std::to_string(stage) + " vs ddp");
  }
  // ZeRO-3 gathers a layer's parameters around its backward: a recomputed MLP reruns inside it.
  expect_same_curve(ddp,
                    curve_of("gpt", 4,
                             kNoDropout + kTP2 + kSP +
                                 "--strategy zero --set strategy.stage=3 --set model.recompute_activations=selective "
                                 "--set model.recompute_modules=core_attn,mlp ",
                             "tp2dp2-sp-zero3-recompute-mlp"),
                    kIters, "TP2 x DP2 + sequence parallelism, ZeRO stage 3, MLPs recomputed vs ddp");
  expect_same_curve(
      curve_of("llama", 4, kNoDropout + kTP2 + "--strategy ddp ", "tp2dp2"),
      curve_of("llama", 4, kNoDropout + kTP2 + kSP + "--strategy zero --set strategy.stage=3 ", "tp2dp2-sp-zero3"),
      kIters, "llama TP2 x DP2 + sequence parallelism, ZeRO-3 vs ddp");
}

// Saved at iteration 5 and resumed: the same losses as 10 uninterrupted iterations (parameters,
// optimizer, and the dropout generators).
TEST(SequenceParallel, ResumesExactly) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "ckpt-sp");
  const std::string args = kDropout + kTP2 + kSP + "--set lr.lr_decay_iters=10 ";
  const Curve whole = curve_of("gpt", 2, args, "whole");
  const Curve first = curve_of("gpt", 2, args + "--set train.train_iters=5 --set checkpoint.save=" + dir, "first");
  const Curve second = curve_of("gpt", 2, args + "--set checkpoint.load=" + dir, "second");
  dtk_test::expect_resumed_curve(whole, second, 5);
}

// Every recompute choice computes what no recomputation computes (one process; dropout on, so
// the recomputed masks must be the same ones).
TEST(Recompute, EveryChoiceGivesTheLossesOfNone) {
  for (const std::string model : {"gpt", "llama"}) {
    const Curve none = curve_of(model, 1, kDropout, "recompute-none");
    const std::pair<std::string, std::string> choices[] = {
        {"selective", "--set model.recompute_activations=selective "},
        {"selective mlp", "--set model.recompute_activations=selective --set model.recompute_modules=mlp "},
        {"full uniform 1", "--set model.recompute_activations=full "},
        {"full uniform 2", "--set model.recompute_activations=full --set model.recompute_num_layers=2 "},
        {"full block 3",
         "--set model.recompute_activations=full --set model.recompute_method=block --set "
         "model.recompute_num_layers=3 "},
    };
    for (const auto& [what, args] : choices)
      expect_same_curve(none, curve_of(model, 1, kDropout + args, "recompute-" + what), kIters,
                        model + " recompute " + what + " vs none");
  }
  // With TP 2 and sequence parallelism too.
  expect_same_curve(
      curve_of("llama", 2, kDropout + kTP2 + kSP, "sp-none"),
      curve_of("llama", 2, kDropout + kTP2 + kSP + "--set model.recompute_activations=selective ", "sp-selective"),
      kIters, "llama TP2 + sequence parallelism, selective recompute vs none");
}

// The memory report's activations per micro-batch (measured by the allocator across a
// forward): sequence parallelism splits what lies outside the tensor-parallel blocks, so at TP 2
// with selective recomputation it is about 17/22 of plain TP's (34 s b h / t against
// s b h (10 + 24 / t)); and the report's tensor-parallel traffic moves the same bytes.
TEST(SequenceParallel, ShrinksMeasuredActivationsAndKeepsTraffic) {
  const std::string args = kNoDropout + kTP2 +
                           "--set model.recompute_activations=selective --set model.hidden_size=128 "
                           "--set train.seq_length=64 --set train.train_iters=3 ";
  const Curve tp = curve_of("gpt", 2, args, "memory-tp");
  const Curve sp = curve_of("gpt", 2, args + kSP, "memory-sp");
  const double tp_mb = report_mb(tp.run.out, "activations per micro-batch");
  const double sp_mb = report_mb(sp.run.out, "activations per micro-batch");
  ASSERT_GT(tp_mb, 0) << tp.run.out;
  ASSERT_GT(sp_mb, 0) << sp.run.out;
  EXPECT_LE(sp_mb, 0.85 * tp_mb) << "sequence parallelism: " << sp_mb << " MB, plain TP: " << tp_mb << " MB";
  // Plain TP's all-reduces become a reduce-scatter and an all-gather of the same bytes each (a
  // ring all-reduce is both); on top, each column-parallel product gathers its input again in
  // backward instead of keeping it (Megatron's trade): 2 per layer x 4 layers x 2 micro-batches of
  // [4, 64, 128] fp32, half of which a rank sends at TP 2: 1 MiB.
  std::smatch a, b;
  const std::regex traffic(
      "tensor-parallel traffic sent per iteration \\(MB\\) \\| all-reduce: ([0-9.]+) \\| "
      "reduce-scatter: ([0-9.]+) \\| all-gather: ([0-9.]+) \\| broadcast: [0-9.]+ \\| total: ([0-9.]+)");
  ASSERT_TRUE(std::regex_search(tp.run.out, a, traffic)) << tp.run.out;
  ASSERT_TRUE(std::regex_search(sp.run.out, b, traffic)) << sp.run.out;
  const double all_reduce = std::stod(a[1]), reduce_scatter = std::stod(b[2]), all_gather = std::stod(b[3]);
  EXPECT_NEAR(reduce_scatter, all_reduce / 2, 0.03 * all_reduce) << "\n" << a[0] << "\n" << b[0];
  EXPECT_NEAR(all_gather, all_reduce / 2 + 1.0, 0.03 * all_reduce) << "\n" << a[0] << "\n" << b[0];
}

// recompute_modules mlp: each layer keeps its MLP's input alone, not dense_h_to_4h's output nor the
// GELU's ([4, 64, 512] fp32 each, 0.5 MiB): 1 MiB less per layer, 4 MiB over the 4 layers, in the
// allocator's count (the start-up estimate's 16 s b h less: MemoryEstimate in run_parts_test.cpp);
// the losses stay the same.
TEST(Recompute, MlpModulesShrinkMeasuredActivations) {
  const std::string args = kNoDropout +
                           "--set model.recompute_activations=selective --set model.hidden_size=128 "
                           "--set train.seq_length=64 --set train.train_iters=3 ";
  const Curve attention = curve_of("gpt", 1, args, "memory-core-attn");
  const Curve mlp = curve_of("gpt", 1, args + "--set model.recompute_modules=core_attn,mlp ", "memory-mlp");
  const double attention_mb = report_mb(attention.run.out, "activations per micro-batch");
  const double mlp_mb = report_mb(mlp.run.out, "activations per micro-batch");
  ASSERT_GT(attention_mb, 0) << attention.run.out;
  ASSERT_GT(mlp_mb, 0) << mlp.run.out;
  EXPECT_NEAR(attention_mb - mlp_mb, 4.0, 0.05) << "core_attn: " << attention_mb << " MB, core_attn,mlp: " << mlp_mb;
  expect_same_curve(attention, mlp, 3, "gpt selective core_attn vs core_attn,mlp");
}

TEST(SequenceParallel, BadInputsAreOneLineErrors) {
  // A sequence the TP ranks cannot split.
  dtk_test::expect_one_line_error(dtk_test::run_dtk("config " + kTP2 + kSP + "--set train.seq_length=31"),
                                  "distributed.sequence_parallel splits train.seq_length 31 over the tensor-parallel "
                                  "size 2, which does not divide it");
  // recompute_num_layers beyond a stage's layers.
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(train("gpt") + "--set model.recompute_activations=full --set model.recompute_num_layers=5"),
      "exceeds the 4 layers of a pipeline stage");
}
