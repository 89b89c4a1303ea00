// Context parallelism (distributed.context_parallel_size, Megatron's --context-parallel-size with
// --cp-comm-type a2a or all_gather) end to end through `dtk launch`, real processes over loopback
// (Gloo). Each rank of a context-parallel group keeps 2 of the sequence's 2 x cp chunks (Megatron's
// load-balanced split) and its attention trades them for whole sequences of 1 / cp of the heads
// (or gathers the keys and values),
// so every run below is compared with one process, iteration by iteration (fp32, lm loss and grad
// norm within 1e-5):
//   * gpt (learned positions) and llama (rotary, grouped-query attention): the tokens drawn from
//     16 ids with id 3 the end of document, so eod_mask_loss leaves the ranks different token
//     counts (the mean divides by the group's count), reset_position_ids gives each document its
//     own positions and reset_attention_mask a whole [b, 1, s, s] mask; CP 2 and CP 4; the
//     per-token loss (train.calculate_per_token_loss); a sliding window;
//   * with TP 2 and sequence parallelism, DP 2 under ZeRO stages 1-3, and PP 2;
//   * under Domino's chunked schedule: equal to one process, and with dropout equal to plain
//     tensor parallelism (the same masks, drawn up front for the whole sequence's attention);
//   * the all_gather exchange (--cp-comm-type all_gather): the same, with pipeline stages, ZeRO
//     stage 3, full recomputation, resume and mixtures of experts too, and where a2a cannot split
//     the heads;
//   * a mixture of experts (its balancing losses over the group; DeepSpeed's gate, sinkhorn and
//     quantile balancing on whole sequences) equals one process, logged losses included, with
//     expert parallelism too; token dropping per rank;
//   * a resumed run equals an uninterrupted one, recomputation equals none, evaluation equals one
//     process's;
//   * bad inputs are one-line errors, a step's non-causal mask under all_gather among them.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"

