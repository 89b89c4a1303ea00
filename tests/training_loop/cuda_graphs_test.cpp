// train.cuda_graphs on the CPU. The GPU records each micro-batch's forward and backward into a
// CUDA graph (tests/gpu checks captured == uncaptured there); here DTK_TEST_CUDA_GRAPH_PROBE=1
// puts the probe in the graph's place: every replay runs the recorded body again with
// capturing() on, on fixed input tensors and fixed gradients, and fails on any host read. So CI
// proves what a graph needs of the step: no host read anywhere in it (the layers' sync-free
// paths, the step's metric as a tensor, the deferred checks), the same losses as the
// uncaptured run (fp32 and bf16, gradient accumulation, gpt and llama, dropout with its seeds
// drawn by the host before each replay, recomputation), a check that fails
// stopping the run before its update, and the start-up line saying why a run stays uncaptured.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "../common/run_dtk.hpp"

namespace {

using dtk_test::Result;

// Two micro-batches per step (the recorded backward accumulates into the bound gradients),
// clipping on, no dropout.
std::string train_args(const std::string& config) {
  return std::string("train --config ") + DTK_SOURCE_DIR + "/configs/" + config +
         " --dataset synthetic --threads 1 --set model.hidden_dropout=0 --set model.attention_dropout=0 "
         "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
         "--set train.micro_batch_size=2 --set train.global_batch_size=4 --set train.train_iters=6 "
         "--set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 --set logging.log_interval=1 "
         "--set eval.eval_interval=0 --set eval.eval_iters=1 ";
}

Result run_probe(const std::string& args) {
  ::setenv("DTK_TEST_CUDA_GRAPH_PROBE", "1", 1);
  Result r = dtk_test::run_dtk(args + " --set train.cuda_graphs=true", 300);
  ::unsetenv("DTK_TEST_CUDA_GRAPH_PROBE");
  return r;
}

// `recorded`: the iterations whose start-up line says they record (by default 3: iterations 1-2
// run as always, 3 records (the probe records nothing) and replays from then on).
void expect_equal_losses(const std::string& args, const std::string& what, size_t iterations = 6,
                         const std::vector<int>& recorded = {3}) {
  const Result plain = dtk_test::run_dtk(args, 300);
  const Result probed = run_probe(args);
  ASSERT_EQ(plain.code, 0) << plain.out;
  ASSERT_EQ(probed.code, 0) << probed.out;
  for (int it : recorded)
    EXPECT_NE(probed.out.find(" > train.cuda_graphs: iteration " + std::to_string(it) +
                              "'s micro-batches replay a recorded forward and backward"),
              std::string::npos)
        << what << ": iteration " << it << " records\n"
        << probed.out;
  EXPECT_EQ(probed.out.find("could not be recorded"), std::string::npos) << probed.out;
  const std::map<int, std::string> want = dtk_test::printed_losses(plain.out);
  const std::map<int, std::string> got = dtk_test::printed_losses(probed.out);
  ASSERT_EQ(want.size(), iterations) << plain.out;
  EXPECT_EQ(got, want) << what << ": the replayed steps' losses differ from the uncaptured run's\n" << probed.out;
}

TEST(CudaGraphs, TheRecordedStepReadsNothingOnTheHostAndTrainsAsTheUncapturedOne) {
  expect_equal_losses(train_args("gpt-tiny.pbtxt"), "gpt fp32");
  expect_equal_losses(train_args("gpt-tiny.pbtxt") + " --set train.params_dtype=bf16", "gpt bf16 (fp32 masters)");
  expect_equal_losses(train_args("llama-tiny.pbtxt") + " --set train.params_dtype=bf16", "llama bf16");
}

// A per-token loss mask makes the output layer's gradient differ between tokens, which a graph
// cannot branch on: the deferred check stops the run in the iteration, before its update.
TEST(CudaGraphs, ADeferredCheckThatFailsStopsTheRunBeforeTheUpdate) {
  const Result r = run_probe(train_args("gpt-tiny.pbtxt") + " --set step.eod_mask_loss=true --set dataset.vocab_size=4 --set step.eod_token=1");
  dtk_test::expect_one_line_error(r, "the fused output layer's loss gradient differs between tokens");
  EXPECT_NE(r.out.find("train.cuda_graphs=false (iteration 3)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" iteration        2/"), std::string::npos) << "the eager iterations ran\n" << r.out;
  EXPECT_EQ(r.out.find(" iteration        3/"), std::string::npos) << "no update from iteration 3\n" << r.out;
}

// Dropout: a mask drawn while recording reads its seed from a slot the host draws into before each
// replay (the probe's first replay draws each slot as it is handed out, the later ones all before
// the replay), from the mask's generator in the uncaptured order: the same masks, so the same
// losses. Full recomputation and Domino's recomputed layers draw from clones of the generators,
// whose draws repeat the forward's slots; selective recomputation, llama, bf16 too.
TEST(CudaGraphs, DropoutDrawsTheUncapturedMasksInTheReplays) {
  const std::string dropout = " --set model.hidden_dropout=0.1 --set model.attention_dropout=0.1";
  expect_equal_losses(train_args("gpt-tiny.pbtxt") + dropout, "gpt fp32 with dropout");
  expect_equal_losses(train_args("gpt-tiny.pbtxt") + dropout + " --set model.recompute_activations=full",
                      "gpt with dropout and full recomputation");
  expect_equal_losses(train_args("gpt-tiny.pbtxt") + dropout + " --set model.recompute_activations=selective",
                      "gpt with dropout and selective recomputation");
  expect_equal_losses(
      train_args("gpt-tiny.pbtxt") + dropout + " --set model.domino_chunks=2 --set model.recompute_activations=full",
      "gpt with dropout, Domino's chunks and full recomputation");
  expect_equal_losses(train_args("llama-tiny.pbtxt") + dropout + " --set train.params_dtype=bf16",
                      "llama bf16 with dropout");
  // A batch-size ramp-up: one micro-batch per step records at 4, two re-record at 5 (the slots of
  // the first recording forgotten, the table's address kept).
  expect_equal_losses(train_args("gpt-tiny.pbtxt") + dropout +
                          " --set model.recompute_activations=full --set train.train_iters=0 "
                          "--set train.train_samples=28 --set train.rampup_batch_size='2 2 8'",
                      "gpt with dropout, full recomputation, re-recorded as the batch ramps up", 9, {4, 5});
}

// Where the step cannot be recorded the run says why once at start and trains as always.
TEST(CudaGraphs, RunsThatCannotBeRecordedSayWhyAtStart) {
  const Result cpu = dtk_test::run_dtk(train_args("gpt-tiny.pbtxt") + " --set train.cuda_graphs=true", 300);
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  EXPECT_NE(cpu.out.find(" > train.cuda_graphs: off: the run trains on the CPU\n"), std::string::npos) << cpu.out;
  const Result zero = run_probe(train_args("gpt-tiny.pbtxt") + " --strategy zero");
  ASSERT_EQ(zero.code, 0) << zero.out;
  EXPECT_NE(zero.out.find(" > train.cuda_graphs: off: strategy 'zero' manages the gradients' memory itself"),
            std::string::npos)
      << zero.out;
  const Result off = dtk_test::run_dtk(train_args("gpt-tiny.pbtxt"), 300);
  EXPECT_EQ(off.out.find("train.cuda_graphs"), std::string::npos) << "said only when asked for\n" << off.out;
}

}  // namespace
