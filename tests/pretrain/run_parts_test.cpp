// The parts the Trainer is put together from, each on its own (no run, no plugins):
//   * the memory estimate == Megatron's activation formula (Korthikanti et al.) computed here by
//     hand for chosen layouts (TP, PP stages, the interleaved warm-up, full recompute, offload);
//   * the run's learning-rate schedule in the plan's units (samples -> iterations), its refusals,
//     and the choice between a resumed checkpoint's schedule and this run's;
//   * the start-up report's lines, the peak throughput's source, the schedules' refusals.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "dtk/core/config/config.hpp"
#include "dtk/core/memory/memory_estimate.hpp"
#include "dtk/core/perf/peak_throughput.hpp"
#include "dtk/core/perf/startup_report.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/run_schedule.hpp"
#include "dtk/core/train/schedule.hpp"
#include "dtk/host/error.hpp"

namespace {

using dtk::core::MemoryEstimateInputs;

// s 128, b 4, h 256, 8 heads, 4 layers, vocab 1000, fp32, one rank, 2 micro-batches per step.
MemoryEstimateInputs small_run() {
  MemoryEstimateInputs in;
  in.seq_length = 128, in.micro_batch_size = 4, in.hidden_size = 256, in.num_attention_heads = 8;
  in.num_layers = 4, in.vocab_size = 1000, in.dtype_bytes = 4, in.micro_batches_per_step = 2;
  in.parameter_bytes = 1000, in.gradient_bytes = 2000, in.master_bytes = 300, in.host_bytes = 300;
  in.optimized_elements = 250;
  return in;
}

// One layer's activations, s b h (34 + 5 a s / h) bytes in 16-bit, by hand.
constexpr double kLayer16 = 128.0 * 4 * 256 * (34 + 5.0 * 8 * 128 / 256);

TEST(MemoryEstimate, MegatronsActivationFormulaByLayout) {
  const auto one = dtk::core::estimate_memory(small_run());
  EXPECT_DOUBLE_EQ(one.activations, 4 * kLayer16 * 2);  // fp32: twice the 16-bit bytes
  // At most 512 rows of fp32 logits and their grad; the weight's fp32 gradient [vocab, h] and the
  // input's [s b, h], which the fused cross entropy computes in forward.
  constexpr double kHeadGrads = 1000.0 * 256 * 4 + 128.0 * 4 * 256 * 4;
  EXPECT_DOUBLE_EQ(one.logits, 512.0 * 1000 * 4 * 2 + kHeadGrads);
  EXPECT_DOUBLE_EQ(one.batches, 5.0 * 4 * 129 * 8);     // queue of 4 + the batch in use
  EXPECT_DOUBLE_EQ(one.params, 1000 + 2000 + 300);      // host bytes count on the machine's budget
  EXPECT_DOUBLE_EQ(one.optimizer, 8.0 * 250);           // Adam's two fp32 moments
  EXPECT_DOUBLE_EQ(one.gradients_in_flight, 0);
  EXPECT_DOUBLE_EQ(one.total(), one.params + one.optimizer + one.activations + one.logits + one.batches);

  auto in = small_run();
  // TP 2: the paper's s b h (10 + 24 / t + 5 a s / (h t)): what lies outside the TP blocks stays whole.
  in.tp_size = 2;
  constexpr double kSbh = 128.0 * 4 * 256, kScores = 5.0 * 8 * 128 / 256;  // 5 a s / h = 20
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh * (10 + 12 + kScores / 2) * 2);
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).logits,
                   512.0 * 500 * 4 * 2 + 500.0 * 256 * 4 + 128.0 * 4 * 256 * 4);  // this rank's vocabulary
  in.sequence_parallel = true;  // s b h / t (34 + 5 a s / h): all of it split
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kLayer16);
  in.selective_recompute = true;  // 34 s b h / t: no attention scores kept
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh * 34 / 2 * 2);
  in.sequence_parallel = false;  // s b h (10 + 24 / t)
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh * 22 * 2);
  in.attention_width = 512;  // heads twice hidden / heads wide (Qwen3's): q, k, v and the context, 8 s b h more
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh * (22 + 8.0 / 2) * 2);
  in.attention_width = 0;
  in.recompute_mlp = true;  // the MLP keeps its input: dense_h_to_4h's and GELU's outputs (16 s b h / t) go
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh * (22 - 16.0 / 2) * 2);
  in.selective_recompute = false;  // the MLP alone: the scores stay
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh * (22 - 8 + kScores / 2) * 2);

  in = small_run();
  in.pp_size = 2, in.micro_batches_per_step = 4;  // 1F1B: stage 0 holds 2 micro-batches of its 2 layers
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 2 * 2 * kLayer16 * 2);
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).logits, 0);  // the output layer is the last stage's
  in.pp_rank = 1;
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 1 * 2 * kLayer16 * 2);

  in = small_run();
  in.pp_size = 2, in.virtual_stages = 2, in.micro_batches_per_step = 4;
  // Interleaved warm-up on rank 0: 2 (p - 1) + (v - 1) p + 1 = 5 chunk-forwards of v = 2 chunks.
  const auto v2 = dtk::core::estimate_memory(in);
  EXPECT_DOUBLE_EQ(v2.activations, 5.0 / 2 * 2 * kLayer16 * 2);
  EXPECT_DOUBLE_EQ(v2.gradients_in_flight, (5.0 + 2 * 2 + 1) * 128 * 4 * 256 * 4);
  EXPECT_DOUBLE_EQ(v2.batches, (4.0 + 4) * 4 * 129 * 8);
  in.pp_rank = 1;  // the last stage holds one micro-batch's output-layer gradients at a time...
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).logits, 512.0 * 1000 * 4 * 2 + kHeadGrads);
  in.micro_batches_per_step = 2;  // ... but every micro-batch's where the schedule runs all forwards first
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).logits, 512.0 * 1000 * 4 * 2 + 2 * kHeadGrads);
  in.on_gpu = true;  // on a GPU the chunk is about 1 GiB of logits: here the whole 512 rows
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).logits, 512.0 * 1000 * 4 * 2 + 2 * kHeadGrads);
  in.seq_length = 8192, in.vocab_size = 50304;  // 5,248 rows (about 1 GiB of fp32 logits) of 4 x 8192
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).logits,
                   5248.0 * 50304 * 4 * 2 + 2 * (50304.0 * 256 * 4 + 8192.0 * 4 * 256 * 4));

  in = small_run();
  in.recompute = true;  // the layer inputs of every layer plus one layer's worth
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * 128.0 * 4 * 256 * 4 + kLayer16 * 2);
  in.recompute_num_layers = 2;  // uniform: 2 groups of 2 layers, one group's worth in backward
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 2 * 128.0 * 4 * 256 * 4 + 2 * kLayer16 * 2);
  in.recompute_block = true, in.recompute_num_layers = 1;  // block: layer 0 checkpointed, 3 kept whole
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 128.0 * 4 * 256 * 4 + 3 * kLayer16 * 2 + kLayer16 * 2);
  in.tp_size = 2, in.sequence_parallel = true, in.recompute_block = false;  // inputs split too
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * 128.0 * 4 * 256 * 4 / 2 + kLayer16);

  in = small_run();
  in.device_budget = true, in.optimizer_on_host = true;  // offload: outside a device budget
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).optimizer, 0);
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).params, 1000 + 2000);
}

