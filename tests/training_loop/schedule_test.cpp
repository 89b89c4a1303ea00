// Unit tests of the loop's algorithms against Megatron's:
//   * GradScaler == DynamicGradScaler.update for a scripted overflow pattern (backoff after the
//     hysteresis runs out, growth after a window of clean iterations, the minimum, the
//     hysteresis tracker going negative as Megatron's does), and the static scaler;
//   * the learning rate == OptimizerParamScheduler.get_lr at chosen steps for WSD (every decay
//     style), lr_warmup_init and lr_warmup_fraction. The expected numbers were computed by a
//     transcription of Megatron's get_lr counting samples (global batch 8), not by DTK;
//   * DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR == lr_schedules.py with the engine's
//     step protocol;
//   * Megatron-DeepSpeed's token-counted warm-up and decay == its optimizer_param_scheduler.py
//     driven as its loop drives it (tokens lag one iteration, skipped iterations);
//   * the weight decay == OptimizerParamScheduler.get_wd (linear, cosine increments);
//   * the optimizer groups == get_param_groups with name rules (lr_mult, wd_mult), first match;
//   * the FLOPs model: 2cN + 4cLhs with N of the whole model under tensor parallelism.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dtk/core/perf/flops.hpp"
#include "dtk/core/optim/grad_scaler.hpp"
#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/core/optim/param_groups.hpp"

