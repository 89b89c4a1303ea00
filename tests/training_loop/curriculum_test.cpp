// Curriculum learning by sequence length (train.curriculum_schedule; DeepSpeed's legacy
// curriculum_learning as Megatron-DeepSpeed applies it):
//   * the lengths equal DeepSpeed's CurriculumScheduler as Megatron-DeepSpeed's loop drives it
//     (update_difficulty(iteration + 1)), expected values from DeepSpeed's own
//     curriculum_scheduler.py (commit edaa722) run here, not computed by DTK;
//   * the token count of the batch plan (lr.lr_*_tokens, train.train_tokens) sums each
//     iteration's global batch x its length, against a plain loop;
//   * end to end: the short iterations of a curriculum run equal a run at that length (same
//     samples, cut), the log and TensorBoard show the length, the token-counted warm-up follows
//     the cut tokens, a resume equals the uninterrupted run across a length change, and pipeline
//     stages and sequence parallelism equal one process;
//   * bad settings are one line each.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/config/curriculum.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/schedule.hpp"

namespace {

using dtk::core::SequenceCurriculum;
using dtk_test::Curve;
using dtk_test::Result;

struct DeepSpeedCase {
  const char* name;
  const char* schedule;
  int64_t min, max, total_step, difficulty_step;
  double root_degree;
  const char* difficulty;
  const char* max_step;
  int64_t iterations;                               // how far DeepSpeed's scheduler was stepped
  std::vector<std::pair<int64_t, int64_t>> stages;  // (first iteration, length) where the length changes
};

dtk::config::TrainingConfig curriculum_config(const DeepSpeedCase& c, int64_t seq_length) {
  dtk::config::TrainingConfig t;
  t.set_seq_length(seq_length);
  t.set_curriculum_schedule(c.schedule);
  t.set_curriculum_min_difficulty(c.min), t.set_curriculum_max_difficulty(c.max);
  t.set_curriculum_total_step(c.total_step), t.set_curriculum_difficulty_step(c.difficulty_step);
  t.set_curriculum_root_degree(c.root_degree);
  t.set_curriculum_discrete_difficulty(c.difficulty), t.set_curriculum_discrete_max_step(c.max_step);
  return t;
}

TEST(Curriculum, LengthsEqualDeepSpeedsScheduler) {
  const std::vector<DeepSpeedCase> cases = {
      {"linear",
       "fixed_linear",
       8,
       64,
       10,
       8,
       0.0,
       "",
       "",
       14,
       {{1, 8}, {2, 16}, {3, 24}, {5, 32}, {6, 40}, {8, 48}, {9, 56}, {10, 64}}},
      {"linear, max and min off the step",
       "fixed_linear",
       12,
       100,
       7,
       8,
       0.0,
       "",
       "",
       12,
       {{1, 24}, {2, 32}, {3, 48}, {4, 56}, {5, 72}, {6, 80}, {7, 96}, {8, 100}}},
      {"square root",
       "fixed_root",
       16,
       128,
       20,
       16,
       2.0,
       "",
       "",
       24,
       {{1, 32}, {2, 48}, {4, 64}, {7, 80}, {11, 96}, {15, 112}, {20, 128}}},
      {"root 3.5", "fixed_root", 5, 37, 9, 4, 3.5, "", "", 14, {{1, 20}, {2, 24}, {3, 28}, {5, 32}, {9, 36}, {13, 37}}},
      {"discrete, falling between",
       "fixed_discrete",
       16,
       64,
       0,
       0,
       0.0,
       "16,48,32,64",
       "2,4,6",
       9,
       {{1, 16}, {3, 48}, {5, 32}, {7, 64}}},
      {"discrete, stays at max", "fixed_discrete", 8, 32, 0, 0, 0.0, "8,32,16", "2,4", 7, {{1, 8}, {3, 32}}},
      {"min at max", "fixed_linear", 32, 32, 5, 8, 0.0, "", "", 4, {{1, 32}}},
      {"long linear",
       "fixed_linear",
       64,
       1024,
       3000,
       8,
       0.0,
       "",
       "",
       3100,
       {{1, 64},     {25, 72},    {50, 80},    {75, 88},    {100, 96},   {125, 104},   {150, 112},   {175, 120},
        {200, 128},  {225, 136},  {250, 144},  {275, 152},  {300, 160},  {325, 168},   {350, 176},   {375, 184},
        {400, 192},  {425, 200},  {450, 208},  {475, 216},  {500, 224},  {525, 232},   {550, 240},   {575, 248},
        {600, 256},  {625, 264},  {650, 272},  {675, 280},  {700, 288},  {725, 296},   {750, 304},   {775, 312},
        {800, 320},  {825, 328},  {850, 336},  {875, 344},  {900, 352},  {925, 360},   {950, 368},   {975, 376},
        {1000, 384}, {1025, 392}, {1050, 400}, {1075, 408}, {1100, 416}, {1125, 424},  {1150, 432},  {1175, 440},
        {1200, 448}, {1225, 456}, {1250, 464}, {1275, 472}, {1300, 480}, {1325, 488},  {1350, 496},  {1375, 504},
        {1400, 512}, {1425, 520}, {1450, 528}, {1475, 536}, {1500, 544}, {1525, 552},  {1550, 560},  {1575, 568},
        {1600, 576}, {1625, 584}, {1650, 592}, {1675, 600}, {1700, 608}, {1725, 616},  {1750, 624},  {1775, 632},
        {1800, 640}, {1825, 648}, {1850, 656}, {1875, 664}, {1900, 672}, {1925, 680},  {1950, 688},  {1975, 696},
        {2000, 704}, {2025, 712}, {2050, 720}, {2075, 728}, {2100, 736}, {2125, 744},  {2150, 752},  {2175, 760},
        {2200, 768}, {2225, 776}, {2250, 784}, {2275, 792}, {2300, 800}, {2325, 808},  {2350, 816},  {2375, 824},
        {2400, 832}, {2425, 840}, {2450, 848}, {2475, 856}, {2500, 864}, {2525, 872},  {2550, 880},  {2575, 888},
        {2600, 896}, {2625, 904}, {2650, 912}, {2675, 920}, {2700, 928}, {2725, 936},  {2750, 944},  {2775, 952},
        {2800, 960}, {2825, 968}, {2850, 976}, {2875, 984}, {2900, 992}, {2925, 1000}, {2950, 1008}, {2975, 1016},
        {3000, 1024}}},
      {"long root",
       "fixed_root",
       80,
       2048,
       45000,
       16,
       2.0,
       "",
       "",
       46000,
       {{1, 80},       {3, 96},       {12, 112},     {27, 128},     {48, 144},     {75, 160},     {108, 176},
        {146, 192},    {191, 208},    {241, 224},    {298, 240},    {360, 256},    {429, 272},    {503, 288},
        {583, 304},    {670, 320},    {762, 336},    {860, 352},    {964, 368},    {1074, 384},   {1190, 400},
        {1312, 416},   {1440, 432},   {1574, 448},   {1714, 464},   {1860, 480},   {2011, 496},   {2169, 512},
        {2332, 528},   {2502, 544},   {2677, 560},   {2859, 576},   {3046, 592},   {3240, 608},   {3439, 624},
        {3644, 640},   {3855, 656},   {4072, 672},   {4296, 688},   {4525, 704},   {4760, 720},   {5000, 736},
        {5247, 752},   {5500, 768},   {5759, 784},   {6024, 800},   {6294, 816},   {6571, 832},   {6854, 848},
        {7142, 864},   {7437, 880},   {7737, 896},   {8043, 912},   {8356, 928},   {8674, 944},   {8998, 960},
        {9328, 976},   {9664, 992},   {10006, 1008}, {10354, 1024}, {10708, 1040}, {11068, 1056}, {11434, 1072},
        {11806, 1088}, {12184, 1104}, {12567, 1120}, {12957, 1136}, {13353, 1152}, {13754, 1168}, {14162, 1184},
        {14575, 1200}, {14995, 1216}, {15420, 1232}, {15851, 1248}, {16288, 1264}, {16732, 1280}, {17181, 1296},
        {17636, 1312}, {18097, 1328}, {18564, 1344}, {19037, 1360}, {19516, 1376}, {20000, 1392}, {20491, 1408},
        {20988, 1424}, {21491, 1440}, {21999, 1456}, {22514, 1472}, {23034, 1488}, {23561, 1504}, {24093, 1520},
        {24632, 1536}, {25176, 1552}, {25726, 1568}, {26282, 1584}, {26845, 1600}, {27413, 1616}, {27987, 1632},
        {28567, 1648}, {29153, 1664}, {29745, 1680}, {30343, 1696}, {30946, 1712}, {31556, 1728}, {32172, 1744},
        {32793, 1760}, {33421, 1776}, {34055, 1792}, {34694, 1808}, {35340, 1824}, {35991, 1840}, {36648, 1856},
        {37312, 1872}, {37981, 1888}, {38656, 1904}, {39337, 1920}, {40024, 1936}, {40717, 1952}, {41416, 1968},
        {42121, 1984}, {42832, 2000}, {43549, 2016}, {44272, 2032}, {45000, 2048}}},
  };
  for (const DeepSpeedCase& c : cases) {
    const SequenceCurriculum curriculum(curriculum_config(c, 2048), c.iterations);
    std::vector<std::pair<int64_t, int64_t>> got;
    for (const auto& s : curriculum.stages())
      if (s.first_iteration <= c.iterations) got.emplace_back(s.first_iteration, s.length);
    EXPECT_EQ(got, c.stages) << c.name;
    // And iteration by iteration, from the stages DeepSpeed's steps gave.
    for (size_t k = 0; k < c.stages.size(); ++k) {
      const int64_t end = k + 1 < c.stages.size() ? c.stages[k + 1].first : c.iterations + 1;
      for (int64_t i = c.stages[k].first; i < end; ++i)
        ASSERT_EQ(curriculum.length_of(i), c.stages[k].second) << c.name << ", iteration " << i;
    }
  }
}

// The stages end with the run: a discrete length after its last iteration is neither worked out
// nor checked (a step count near int64's end does not overflow), and a step past max is refused.
TEST(Curriculum, StagesEndWithTheRun) {
  DeepSpeedCase c{"", "fixed_discrete", 8, 64, 0, 0, 0, "8,16,6000", "2,9223372036854775807", 0, {}};
  const SequenceCurriculum curriculum(curriculum_config(c, 64), 10);
  ASSERT_EQ(curriculum.stages().size(), 2u);
  EXPECT_EQ(curriculum.length_of(10), 16);
  DeepSpeedCase wide{"", "fixed_root", 8, 64, 100, 65, 0.5, "", "", 0, {}};
  EXPECT_THROW(SequenceCurriculum(curriculum_config(wide, 64), 10), std::exception);
}

dtk::config::RunConfig plan_config(const std::string& schedule, int64_t iters) {
  dtk::config::RunConfig cfg = dtk::core::default_config();
  auto& t = *cfg.mutable_train();
  t.set_micro_batch_size(2), t.set_global_batch_size(8), t.set_train_iters(iters), t.set_seq_length(64);
  t.set_curriculum_schedule(schedule);
  t.set_curriculum_min_difficulty(8);
  if (schedule == "fixed_discrete") {
    t.set_curriculum_discrete_difficulty("8,32,16,64"), t.set_curriculum_discrete_max_step("3,5,9");
  } else {
    t.set_curriculum_total_step(37), t.set_curriculum_difficulty_step(8);
    if (schedule == "fixed_root") t.set_curriculum_root_degree(2);
  }
  return cfg;
}

// The plan's token counts are sums over the stages; a plain loop over the iterations is the
// reference. train.train_tokens ends the run after the first iteration that reaches it.
TEST(Curriculum, TokenCountsSumEachIterationsLength) {
  dtk::core::Topology topo;
  topo.dp_size = 2, topo.dp_rank = 0, topo.world_size = 2;
  for (const std::string schedule : {"fixed_linear", "fixed_root", "fixed_discrete"}) {
    dtk::config::RunConfig cfg = plan_config(schedule, 60);
    dtk::core::validate_config(cfg);
    const dtk::core::BatchPlan plan(cfg, topo);
    int64_t tokens = 0;
    std::vector<int64_t> tokens_before{0, 0};  // [i]: before iteration i
    for (int64_t i = 1; i <= 61; ++i) {
      ASSERT_EQ(plan.tokens_before(i), tokens) << schedule << ", iteration " << i;
      if (i <= 60) tokens += 8 * plan.seq_length_of(i);
      tokens_before.push_back(tokens);
    }
    EXPECT_LT(plan.seq_length_of(1), 64) << schedule;
    EXPECT_EQ(plan.seq_length_of(60), 64) << schedule;
    for (const int64_t limit : std::vector<int64_t>{1, 100, 257, 2000, 3000, tokens, tokens + 1}) {
      cfg.mutable_train()->set_train_tokens(limit);
      const dtk::core::BatchPlan ended(cfg, topo);
      int64_t want = 60;
      for (int64_t n = 1; n <= 60; ++n)
        if (tokens_before[n + 1] >= limit) {
          want = n;
          break;
        }
      EXPECT_EQ(ended.final_iteration(), want) << schedule << ", train_tokens " << limit;
    }
  }
}

TEST(Curriculum, SequenceParallelismAndCudaGraphsRefuseWhatTheyCannotFollow) {
  dtk::config::RunConfig cfg = plan_config("fixed_linear", 60);
  cfg.mutable_train()->set_curriculum_difficulty_step(3);
  cfg.mutable_distributed()->set_sequence_parallel(true);
  dtk::core::Topology topo;
  topo.tp_size = 2, topo.world_size = 2;
  try {
    const dtk::core::BatchPlan plan(cfg, topo);
    FAIL() << "an odd length under sequence parallelism was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("distributed.sequence_parallel splits each sequence length over the "
                                         "tensor-parallel size 2, and train.curriculum_schedule gives 9 from "
                                         "iteration 1"),
              std::string::npos)
        << e.what();
  }
  cfg.mutable_train()->set_curriculum_difficulty_step(8);
  EXPECT_NO_THROW(dtk::core::BatchPlan(cfg, topo));
  dtk::core::CaptureSetup s;
  s.asked = s.cuda_device = s.torch_cuda = true;
  s.strategy = "ddp";
  EXPECT_EQ(dtk::core::cuda_graphs_refusal(s), "");
  s.curriculum = "fixed_linear";
  EXPECT_NE(dtk::core::cuda_graphs_refusal(s).find("changes the sequence length"), std::string::npos);
}

