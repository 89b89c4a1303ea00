// Unit tests of the loop's algorithms against Megatron's:
//   * GradScaler == DynamicGradScaler.update for a scripted overflow pattern (backoff after the
//     hysteresis runs out, growth after a window of clean iterations, the minimum, the
//     hysteresis tracker going negative as Megatron's does), and the static scaler;
//   * the learning rate == OptimizerParamScheduler.get_lr at chosen steps for WSD (every decay
//     style), lr_warmup_init and lr_warmup_fraction. The expected numbers were computed by a
//     transcription of Megatron's get_lr counting samples (global batch 8), not by DTK;
//   * the FLOPs model: 2cN + 4cLhs with N of the whole model under tensor parallelism.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "dtk/core/flops.hpp"
#include "dtk/core/grad_scaler.hpp"
#include "dtk/core/lr_schedule.hpp"

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

dtk::Param param(std::vector<int64_t> shape, bool tensor_parallel) {
  dtk::Param p;
  p.tensor = at::zeros(shape);
  p.info.tensor_parallel = tensor_parallel ? 1 : 0;
  return p;
}

TEST(Flops, CountsTheWholeModelUnderTensorParallelism) {
  // A rank of TP=2: a [50, 8] vocab shard and a [8, 8] column shard, a replicated [8] norm weight,
  // and the embedding again (tied: counted once).
  std::vector<dtk::Param> params = {param({50, 8}, true), param({8, 8}, true), param({8}, false)};
  params.push_back(params[0]);
  dtk_model_info info{};
  info.num_layers = 2, info.hidden_size = 8, info.seq_length = 16;
  const auto s = dtk::core::model_stats(params, info, /*tp_size=*/2);
  EXPECT_EQ(s.num_parameters, 400 + 64 + 8);
  EXPECT_EQ(s.model_parameters, 2 * 400 + 2 * 64 + 8);
  EXPECT_EQ(s.passes, 3);
  EXPECT_DOUBLE_EQ(s.flops_per_token, 2 * 3 * 936.0 + 4 * 3 * 2 * 8 * 16);  // 6N + 12Lhs
  info.recompute = 1;
  EXPECT_DOUBLE_EQ(dtk::core::model_stats(params, info, 2).flops_per_token, 8 * 936.0 + 16 * 2 * 8 * 16);
}

}  // namespace