// Context parallelism: each rank keeps 1 / cp of every activation. a2a: whole sequences of 1 / cp
// of the heads, a2a's scores 1 / cp of one process's. all_gather: its queries' two chunks over the
// keys up to each chunk's end, (2 cp + 1) / (4 cp) of a2a's scores, plus those keys and values
// (2 (2 cp + 1) s b h / t in 16-bit, grouped-query attention's per-chunk copies at the queries'
// width, of which the share's own 4 s b h / t are counted already) unless core attention is
// recomputed (it gathers them again).
TEST(MemoryEstimate, ContextParallelByExchange) {
  constexpr double kSbh = 128.0 * 4 * 256, kScores = 5.0 * 8 * 128 / 256;  // 5 a s / h = 20
  auto in = small_run();
  in.cp_size = 2;  // a2a
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh / 2 * (34 + kScores) * 2);
  in.cp_gathers_keys = true;  // all_gather: 5 / 8 of the scores, 2 x 5 - 4 of keys and values
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh / 2 * (34 + kScores * 5 / 8 + 6) * 2);
  in.cp_size = 4, in.tp_size = 2;  // 9 / 16 of the scores of a TP rank's heads, 2 x 9 - 4 of keys and values
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations,
                   4 * kSbh / 4 * (10 + 12 + kScores / 2 * 9 / 16 + 14.0 / 2) * 2);
  in.attention_width = 512;  // heads twice hidden / heads wide: the gathered keys and values too
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations,
                   4 * kSbh / 4 * (10 + 12 + 8.0 / 2 + kScores / 2 * 9 / 16 + 14.0 * 2 / 2) * 2);
  in.attention_width = 0, in.selective_recompute = true;  // neither scores nor gathered keys kept
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh / 4 * 22 * 2);
  in.cp_size = 1;  // without context parallelism the exchange changes nothing
  in.selective_recompute = false;
  EXPECT_DOUBLE_EQ(dtk::core::estimate_memory(in).activations, 4 * kSbh * (10 + 12 + kScores / 2) * 2);
}