namespace {

using dtk::core::GradScaler;

TEST(GradScaler, FollowsMegatronsDynamicAlgorithm) {
  GradScaler s(1024, 1, /*window=*/3, /*hysteresis=*/2);
  // found_inf per iteration, and (scale, growth_tracker, hysteresis_tracker) after its update.
  struct Step {
    bool inf;
    double scale;
    int64_t growth, hysteresis;
  };
  const std::vector<Step> script = {
      {false, 1024, 1, 2}, {true, 1024, 0, 1},  {true, 512, 0, 0},  {false, 512, 1, 0},  {false, 512, 2, 0},
      {false, 1024, 0, 2}, {true, 1024, 0, 1},  {false, 1024, 1, 1}, {true, 512, 0, 0},  {true, 256, 0, -1},
      {false, 256, 1, -1}, {false, 256, 2, -1}, {false, 512, 0, 2},
  };
  for (size_t i = 0; i < script.size(); ++i) {
    s.update(script[i].inf);
    EXPECT_EQ(s.scale(), script[i].scale) << "after iteration " << i + 1;
    EXPECT_EQ(s.state().growth_tracker, script[i].growth) << "after iteration " << i + 1;
    EXPECT_EQ(s.state().hysteresis_tracker, script[i].hysteresis) << "after iteration " << i + 1;
  }
}

TEST(GradScaler, NeverBacksOffBelowTheMinimum) {
  GradScaler s(8, 2, 1000, 1);
  for (double want : {4.0, 2.0, 2.0, 2.0}) {
    s.update(true);
    EXPECT_EQ(s.scale(), want);
  }
}

TEST(GradScaler, KindFollowsTheConfig) {
  dtk::config::TrainingConfig t;
  t.set_params_dtype("fp32");
  EXPECT_EQ(GradScaler(t).kind(), GradScaler::Kind::kNone);
  EXPECT_EQ(GradScaler(t).scale(), 1.0);
  t.set_params_dtype("fp16");
  GradScaler fp16(t);
  EXPECT_TRUE(fp16.dynamic());
  EXPECT_EQ(fp16.scale(), std::ldexp(1.0, 32));  // Megatron's --initial-loss-scale default
  EXPECT_EQ(fp16.state().hysteresis_tracker, 2);
  t.set_loss_scale(128);  // a static --loss-scale wins, in any precision
  GradScaler fixed(t);
  EXPECT_EQ(fixed.kind(), GradScaler::Kind::kStatic);
  fixed.update(true);
  EXPECT_EQ(fixed.scale(), 128);
  t.set_loss_scale(0);
  t.set_params_dtype("bf16");
  t.set_dynamic_loss_scale(true);
  t.set_initial_loss_scale(4096);
  EXPECT_TRUE(GradScaler(t).dynamic());
  EXPECT_EQ(GradScaler(t).scale(), 4096);
}

// Steps 0, 1, 5, 10, 11, 60, 79, 80, 81, 90, 99, 100, 101 of a 100-iteration run.
const std::vector<int64_t> kSteps = {0, 1, 5, 10, 11, 60, 79, 80, 81, 90, 99, 100, 101};

void expect_rates(const dtk::core::LrParams& p, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(want.size(), kSteps.size());
  for (size_t i = 0; i < kSteps.size(); ++i)
    EXPECT_NEAR(dtk::core::learning_rate(kSteps[i], p), want[i], 1e-15) << what << " at step " << kSteps[i];
}

TEST(LearningRate, WarmupStableDecayEqualsMegatron) {
  // lr 1e-3, min 1e-5, lr_warmup_init 1e-4, 10 warm-up iterations, WSD over the last 20.
  dtk::core::LrParams p;
  p.max_lr = 1e-3, p.min_lr = 1e-5, p.init_lr = 1e-4, p.warmup_iters = 10, p.decay_iters = 100;
  p.style = "WSD", p.wsd_decay_iters = 20;
  const std::vector<double> head = {0.0001, 0.00019000000000000001, 0.00055000000000000003, 0.001, 0.001,
                                    0.001,  0.001,                  0.001};
  auto with = [&](std::vector<double> tail) {
    std::vector<double> v = head;
    v.insert(v.end(), tail.begin(), tail.end());
    return v;
  };
  p.wsd_style = "exponential";
  expect_rates(p, with({0.0009325539312711943, 0.0004200714267493642, 4.4912274602963808e-05, 1e-05, 1e-05}),
               "exponential");
  p.wsd_style = "linear";
  expect_rates(p, with({0.00095049999999999996, 0.00050500000000000002, 5.9500000000000044e-05, 1e-05, 1e-05}),
               "linear");
  p.wsd_style = "cosine";
  expect_rates(p, with({0.0009939057285945933, 0.00050500000000000002, 1.6094271405406858e-05, 1e-05, 1e-05}),
               "cosine");
  p.wsd_style = "minus_sqrt";
  expect_rates(p, with({0.00077862927022752089, 0.00029996428662531794, 3.506735986391263e-05, 1e-05, 1e-05}),
               "minus_sqrt");
}

// Megatron counts samples: inverse-square-root without a warm-up is max_lr / sqrt(samples), not
// / sqrt(iterations). Expected values: Megatron-DeepSpeed's optimizer_param_scheduler.py stepped
// by a global batch of 8 samples, no warm-up (the rate each iteration used).
TEST(LearningRate, InverseSquareRootWithoutWarmupCountsSamples) {
  dtk::core::LrParams p;
  p.max_lr = 1e-3, p.min_lr = 1e-5, p.decay_iters = 100, p.style = "inverse-square-root", p.step_samples = 8;
  const std::vector<std::pair<int64_t, double>> want = {
      {0, 0.001},  {1, 0.00035355339059327376}, {2, 0.00025}, {5, 0.00015811388300841897}, {10, 0.00011180339887498948},
      {50, 5e-05}, {100, 3.535533905932738e-05}};
  for (const auto& [step, rate] : want) EXPECT_NEAR(dtk::core::learning_rate(step, p), rate, 1e-15) << "step " << step;
}

TEST(LearningRate, WarmupFractionEqualsMegatron) {
  // lr_warmup_fraction 0.05 of a 100-iteration cosine decay (5 iterations), from 0.
  dtk::config::LrSchedule lr;
  lr.set_lr(1e-3), lr.set_min_lr(1e-5), lr.set_lr_decay_style("cosine"), lr.set_lr_warmup_fraction(0.05);
  const dtk::core::LearningRateSchedule schedule(lr, 100);
  const std::vector<double> want = {0,
                                    0.00020000000000000001,
                                    0.001,
                                    0.0009932488451843476,
                                    0.00099028808310803063,
                                    0.00038348468386530446,
                                    0.0001246414501258549,
                                    0.00011437544784878524,
                                    0.00010453658778440107,
                                    3.6820465358185854e-05,
                                    1.0270637616241606e-05,
                                    1e-05,
                                    1e-05};
  expect_rates(schedule.params(), want, "warm-up fraction");
}

// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR as deepspeed.initialize runs them: the
// scheduler is built at last_batch_iteration -1 (which sets the first update's rate) and steps
// after each update. Expected values from a transcription of deepspeed/runtime/lr_schedules.py and
// that protocol (the rate each update used), not by DTK, at updates 0, 1, 2, 5, 10, 11, 12, 60, 79,
// 80, 81, 90, 99, 100, 101 of DTK's count. An unset lr_warmup_style is DeepSpeed's log.
TEST(LearningRate, DeepSpeedSchedulersEqualDeepSpeed) {
  const std::vector<int64_t> steps = {0, 1, 2, 5, 10, 11, 12, 60, 79, 80, 81, 90, 99, 100, 101};
  struct Case {
    const char* style;
    const char* warmup;
    double lr, init, min;
    int64_t warmup_iters, decay_iters;
    std::vector<double> want;
  };
  const std::vector<Case> cases = {
      {"WarmupLR",
       "",
       1e-3,
       1e-4,
       1e-4,
       10,
       0,
       {0.0001, 0.0001, 0.000370926996097583, 0.0007290730039024168, 0.0009999999999999998, 0.001, 0.001, 0.001, 0.001,
        0.001, 0.001, 0.001, 0.001, 0.001, 0.001}},
      {"WarmupLR",
       "linear",
       2e-3,
       1e-4,
       1e-4,
       10,
       0,
       {0.0001, 0.0001, 0.00029, 0.0008600000000000001, 0.00181, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002,
        0.002, 0.002}},
      {"WarmupDecayLR",
       "log",
       2e-3,
       1e-5,
       1e-5,
       10,
       100,
       {1e-05, 1e-05, 0.0006090496913713225, 0.001400950308628677, 0.0019999999999999996, 0.002, 0.001977888888888889,
        0.0009165555555555555, 0.0004964444444444444, 0.0004743333333333334, 0.00045222222222222224,
        0.00025322222222222223, 5.422222222222222e-05, 3.2111111111111114e-05, 1e-05}},
      {"WarmupDecayLR",
       "linear",
       2e-3,
       0,
       0,
       10,
       100,
       {0.0, 0.0, 0.0002, 0.0008, 0.0018000000000000002, 0.002, 0.001977777777777778, 0.0009111111111111111,
        0.0004888888888888889, 0.00046666666666666666, 0.0004444444444444444, 0.00024444444444444443,
        4.4444444444444447e-05, 2.2222222222222223e-05, 0.0}},
      // warmup_min_ratio 0.1, cos_min_ratio 0.01 of lr 1e-3.
      {"WarmupCosineLR",
       "",
       1e-3,
       1e-4,
       1e-5,
       10,
       100,
       {0.0, 0.0001, 0.00037092699609758304, 0.0007290730039024168, 0.0009999999999999998, 0.0009996984593744526,
        0.0009987942048786129, 0.0004190441520548695, 0.0001371433113886898, 0.00012580800065610596,
        0.00011493467696467265, 3.9852152710975386e-05, 1.0301540625547598e-05, 1e-05, 1e-05}},
      // DeepSpeed's defaults: warmup_min_ratio 0, cos_min_ratio 0.0001.
      {"WarmupCosineLR",
       "linear",
       1e-3,
       0,
       1e-7,
       10,
       100,
       {0.0, 0.0, 0.0001, 0.0004, 0.0009000000000000001, 0.000999695443968197, 0.0009987821469273992,
        0.0004132345935754182, 0.0001285147445025767, 0.00011706608066266701, 0.00010608402373431938,
        3.0250674238085136e-05, 4.045560318030737e-07, 1.0000000000000001e-07, 1.0000000000000001e-07}},
      // One warm-up step is DeepSpeed's two.
      {"WarmupLR",
       "linear",
       1e-3,
       0,
       0,
       1,
       0,
       {0.0, 0.0, 0.0005, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001}},
  };
  for (const Case& c : cases) {
    dtk::config::LrSchedule lr;
    lr.set_lr(c.lr), lr.set_lr_warmup_init(c.init), lr.set_min_lr(c.min), lr.set_lr_decay_style(c.style);
    lr.set_lr_warmup_style(c.warmup), lr.set_lr_warmup_iters(c.warmup_iters), lr.set_lr_decay_iters(c.decay_iters);
    const dtk::core::LearningRateSchedule schedule(lr, 120);
    for (size_t i = 0; i < steps.size(); ++i)
      EXPECT_NEAR(schedule.rate(steps[i]), c.want[i], 1e-15) << c.style << " " << c.warmup << " at update " << steps[i];
  }
}

// DeepSpeed's LRRangeTest and OneCycle (stairs, an asymmetric cycle, a rising-only cycle, the
// decay after it, momentum cycling on and off) as deepspeed.initialize runs them. Expected values:
// DeepSpeed's own deepspeed/runtime/lr_schedules.py (commit edaa722) over a stub optimizer, built
// at last_batch_iteration -1 and stepped after each update, recording the param group's lr and
// betas[0] that each update used (before the scheduler's step), at DTK's updates 0, 1, 2, 3, 5, 9,
// 10, 11, 17, 25, 39, 40, 41, 45, 50, 59. No beta1 listed: the schedule leaves the betas alone.
// The same float operations in the same order: equal to the last bit.
TEST(LearningRate, DeepSpeedRangeTestAndOneCycleEqualDeepSpeed) {
  const std::vector<int64_t> steps = {0, 1, 2, 3, 5, 9, 10, 11, 17, 25, 39, 40, 41, 45, 50, 59};
  struct Case {
    const char* style;
    std::map<std::string, double> params;  // DeepSpeed's names
    std::vector<double> lr, beta1;
  };
  const std::vector<Case> cases = {
      // LRRangeTest lr_range_test_min_lr=0.001, lr_range_test_step_size=10, lr_range_test_step_rate=5.0
      {"LRRangeTest",
       {{"lr_range_test_min_lr", 0.001}, {"lr_range_test_step_size", 10.0}, {"lr_range_test_step_rate", 5.0}},
       {0.001, 0.0015, 0.002, 0.0025, 0.0035, 0.0055, 0.006, 0.006500000000000001, 0.0095, 0.0135, 0.0205, 0.021,
        0.021500000000000002, 0.0235, 0.026000000000000002, 0.0305},
       {}},
      // LRRangeTest lr_range_test_min_lr=0.0002, lr_range_test_step_size=7, lr_range_test_step_rate=0.5,
      // lr_range_test_staircase=True
      {"LRRangeTest",
       {{"lr_range_test_min_lr", 0.0002},
        {"lr_range_test_step_size", 7.0},
        {"lr_range_test_step_rate", 0.5},
        {"lr_range_test_staircase", 1}},
       {0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.00030000000000000003, 0.00030000000000000003, 0.00030000000000000003,
        0.0004, 0.0005, 0.0007, 0.0007, 0.0007, 0.0008, 0.0009000000000000001, 0.001},
       {}},
      // OneCycle cycle_min_lr=0.0001, cycle_max_lr=0.001, cycle_first_step_size=10
      {"OneCycle",
       {{"cycle_min_lr", 0.0001}, {"cycle_max_lr", 0.001}, {"cycle_first_step_size", 10.0}},
       {0.0001, 0.00019000000000000006, 0.00028000000000000014, 0.00036999999999999983, 0.00055, 0.0009099999999999999,
        0.001, 0.0009099999999999999, 0.00036999999999999983, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001},
       {0.8, 0.89, 0.88, 0.87, 0.8500000000000001, 0.81, 0.8, 0.81, 0.87, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9}},
      // OneCycle cycle_min_lr=0.0001, cycle_max_lr=0.002, cycle_first_step_size=10, cycle_second_step_size=30,
      // cycle_first_stair_count=4, cycle_second_stair_count=3, decay_step_size=5, decay_lr_rate=0.5,
      // decay_mom_rate=0.01, cycle_min_mom=0.85, cycle_max_mom=0.95
      {"OneCycle",
       {{"cycle_min_lr", 0.0001},
        {"cycle_max_lr", 0.002},
        {"cycle_first_step_size", 10.0},
        {"cycle_second_step_size", 30.0},
        {"cycle_first_stair_count", 4.0},
        {"cycle_second_stair_count", 3.0},
        {"decay_step_size", 5.0},
        {"decay_lr_rate", 0.5},
        {"decay_mom_rate", 0.01},
        {"cycle_min_mom", 0.85},
        {"cycle_max_mom", 0.95}},
       {0.0001, 0.0001, 0.0001, 0.000575, 0.00105, 0.001525, 0.002, 0.0013666666666666666, 0.0013666666666666666,
        0.0007333333333333333, 0.0001, 0.0001, 9.09090909090909e-05, 6.666666666666667e-05, 5e-05,
        3.4482758620689657e-05},
       {0.85, 0.95, 0.95, 0.9249999999999999, 0.8999999999999999, 0.875, 0.85, 0.8833333333333333, 0.8833333333333333,
        0.9166666666666666, 0.95, 0.95, 0.9519, 0.9594999999999999, 0.969, 0.9861}},
      // OneCycle cycle_min_lr=0.0003, cycle_max_lr=0.001, cycle_first_step_size=7, cycle_second_step_size=0,
      // decay_step_size=3, decay_lr_rate=1.0, cycle_momentum=False
      {"OneCycle",
       {{"cycle_min_lr", 0.0003},
        {"cycle_max_lr", 0.001},
        {"cycle_first_step_size", 7.0},
        {"cycle_second_step_size", 0.0},
        {"decay_step_size", 3.0},
        {"decay_lr_rate", 1.0},
        {"cycle_momentum", 0}},
       {0.0003, 0.00039999999999999996, 0.0004999999999999999, 0.0006000000000000001, 0.0008000000000000001, 0.00018,
        0.00015, 0.00012857142857142858, 6.923076923076921e-05, 4.2857142857142856e-05, 2.5714285714285714e-05,
        2.4999999999999998e-05, 2.432432432432432e-05, 2.195121951219512e-05, 1.9565217391304346e-05,
        1.6363636363636363e-05},
       {}},
      // OneCycle cycle_min_lr=1e-05, cycle_max_lr=0.001, cycle_first_step_size=10, cycle_first_stair_count=5,
      // decay_step_size=10, decay_lr_rate=0.0, decay_mom_rate=0.002
      {"OneCycle",
       {{"cycle_min_lr", 1e-05},
        {"cycle_max_lr", 0.001},
        {"cycle_first_step_size", 10.0},
        {"cycle_first_stair_count", 5.0},
        {"decay_step_size", 10.0},
        {"decay_lr_rate", 0.0},
        {"decay_mom_rate", 0.002}},
       {1e-05, 1e-05, 0.00020800000000000001, 0.00020800000000000001, 0.00040600000000000006, 0.0008020000000000001,
        0.001, 0.0008020000000000001, 0.00020800000000000001, 1e-05, 1e-05, 1e-05, 1e-05, 1e-05, 1e-05, 1e-05},
       {0.8, 0.9, 0.88, 0.88, 0.86, 0.8200000000000001, 0.8, 0.8200000000000001, 0.88, 0.9008999999999999, 0.90342,
        0.9036000000000001, 0.90378, 0.9045, 0.9054, 0.90702}},
      // OneCycle {'cycle_min_lr': 0.0001, 'cycle_max_lr': 0.001, 'cycle_first_step_size': 5, 'cycle_second_step_size':
      // 8, 'cycle_second_stair_count': 2, 'decay_step_size': 0, 'decay_lr_rate': 0.3, 'decay_mom_rate': 0.05}
      {"OneCycle",
       {{"cycle_min_lr", 0.0001},
        {"cycle_max_lr", 0.001},
        {"cycle_first_step_size", 5.0},
        {"cycle_second_step_size", 8.0},
        {"cycle_second_stair_count", 2.0},
        {"decay_step_size", 0.0},
        {"decay_lr_rate", 0.3},
        {"decay_mom_rate", 0.05}},
       {0.0001, 0.00027999999999999987, 0.0004599999999999997, 0.0006400000000000002, 0.0009999999999999998, 0.00055,
        0.0001, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001, 0.0001},
       {0.8, 0.88, 0.8600000000000001, 0.8400000000000001, 0.8, 0.8500000000000001, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9,
        0.9, 0.9, 0.9}},
  };
  for (const Case& c : cases) {
    dtk::config::LrSchedule lr;
    lr.set_lr_decay_style(c.style);
    for (const auto& [key, v] : c.params) {
      const auto whole = static_cast<int64_t>(v);
      if (key == "lr_range_test_min_lr" || key == "cycle_max_lr")
        lr.set_lr(v);
      else if (key == "cycle_min_lr")
        lr.set_min_lr(v);
      else if (key == "lr_range_test_step_size")
        lr.set_lr_range_test_step_size(whole);
      else if (key == "lr_range_test_step_rate")
        lr.set_lr_range_test_step_rate(v);
      else if (key == "lr_range_test_staircase")
        lr.set_lr_range_test_staircase(v != 0);
      else if (key == "cycle_first_step_size")
        lr.set_cycle_first_step_size(whole);
      else if (key == "cycle_second_step_size")
        lr.set_cycle_second_step_size(whole);
      else if (key == "cycle_first_stair_count")
        lr.set_cycle_first_stair_count(whole);
      else if (key == "cycle_second_stair_count")
        lr.set_cycle_second_stair_count(whole);
      else if (key == "decay_step_size")
        lr.set_decay_step_size(whole);
      else if (key == "decay_lr_rate")
        lr.set_decay_lr_rate(v);
      else if (key == "decay_mom_rate")
        lr.set_decay_mom_rate(v);
      else if (key == "cycle_momentum")
        lr.set_cycle_momentum(v != 0);
      else if (key == "cycle_min_mom")
        lr.set_cycle_min_mom(v);
      else if (key == "cycle_max_mom")
        lr.set_cycle_max_mom(v);
      else
        FAIL() << "no field for " << key;
    }
    const dtk::core::LearningRateSchedule schedule(lr, 100);
    for (size_t i = 0; i < steps.size(); ++i) {
      const dtk::core::SchedulePosition at{steps[i]};
      EXPECT_EQ(schedule.rate(at), c.lr[i]) << c.style << " case " << (&c - cases.data()) << " at update " << steps[i];
      const auto betas = schedule.betas(at);
      ASSERT_EQ(betas.has_value(), !c.beta1.empty()) << c.style << " case " << (&c - cases.data());
      if (!betas) continue;
      EXPECT_EQ(betas->beta1, c.beta1[i]) << "beta1, case " << (&c - cases.data()) << " at update " << steps[i];
      EXPECT_EQ(betas->beta2, 0.99);
    }
  }
}

// Megatron's get_wd counts samples: wd_incr_steps = train_iters x global batch, num_steps = the
// scheduler's successful steps x global batch. Expected values from a transcription of get_wd
// (train_iters 10, global batch 8, 0.02 -> 0.1) at steps 0, 1, 3, 5, 9, 10, 11.
// Megatron-DeepSpeed's token-counted schedule (--lr-warmup-tokens, --lr-decay-tokens) as its loop
// drives it: the scheduler steps after each successful update with the tokens consumed before
// that iteration (the loop adds the iteration's tokens after train_step), a skipped iteration
// consumes its tokens without a step. Expected values: Megatron-DeepSpeed's own
// optimizer_param_scheduler.py (get_args/print_rank_0 stubbed) driven by that protocol in samples
// (global batch 8, seq 16: 128 tokens per iteration; a step warm-up of 80 samples, a decay of 800,
// here 10 and 100 iterations), at chosen iterations (the rate each iteration used).
struct TokenCase {
  const char* name;
  const char* style;
  int64_t warmup_iters;
  std::optional<int64_t> warmup_tokens, decay_tokens;
  int64_t iters;
  std::set<int64_t> skips;
  std::vector<std::pair<int64_t, double>> want;
  int64_t final_tokens, final_warmup_tokens;  // the scheduler's num_tokens and lr_warmup_tokens after the run
};

TEST(LearningRate, TokenCountedSchedulesEqualMegatronDeepSpeed) {
  const std::vector<TokenCase> cases = {
      {"token warm-up and cosine decay",
       "cosine",
       0,
       1000,
       10000,
       100,
       {},
       {{1, 0.0},
        {2, 0.0},
        {3, 0.000128},
        {4, 0.000256},
        {5, 0.000384},
        {9, 0.000896},
        {10, 0.000999982629597848},
        {11, 0.0009993034132336855},
        {12, 0.0009976375629910065},
        {13, 0.0009949884039212712},
        {14, 0.0009913612237688447},
        {15, 0.0009867632624166122},
        {16, 0.0009812036974351124},
        {20, 0.0009495996389495543},
        {40, 0.0006139924247899142},
        {60, 0.0001969904986168749},
        {70, 5.9794400474646314e-05},
        {79, 1.0625206480021355e-05},
        {80, 1.000772020381911e-05},
        {81, 1e-05},
        {90, 1e-05},
        {100, 1e-05}},
       12672,
       1000},
      // The decay starts from the tokens seen when the steps reached the warm-up's end (1152).
      {"step warm-up, token linear decay",
       "linear",
       10,
       std::nullopt,
       9000,
       100,
       {},
       {{1, 0.0},
        {2, 0.0001},
        {3, 0.0002},
        {4, 0.00030000000000000003},
        {5, 0.0004},
        {9, 0.0008},
        {10, 0.0009000000000000001},
        {11, 0.001},
        {12, 0.0009838532110091744},
        {13, 0.0009677064220183486},
        {14, 0.000951559633027523},
        {15, 0.0009354128440366972},
        {16, 0.0009192660550458716},
        {20, 0.0008546788990825688},
        {40, 0.000531743119266055},
        {60, 0.00020880733944954124},
        {70, 4.733944954128445e-05},
        {79, 1e-05},
        {80, 1e-05},
        {81, 1e-05},
        {90, 1e-05},
        {100, 1e-05}},
       12672,
       1152},
      // No warm-up at all: DTK's origin 0 (Megatron-DeepSpeed fails on its unset lr_warmup_tokens;
      // the reference ran with --lr-warmup-tokens 0, what the unset value means).
      {"token cosine decay without a warm-up",
       "cosine",
       0,
       std::nullopt,
       6000,
       60,
       {},
       {{1, 0.001},
        {2, 0.001},
        {3, 0.000998888703827289},
        {4, 0.0009955598051240389},
        {5, 0.0009900282509302022},
        {9, 0.0009465179253646896},
        {10, 0.0009305386330281581},
        {11, 0.0009126486358260715},
        {12, 0.0008929282613762907},
        {13, 0.0008714660558471002},
        {14, 0.0008483583863773384},
        {15, 0.0008237090083797006},
        {16, 0.0007976285996700594},
        {20, 0.0006814238799630591},
        {40, 9.501328787168594e-05},
        {60, 1e-05}},
       7552,
       -1},
      {"token warm-up, inverse square root",
       "inverse-square-root",
       0,
       1000,
       std::nullopt,
       40,
       {},
       {{1, 0.0},
        {2, 0.0},
        {3, 0.000128},
        {4, 0.000256},
        {5, 0.000384},
        {9, 0.000896},
        {10, 0.0009882117688026185},
        {11, 0.0009316949906249125},
        {12, 0.0008838834764831843},
        {13, 0.0008427498280790525},
        {14, 0.0008068715304598785},
        {15, 0.0007752170911825529},
        {16, 0.0007470178808339959},
        {20, 0.0006588078458684123},
        {40, 0.00045342265631875725}},
       4992,
       1000},
      {"token warm-up, step cosine decay",
       "cosine",
       0,
       1000,
       std::nullopt,
       100,
       {},
       {{1, 0.0},
        {2, 0.0},
        {3, 0.000128},
        {4, 0.000256},
        {5, 0.000384},
        {9, 0.000896},
        {10, 0.0009803453744100868},
        {11, 0.0009757729755661011},
        {12, 0.0009707359806323416},
        {13, 0.0009652393605146844},
        {14, 0.0009592885397135706},
        {15, 0.0009528893909706797},
        {16, 0.0009460482294732421},
        {20, 0.0009144048842659081},
        {40, 0.0006726752705214194},
        {60, 0.00036689940251058157},
        {70, 0.00022676872796319547},
        {79, 0.00012359594482598438},
        {80, 0.00011387326887403324},
        {81, 0.00010453658778440107},
        {90, 3.92640193676584e-05},
        {100, 1.0244252618962858e-05}},
       12672,
       1000},
      // Skipped iterations keep the rate and consume their tokens: the warm-up ends two steps late.
      {"skipped iterations",
       "cosine",
       10,
       std::nullopt,
       5000,
       60,
       {3, 4, 12, 13, 30},
       {{1, 0.0},
        {2, 0.0001},
        {3, 0.0002},
        {4, 0.0002},
        {5, 0.0002},
        {9, 0.0006000000000000001},
        {10, 0.0007},
        {11, 0.0008},
        {12, 0.0009000000000000001},
        {13, 0.0009000000000000001},
        {14, 0.0009000000000000001},
        {15, 0.001},
        {16, 0.000996408160851076},
        {20, 0.0009127839788764766},
        {40, 1.405421665043768e-05},
        {60, 1e-05}},
       7552,
       1664},
  };
  for (const auto& c : cases) {
    dtk::config::LrSchedule lr;
    lr.set_lr(1e-3), lr.set_min_lr(1e-5), lr.set_lr_decay_style(c.style), lr.set_lr_warmup_iters(c.warmup_iters);
    if (c.warmup_tokens) lr.set_lr_warmup_tokens(*c.warmup_tokens);
    if (c.decay_tokens) lr.set_lr_decay_tokens(*c.decay_tokens);
    const dtk::core::LearningRateSchedule schedule(lr, 100);
    EXPECT_TRUE(schedule.counts_tokens()) << c.name;
    dtk::core::SchedulePosition at;
    std::map<int64_t, double> used;
    for (int64_t it = 1; it <= c.iters; ++it) {
      used[it] = schedule.rate(at);
      if (!c.skips.count(it)) schedule.advance(at, 1, (it - 1) * 128);
    }
    for (const auto& [it, want] : c.want) EXPECT_NEAR(used[it], want, 1e-15) << c.name << " at iteration " << it;
    EXPECT_EQ(at.tokens, c.final_tokens) << c.name;
    if (!c.warmup_tokens) {
      EXPECT_EQ(at.warmup_end_tokens, c.final_warmup_tokens) << c.name;
    }
  }
}

TEST(WeightDecay, IncrementEqualsMegatron) {
  dtk::config::LrSchedule lr;
  lr.set_lr(1e-3), lr.set_min_lr(1e-5), lr.set_lr_decay_style("cosine");
  lr.set_start_weight_decay(0.02), lr.set_end_weight_decay(0.1);
  const std::vector<int64_t> steps = {0, 1, 3, 5, 9, 10, 11};
  const std::map<std::string, std::vector<double>> want = {
      {"linear", {0.02, 0.028, 0.044, 0.06, 0.09200000000000001, 0.1, 0.1}},
      {"cosine", {0.02, 0.02195773934819386, 0.036488589908301075, 0.06, 0.09804226065180616, 0.1, 0.1}}};
  for (const auto& [style, values] : want) {
    lr.set_weight_decay_incr_style(style);
    const dtk::core::LearningRateSchedule schedule(lr, 10);
    EXPECT_TRUE(schedule.weight_decay_varies());
    EXPECT_EQ(schedule.reference_weight_decay(), 0.1);  // the groups carry the end value
    for (size_t i = 0; i < steps.size(); ++i) {
      EXPECT_NEAR(dtk::core::weight_decay(steps[i], schedule.params()), values[i], 1e-15) << style << " " << steps[i];
      EXPECT_NEAR(schedule.weight_decay_scale(steps[i]) * 0.1, values[i], 1e-15) << style << " " << steps[i];
    }
  }
  // Constant (the default): lr.weight_decay throughout, scale 1.
  dtk::config::LrSchedule constant;
  constant.set_lr(1e-3), constant.set_weight_decay(0.05);
  const dtk::core::LearningRateSchedule flat(constant, 10);
  EXPECT_FALSE(flat.weight_decay_varies());
  for (int64_t step : steps) EXPECT_EQ(flat.weight_decay_scale(step), 1.0);
  EXPECT_EQ(dtk::core::weight_decay(3, flat.params()), 0.05);
}

dtk::Param named(const std::string& name, bool no_weight_decay) {
  dtk::Param p;
  p.name = name;
  p.tensor = at::zeros({2, 3});
  p.info.no_weight_decay = no_weight_decay ? 1 : 0;
  return p;
}

// Megatron's get_param_groups: (wd_mult, lr_mult) per parameter; DTK's groups are fixed by the
// config (0 decay, 1 no decay, then two per rule), the first matching rule decides.
TEST(ParamGroups, RulesDecideGroupsByName) {
  dtk::config::LrSchedule lr;
  auto* out = lr.add_param_rules();
  out->set_match("output_layer"), out->set_lr_mult(0.1);
  auto* norms = lr.add_param_rules();
  norms->set_match("layernorm"), norms->set_wd_mult(0.5);
  auto* shadowed = lr.add_param_rules();
  shadowed->set_match("final_layernorm"), shadowed->set_lr_mult(7);  // never reached: rule 1 matches first
  const dtk::core::ParamGroups g(lr, 0.01);
  ASSERT_EQ(g.specs().size(), 8u);
  EXPECT_EQ(g.specs()[0].weight_decay, 0.01);
  EXPECT_EQ(g.specs()[1].weight_decay, 0.0);
  EXPECT_EQ(g.specs()[2].lr_scale, 0.1);   // rule 0, decaying parameters
  EXPECT_EQ(g.specs()[2].weight_decay, 0.01);
  EXPECT_EQ(g.specs()[3].weight_decay, 0.0);  // rule 0 keeps a bias's own "no decay"
  EXPECT_EQ(g.specs()[4].weight_decay, 0.005);  // rule 1: wd_mult replaces the default...
  EXPECT_EQ(g.specs()[5].weight_decay, 0.005);  // ...for no-decay parameters too
  EXPECT_EQ(g.specs()[5].lr_scale, 1.0);
  EXPECT_EQ(g.group_of("layers.0.mlp.weight", false), 0u);
  EXPECT_EQ(g.group_of("layers.0.mlp.bias", true), 1u);
  EXPECT_EQ(g.group_of("language_model.output_layer.weight", false), 2u);
  EXPECT_EQ(g.group_of("language_model.output_layer.bias", true), 3u);
  EXPECT_EQ(g.group_of("layers.3.input_layernorm.weight", true), 5u);
  EXPECT_EQ(g.group_of("encoder.final_layernorm.bias", true), 5u);
  const auto lines = g.describe({named("m.layers.0.fc.weight", false), named("m.layers.1.fc.weight", false),
                                 named("m.layers.0.input_layernorm.bias", true), named("m.output_layer.weight", false)});
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], " > optimizer group 0, decay (weight decay 0.01, lr x 1): 2 tensors, 12 elements: "
                      "m.layers.*.fc.weight (x2)");
  EXPECT_NE(lines[1].find("optimizer group 2, rule 0 \"output_layer\" (weight decay 0.01, lr x 0.1): 1 tensors"),
            std::string::npos)
      << lines[1];
  EXPECT_NE(lines[2].find("optimizer group 5, rule 1 \"layernorm\", a no-decay parameter (weight decay 0.005, lr x 1)"),
            std::string::npos)
      << lines[2];
}