// ---- end to end ------------------------------------------------------------------------------

// gpt-tiny on synthetic tokens, whose samples start alike at any length (a sample is a stream of
// tokens from its index), with a position table of 32 rows whatever seq_length says.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 "
                           "--set model.hidden_dropout=0 --set model.attention_dropout=0 "
                           "--set model.max_position_embeddings=32 --set model.vocab_size=512 "
                           "--set dataset.vocab_size=512 --set train.micro_batch_size=2 "
                           "--set train.global_batch_size=4 --set train.clip_grad=0.3 --set lr.lr=0.001 "
                           "--set lr.lr_warmup_iters=2 --set logging.log_interval=1 --set eval.eval_interval=0 "
                           "--set eval.eval_iters=1 ";
// 16 tokens through iteration 3, then 32.
const std::string kDiscrete =
    " --set train.seq_length=32 --set train.curriculum_schedule=fixed_discrete --set "
    "train.curriculum_min_difficulty=16 "
    "--set train.curriculum_discrete_difficulty=16,32 --set train.curriculum_discrete_max_step=3 ";

std::string iters(int n) { return " --set train.train_iters=" + std::to_string(n) + " "; }

std::map<std::string, std::map<int64_t, float>> run_scalars(const std::string& args, const std::string& name,
                                                            Result* result) {
  return dtk_test::run_scalars(args, DTK_TEST_TMP, "curriculum-" + name, result);
}