// What a model's dtk_model_info says it recomputes selectively: its DTK_RECOMPUTE_* bits, core
// attention where it names none (a 2.15 model, whose struct ends before the field, or 0), nothing
// unless its granularity is selective.
TEST(MemoryEstimate, SelectiveModulesFromTheModelsInfo) {
  dtk_model_info info{};
  info.struct_size = sizeof(dtk_model_info);
  info.recompute_granularity = 2;
  info.recompute_modules = DTK_RECOMPUTE_MLP;
  EXPECT_EQ(dtk::core::selective_recompute_modules(info), DTK_RECOMPUTE_MLP);
  info.recompute_modules = DTK_RECOMPUTE_CORE_ATTENTION | DTK_RECOMPUTE_MOE;
  EXPECT_EQ(dtk::core::selective_recompute_modules(info), DTK_RECOMPUTE_CORE_ATTENTION | DTK_RECOMPUTE_MOE);
  info.recompute_modules = 0;
  EXPECT_EQ(dtk::core::selective_recompute_modules(info), DTK_RECOMPUTE_CORE_ATTENTION);
  info.recompute_modules = DTK_RECOMPUTE_MLP;
  info.struct_size = offsetof(dtk_model_info, recompute_modules);  // a 2.15 model: the field is not its
  EXPECT_EQ(dtk::core::selective_recompute_modules(info), DTK_RECOMPUTE_CORE_ATTENTION);
  info.struct_size = sizeof(dtk_model_info);
  info.recompute_granularity = 1;
  EXPECT_EQ(dtk::core::selective_recompute_modules(info), 0);
}

TEST(MemoryEstimate, RefusesOverTheBudgetNamingIt) {
  const auto e = dtk::core::estimate_memory(small_run());
  EXPECT_EQ(dtk::core::memory_refusal(e, static_cast<int64_t>(e.total()) + 1, "of train.memory_limit_mb"), "");
  EXPECT_EQ(dtk::core::memory_refusal(e, 0, "of train.memory_limit_mb"), "");  // no budget known
  const std::string why = dtk::core::memory_refusal(e, 1 << 20, "of train.memory_limit_mb");
  // 56.6 MB of activations + 5.6 MB of the output layer's (4.1 of logits, 1.0 of its weight's
  // gradient, 0.5 of its input's) + the rest = 62.3e6 bytes = 59.4 MiB.
  EXPECT_NE(why.find("config: this run needs about 59 MB per rank"), std::string::npos) << why;
  EXPECT_NE(why.find("activations 59 MB, batches 0 MB"), std::string::npos) << why;
  EXPECT_NE(why.find("more than the 1 MB of train.memory_limit_mb"), std::string::npos) << why;
  EXPECT_NE(why.find("train.skip_memory_check=true"), std::string::npos) << why;
  EXPECT_NE(why.find("lower train.micro_batch_size"), std::string::npos) << why;
  // Parameters and optimizer state alone over the budget: a smaller batch would not help.
  dtk::core::MemoryEstimateInputs big = small_run();
  big.parameter_bytes = big.gradient_bytes = int64_t{1} << 30;
  const std::string model = dtk::core::memory_refusal(dtk::core::estimate_memory(big), int64_t{1} << 30, "of train.memory_limit_mb");
  EXPECT_NE(model.find("the model's state alone is more: a smaller model"), std::string::npos) << model;
  EXPECT_EQ(model.find("lower train.micro_batch_size"), std::string::npos) << model;
}