namespace {

using dtk_test::Curve;
using dtk_test::expect_same_curve;

constexpr size_t kIters = 6;

// A tiny model on synthetic tokens of 16 ids (id 3 ends a document): 4 layers, 6 iterations of 8
// samples in micro-batches of 4, no dropout (each rank draws its own masks), clipping active.
std::string train(const std::string& model) {
  return "train --config " + std::string(DTK_SOURCE_DIR) + "/configs/" + model +
         "-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=4 "
         "--set model.vocab_size=512 --set dataset.vocab_size=16 --set train.seq_length=32 "
         "--set train.micro_batch_size=4 --set train.global_batch_size=8 --set train.train_iters=6 "
         "--set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 --set logging.log_interval=1 "
         "--set eval.eval_interval=0 --set eval.eval_iters=1 "
         "--set model.hidden_dropout=0 --set model.attention_dropout=0 ";
}
const std::string kDocuments =
    "--set step.eod_token=3 --set step.eod_mask_loss=true --set step.reset_position_ids=true "
    "--set step.reset_attention_mask=true ";
std::string cp(int n) { return "--set distributed.context_parallel_size=" + std::to_string(n) + " "; }

Curve curve_of(const std::string& model, int nproc, const std::string& args, const std::string& name) {
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  return dtk_test::run_curve(launch + train(model) + args, DTK_TEST_TMP, model + "-" + name);
}

// The evaluations' lm loss values, in the order the run printed them (validation, then test).
std::vector<double> evaluation_losses(const std::string& out) {
  std::vector<double> losses;
  const std::regex re("on (validation|test) set \\| lm loss value: ([0-9.E+-]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    losses.push_back(std::stod((*it)[2]));
  return losses;
}

// A failed launch's output holds the error line.
void expect_error(int nproc, const std::string& model, const std::string& args, const std::string& what) {
  const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
  const dtk_test::Result r = dtk_test::run_dtk(launch + train(model) + args, 120);
  EXPECT_NE(r.code, 0) << args;
  EXPECT_NE(r.out.find("dtk: error: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(what), std::string::npos) << "want: " << what << "\n" << r.out;
}

}  // namespace

TEST(ContextParallel, GptAndLlamaEqualOneProcess) {
  for (const std::string model : {"gpt", "llama"}) {
    const Curve one = curve_of(model, 1, kDocuments, "one");
    expect_same_curve(one, curve_of(model, 2, kDocuments + cp(2), "cp2"), kIters, model + " CP 2 vs one process");
    // The causal mask alone (LibTorch's or DTK's fused path), positions 0..s-1 from the step.
    expect_same_curve(curve_of(model, 1, "", "one-plain"), curve_of(model, 2, cp(2), "cp2-plain"), kIters,
                      model + " CP 2 vs one process, the causal mask alone");
  }
  // A sliding window (Megatron's --window-size 8,0): its mask on the whole sequence's positions.
  const std::string window = "--set model.window_size=8,0 ";
  expect_same_curve(curve_of("llama", 1, window, "one-window"), curve_of("llama", 2, window + cp(2), "cp2-window"),
                    kIters, "llama CP 2 vs one process, a sliding window of 8");
  // Evaluation reads the data ranks' samples and splits them as training does.
  const std::string eval = "--set eval.eval_interval=3 --set eval.eval_iters=2 ";
  const Curve one = curve_of("gpt", 1, kDocuments + eval, "one-eval");
  const Curve two = curve_of("gpt", 2, kDocuments + eval + cp(2), "cp2-eval");
  const std::vector<double> want = evaluation_losses(one.run.out), got = evaluation_losses(two.run.out);
  ASSERT_GE(want.size(), 2u) << one.run.out;  // validation at iterations 3 and 6, after training; test
  ASSERT_EQ(got.size(), want.size()) << two.run.out;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << "evaluation " << i;
  // Four ranks: 8 chunks of 4 positions; gpt's 4 heads one per rank.
  expect_same_curve(curve_of("gpt", 1, kDocuments, "one"), curve_of("gpt", 4, kDocuments + cp(4), "cp4"), kIters,
                    "gpt CP 4 vs one process");
  // Megatron's --calculate-per-token-loss: each rank's summed loss and its token count.
  const std::string per_token = kDocuments + "--set train.calculate_per_token_loss=true ";
  expect_same_curve(curve_of("llama", 1, per_token, "one-per-token"),
                    curve_of("llama", 2, per_token + cp(2), "cp2-per-token"), kIters,
                    "llama CP 2 vs one process, per-token loss");
}

TEST(ContextParallel, WithTensorDataAndPipelineParallelism) {
  const std::string tp2_sp = "--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true ";
  for (const std::string model : {"gpt", "llama"}) {
    const Curve one = curve_of(model, 1, kDocuments, "one");
    // llama-tiny's 2 key/value groups leave one per tensor-parallel rank, which CP 2 cannot
    // split: it takes 4 groups here.
    const std::string groups = model == "llama" ? "--set model.num_query_groups=4 " : "";
    const Curve one_groups = model == "llama" ? curve_of(model, 1, kDocuments + groups, "one-4-groups") : one;
    expect_same_curve(one_groups, curve_of(model, 4, kDocuments + groups + tp2_sp + cp(2), "tp2-sp-cp2"), kIters,
                      model + " TP 2 x CP 2 with sequence parallelism vs one process");
    expect_same_curve(
        one, curve_of(model, 4, kDocuments + cp(2) + "--set distributed.pipeline_model_parallel_size=2 ", "cp2-pp2"),
        kIters, model + " CP 2 x PP 2 vs one process");
  }
  const Curve one = curve_of("gpt", 1, kDocuments, "one");
  for (int stage : {1, 2, 3})
    expect_same_curve(one,
                      curve_of("gpt", 4,
                               kDocuments + cp(2) + "--strategy zero --set strategy.stage=" + std::to_string(stage) +
                                   (stage == 3 ? " --set strategy.stage3_param_persistence_threshold=100 " : " "),
                               "cp2-dp2-zero" + std::to_string(stage)),
                      kIters, "gpt CP 2 x DP 2, ZeRO stage " + std::to_string(stage) + " vs one process");
}

// Domino (model.domino_chunks=2) splits each micro-batch into 2 chunks whose tensor-parallel
// reductions overlap the other chunk's compute; each chunk's attention makes its own exchanges.
TEST(ContextParallel, WithDomino) {
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  const std::string domino = "--set model.domino_chunks=2 ";
  expect_same_curve(curve_of("gpt", 1, kDocuments, "one"),
                    curve_of("gpt", 4, kDocuments + tp2 + cp(2) + domino, "tp2-cp2-domino"), kIters,
                    "gpt TP 2 x CP 2 under Domino vs one process");
  // With dropout: the masks Domino draws up front for the whole micro-batch are the plain
  // layers' (attention probabilities over the whole sequence of this rank's heads). llama with
  // sequence parallelism, its rotary positions the whole sequence's.
  const std::string dropout = "--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 ";
  for (const std::string model : {"gpt", "llama"}) {
    const std::string args = kDocuments + dropout + tp2 + cp(2) +
                             (model == "llama" ? "--set model.num_query_groups=4 "
                                                 "--set distributed.sequence_parallel=true "
                                               : "");
    expect_same_curve(curve_of(model, 4, args, "tp2-cp2-dropout"),
                      curve_of(model, 4, args + domino, "tp2-cp2-dropout-domino"), kIters,
                      model + " TP 2 x CP 2 with dropout, Domino vs plain");
  }
}

// Megatron's --cp-comm-type all_gather (distributed.cp_comm_type): each rank gathers the whole
// sequence's keys and values and attends with its own queries, each of its two chunks over the keys
// up to its end; the backward reduce-scatters their gradients. It asks nothing of the heads, so
// llama-tiny's 2 key/value groups run at CP 4 and at TP 2 x CP 2, where a2a refuses them.
TEST(ContextParallel, AllGatherEqualsOneProcess) {
  const std::string gather = "--set distributed.cp_comm_type=all_gather ";
  const std::string tp2 = "--set distributed.tensor_model_parallel_size=2 ";
  for (const std::string model : {"gpt", "llama"}) {
    // The documents' own positions and the whole [b, 1, s, s] mask, each chunk reading its rows.
    expect_same_curve(curve_of(model, 1, kDocuments, "one"), curve_of(model, 2, kDocuments + cp(2) + gather, "ag2"),
                      kIters, model + " CP 2 all_gather vs one process");
    // The causal mask alone, at CP 4 (8 chunks of 4 positions).
    expect_same_curve(curve_of(model, 1, "", "one-plain"), curve_of(model, 4, cp(4) + gather, "ag4-plain"), kIters,
                      model + " CP 4 all_gather vs one process, the causal mask alone");
  }
  // One key/value group per tensor-parallel rank, sequence parallelism inside each share.
  expect_same_curve(
      curve_of("llama", 1, kDocuments, "one"),
      curve_of("llama", 4, kDocuments + tp2 + "--set distributed.sequence_parallel=true " + cp(2) + gather,
               "tp2-sp-ag2"),
      kIters, "llama TP 2 x CP 2 all_gather with sequence parallelism vs one process");
  // A sliding window (8,0) over the documents' mask: each chunk's window over the gathered keys.
  const std::string window = kDocuments + "--set model.window_size=8,0 ";
  expect_same_curve(curve_of("llama", 1, window, "one-documents-window"),
                    curve_of("llama", 2, window + cp(2) + gather, "ag2-documents-window"), kIters,
                    "llama CP 2 all_gather vs one process, a sliding window of 8 and the documents' mask");
  // Domino's chunks attend as the plain layers do: equal to one process; with dropout equal to
  // plain tensor parallelism (the probabilities' masks drawn up front for gathered_probs_shape).
  const std::string domino = "--set model.domino_chunks=2 ";
  expect_same_curve(curve_of("gpt", 1, kDocuments, "one"),
                    curve_of("gpt", 4, kDocuments + tp2 + cp(2) + gather + domino, "tp2-ag2-domino"), kIters,
                    "gpt TP 2 x CP 2 all_gather under Domino vs one process");
  const std::string dropout = "--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 ";
  for (const std::string model : {"gpt", "llama"}) {
    const std::string args = kDocuments + dropout + tp2 + cp(2) + gather;
    const Curve plain = curve_of(model, 4, args, "tp2-ag2-dropout");
    expect_same_curve(plain, curve_of(model, 4, args + domino, "tp2-ag2-dropout-domino"), kIters,
                      model + " TP 2 x CP 2 all_gather with dropout, Domino vs plain");
    // Selective recomputation draws the same masks again, and gathers again.
    expect_same_curve(
        plain, curve_of(model, 4, args + "--set model.recompute_activations=selective ", "tp2-ag2-dropout-selective"),
        kIters, model + " TP 2 x CP 2 all_gather with dropout, selective recomputation vs none");
  }
}

// all_gather under the schedules and strategies that do not touch the attention's exchange:
// pipeline stages (their activations are the shares), ZeRO stage 3 over the DP x CP ranks, full
// recomputation (the gather again inside each checkpoint), and a resumed run with dropout (each
// rank's generators and the masks drawn for gathered_probs_shape) equal to an uninterrupted one.
TEST(ContextParallel, AllGatherWithPipelineZeroRecomputeAndResume) {
  const std::string gather = kDocuments + cp(2) + "--set distributed.cp_comm_type=all_gather ";
  // The run's exchange, from rank 0's traffic line: all-gathers and no all-to-all (a run that fell
  // back to a2a would equal one process too).
  const auto gathered = [](const Curve& c) {
    EXPECT_TRUE(std::regex_search(c.run.out, std::regex("context-parallel traffic sent per iteration \\(MB\\) \\| "
                                                        "all-to-all: 0\\.00 \\| all-gather: [0-9]*\\.[0-9]*[1-9]")))
        << c.run.out;
    return c;
  };
  for (const std::string model : {"gpt", "llama"})
    expect_same_curve(
        curve_of(model, 1, kDocuments, "one"),
        gathered(curve_of(model, 4, gather + "--set distributed.pipeline_model_parallel_size=2 ", "ag-cp2-pp2")),
        kIters, model + " all_gather CP 2 x PP 2 vs one process");
  const Curve one = curve_of("gpt", 1, kDocuments, "one");
  expect_same_curve(one,
                    gathered(curve_of("gpt", 4,
                                      gather + "--strategy zero --set strategy.stage=3 "
                                               "--set strategy.stage3_param_persistence_threshold=100 ",
                                      "ag-cp2-dp2-zero3")),
                    kIters, "gpt all_gather CP 2 x DP 2, ZeRO stage 3 vs one process");
  expect_same_curve(one,
                    gathered(curve_of("gpt", 2, gather + "--set model.recompute_activations=full ", "ag-cp2-full")),
                    kIters, "gpt all_gather CP 2, full recomputation vs one process");

  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "ckpt-ag");
  const std::string args = gather +
                           "--strategy zero --set strategy.stage=1 --set model.hidden_dropout=0.1 "
                           "--set model.attention_dropout=0.1 --set lr.lr_decay_iters=6 ";
  const Curve whole = gathered(curve_of("llama", 4, args, "ag-resume-whole"));
  curve_of("llama", 4, args + "--set train.train_iters=3 --set checkpoint.save=" + dir, "ag-first");
  const Curve second = curve_of("llama", 4, args + "--set checkpoint.load=" + dir, "ag-second");
  dtk_test::expect_resumed_curve(whole, second, 3);
}

// A step of a user's own whose mask lets a query see later keys (a prefix language model's: the
// first 12 of 32 positions see each other). a2a attends over whole sequences with the mask as
// given, so CP 2 equals one process; all_gather's first chunk of queries (positions 0..7) reads
// only the keys up to its end, and the mask lets it see keys 8..11: one line, not another model.
TEST(ContextParallel, AllGatherRefusesAMaskThatSeesLaterKeys) {
  const std::string step = "--step prefix_lm_step --plugin_path " + std::string(DTK_CP_PLUGIN_DIR) + " ";
  const Curve one = curve_of("gpt", 1, step, "prefix-one");
  expect_same_curve(one, curve_of("gpt", 2, step + cp(2) + "--set distributed.cp_comm_type=a2a", "prefix-a2a"), kIters,
                    "a prefix mask, a2a CP 2 vs one process");
  expect_error(2, "gpt", step + cp(2) + "--set distributed.cp_comm_type=all_gather",
               "context parallelism's all_gather: the attention mask lets a query at positions 0..7 see a later "
               "key, and all_gather's chunks of queries attend over the keys up to their own end only (a causal "
               "mask); run distributed.cp_comm_type=a2a");
}

// A mixture of experts routes each rank's share of the sequence; its balancing losses count the
// tokens over the context-parallel group and each rank's loss is its share of the whole's, so the
// gradients (the router's through the losses) and the logged losses equal one process's.
TEST(ContextParallel, MixtureOfExpertsEqualsOneProcess) {
  const std::string moe = "--set model.num_experts=4 --set model.moe_router_topk=2 ";
  // Each losses' configuration with one process and split (nproc, split).
  struct Case {
    std::string model, name, losses;
    int nproc;
    std::string split;
    std::vector<std::string> logged;
    int reference_nproc = 1;  // the run it must equal: one process, or DP 2 where that differs
  };
  const std::string tp2_sp = "--set distributed.tensor_model_parallel_size=2 --set distributed.sequence_parallel=true ";
  const std::string ep2 = "--set distributed.expert_model_parallel_size=2 ";
  const std::string aux = "--set model.moe_aux_loss_coeff=0.05 --set model.moe_z_loss_coeff=0.01 ";
  const std::vector<std::string> aux_z = {"load_balancing_loss", "z_loss"};
  const std::vector<Case> cases = {
      {"gpt", "aux", aux, 2, cp(2), aux_z},
      {"gpt", "aux", aux, 4, tp2_sp + cp(2), aux_z},
      // Expert parallelism over the data- and context-parallel ranks together (Megatron's
      // expert-data-parallel group folds CP in): EP 2 x CP 2, both dispatchers.
      {"gpt", "aux", aux, 4, ep2 + cp(2), aux_z},
      {"gpt", "aux", aux, 4, ep2 + cp(2) + "--set model.moe_token_dispatcher=alltoall ", aux_z},
      // The all_gather exchange: the attention's, which the router never sees.
      {"gpt", "aux", aux, 4, ep2 + cp(2) + "--set distributed.cp_comm_type=all_gather ", aux_z},
      // DeepSeek-V3's: per-sequence and global-batch losses, sigmoid scores steered by the expert
      // bias (its loads summed over the data- and context-parallel ranks), a per-token loss.
      {"llama",
       "seq-global-bias",
       "--set model.moe_router_load_balancing_type=seq_aux_loss,global_aux_loss "
       "--set model.moe_aux_loss_coeff=0.05,0.02 --set model.moe_router_score_function=sigmoid "
       "--set model.moe_router_enable_expert_bias=true --set train.calculate_per_token_loss=true ",
       2,
       cp(2),
       {"seq_load_balancing_loss", "global_load_balancing_loss"}},
      {"llama",
       "seq-global-bias",
       "--set model.moe_router_load_balancing_type=seq_aux_loss,global_aux_loss "
       "--set model.moe_aux_loss_coeff=0.05,0.02 --set model.moe_router_score_function=sigmoid "
       "--set model.moe_router_enable_expert_bias=true --set train.calculate_per_token_loss=true ",
       2,
       cp(2) + "--set distributed.cp_comm_type=all_gather ",
       {"seq_load_balancing_loss", "global_load_balancing_loss"}},
      // The global batch's counts over DP 2 x CP 2 (each rank adds 1 / C of its group's) equal
      // DP 2's: one process counts its two micro-batches as a running mean (tests/moe).
      {"gpt",
       "global",
       "--set model.moe_router_load_balancing_type=global_aux_loss --set model.moe_aux_loss_coeff=0.02 ",
       4,
       cp(2),
       {"global_load_balancing_loss"},
       2},
      // What decides on whole sequences gathers them over the group: DeepSpeed's gate (top-2 with
      // its sampled second expert and capacity), sinkhorn, quantile balancing.
      {"gpt",
       "deepspeed",
       "--set model.moe_gate=deepspeed --set model.moe_aux_loss_coeff=0.05 --set model.moe_expert_capacity_factor=1 ",
       2,
       cp(2),
       {"load_balancing_loss"}},
      {"gpt",
       "sinkhorn",
       "--set model.moe_router_load_balancing_type=sinkhorn --set model.moe_aux_loss_coeff=0 ",
       4,
       tp2_sp + cp(2),
       {}},
      {"llama",
       "quantile",
       "--set model.moe_router_load_balancing_type=quantile_balancing --set model.moe_aux_loss_coeff=0 ",
       2,
       cp(2),
       {}}};
  std::map<std::string, std::pair<dtk_test::Result, std::map<std::string, std::map<int64_t, float>>>> ones;
  for (const Case& c : cases) {
    const auto run = [&](int nproc, const std::string& args, const std::string& name, dtk_test::Result* r) {
      const std::string launch = nproc == 1 ? "" : "launch --nproc_per_node " + std::to_string(nproc) + " ";
      auto scalars = dtk_test::run_scalars(launch + train(c.model) + kDocuments + moe + c.losses + args, DTK_TEST_TMP,
                                           "moe-" + c.model + "-" + c.name + "-" + name, r);
      EXPECT_EQ(r->code, 0) << r->out;
      return scalars;
    };
    // One process once per configuration.
    auto& [one_run, one] = ones[c.model + c.name + std::to_string(c.reference_nproc)];
    if (one.empty()) one = run(c.reference_nproc, "", "reference", &one_run);
    dtk_test::Result cp_run;
    auto split = run(c.nproc, c.split, "split", &cp_run);
    const std::string what = c.model + " MoE " + c.name + ", " + c.split;
    Curve want, got;
    want.loss = one["lm loss"], want.norm = one["grad-norm"], want.run = one_run;
    got.loss = split["lm loss"], got.norm = split["grad-norm"], got.run = cp_run;
    expect_same_curve(want, got, kIters, what + " vs " + std::to_string(c.reference_nproc) + " process(es)");
    for (const std::string& loss : c.logged) {
      ASSERT_EQ(one[loss].size(), kIters) << loss << "\n" << one_run.out;
      ASSERT_EQ(split[loss].size(), kIters) << loss << "\n" << cp_run.out;
      for (const auto& [it, v] : one[loss])
        EXPECT_NEAR(split[loss].at(it), v, 1e-5 * std::abs(v)) << what << " " << loss << " at iteration " << it;
    }
  }
}

// Token dropping under context parallelism (each expert's capacity of the rank's own tokens, as
// Megatron's router call on the rank's share) runs: padding every expert to its capacity equals
// not padding, and the curve differs from dropless. (Which tokens a rank's capacity keeps is
// tests/moe's token-dropping reference, on the rows the router call is given.)
TEST(ContextParallel, MixtureOfExpertsDropsTokens) {
  const std::string moe = kDocuments + cp(2) +
                          "--set model.num_experts=4 --set model.moe_router_topk=2 "
                          "--set model.moe_aux_loss_coeff=0.05 ";
  const std::string drop = "--set model.moe_expert_capacity_factor=0.5 ";
  const Curve dropless = curve_of("gpt", 2, moe, "moe-dropless");
  const Curve dropping = curve_of("gpt", 2, moe + drop, "moe-drop");
  expect_same_curve(dropping,
                    curve_of("gpt", 2, moe + drop + "--set model.moe_pad_expert_input_to_capacity=true ", "moe-pad"),
                    kIters, "gpt CP 2 with token dropping, padded vs not");
  ASSERT_EQ(dropping.loss.size(), kIters) << dropping.run.out;
  EXPECT_GT(std::abs(dropping.loss.at(kIters) - dropless.loss.at(kIters)), 1e-4) << dropping.run.out;
}

// Saved at iteration 3 and resumed under CP 2 x DP 2 with ZeRO-1 and dropout: the same losses as
// 6 uninterrupted iterations (parameters, optimizer shards over the DP x CP ranks, each rank's
// dropout generators). Recomputation reruns the attention's all-to-alls inside its checkpoint.
TEST(ContextParallel, ResumesExactlyAndRecomputes) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "ckpt-cp");
  const std::string args = kDocuments + cp(2) +
                           "--strategy zero --set strategy.stage=1 --set model.hidden_dropout=0.1 "
                           "--set model.attention_dropout=0.1 --set lr.lr_decay_iters=6 ";
  const Curve whole = curve_of("llama", 4, args, "resume-whole");
  const Curve first = curve_of("llama", 4, args + "--set train.train_iters=3 --set checkpoint.save=" + dir, "first");
  const Curve second = curve_of("llama", 4, args + "--set checkpoint.load=" + dir, "second");
  dtk_test::expect_resumed_curve(whole, second, 3);
  const Curve plain = curve_of("gpt", 2, kDocuments + cp(2), "cp2");
  for (const std::string recompute : {"selective", "full"})
    expect_same_curve(plain,
                      curve_of("gpt", 2, kDocuments + cp(2) + "--set model.recompute_activations=" + recompute + " ",
                               "cp2-recompute-" + recompute),
                      kIters, "gpt CP 2, recompute " + recompute + " vs none");
}