TEST(Curriculum, ShortIterationsEqualARunAtThatLength) {
  Result cut_run, short_run;
  auto cut = run_scalars(kTrain + kDiscrete + iters(5), "cut", &cut_run);
  auto plain = run_scalars(kTrain + " --set train.seq_length=16 " + iters(3), "short", &short_run);
  ASSERT_EQ(cut_run.code, 0) << cut_run.out;
  ASSERT_EQ(short_run.code, 0) << short_run.out;
  ASSERT_EQ(cut["lm loss"].size(), 5u);
  for (int64_t it = 1; it <= 3; ++it) {
    EXPECT_EQ(cut["lm loss"].at(it), plain["lm loss"].at(it)) << "iteration " << it;
    EXPECT_EQ(cut["grad-norm"].at(it), plain["grad-norm"].at(it)) << "iteration " << it;
  }
  for (int64_t it = 1; it <= 5; ++it)
    EXPECT_EQ(cut["seqlen/curriculum_seqlen"].at(it), it <= 3 ? 16 : 32) << "iteration " << it;
  EXPECT_NE(
      cut_run.out.find("curriculum (train.curriculum_schedule fixed_discrete): sequence length 16 at iteration 1, "
                       "32 from iteration 4 (2 lengths); validation and test at 32"),
      std::string::npos)
      << cut_run.out;
  std::smatch m;
  EXPECT_TRUE(std::regex_search(cut_run.out, m, std::regex(R"(iteration\s+3/\s+5 \|.* curriculum seqlen:    16 \|)")))
      << cut_run.out;
  EXPECT_TRUE(std::regex_search(cut_run.out, m, std::regex(R"(iteration\s+4/\s+5 \|.* curriculum seqlen:    32 \|)")))
      << cut_run.out;
  EXPECT_EQ(plain.count("seqlen/curriculum_seqlen"), 0u);
}