dtk::config::RunConfig sample_run(int64_t decay_samples) {
  dtk::config::RunConfig cfg = dtk::core::default_config();
  cfg.mutable_train()->set_micro_batch_size(2);
  cfg.mutable_train()->set_global_batch_size(8);
  cfg.mutable_train()->set_train_iters(0);
  cfg.mutable_train()->set_train_samples(800);
  cfg.mutable_lr()->set_lr_decay_style("cosine");
  cfg.mutable_lr()->set_lr_warmup_iters(0);
  cfg.mutable_lr()->set_lr_decay_samples(decay_samples);
  return cfg;
}

TEST(RunSchedule, SampleLengthsBecomeIterationsWithoutARampUp) {
  const auto cfg = sample_run(400);
  const dtk::core::BatchPlan plan(cfg, dtk::core::Topology{});
  ASSERT_EQ(plan.train_iters(), 100);
  EXPECT_EQ(dtk::core::make_run_schedule(cfg, plan).params().decay_iters, 50);
  auto warm = sample_run(400);
  warm.mutable_lr()->set_lr_warmup_samples(80);
  EXPECT_DOUBLE_EQ(dtk::core::make_run_schedule(warm, plan).params().warmup_iters, 10);
}

TEST(RunSchedule, RefusesLengthsThatCannotBe) {
  const auto odd = sample_run(404);  // not a whole number of global batches of 8
  const dtk::core::BatchPlan plan(odd, dtk::core::Topology{});
  try {
    dtk::core::make_run_schedule(odd, plan);
    FAIL() << "lr.lr_decay_samples 404 with a global batch of 8 was accepted";
  } catch (const dtk::host::HostError& e) {
    EXPECT_NE(std::string(e.what()).find("lr.lr_decay_samples (404) is not a whole number of global batches of 8"),
              std::string::npos)
        << e.what();
  }
  auto long_warmup = sample_run(400);
  long_warmup.mutable_lr()->set_lr_warmup_samples(400);  // as long as the decay
  EXPECT_THROW(dtk::core::make_run_schedule(long_warmup, plan), dtk::host::HostError);
}

TEST(RunSchedule, AResumedScheduleIsKeptOnlyWhenTheConfigSaysWhich) {
  const auto cfg = sample_run(400);
  const dtk::core::BatchPlan plan(cfg, dtk::core::Topology{});
  dtk::core::LearningRateSchedule schedule = dtk::core::make_run_schedule(cfg, plan);
  dtk::core::LrParams saved = schedule.params();
  std::vector<std::string> printed;
  auto print = [&](const std::string& line) { printed.push_back(line); };
  dtk::config::CheckpointConfig ck;
  dtk::core::reconcile_resumed_schedule(saved, ck, "ckpt", schedule, print);  // the same: nothing to say
  EXPECT_TRUE(printed.empty());
  saved.max_lr = schedule.params().max_lr * 2;
  try {
    dtk::core::reconcile_resumed_schedule(saved, ck, "ckpt", schedule, print);
    FAIL() << "another schedule was resumed silently";
  } catch (const dtk::host::HostError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint in ckpt was trained with another learning-rate schedule: lr.lr"),
              std::string::npos)
        << e.what();
  }
  ck.set_override_opt_param_scheduler(true);
  dtk::core::reconcile_resumed_schedule(saved, ck, "ckpt", schedule, print);
  EXPECT_NE(schedule.params().max_lr, saved.max_lr);  // this run's
  ck.set_override_opt_param_scheduler(false);
  ck.set_use_checkpoint_opt_param_scheduler(true);
  dtk::core::reconcile_resumed_schedule(saved, ck, "ckpt", schedule, print);
  EXPECT_EQ(schedule.params().max_lr, saved.max_lr);  // the checkpoint's
  ASSERT_EQ(printed.size(), 2u);
  EXPECT_NE(printed[0].find("from this run's config"), std::string::npos) << printed[0];
  EXPECT_NE(printed[1].find("from the checkpoint"), std::string::npos) << printed[1];
}