dtk::Param param(std::vector<int64_t> shape, bool tensor_parallel) {
  dtk::Param p;
  p.tensor = at::zeros(shape);
  p.info.tensor_parallel = tensor_parallel ? 1 : 0;
  return p;
}

TEST(Flops, CountsTheWholeModelUnderTensorParallelism) {
  // A rank of TP=2: a [50, 8] vocab shard (the tied embedding, listed once: ModelInstance refuses a
  // tensor listed twice) and a [8, 8] column shard, a replicated [8] norm weight.
  std::vector<dtk::Param> params = {param({50, 8}, true), param({8, 8}, true), param({8}, false)};
  dtk_model_info info{};
  // The model declares a context of 1024 (for export); the run's samples hold 16 tokens: s = 16.
  info.num_layers = 2, info.hidden_size = 8, info.seq_length = 1024;
  const auto s = dtk::core::model_stats(params, info, /*seq_length=*/16, /*tp_size=*/2);
  EXPECT_EQ(s.num_parameters, 400 + 64 + 8);
  EXPECT_EQ(s.model_parameters, 2 * 400 + 2 * 64 + 8);
  EXPECT_EQ(s.passes, 3);
  EXPECT_DOUBLE_EQ(s.flops_per_token, 2 * 3 * 936.0 + 4 * 3 * 2 * 8 * 16);  // 6N + 12Lhs
  info.recompute = 1;
  EXPECT_DOUBLE_EQ(dtk::core::model_stats(params, info, 16, 2).flops_per_token, 8 * 936.0 + 16 * 2 * 8 * 16);
  // ABI 2.15: 2 heads of 8 channels over hidden 8 (Qwen3's wider heads): the scores and the
  // context are 16 wide, Megatron's query_projection_size; a 2.13 model's info is read as before.
  info.recompute = 0, info.num_attention_heads = 2, info.kv_channels = 8;
  info.struct_size = dtk_model_info_STRUCT_SIZE;
  EXPECT_DOUBLE_EQ(dtk::core::model_stats(params, info, 16, 2).flops_per_token, 6 * 936.0 + 12 * 2 * 16 * 16);
  info.struct_size = dtk_model_info_STRUCT_SIZE_2_13;
  EXPECT_DOUBLE_EQ(dtk::core::model_stats(params, info, 16, 2).flops_per_token, 6 * 936.0 + 12 * 2 * 8 * 16);
}