// Megatron-DeepSpeed counts an iteration's tokens at its length: the token warm-up's rate after
// iteration i is lr x tokens before i / lr_warmup_tokens, with 4 x 16 tokens an iteration through
// iteration 3 and 4 x 32 after; train.train_tokens ends the run by the same count.
TEST(Curriculum, TokenCountedScheduleAndEndCountTheCutTokens) {
  Result run;
  auto scalars = run_scalars(kTrain + kDiscrete + iters(6) +
                                 " --set lr.lr_warmup_iters=0 --set lr.lr_warmup_tokens=1000 "
                                 "--set lr.lr_decay_tokens=4000 --set lr.lr_decay_style=linear",
                             "tokens", &run);
  ASSERT_EQ(run.code, 0) << run.out;
  const std::vector<int64_t> tokens_before = {0, 0, 64, 128, 192, 320, 448};
  for (int64_t it = 1; it <= 6; ++it)
    EXPECT_NEAR(scalars["learning-rate"].at(it), 0.001 * static_cast<double>(tokens_before[it]) / 1000, 1e-9)
        << "iteration " << it;
  Result ended = dtk_test::run_dtk(kTrain + kDiscrete + iters(6) + " --set train.train_tokens=300", 300);
  ASSERT_EQ(ended.code, 0) << ended.out;
  EXPECT_NE(ended.out.find("train.train_tokens 300 ends it after iteration 4 (320 tokens)"), std::string::npos)
      << ended.out;
}

