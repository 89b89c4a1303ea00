// train.device=cuda end to end through the `dtk` binary (label `gpu`): the GPU against the CPU,
// a run whose loss falls, an exact resume, ZeRO-Offload against ddp, and two processes on the
// GPUs (over NCCL where there are two; on one GPU over Gloo, since NCCL refuses two ranks on one
// device). Where this dtk cannot train on a GPU (CI: a CPU-only LibTorch, no device) every test
// skips, saying why.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "../common/curves.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/cuda/runtime.hpp"

namespace {

using dtk_test::Curve;
using dtk_test::expect_same_curve;
using dtk_test::run_curve;

// A small GPT on synthetic tokens, no dropout, clipping active: the same run as the CPU tests'.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 2 "
                           "--set model.hidden_dropout=0 --set model.attention_dropout=0 "
                           "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
                           "--set train.micro_batch_size=2 --set train.global_batch_size=8 "
                           "--set train.train_iters=20 --set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 "
                           "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 "
                           "--set distributed.timeout_seconds=120 ";

// The same for llama-tiny (RMSNorm, SwiGLU, rotary positions, grouped-query attention).
const std::string kLlama = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/llama-tiny.pbtxt --dataset synthetic --threads 2 "
                           "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
                           "--set train.micro_batch_size=2 --set train.global_batch_size=8 "
                           "--set train.train_iters=20 --set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 "
                           "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 ";

#define SKIP_WITHOUT_GPU_TRAINING()                                     \
  do {                                                                  \
    std::string why;                                                    \
    if (!dtk::core::cuda_training_available(&why)) GTEST_SKIP() << why; \
  } while (0)

Curve curve(const std::string& args, const std::string& name) { return run_curve(args, DTK_TEST_TMP, name); }

std::string fresh_dir(const std::string& name) { return dtk_test::fresh_dir(DTK_TEST_TMP, name); }

// The first iteration's loss is a function of the untrained model's logits alone: equal within
// 1e-5 means the GPU computes the CPU's logits (fp32; TF32 is off in LibTorch's matmuls by
// default). Later iterations compound rounding differences through Adam: 1e-4. Then the same with
// hidden dropout.
TEST(GpuTraining, TinyGptOnTheGpuEqualsTheCpuInFp32) {
  SKIP_WITHOUT_GPU_TRAINING();
  const Curve cpu = curve(kTrain, "cpu");
  const Curve gpu = curve(kTrain + "--set train.device=cuda", "gpu");
  ASSERT_EQ(gpu.run.code, 0) << gpu.run.out;
  ASSERT_FALSE(cpu.loss.empty());
  EXPECT_NEAR(gpu.loss.at(1), cpu.loss.at(1), 1e-5 * std::abs(cpu.loss.at(1)));
  expect_same_curve(cpu, gpu, 20, "cuda against the cpu", 1e-4);
  // With hidden dropout the GPU applies the branches' masks in its add + LayerNorm kernels (bits
  // hashed there), the CPU in its host loop after products that keep their biases: the same masks,
  // drawn in the same order, so the same losses.
  const std::string dropout = "--set model.hidden_dropout=0.1 ";
  const Curve cpu_dropout = curve(kTrain + dropout, "cpu-dropout");
  const Curve gpu_dropout = curve(kTrain + dropout + "--set train.device=cuda", "gpu-dropout");
  ASSERT_EQ(gpu_dropout.run.code, 0) << gpu_dropout.run.out;
  ASSERT_FALSE(cpu_dropout.loss.empty()) << cpu_dropout.run.out;
  expect_same_curve(cpu_dropout, gpu_dropout, 20, "cuda against the cpu, hidden dropout 0.1", 1e-4);
}

// The same for Llama (RMSNorm, SwiGLU, rotary positions, grouped-query attention): the GPU's
// rotary table, key/value expansion and fused output layer against the CPU's.
TEST(GpuTraining, TinyLlamaOnTheGpuEqualsTheCpuInFp32) {
  SKIP_WITHOUT_GPU_TRAINING();
  const Curve cpu = curve(kLlama, "llama-cpu");
  const Curve gpu = curve(kLlama + "--set train.device=cuda", "llama-gpu");
  ASSERT_EQ(gpu.run.code, 0) << gpu.run.out;
  ASSERT_FALSE(cpu.loss.empty()) << cpu.run.out;
  EXPECT_NEAR(gpu.loss.at(1), cpu.loss.at(1), 1e-5 * std::abs(cpu.loss.at(1)));
  expect_same_curve(cpu, gpu, 20, "llama: cuda against the cpu", 1e-4);
}

// The fast path against the plain one in bf16 (issue 33): the chunked output layer with its cross
// entropy (chunks of 16 tokens: 4 per micro-batch) against whole logits made fp32, 50 iterations
// of a model that learns. bf16 products round differently in chunks, so within bf16's tolerance.
TEST(GpuTraining, ChunkedOutputLayerEqualsWholeLogitsInBf16) {
  SKIP_WITHOUT_GPU_TRAINING();
  const std::string args = kTrain +
                           "--set train.device=cuda --set train.params_dtype=bf16 --set train.train_iters=50 "
                           "--set lr.lr=3e-3 --set dataset.vocab_size=16 ";
  const Curve whole = curve(args + "--set model.fused_lm_head=false", "whole");
  const Curve chunked = curve(args + "--set model.fused_lm_head=true --set model.lm_head_chunk_tokens=16", "chunked");
  ASSERT_EQ(chunked.run.code, 0) << chunked.run.out;
  ASSERT_EQ(whole.loss.size(), 50u) << whole.run.out;
  expect_same_curve(whole, chunked, 50, "chunked output layer against whole logits (bf16)", 3e-2);
}

// The layers' fused kernels against their LibTorch-op references end to end (issue 33:
// model.unfused_kernels=all): gpt (add + LayerNorm twice per layer with the row-parallel biases,
// and with hidden dropout their masks; bias + GELU) and llama
// (add + RMSNorm, RMSNorm, SwiGLU, rotary), each in fp32 over 20 iterations (the kernels compute
// in fp32 as the ops do: rounding differences only, 1e-4 as the GPU against the CPU) and in bf16
// over 50 iterations of a model that learns (within bf16's tolerance); and both with attention
// dropout in DTK's attention kernel (bf16 only: the kernel takes no fp32), and both with a sliding
// window in it.
TEST(GpuTraining, FusedKernelsTrainAsTheirReferences) {
  SKIP_WITHOUT_GPU_TRAINING();
  const std::string unfused = "--set model.unfused_kernels=all ";
  const std::string bf16 =
      "--set train.params_dtype=bf16 --set train.train_iters=50 --set lr.lr=3e-3 "
      "--set dataset.vocab_size=16 ";
  for (const auto& [name, base] : {std::pair<std::string, std::string>{"gpt", kTrain}, {"llama", kLlama}}) {
    const std::string gpu = base + "--set train.device=cuda ";
    const Curve fused = curve(gpu, name + "-fused");
    const Curve ops = curve(gpu + unfused, name + "-unfused");
    ASSERT_EQ(fused.run.code, 0) << fused.run.out;
    ASSERT_EQ(ops.loss.size(), 20u) << ops.run.out;
    expect_same_curve(ops, fused, 20, name + ": fused kernels against their references (fp32)", 1e-4);
    const Curve fused16 = curve(gpu + bf16, name + "-fused-bf16");
    const Curve ops16 = curve(gpu + bf16 + unfused, name + "-unfused-bf16");
    ASSERT_EQ(fused16.run.code, 0) << fused16.run.out;
    ASSERT_EQ(ops16.loss.size(), 50u) << ops16.run.out;
    expect_same_curve(ops16, fused16, 50, name + ": fused kernels against their references (bf16)", 3e-2);
  }
  // gpt with hidden dropout: the row-parallel biases and the branches' masks applied in the add +
  // LayerNorm kernels (Megatron's bias-dropout-add) against the products' biases, dropout's own
  // kernel and the ops; the masks are the same bits either way (fp32).
  const std::string dropout = kTrain + "--set train.device=cuda --set model.hidden_dropout=0.1 ";
  const Curve fused = curve(dropout, "gpt-dropout-fused");
  const Curve ops = curve(dropout + unfused, "gpt-dropout-unfused");
  ASSERT_EQ(fused.run.code, 0) << fused.run.out;
  ASSERT_EQ(ops.loss.size(), 20u) << ops.run.out;
  expect_same_curve(ops, fused, 20, "gpt with hidden dropout: bias-dropout-add in the norms' kernels (fp32)", 1e-4);
  // DTK's attention kernel (bf16, head_dim 64: gpt with 2 heads of 64, llama with 4 heads of 64 in
  // 2 key/value groups) against attention_ops (the probabilities formed in memory), 50 iterations
  // within bf16's tolerance: with attention dropout (the same masks), and with a sliding window
  // and no dropout (Mistral's; 160 positions, 3 tiles, a window of 40: the walks skip tiles). A
  // smoke test: with tokens of no structure attention carries little, so the tolerance cannot
  // tell a wrong kernel (GpuKernels.AttentionKernelEqualsOps does). It shows the kernel trains,
  // and the profile shows it ran (its autograd function's ranges); gpt's selective recomputation
  // leaves the kernel out of its checkpoint: the same bits.
  for (const auto& [what, settings] :
       {std::pair<std::string, std::string>{"attention dropout", "--set model.attention_dropout=0.1 "},
        {"a sliding window", "--set train.seq_length=160 --set model.window_size=40,0 "}}) {
    for (const auto& [name, base] :
         {std::pair<std::string, std::string>{"gpt", kTrain + "--set model.hidden_size=128 "
                                                              "--set model.num_attention_heads=2 "},
          {"llama", kLlama + "--set model.hidden_size=256 "}}) {
      const std::string run = base + "--set train.device=cuda " + settings + bf16;
      const std::string tag = name + (what == "a sliding window" ? "-window" : "-attention");
      const std::string profile = fresh_dir(tag + "-profile");
      const Curve kernel =
          curve(run + "--set logging.profile_steps=3 --set logging.profile_dir=" + profile + " ", tag + "-kernel");
      const Curve plain = curve(run + "--set model.unfused_kernels=attention ", tag + "-ops");
      ASSERT_EQ(kernel.run.code, 0) << kernel.run.out;
      ASSERT_EQ(plain.loss.size(), 50u) << plain.run.out;
      std::ifstream trace(profile + "/rank0.json");
      std::stringstream text;
      text << trace.rdbuf();
      EXPECT_NE(text.str().find("dtk::attention_backward"), std::string::npos)
          << name << ", " << what << ": the kernel did not run";
      expect_same_curve(plain, kernel, 50, name + ", " + what + ": DTK's attention kernel against the ops (bf16)",
                        3e-2);
      if (name == "gpt") {
        const Curve selective = curve(run + "--set model.recompute_activations=selective ", tag + "-selective");
        expect_same_curve(kernel, selective, 50,
                          "gpt, " + what + ": the attention kernel under selective recomputation", 1e-7);
      }
    }
  }
}

// train.cuda_graphs (issue 33): from iteration 3 each micro-batch replays a recorded forward and
// backward; the losses equal the uncaptured run's (the same kernels on the same inputs: only
// launch order and streams differ). fp32 GPT with two micro-batches per step, bf16 Llama.
TEST(GpuTraining, CapturedStepsEqualUncapturedOnes) {
  SKIP_WITHOUT_GPU_TRAINING();
  const std::string gpt = kTrain + "--set train.device=cuda ";
  const Curve plain = curve(gpt, "graphs-off");
  const Curve captured = curve(gpt + "--set train.cuda_graphs=true", "graphs-on");
  ASSERT_EQ(captured.run.code, 0) << captured.run.out;
  EXPECT_NE(captured.run.out.find("micro-batches replay a recorded forward and backward"), std::string::npos)
      << captured.run.out;
  EXPECT_EQ(captured.run.out.find("could not be recorded"), std::string::npos) << captured.run.out;
  expect_same_curve(plain, captured, 20, "captured against uncaptured (gpt fp32)", 1e-6);
  const std::string llama = kLlama + "--set train.device=cuda --set train.params_dtype=bf16 ";
  const Curve llama_plain = curve(llama, "llama-graphs-off");
  const Curve llama_captured = curve(llama + "--set train.cuda_graphs=true", "llama-graphs-on");
  ASSERT_EQ(llama_captured.run.code, 0) << llama_captured.run.out;
  EXPECT_EQ(llama_captured.run.out.find("could not be recorded"), std::string::npos) << llama_captured.run.out;
  expect_same_curve(llama_plain, llama_captured, 20, "captured against uncaptured (llama bf16)", 1e-6);
}

// With dropout a recorded step reads each mask's seed from a table the host draws into before
// every replay (capture::RecordedSeeds), so the replays draw the uncaptured run's masks: gpt bf16
// with both dropouts and heads of 64 (DTK's attention kernel, the dropout and add + LayerNorm
// kernels all read the table), plain and with full recomputation (the recomputed layers repeat
// the forward's slots). The same kernels on the same inputs: equal to rounding.
TEST(GpuTraining, CapturedStepsWithDropoutDrawTheUncapturedMasks) {
  SKIP_WITHOUT_GPU_TRAINING();
  const std::string base = kTrain +
                           "--set train.device=cuda --set train.params_dtype=bf16 --set model.hidden_size=128 "
                           "--set model.num_attention_heads=2 --set model.hidden_dropout=0.1 "
                           "--set model.attention_dropout=0.1 ";
  for (const std::string recompute : {"none", "full"}) {
    const std::string args = base + "--set model.recompute_activations=" + recompute + " ";
    const Curve plain = curve(args, "dropout-graphs-off-" + recompute);
    const Curve captured = curve(args + "--set train.cuda_graphs=true", "dropout-graphs-on-" + recompute);
    ASSERT_EQ(captured.run.code, 0) << captured.run.out;
    EXPECT_NE(captured.run.out.find("micro-batches replay a recorded forward and backward"), std::string::npos)
        << captured.run.out;
    EXPECT_EQ(captured.run.out.find("could not be recorded"), std::string::npos) << captured.run.out;
    expect_same_curve(plain, captured, 20, "captured against uncaptured with dropout, recompute " + recompute, 1e-6);
  }
}

// bf16 parameters with fp32 masters (ddp) on the GPU: the first loss within bf16's rounding of the
// fp32 one, and the run trains.
TEST(GpuTraining, Bf16OnTheGpuStaysNearFp32AndTheLossFalls) {
  SKIP_WITHOUT_GPU_TRAINING();
  // The model's vocabulary is 512, the tokens come from 16 of them: the model learns that (from
  // about ln 512 = 6.2 toward ln 16 = 2.8); uniform tokens over all 512 would leave nothing to learn.
  const std::string args =
      kTrain + "--set train.device=cuda --set train.train_iters=60 --set lr.lr=3e-3 --set dataset.vocab_size=16 ";
  const Curve fp32 = curve(args, "fp32");
  const Curve bf16 = curve(args + "--set train.params_dtype=bf16", "bf16");
  ASSERT_EQ(bf16.run.code, 0) << bf16.run.out;
  ASSERT_EQ(bf16.loss.size(), 60u) << bf16.run.out;
  EXPECT_NEAR(bf16.loss.at(1), fp32.loss.at(1), 2e-2 * std::abs(fp32.loss.at(1)));
  EXPECT_LT(bf16.loss.at(60), bf16.loss.at(1) - 0.2) << bf16.run.out;
  EXPECT_LT(fp32.loss.at(60), fp32.loss.at(1) - 0.2) << fp32.run.out;
}

// Save at 10 on the GPU, resume: iterations 11-20 equal the uninterrupted run's exactly (dropout
// on: the checkpoint carries the host's and the device's generators, and the model's streams).
TEST(GpuTraining, ResumeOnTheGpuIsBitExact) {
  SKIP_WITHOUT_GPU_TRAINING();
  // The decay spans 20 iterations in both halves (a resume must keep the schedule).
  const std::string args =
      kTrain + "--set train.device=cuda --set model.hidden_dropout=0.1 --set lr.lr_decay_iters=20 ";
  const Curve full = curve(args, "full");
  const std::string ck = fresh_dir("ck");
  const Curve first = curve(args + "--set train.train_iters=10 --set checkpoint.save=" + ck, "first");
  ASSERT_EQ(first.run.code, 0) << first.run.out;
  const Curve resumed = curve(args + "--set checkpoint.load=" + ck, "resumed");
  ASSERT_EQ(resumed.run.code, 0) << resumed.run.out;
  ASSERT_EQ(resumed.loss.size(), 10u) << resumed.run.out;
  for (const auto& [it, loss] : resumed.loss) {
    EXPECT_EQ(loss, full.loss.at(it)) << "lm loss at iteration " << it;
    EXPECT_EQ(resumed.norm.at(it), full.norm.at(it)) << "grad norm at iteration " << it;
  }
}

// ZeRO stage 2 with the optimizer on the host (pinned partition, copies on their own stream)
// against ddp with the optimizer on the GPU: the same updates.
TEST(GpuTraining, ZeroOffloadEqualsDdp) {
  SKIP_WITHOUT_GPU_TRAINING();
  const std::string args = kTrain + "--set train.device=cuda ";
  const Curve ddp = curve(args, "ddp");
  const Curve offload = curve(args +
                                  "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu "
                                  "--set strategy.overlap_comm=true",
                              "offload");
  expect_same_curve(ddp, offload, 20, "zero-2 offload against ddp", 1e-5);
}

// train.memory_limit_mb on a GPU caps LibTorch's caching allocator (the capacity benchmark's
// smaller GPU, tools/bench/gpu_capacity.sh): a model past it fails with CUDA's out-of-memory line,
// the same run under a cap it fits trains, and a cap past the device's memory is a config error.
TEST(GpuTraining, MemoryLimitCapsTheGpu) {
  SKIP_WITHOUT_GPU_TRAINING();
  // A 50304-token vocabulary at hidden 256: the embedding alone is 51 MB in fp32.
  const std::string args = kTrain +
                           "--set train.device=cuda --set model.vocab_size=50304 --set dataset.vocab_size=50304 "
                           "--set model.hidden_size=256 --set train.train_iters=3 --set train.skip_memory_check=true ";
  dtk_test::expect_one_line_error(dtk_test::run_dtk(args + "--set train.memory_limit_mb=16"), "out of memory");
  const dtk_test::Result fits = dtk_test::run_dtk(args + "--set train.memory_limit_mb=4096");
  EXPECT_EQ(fits.code, 0) << fits.out;
  dtk_test::expect_one_line_error(dtk_test::run_dtk(args + "--set train.memory_limit_mb=100000000"),
                                  "train.memory_limit_mb (100000000 MiB) is more than cuda:0 has");
}

// Data parallel across processes: over NCCL with one GPU per rank where there are two; on a single
// GPU two ranks share it over Gloo (the CUDA tensors go through host copies) and the test says so.
TEST(GpuTraining, TwoProcessesEqualOne) {
  SKIP_WITHOUT_GPU_TRAINING();
  const int gpus = dtk::cuda::device_count();
  const Curve one = curve(kTrain + "--set train.device=cuda", "dp1");
  std::string two_args = "launch --nproc_per_node 2 " + kTrain;
  if (gpus >= 2) {
    two_args += "--set train.device=cuda --set distributed.backend=nccl";
  } else {
    std::printf("one GPU: two ranks share cuda:0 over Gloo (NCCL refuses two ranks on one device)\n");
    two_args += "--set train.device=cuda:0 --set distributed.backend=gloo";
  }
  const Curve two = curve(two_args, "dp2");
  ASSERT_EQ(two.run.code, 0) << two.run.out;
  expect_same_curve(one, two, 20, gpus >= 2 ? "DP2 over NCCL against DP1" : "DP2 on one GPU over Gloo against DP1");
}

// Tensor parallel across two GPUs over NCCL against one GPU (needs two).
TEST(GpuTraining, TensorParallelOverNcclEqualsOneGpu) {
  SKIP_WITHOUT_GPU_TRAINING();
  if (dtk::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  const Curve one = curve(kTrain + "--set train.device=cuda", "tp1");
  const Curve two = curve("launch --nproc_per_node 2 " + kTrain +
                              "--set train.device=cuda --set distributed.backend=nccl "
                              "--set distributed.tensor_model_parallel_size=2 --set model.domino_chunks=2",
                          "tp2");
  ASSERT_EQ(two.run.code, 0) << two.run.out;
  expect_same_curve(one, two, 20, "TP2 with Domino over NCCL against one GPU", 1e-5);
}

// Pipeline parallel (1F1B) with the stages on the GPU: the stages' messages travel through host
// copies, the tied embedding's gradients are summed over the stages. Two GPUs: NCCL; one GPU: both
// stages on cuda:0 over Gloo.
TEST(GpuTraining, PipelineStagesOnTheGpuEqualOneStage) {
  SKIP_WITHOUT_GPU_TRAINING();
  const bool two = dtk::cuda::device_count() >= 2;
  const Curve one = curve(kTrain + "--set train.device=cuda", "pp1");
  const Curve stages =
      curve("launch --nproc_per_node 2 " + kTrain + "--set distributed.pipeline_model_parallel_size=2 " +
                (two ? "--set train.device=cuda --set distributed.backend=nccl"
                     : "--set train.device=cuda:0 --set distributed.backend=gloo"),
            "pp2");
  ASSERT_EQ(stages.run.code, 0) << stages.run.out;
  expect_same_curve(one, stages, 20, two ? "PP2 over NCCL against one stage" : "PP2 on one GPU against one stage",
                    1e-5);
}

}  // namespace