// A token runs topk of each MoE layer's experts: of the model's count, or of its layer's own
// (ABI 2.18's dtk_param_info.layer_experts, DeepSpeed's pyramid MoE), which a 2.17 plugin's
// shorter parameter info does not hold.
TEST(Flops, CountsEachMoeLayersExpertsAtItsOwnShare) {
  const auto expert = [](int64_t numel, int32_t layer_experts, size_t struct_size) {
    dtk::Param p = param({numel}, false);
    p.info.expert = 1, p.info.layer_experts = layer_experts, p.info.struct_size = struct_size;
    return p;
  };
  dtk_model_info info{};
  info.struct_size = dtk_model_info_STRUCT_SIZE;
  info.num_layers = 2, info.hidden_size = 8, info.num_experts = 8, info.moe_router_topk = 2;
  // A dense weight of 10; a layer of 2 experts of 6 (read whole), one of 8 of 6 (read at 2 of 8).
  std::vector<dtk::Param> params = {param({10}, false)};
  for (int e = 0; e < 2; ++e) params.push_back(expert(6, 2, dtk_param_info_STRUCT_SIZE));
  for (int e = 0; e < 8; ++e) params.push_back(expert(6, 8, dtk_param_info_STRUCT_SIZE));
  auto s = dtk::core::model_stats(params, info, 16, 1);
  EXPECT_EQ(s.model_parameters, 10 + 12 + 48);
  EXPECT_EQ(s.active_parameters, 10 + 12 + 12);
  // Under EP 2 this rank holds half of each layer's experts: the same whole model.
  params.erase(params.begin() + 2), params.erase(params.begin() + 3, params.begin() + 7);
  s = dtk::core::model_stats(params, info, 16, 1, 0, 1, /*ep_size=*/2);
  EXPECT_EQ(s.model_parameters, 10 + 12 + 48);
  EXPECT_EQ(s.active_parameters, 10 + 12 + 12);
  // A 2.17 parameter info (no layer_experts: what lies past its struct_size is not read): every
  // expert is one of num_experts.
  for (dtk::Param& p : params)
    if (p.info.expert) p.info.struct_size = dtk_param_info_STRUCT_SIZE_2_9;
  s = dtk::core::model_stats(params, info, 16, 1, 0, 1, 2);
  EXPECT_EQ(s.active_parameters, 10 + (12 + 48) * 2 / 8);
}

}  // namespace