TEST(Curriculum, ResumeEqualsTheUninterruptedRunAcrossALengthChange) {
  const std::string ckpt = dtk_test::fresh_dir(DTK_TEST_TMP, "ckpt-curriculum");
  const std::string base = kTrain + kDiscrete + iters(6);
  Result full_run, first_run, resumed_run;
  auto full = run_scalars(base, "full", &full_run);
  run_scalars(base + " --set train.exit_interval=2 --set checkpoint.save=" + ckpt, "first", &first_run);
  ASSERT_EQ(full_run.code, 0) << full_run.out;
  ASSERT_EQ(first_run.code, 0) << first_run.out;
  auto resumed = run_scalars(base + " --set checkpoint.load=" + ckpt, "resumed", &resumed_run);
  ASSERT_EQ(resumed_run.code, 0) << resumed_run.out;
  ASSERT_EQ(resumed["lm loss"].size(), 4u) << resumed_run.out;
  for (int64_t it = 3; it <= 6; ++it) {
    EXPECT_EQ(resumed["lm loss"].at(it), full["lm loss"].at(it)) << "iteration " << it;
    EXPECT_EQ(resumed["seqlen/curriculum_seqlen"].at(it), full["seqlen/curriculum_seqlen"].at(it));
  }
}

// A new length every iteration or two: pipeline stages exchange activations of each iteration's
// length (and validation's full one), sequence parallelism splits each over the TP ranks.
TEST(Curriculum, PipelineStagesAndSequenceParallelismEqualOneProcess) {
  const std::string run = kTrain + iters(8) +
                          " --set train.seq_length=32 --set train.curriculum_schedule=fixed_linear "
                          "--set train.curriculum_min_difficulty=8 --set train.curriculum_total_step=6 "
                          "--set train.curriculum_difficulty_step=4 --set eval.eval_interval=4 ";
  const Curve one = dtk_test::run_curve(run, DTK_TEST_TMP, "curriculum-one");
  const Curve pipeline =
      dtk_test::run_curve("launch --nproc_per_node 2 " + run + " --set distributed.pipeline_model_parallel_size=2",
                          DTK_TEST_TMP, "curriculum-pp2");
  const Curve sequence = dtk_test::run_curve("launch --nproc_per_node 2 " + run +
                                                 " --set distributed.tensor_model_parallel_size=2 "
                                                 "--set distributed.sequence_parallel=true",
                                             DTK_TEST_TMP, "curriculum-sp2");
  dtk_test::expect_same_curve(one, pipeline, 8, "PP2");
  dtk_test::expect_same_curve(one, sequence, 8, "TP2 with sequence parallelism");
  // Validation between the iterations runs at the full 32 tokens.
  const auto validation = [](const Result& r) {
    std::smatch m;
    const bool found =
        std::regex_search(r.out, m, std::regex(R"(validation loss at iteration 4 \| lm loss value: (\S+) \|)"));
    return found ? std::strtod(m[1].str().c_str(), nullptr) : -1.0;
  };
  ASSERT_GT(validation(one.run), 0) << one.run.out;
  EXPECT_NEAR(validation(pipeline.run), validation(one.run), 1e-5 * validation(one.run));
  EXPECT_NEAR(validation(sequence.run), validation(one.run), 1e-5 * validation(one.run));
}