TEST(StartupReport, SaysTheFlopsModelEngineAllocatorAndScaling) {
  dtk::core::StartupFacts f;
  f.stats.flops_per_token = 1.5e9, f.stats.passes = 4, f.stats.model_parameters = 124000000;
  f.num_layers = 12, f.hidden_size = 768, f.seq_length = 1024, f.world_size = 2;
  f.cpu_gemm_engine = "oneDNN sgemm";
  f.malloc_name = "glibc";
  const auto plain = dtk::core::startup_report(f);
  ASSERT_EQ(plain.size(), 3u);
  EXPECT_NE(plain[0].find("training FLOPs per token: 1.5e+09 (2cN + 4cLhs with c = 4 (full recompute), "
                          "N = 124000000 parameters of the whole model, L = 12 layers, h = 768, s = 1024)"),
            std::string::npos)
      << plain[0];
  EXPECT_NE(plain[0].find("/ 2 ranks"), std::string::npos) << plain[0];
  EXPECT_EQ(plain[1], " > CPU matrix products: oneDNN sgemm (DTK_CPU_GEMM=aten selects LibTorch's BLAS; dtk/gemm.hpp)");
  EXPECT_NE(plain[2].find("glibc malloc (training runs several times slower"), std::string::npos) << plain[2];
  f.cpu_gemm_engine = "";  // a GPU run
  f.malloc_name = "tcmalloc";
  f.bf16_line = " > bf16 line";
  f.loss_scaling = true, f.dynamic_scale = true, f.loss_scale = 65536;
  const auto gpu = dtk::core::startup_report(f);
  ASSERT_EQ(gpu.size(), 4u);
  EXPECT_EQ(gpu[1], " > bf16 line");
  EXPECT_EQ(gpu[2], " > memory allocator: tcmalloc (DTK_ALLOCATOR=system selects glibc malloc)");
  EXPECT_EQ(gpu[3], " > loss scaling: dynamic, scale 65536");
}

TEST(PeakThroughput, GivenOrUnknownOutsideBenchMode) {
  dtk::config::RunConfig cfg = dtk::core::default_config();
  cfg.mutable_train()->set_bench_steps(0);
  cfg.mutable_logging()->set_peak_tflops(0);
  const auto none = dtk::core::find_peak_throughput(cfg, c10::Device(c10::kCPU));
  EXPECT_EQ(none.tflops, 0);
  EXPECT_FALSE(none.measured);
  EXPECT_EQ(dtk::core::remeasure_peak(none), 0);
  cfg.mutable_logging()->set_peak_tflops(989);
  const auto given = dtk::core::find_peak_throughput(cfg, c10::Device(c10::kCPU));
  EXPECT_EQ(given.tflops, 989);
  EXPECT_EQ(given.source, "logging.peak_tflops");
  EXPECT_FALSE(given.measured);
}

TEST(Schedules, TheInterleavedScheduleNeedsWholeRoundsOfMicroBatches) {
  EXPECT_EQ(dtk::core::schedule_refusal(1, 4, 3), "");  // 1F1B takes any count
  EXPECT_EQ(dtk::core::schedule_refusal(2, 2, 4), "");
  const std::string why = dtk::core::schedule_refusal(2, 2, 3);
  EXPECT_NE(why.find("needs the micro-batches per step (3"), std::string::npos) << why;
  EXPECT_NE(why.find("a multiple of distributed.pipeline_model_parallel_size 2"), std::string::npos) << why;
}

}  // namespace