// Bench mode (train.bench_steps) reports the context-parallel group's communication per measured
// iteration beside the other groups', as the progress line does per iteration; and the expert-
// parallel group's (an MoE model at EP 2 x CP 2), in its summary and its --bench_out object.
TEST(ContextParallel, BenchModeReportsItsComm) {
  const std::string json = dtk_test::fresh_dir(DTK_TEST_TMP, "bench-cp") + "/bench.json";
  const std::string bench = "--set train.bench_steps=1 --set train.perf_warmup_steps=1 ";
  const std::string moe =
      "--set model.num_experts=4 --set model.moe_router_topk=2 --set distributed.expert_model_parallel_size=2 ";
  const dtk_test::Result r =
      dtk_test::run_dtk("launch --nproc_per_node 4 " + train("gpt") + cp(2) + bench + moe + "--bench_out " + json, 120);
  ASSERT_EQ(r.code, 0) << r.out;
  std::smatch m;
  for (const std::string group : {"context", "expert"}) {
    for (const std::string pattern :
         {group + R"(-parallel comm \(ms\) in flight: (\S+) \| exposed: (\S+) \|)",
          group + R"(-parallel comm per iteration \(ms\): in flight (\S+) \| exposed (\S+) \()"}) {
      ASSERT_TRUE(std::regex_search(r.out, m, std::regex(pattern))) << pattern << "\n" << r.out;
      const double in_flight = std::stod(m[1]), exposed = std::stod(m[2]);
      EXPECT_GT(in_flight, 0.0) << r.out;  // all-to-alls (all-gathers) in every layer
      EXPECT_GE(exposed, 0.0) << r.out;
      EXPECT_LE(exposed, in_flight + 5.0) << "a wait ends at most with its collective (+ copy-back): " << r.out;
    }
  }
  std::ifstream in(json);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* field : {"\"context_parallel_comm_in_flight_ms_mean\"", "\"expert_parallel_comm_exposed_ms_mean\""})
    EXPECT_NE(text.find(field), std::string::npos) << field << "\n" << text;
}

TEST(ContextParallel, BadInputsAreOneLine) {
  // The sequence in 2 x cp equal chunks.
  expect_error(2, "gpt", cp(2) + "--set train.seq_length=30",
               "distributed.context_parallel_size 2 splits each sequence into 4 equal chunks");
  // Each tensor-parallel rank's heads (llama: key/value groups) divide over the group.
  expect_error(3, "gpt", cp(3) + "--set train.seq_length=48",
               "num_attention_heads / the tensor-parallel size (4 / 1) must divide by 3");
  expect_error(4, "llama", cp(4), "num_query_groups / the tensor-parallel size (2 / 1) must divide by 4");
  expect_error(1, "gpt", cp(2) + "--set distributed.cp_comm_type=ring",
               "config: distributed.cp_comm_type must be a2a or all_gather (Megatron's --cp-comm-type), got 'ring'");
  // The world holds TP x CP x DP x PP ranks.
  expect_error(3, "gpt", cp(2), "is not divisible by distributed.context_parallel_size 2");
  expect_error(1, "gpt", "--set distributed.context_parallel_size=-1",
               "distributed.context_parallel_size must be at least 1");
}