TEST(Curriculum, BadSettingsAreOneLine) {
  const std::string run = kTrain + iters(4) + " --set train.seq_length=32 ";
  const std::string linear =
      " --set train.curriculum_schedule=fixed_linear --set train.curriculum_min_difficulty=8 "
      "--set train.curriculum_total_step=4 --set train.curriculum_difficulty_step=8 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" --set train.curriculum_schedule=fixed_cubic",
       "train.curriculum_schedule must be fixed_linear, fixed_root or fixed_discrete (or \"\": off), got "
       "'fixed_cubic'"},
      {" --set train.curriculum_schedule=custom",
       "train.curriculum_schedule custom is DeepSpeed's schedule given as a "
       "Python function"},
      {" --set train.curriculum_min_difficulty=8",
       "train.curriculum_min_difficulty does nothing under "
       "train.curriculum_schedule \"\" (off)"},
      {" --set train.curriculum_schedule=fixed_linear --set train.curriculum_total_step=4 "
       "--set train.curriculum_difficulty_step=8",
       "train.curriculum_min_difficulty must be set (>= 1; DeepSpeed's min_difficulty), got 0"},
      {linear + " --set train.curriculum_max_difficulty=64",
       "train.curriculum_max_difficulty (64) is longer than train.seq_length (32)"},
      {linear + " --set train.curriculum_root_degree=2",
       "train.curriculum_root_degree does nothing under train.curriculum_schedule fixed_linear"},
      {" --set train.curriculum_schedule=fixed_root --set train.curriculum_min_difficulty=8 "
       "--set train.curriculum_total_step=4 --set train.curriculum_difficulty_step=8",
       "train.curriculum_root_degree must be positive under fixed_root"},
      {" --set train.curriculum_schedule=fixed_linear --set train.curriculum_min_difficulty=4 "
       "--set train.curriculum_total_step=40 --set train.curriculum_difficulty_step=8",
       "train.curriculum_schedule fixed_linear gives a sequence length of 0 at iteration 1 "
       "(train.curriculum_min_difficulty 4 rounded down to a multiple of train.curriculum_difficulty_step 8)"},
      {" --set train.curriculum_schedule=fixed_discrete --set train.curriculum_min_difficulty=8 "
       "--set train.curriculum_discrete_difficulty=8,16 --set train.curriculum_discrete_max_step=2,3",
       "train.curriculum_discrete_difficulty needs one length more than train.curriculum_discrete_max_step has steps"},
      {" --set train.curriculum_schedule=fixed_discrete --set train.curriculum_min_difficulty=8 "
       "--set train.curriculum_discrete_difficulty=8,16,32 --set train.curriculum_discrete_max_step=3,3",
       "train.curriculum_discrete_max_step '3,3' must increase"},
      {" --set train.curriculum_schedule=fixed_discrete --set train.curriculum_min_difficulty=8 "
       "--set train.curriculum_discrete_difficulty=8,x --set train.curriculum_discrete_max_step=3",
       "train.curriculum_discrete_difficulty '8,x': 'x' is not a positive whole number"},
      {linear + " --set train.bench_steps=2",
       "train.bench_steps measures iterations of one size; train.curriculum_schedule changes their sequence length"},
  };
  for (const auto& [flags, message] : cases) dtk_test::expect_one_line_error(dtk_test::run_dtk(run + flags), message);
}

}  // namespace
