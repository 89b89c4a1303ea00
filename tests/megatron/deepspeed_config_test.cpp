// Megatron-DeepSpeed's `--deepspeed --deepspeed_config FILE`: the DeepSpeed JSON config becomes
// DTK's strategy, precision, clipping and batch key by key; Megatron flags it overrules are said to
// do nothing, two values of one setting are refused, every key DTK cannot run is named, and the
// docs' table is the reader's own. A run from a DeepSpeed config trains exactly as the same run
// from DTK's own options.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "../common/run_dtk.hpp"
#include "doc_table.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/config/deepspeed_config.hpp"
#include "dtk/core/config/megatron_args.hpp"
#include "dtk/host/error.hpp"

namespace {

using dtk::core::config_value;
using dtk::core::MegatronMapping;

const std::string kFixtures = DTK_FIXTURES;

// A DeepSpeed config file holding `text`, one per test.
std::string ds_file(const std::string& name, const std::string& text) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "ds-" + name);
  std::ofstream(dir + "/ds.json") << text;
  return dir + "/ds.json";
}

// Megatron-DeepSpeed's flags for a DeepSpeed config, with --no-pipeline-parallel as its ZeRO-2/3
// scripts give it.
MegatronMapping map(std::vector<std::string> flags, const std::string& ds_path) {
  flags.insert(flags.end(), {"--deepspeed", "--deepspeed_config", ds_path, "--no-pipeline-parallel"});
  return dtk::core::map_megatron_args(flags);
}

dtk::config::RunConfig config_of(MegatronMapping m) {
  m.refused.clear();
  dtk::config::RunConfig cfg = dtk::core::default_config();
  for (const auto& d : dtk::core::megatron_defaults()) dtk::core::apply_override(cfg, d);
  dtk::core::apply_megatron_mapping(cfg, m);
  return cfg;
}

bool has(const std::vector<std::string>& lines, const std::string& needle) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(needle) != std::string::npos; });
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += s + "\n";
  return out;
}

}  // namespace

// Megatron-DeepSpeed's published Llama 2 script (TP 2, PP 2, ZeRO stage 0, bf16) with the JSON it
// writes: the llama model with 4 key-value groups, ddp, bf16, its batch, DeepSpeed's clipping at
// 1.0 (its default: the config has no gradient_clipping), which the script's --clip-grad 1 agrees with.
TEST(MegatronDeepSpeed, Llama2ScriptMapsFieldByField) {
  std::vector<std::string> flags = dtk::core::split_megatron_args("@" + kFixtures + "/mds_llama2.args");
  flags.insert(flags.end(), {"--deepspeed_config=" + kFixtures + "/mds_llama2_ds.json"});
  const MegatronMapping m = dtk::core::map_megatron_args(flags);
  EXPECT_TRUE(m.refused.empty()) << joined(m.refused);
  EXPECT_EQ(m.model, "llama");
  EXPECT_EQ(m.strategy, "ddp");
  EXPECT_TRUE(m.notes.empty()) << joined(m.notes);
  EXPECT_TRUE(has(m.ignored, "mds_llama2_ds.json: steps_per_print (")) << joined(m.ignored);
  const auto cfg = config_of(m);
  for (const auto& [path, value] :
       std::vector<std::pair<std::string, std::string>>{{"model.num_query_groups", "4"},
                                                        {"model.num_attention_heads", "16"},
                                                        {"model.add_bias_linear", "false"},
                                                        {"train.params_dtype", "bf16"},
                                                        {"train.micro_batch_size", "4"},
                                                        {"train.global_batch_size", "32"},
                                                        {"train.clip_grad", "1"},
                                                        {"optimizer.beta2", "0.95"},
                                                        {"distributed.pipeline_model_parallel_size", "2"}})
    EXPECT_EQ(config_value(cfg, path), value) << path;
}

// ZeRO keys: stage 3 with both offloads to the host is the zero strategy with DeepSpeed's values
// (overlap_comm on by default at stage 3), the offloaded step cpu_adam (--cpu-optimizer, or
// zero_force_ds_cpu_optimizer false); without either, refused as DeepSpeed refuses it.
TEST(MegatronDeepSpeed, ZeroKeysBecomeTheStrategysOptions) {
  const std::string path = ds_file("zero3", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 1e6,
      "stage3_param_persistence_threshold": 1000, "sub_group_size": 1e9, "contiguous_gradients": true,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": true}})");
  const MegatronMapping m = map({"--cpu-optimizer"}, path);
  EXPECT_TRUE(m.refused.empty()) << joined(m.refused);
  EXPECT_EQ(m.strategy, "zero");
  EXPECT_EQ(m.optimizer, "cpu_adam");
  EXPECT_TRUE(has(m.ignored, "ds.json: zero_optimization.sub_group_size (")) << joined(m.ignored);
  const auto cfg = config_of(m);
  for (const auto& [path, value] :
       std::vector<std::pair<std::string, std::string>>{{"strategy.stage", "3"},
                                                        {"strategy.reduce_bucket_size", "50000000"},
                                                        {"strategy.stage3_prefetch_bucket_size", "1000000"},
                                                        {"strategy.stage3_param_persistence_threshold", "1000"},
                                                        {"strategy.offload_optimizer", "cpu"},
                                                        {"strategy.offload_param", "cpu"},
                                                        {"strategy.overlap_comm", "true"},
                                                        {"train.micro_batch_size", "2"},
                                                        {"train.gradient_accumulation_steps", "4"},
                                                        {"train.clip_grad", "0.5"}})
    EXPECT_EQ(config_value(cfg, path), value) << path;

  const MegatronMapping gpu_adam = map({}, path);
  ASSERT_EQ(gpu_adam.refused.size(), 1u) << joined(gpu_adam.refused);
  EXPECT_NE(gpu_adam.refused[0].find("zero_optimization.offload_optimizer.device cpu without --cpu-optimizer: "
                                     "DeepSpeed refuses ZeRO-Offload with an optimizer other than its CPU Adam"),
            std::string::npos)
      << gpu_adam.refused[0];
  const MegatronMapping sgd = map({"--optimizer", "sgd", "--cpu-optimizer"}, path);
  EXPECT_TRUE(has(sgd.refused, "--cpu-optimizer with --optimizer sgd: CPU offloading is for Adam"))
      << joined(sgd.refused);
  const std::string unforced = ds_file("unforced", R"({"train_batch_size": 8, "zero_force_ds_cpu_optimizer": false,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})");
  const MegatronMapping allowed = map({}, unforced);
  EXPECT_TRUE(allowed.refused.empty()) << joined(allowed.refused);
  EXPECT_EQ(allowed.optimizer, "cpu_adam");
}

// DeepSpeed's legacy curriculum_learning (Megatron-DeepSpeed's examples_deepspeed/curriculum_learning
// configs): the section maps to train.curriculum_*; with "enabled" false or absent it says
// nothing; what DeepSpeed asserts or DTK cannot run is refused, one line each.
TEST(MegatronDeepSpeed, CurriculumLearningMapsToTheSequenceCurriculum) {
  const std::string linear = ds_file("curriculum", R"({"train_batch_size": 8, "curriculum_learning": {
    "enabled": true, "curriculum_type": "seqlen", "min_difficulty": 64, "max_difficulty": 1024,
    "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 3000, "difficulty_step": 8,
    "root_degree": 2}}})");
  const MegatronMapping m = map({}, linear);
  EXPECT_TRUE(m.refused.empty()) << joined(m.refused);
  EXPECT_TRUE(has(m.ignored,
                  "ds.json: curriculum_learning.schedule_config.root_degree (schedule_type fixed_linear "
                  "does not read it)"))
      << joined(m.ignored);
  const auto cfg = config_of(m);
  for (const auto& [path, value] :
       std::vector<std::pair<std::string, std::string>>{{"train.curriculum_schedule", "fixed_linear"},
                                                        {"train.curriculum_min_difficulty", "64"},
                                                        {"train.curriculum_max_difficulty", "1024"},
                                                        {"train.curriculum_total_step", "3000"},
                                                        {"train.curriculum_difficulty_step", "8"},
                                                        {"train.curriculum_root_degree", "0"}})
    EXPECT_EQ(config_value(cfg, path), value) << path;
  const MegatronMapping discrete = map({}, ds_file("discrete", R"({"train_batch_size": 8, "curriculum_learning": {
    "enabled": true, "curriculum_type": "seqlen", "min_difficulty": 16, "max_difficulty": 64,
    "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [16, 32, 64], "max_step": [100, 200.0]}}})"));
  EXPECT_TRUE(discrete.refused.empty()) << joined(discrete.refused);
  EXPECT_EQ(config_value(config_of(discrete), "train.curriculum_discrete_difficulty"), "16,32,64");
  EXPECT_EQ(config_value(config_of(discrete), "train.curriculum_discrete_max_step"), "100,200");
  for (const std::string off :
       {R"({"enabled": false, "curriculum_type": "vocabularyrarity"})", R"({"min_difficulty": 8})"}) {
    const MegatronMapping o =
        map({}, ds_file("curriculum-off", R"({"train_batch_size": 8, "curriculum_learning": )" + off + "}"));
    EXPECT_TRUE(o.refused.empty()) << off << "\n" << joined(o.refused);
    EXPECT_EQ(config_value(config_of(o), "train.curriculum_schedule"), "") << off;
  }
  const std::string head = R"({"train_batch_size": 8, "curriculum_learning": {"enabled": true, )";
  const std::string seqlen = R"("curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64, )";
  for (const auto& [section, refusal] : std::vector<std::pair<std::string, std::string>>{
           {R"("curriculum_type": "vocabularyrarity", "min_difficulty": 8, "max_difficulty": 64, )"
            R"("schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 64], "max_step": [4]}})",
            "curriculum_learning.curriculum_type \"vocabularyrarity\": DTK's curriculum is by sequence length"},
           {R"("curriculum_type": "seqlen", "max_difficulty": 64, "schedule_type": "fixed_linear", )"
            R"("schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}})",
            "curriculum_learning.min_difficulty: required with \"enabled\": true"},
           {seqlen + R"("schedule_type": "custom"})", "DeepSpeed's custom schedule is a Python function"},
           {seqlen + R"("schedule_type": "fixed_cubic"})", "not one of fixed_linear, fixed_root, fixed_discrete"},
           {seqlen + R"("schedule_type": "fixed_root", "schedule_config": {"total_curriculum_step": 4, )"
                     R"("difficulty_step": 8}})",
            "curriculum_learning.schedule_config.root_degree: required by schedule_type fixed_root"},
           {seqlen + R"("schedule_type": "fixed_discrete", "schedule_config": {"difficulty": 8, "max_step": [4]}})",
            "curriculum_learning.schedule_config.difficulty 8: not a list of lengths or steps"},
           {seqlen + R"("schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4.5, )"
                     R"("difficulty_step": 8}})",
            "curriculum_learning.schedule_config.total_curriculum_step 4.5: not a whole number of at least 1"}})
    EXPECT_TRUE(has(map({}, ds_file("curriculum-bad", head + section + "}")).refused, refusal))
        << section << "\n"
        << joined(map({}, ds_file("curriculum-bad", head + section + "}")).refused);
}

// DeepSpeed reads the stage-3 keys at stage 3 only, and no zero_optimization key at stage 0: they
// are said to do nothing (DTK's strategy would refuse them), and overlap_comm is off below stage 3.
TEST(MegatronDeepSpeed, KeysOfAnotherStageDoNothing) {
  const std::string path = ds_file("stage2", R"({"train_batch_size": 8, "zero_optimization": {"stage": 2,
    "stage3_max_live_parameters": 1e8, "offload_param": {"device": "cpu"}, "reduce_bucket_size": 1e6}})");
  const MegatronMapping m = map({}, path);
  EXPECT_TRUE(m.refused.empty()) << joined(m.refused);
  EXPECT_TRUE(has(m.ignored,
                  "zero_optimization.stage3_max_live_parameters (stage 2: DeepSpeed does not read it at this stage)"))
      << joined(m.ignored);
  EXPECT_TRUE(has(m.ignored, "zero_optimization.offload_param.device (stage 2")) << joined(m.ignored);
  const auto cfg = config_of(m);
  EXPECT_EQ(config_value(cfg, "strategy.stage"), "2");
  for (const auto& set : m.sets) EXPECT_NE(set.rfind("strategy.overlap_comm", 0), 0u) << set;
  EXPECT_EQ(config_value(cfg, "strategy.reduce_bucket_size"), "1000000");

  const std::string zero0 =
      ds_file("stage0", R"({"train_batch_size": 8, "zero_optimization": {"stage": 0, "reduce_bucket_size": 1e6}})");
  const MegatronMapping ddp = map({"--use-distributed-optimizer", "--overlap-grad-reduce"}, zero0);
  EXPECT_TRUE(ddp.refused.empty()) << joined(ddp.refused);
  EXPECT_EQ(ddp.strategy, "ddp");
  EXPECT_TRUE(has(ddp.ignored, "zero_optimization.reduce_bucket_size (stage 0: DeepSpeed's ZeRO is off)"));
  EXPECT_TRUE(has(ddp.ignored, "--use-distributed-optimizer (under --deepspeed the config's zero_optimization decides"))
      << joined(ddp.ignored);
  EXPECT_TRUE(has(ddp.ignored, "--overlap-grad-reduce (under --deepspeed"));
  for (const auto& set : ddp.sets) EXPECT_NE(set.rfind("strategy.", 0), 0u) << set;
}

// fp16: DeepSpeed's dynamic scaler from 2^initial_scale_power (2^16 by default) with its window,
// hysteresis and floor; Megatron's loss-scale flags do nothing under --deepspeed; a static scale.
TEST(MegatronDeepSpeed, Fp16SectionScalesTheLoss) {
  const std::string dynamic = ds_file("fp16", R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 0,
    "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 0.5}})");
  const MegatronMapping m = map({"--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "10"}, dynamic);
  EXPECT_TRUE(m.refused.empty()) << joined(m.refused);
  EXPECT_TRUE(
      has(m.ignored, "--initial-loss-scale 1024 (under --deepspeed the config's fp16 section scales the loss)"));
  const auto cfg = config_of(m);
  EXPECT_EQ(config_value(cfg, "train.params_dtype"), "fp16");
  EXPECT_EQ(config_value(cfg, "train.initial_loss_scale"), "4096");
  EXPECT_EQ(config_value(cfg, "train.loss_scale_window"), "500");
  EXPECT_EQ(config_value(cfg, "train.hysteresis"), "3");
  EXPECT_EQ(config_value(cfg, "train.min_loss_scale"), "0.5");
  EXPECT_EQ(config_value(cfg, "train.loss_scale"), "0");
  const auto defaults =
      config_of(map({}, ds_file("fp16-defaults", R"({"train_batch_size": 8, "fp16": {"enabled": true}})")));
  EXPECT_EQ(config_value(defaults, "train.initial_loss_scale"), "65536");
  const auto fixed = config_of(
      map({}, ds_file("fp16-static", R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 128}})")));
  EXPECT_EQ(config_value(fixed, "train.loss_scale"), "128");
}

// What DTK cannot run, or what disagrees, is refused with the key or flag and the reason; the
// optimizer and scheduler sections are said to do nothing (Megatron-DeepSpeed passes its own).
TEST(MegatronDeepSpeed, RefusesWhatItCannotRunAndSaysWhatDoesNothing) {
  struct Case {
    std::vector<std::string> flags;
    std::string json, refusal;
  };
  const std::vector<Case> cases = {
      {{},
       R"({"zero_optimisation": {"stage": 1}})",
       "ds.json: zero_optimisation {...}: not a DeepSpeed config key DTK knows"},
      {{},
       R"({"zero_optimization": {"stage": 1, "overlap_comms": true}})",
       "ds.json: zero_optimization.overlap_comms true: not a DeepSpeed config key DTK knows"},
      {{},
       R"({"train_batch_size": "auto"})",
       "ds.json: train_batch_size \"auto\": \"auto\" is Hugging Face Trainer's placeholder"},
      {{}, R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "fp16.enabled and bf16.enabled are both true"},
      {{},
       R"({"fp16": {"enabled": true, "consecutive_hysteresis": true}})",
       "ds.json: fp16.consecutive_hysteresis true: DTK runs only false"},
      {{},
       R"({"curriculum_learning": {"enabled": true}})",
       "ds.json: curriculum_learning.min_difficulty: required with \"enabled\": true"},
      {{}, R"({"compression_training": {"weight_quantization": {}}})", "compression training is not built"},
      {{},
       R"({"train_batch_size": 8, "zero_optimization.stage": 3})",
       "ds.json: zero_optimization.stage 3: a key with a '.'"},
      {{}, R"({"train_batch_size": 8, "gradient_clipping": null})", "gradient_clipping null: give a value or leave"},
      {{},
       R"({"zero_optimization": {"stage": 1}})",
       "ds.json: neither train_batch_size nor train_micro_batch_size_per_gpu"},
      {{},
       R"({"train_batch_size": 8, "gradient_accumulation_steps": 0})",
       "ds.json: gradient_accumulation_steps 0: not a whole number of at least 1"},
      {{},
       R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale_window": 0}})",
       "fp16.loss_scale_window 0: not a whole number of at least 1"},
      {{},
       R"({"train_batch_size": 8, "zero_optimization": 3})",
       "ds.json: zero_optimization 3: a JSON number, not a section (a JSON object) nor DeepSpeed's older"},
      {{}, R"({"train_batch_size": 8, "gradient_clipping": 1e400})", "ds.json: not valid JSON"},
      {{},
       R"({"train_batch_size": 8, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})",
       "zero_optimization.offload_optimizer.device cpu at stage 0: DeepSpeed offloads the optimizer with ZeRO only"},
      {{},
       R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "cpu_offload": true,
         "offload_optimizer": {"device": "cpu"}}})",
       "which names the same offload: give one"},
      {{"--optimizer", "sgd"},
       R"({"train_batch_size": 8, "zero_optimization": {"stage": 1}})",
       "'s zero_optimization.stage 1: DeepSpeed refuses an optimizer its ZeRO was not tested with"},
      {{"--num-key-value-heads", "0"}, R"({"train_batch_size": 8})", "--num-key-value-heads 0: not a positive number"},
      {{}, R"({"zero_optimization": {"stage": 4}})", "ds.json: zero_optimization.stage 4: not one of 0, 1, 2, 3"},
      {{},
       R"({"communication_data_type": "bf16"})",
       "ds.json: communication_data_type \"bf16\": DTK reduces gradients in fp32"},
      {{"--zero-stage", "3"}, R"({"zero_optimization": {"stage": 1}})", "--zero-stage 3: "},
      {{"--fp16"}, R"({"bf16": {"enabled": true}})", "--fp16: "},
      {{"--micro-batch-size", "8"}, R"({"train_micro_batch_size_per_gpu": 4})", "--micro-batch-size 8: "},
      {{"--global-batch-size", "64"}, R"({"train_batch_size": 32})", "--global-batch-size 64: "},
      {{},
       R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
         "offload_param": {"device": "nvme", "nvme_path": "/b"}}, "zero_force_ds_cpu_optimizer": false})",
       "zero_optimization.offload_param.nvme_path /b: DTK keeps both tiers' swap files in one folder"},
      {{}, R"({"stage": 1, "stage": 2})", "the key \"stage\" is given twice"},
      {{}, R"([1, 2])", "not a JSON object"},
      {{}, R"({"stage": )", "not valid JSON"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const MegatronMapping m = map(cases[i].flags, ds_file("refuse" + std::to_string(i), cases[i].json));
    EXPECT_TRUE(has(m.refused, cases[i].refusal)) << "case " << i << ": " << cases[i].json << "\n" << joined(m.refused);
  }
  // A section DeepSpeed would not run is accepted while it is off.
  EXPECT_TRUE(map({}, ds_file("off", R"({"train_batch_size": 8, "curriculum_learning": {"enabled": false},
    "tensorboard": {"enabled": false}, "amp": {"enabled": false, "opt_level": "O1"}})"))
                  .refused.empty());
  // Nesting deeper than a config is refused before it can exhaust the stack.
  std::string deep = "{\"train_batch_size\": 8, \"aio\": ";
  for (int i = 0; i < 100000; ++i) deep += "{\"a\": ";
  deep += "1" + std::string(100000, '}') + "}";
  EXPECT_TRUE(has(map({}, ds_file("deep", deep)).refused, "nested deeper than 32 levels"));
  // ZeRO-2 and 3 need --no-pipeline-parallel (DeepSpeed's pipeline engine refuses them).
  const std::string stage2 = ds_file("pipe", R"({"train_batch_size": 8, "zero_optimization": {"stage": 2}})");
  EXPECT_TRUE(has(dtk::core::map_megatron_args({"--deepspeed", "--deepspeed_config", stage2}).refused,
                  "zero_optimization.stage 2 without --no-pipeline-parallel"));
  const MegatronMapping sections = map({}, ds_file("client", R"({"train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1}},
    "scheduler": {"type": "WarmupLR"}})"));
  EXPECT_TRUE(sections.refused.empty()) << joined(sections.refused);
  EXPECT_TRUE(
      has(sections.notes, "\"optimizer\" has no effect: Megatron-DeepSpeed passes DeepSpeed its own optimizer"));
  EXPECT_TRUE(has(sections.notes, "\"scheduler\" has no effect"));
  // --deepspeed needs its config; the config without --deepspeed is not read; a missing file.
  EXPECT_TRUE(has(dtk::core::map_megatron_args({"--deepspeed"}).refused, "--deepspeed: needs --deepspeed_config FILE"));
  EXPECT_TRUE(has(dtk::core::map_megatron_args({"--deepspeed_config", "x.json"}).ignored,
                  "--deepspeed_config x.json (without --deepspeed Megatron-DeepSpeed does not read it)"));
  EXPECT_TRUE(has(dtk::core::map_megatron_args({"--deepspeed", "--deepspeed_config", "/nonexistent/ds.json"}).refused,
                  "--deepspeed_config /nonexistent/ds.json: /nonexistent/ds.json: cannot read the DeepSpeed config"));
}

// Megatron-DeepSpeed's MoE (examples_deepspeed/MoE): with --deepspeed, --num-experts is DeepSpeed's
// MoE layer with its defaults (every second layer, top-1, capacity factors 1.0, least capacity 4,
// loss coefficient 0.1), each of its flags mapped (the residual MoE too); Megatron-LM's reading
// stays without them; a list of counts is DeepSpeed's pyramid MoE; a mix of the two families is refused.
TEST(MegatronDeepSpeed, MoeFlagsAreDeepSpeedsGate) {
  const std::string ds = ds_file("moe", R"({"train_batch_size": 8})");
  const auto options_of = [](const MegatronMapping& m) { return config_of(m).model().options(); };
  const auto expect_options = [&](const MegatronMapping& m, const std::map<std::string, std::string>& want,
                                  const std::string& what) {
    ASSERT_TRUE(m.refused.empty()) << what << ": " << joined(m.refused);
    const auto options = options_of(m);
    for (const auto& [key, value] : want) {
      ASSERT_EQ(options.count(key), 1u) << what << ": " << key;
      EXPECT_EQ(options.at(key), value) << what << ": " << key;
    }
  };
  // The defaults: --num-experts alone under --deepspeed.
  expect_options(map({"--num-layers", "6", "--num-experts", "8"}, ds),
                 {{"num_experts", "8"},
                  {"moe_gate", "deepspeed"},
                  {"moe_layer_freq", "[0,1,0,1,0,1]"},
                  {"moe_router_topk", "1"},
                  {"moe_aux_loss_coeff", "0.1"},
                  {"moe_expert_capacity_factor", "1.0"},
                  {"moe_eval_capacity_factor", "1.0"},
                  {"moe_min_capacity", "4"}},
                 "defaults");
  // ds_pretrain_gpt_*_MoE*.sh's flags; they alone (no --deepspeed) choose DeepSpeed's reading too.
  const std::vector<std::string> example = {"--num-layers",
                                            "12",
                                            "--num-experts",
                                            "16",
                                            "--topk",
                                            "2",
                                            "--moe-expert-parallel-size",
                                            "4",
                                            "--moe-loss-coeff",
                                            "0.01",
                                            "--moe-train-capacity-factor",
                                            "1.25",
                                            "--moe-eval-capacity-factor",
                                            "2.0",
                                            "--moe-min-capacity",
                                            "8",
                                            "--expert-interval",
                                            "3",
                                            "--create-moe-param-group",
                                            "--disable-moe-top2-2nd-expert-sampling",
                                            "--mlp-type",
                                            "standard"};
  for (const bool with_deepspeed : {true, false}) {
    const MegatronMapping m = with_deepspeed ? map(example, ds) : dtk::core::map_megatron_args(example);
    expect_options(m,
                   {{"num_experts", "16"},
                    {"moe_gate", "deepspeed"},
                    {"moe_layer_freq", "[0,0,1,0,0,1,0,0,1,0,0,1]"},
                    {"moe_router_topk", "2"},
                    {"moe_aux_loss_coeff", "0.01"},
                    {"moe_expert_capacity_factor", "1.25"},
                    {"moe_eval_capacity_factor", "2.0"},
                    {"moe_min_capacity", "8"},
                    {"moe_top2_2nd_expert_sampling", "false"}},
                   with_deepspeed ? "example" : "example without --deepspeed");
    EXPECT_EQ(config_of(m).distributed().expert_model_parallel_size(), 4);
    EXPECT_TRUE(has(m.ignored, "--create-moe-param-group")) << joined(m.ignored);
  }
  // DeepSpeed's residual MoE (PR-MoE's residual half).
  expect_options(map({"--num-layers", "4", "--num-experts", "4", "--mlp-type", "residual"}, ds),
                 {{"moe_residual", "true"}}, "residual");
  expect_options(map({"--num-layers", "4", "--num-experts", "4"}, ds), {{"moe_residual", "false"}}, "standard");
  // DeepSpeed's topkgating: --topk above 2.
  const MegatronMapping top4 =
      map({"--num-layers", "4", "--num-experts", "8", "--topk", "4", "--disable-moe-top2-2nd-expert-sampling"}, ds);
  expect_options(top4, {{"moe_router_topk", "4"}, {"moe_gate", "deepspeed"}}, "top-4");
  EXPECT_EQ(options_of(top4).count("moe_top2_2nd_expert_sampling"), 0u);
  EXPECT_TRUE(has(top4.ignored, "--disable-moe-top2-2nd-expert-sampling (top-4 samples no second expert)"))
      << joined(top4.ignored);
  const MegatronMapping top4_dropless =
      map({"--num-layers", "4", "--num-experts", "8", "--topk", "4", "--disable-moe-token-dropping"}, ds);
  expect_options(top4_dropless, {{"moe_router_topk", "4"}, {"moe_expert_capacity_factor", "0"}}, "top-4 dropless");
  EXPECT_TRUE(has(top4_dropless.notes,
                  "--disable-moe-token-dropping with --topk 4: DeepSpeed's topkgating fails "
                  "without dropping; DTK keeps every choice of each token"))
      << joined(top4_dropless.notes);
  // One count per MoE layer, all the same: the same model.
  const MegatronMapping same = map({"--num-layers", "4", "--num-experts", "8", "8"}, ds);
  expect_options(same, {{"num_experts", "8"}, {"moe_layer_freq", "[0,1,0,1]"}}, "a list");
  EXPECT_EQ(options_of(same).count("moe_layer_num_experts"), 0u);
  // PR-MoE (ds_pretrain_gpt_*_PR-MoE*.sh): a pyramid of counts, one per MoE layer, with the residual
  // MoE; num_experts is the largest, the start note says the counts.
  const MegatronMapping pyramid = map({"--num-layers", "8", "--num-experts", "4", "4", "8", "8", "--mlp-type",
                                       "residual", "--moe-expert-parallel-size", "2"},
                                      ds);
  expect_options(pyramid,
                 {{"num_experts", "8"},
                  {"moe_layer_num_experts", "4,4,8,8"},
                  {"moe_layer_freq", "[0,1,0,1,0,1,0,1]"},
                  {"moe_residual", "true"},
                  {"moe_gate", "deepspeed"}},
                 "pyramid");
  EXPECT_EQ(config_of(pyramid).distributed().expert_model_parallel_size(), 2);
  EXPECT_TRUE(has(pyramid.notes, "on layers 2, 4, ... (1-based) with 4,4,8,8 experts (a pyramid), top-1"))
      << joined(pyramid.notes);
  // A count of one is a dense layer there (Megatron-DeepSpeed's ParallelMLP).
  const MegatronMapping partly = map({"--num-layers", "6", "--num-experts", "1", "4", "1"}, ds);
  expect_options(partly, {{"num_experts", "4"}, {"moe_layer_freq", "[0,0,0,1,0,0]"}}, "partly dense");
  EXPECT_EQ(options_of(partly).count("moe_layer_num_experts"), 0u);
  EXPECT_TRUE(has(partly.notes, "on layers 4 (1-based), top-1")) << joined(partly.notes);
  const MegatronMapping with_dense = map({"--num-layers", "6", "--num-experts", "2", "1", "4"}, ds);
  expect_options(with_dense,
                 {{"num_experts", "4"}, {"moe_layer_num_experts", "2,4"}, {"moe_layer_freq", "[0,1,0,0,0,1]"}},
                 "a pyramid with a dense layer");
  // Dropless: no capacity (the capacity flags said to do nothing); interval 1: every layer.
  const MegatronMapping dropless = map({"--num-layers", "4", "--num-experts", "4", "--disable-moe-token-dropping",
                                        "--moe-min-capacity", "2", "--expert-interval", "1"},
                                       ds);
  expect_options(dropless, {{"moe_layer_freq", "1"}, {"moe_expert_capacity_factor", "0"}}, "dropless");
  EXPECT_EQ(options_of(dropless).count("moe_min_capacity"), 0u);
  EXPECT_TRUE(has(dropless.ignored, "--moe-min-capacity 2 (--disable-moe-token-dropping: no capacity)"));
  // One expert (Megatron-DeepSpeed's default): dense, its MoE flags do nothing.
  const MegatronMapping dense = map({"--num-layers", "4", "--num-experts", "1", "--topk", "2"}, ds);
  EXPECT_TRUE(dense.refused.empty()) << joined(dense.refused);
  EXPECT_EQ(options_of(dense).count("num_experts"), 0u);
  EXPECT_TRUE(has(dense.ignored, "--topk 2 (at most one expert"));
  // Megatron-LM's reading without them: every layer, its own flags.
  const MegatronMapping megatron = dtk::core::map_megatron_args({"--num-experts", "8", "--moe-router-topk", "2"});
  EXPECT_TRUE(megatron.refused.empty()) << joined(megatron.refused);
  EXPECT_EQ(options_of(megatron).count("moe_gate"), 0u);
  EXPECT_EQ(options_of(megatron).at("num_experts"), "8");
  // Refusals, one line each.
  const std::pair<std::vector<std::string>, std::string> refused[] = {
      {{"--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "2"},
       "--moe-router-topk 2: Megatron-LM's MoE flag; with --deepspeed --num-experts is DeepSpeed's MoE"},
      {{"--num-layers", "4", "--num-experts", "4", "eight"},
       "--num-experts 4 eight: 'eight' is not a number of experts"},
      {{"--num-layers", "4", "--num-experts", "4", "0"}, "--num-experts 4 0: '0' is not a number of experts"},
      {{"--num-layers", "4", "--num-experts", "4", "4", "4"},
       "--num-experts 4 4 4: 3 counts for 2 MoE layers (Megatron-DeepSpeed asserts one count, or one per MoE layer)"},
      {{"--num-layers", "4", "--num-experts", "4", "--mlp-type", "pyramid"},
       "--mlp-type pyramid: not one of standard, residual"},
      {{"--num-layers", "4", "--num-experts", "4", "--moe-train-capacity-factor", "0"},
       "--moe-train-capacity-factor 0: not a factor > 0 (at 0 DeepSpeed's capacity is --moe-min-capacity alone"},
      {{"--num-experts", "4"},
       "--num-experts 4: DeepSpeed's MoE layers are every --expert-interval-th layer: give "
       "--num-layers"},
      {{"--num-layers", "4", "--num-experts", "4", "--expert-interval", "0"},
       "--expert-interval 0: not a positive number of layers"}};
  for (const auto& [flags, line] : refused) {
    const MegatronMapping m = map(flags, ds);
    EXPECT_TRUE(has(m.refused, line)) << line << "\n got: " << joined(m.refused);
  }
  const MegatronMapping mixed =
      dtk::core::map_megatron_args({"--num-experts", "8", "--topk", "2", "--expert-model-parallel-size", "2"});
  EXPECT_TRUE(has(mixed.refused,
                  "--expert-model-parallel-size 2 with --topk 2: Megatron-LM's and "
                  "Megatron-DeepSpeed's MoE flags; give one family"))
      << joined(mixed.refused);
  for (const std::vector<std::string>& list :
       {std::vector<std::string>{"--num-experts", "4", "8"}, std::vector<std::string>{"--num-experts", "4", "4"}})
    EXPECT_TRUE(has(dtk::core::map_megatron_args(list).refused,
                    "--num-experts 4 " + list[2] + ": Megatron-LM's --num-experts is one count"));
  // Fewer layers than the interval: no MoE layer, dense as in Megatron-DeepSpeed.
  const MegatronMapping shallow = map({"--num-layers", "1", "--num-experts", "4", "--topk", "2"}, ds);
  EXPECT_TRUE(shallow.refused.empty()) << joined(shallow.refused);
  EXPECT_EQ(options_of(shallow).count("num_experts"), 0u);
  EXPECT_TRUE(has(shallow.ignored, "--num-experts 4 (no layer of 1 is a multiple of --expert-interval 2"))
      << joined(shallow.ignored);
  // The reading is said at start.
  EXPECT_TRUE(has(map({"--num-layers", "6", "--num-experts", "8"}, ds).notes,
                  "--num-experts 8 is Megatron-DeepSpeed's (--deepspeed): DeepSpeed's gate (model.moe_gate=deepspeed) "
                  "on layers 2, 4, ... (1-based), top-1, capacity factor 1.0 (evaluation 1.0), least capacity 4, "
                  "loss coefficient 0.1"));
}

// Megatron-DeepSpeed's other names: lowercase norms, --num-key-value-heads, the rope theta, and the
// older --checkpoint-activations (full, uniform groups of --checkpoint-num-layers).
TEST(MegatronDeepSpeed, MegatronDeepSpeedFlagNames) {
  const std::vector<std::string> llama = {"--num-layers",
                                          "4",
                                          "--hidden-size",
                                          "64",
                                          "--num-attention-heads",
                                          "8",
                                          "--use-rotary-position-embeddings",
                                          "--normalization",
                                          "rmsnorm",
                                          "--swiglu",
                                          "--rotary-position-embeddings-theta",
                                          "500000",
                                          "--num-key-value-heads",
                                          "2",
                                          "--checkpoint-activations",
                                          "--checkpoint-num-layers",
                                          "2"};
  const MegatronMapping m = dtk::core::map_megatron_args(llama);
  EXPECT_TRUE(m.refused.empty()) << joined(m.refused);
  EXPECT_EQ(m.model, "llama");
  const auto cfg = config_of(m);
  EXPECT_EQ(config_value(cfg, "model.num_query_groups"), "2");
  EXPECT_EQ(config_value(cfg, "model.rotary_base"), "500000");
  EXPECT_EQ(config_value(cfg, "model.recompute_activations"), "full");
  EXPECT_EQ(config_value(cfg, "model.recompute_method"), "uniform");
  EXPECT_EQ(config_value(cfg, "model.recompute_num_layers"), "2");
  // As many key-value heads as heads is multi-head attention: the gpt model still takes it.
  const MegatronMapping gpt = dtk::core::map_megatron_args(
      {"--num-attention-heads", "8", "--num-key-value-heads", "8", "--normalization", "layernorm"});
  EXPECT_TRUE(gpt.refused.empty()) << joined(gpt.refused);
  EXPECT_EQ(gpt.model, "");
  EXPECT_TRUE(has(dtk::core::map_megatron_args({"--checkpoint-activations", "--recompute-granularity", "full"}).refused,
                  "--checkpoint-activations with --recompute-granularity"));
}

// docs/user-guide.md holds the table the reader prints (`dtk config --deepspeed_table`).
TEST(MegatronDeepSpeed, DocsTableIsTheReadersTable) {
  const auto table = dtk_test::doc_table("deepspeed", "deepspeed_table");
  ASSERT_TRUE(table) << "docs/user-guide.md lacks the table's markers";
  EXPECT_EQ(*table, dtk::core::deepspeed_key_table()) << "regenerate with tools/gen_megatron_table.sh";
}

namespace {

// The rate each log line shows (the next update's, as Megatron's does).
std::vector<std::string> printed_rates(const std::string& log) {
  std::vector<std::string> rates;
  std::regex re("learning rate: ([0-9.E+-]+)");
  for (std::sregex_iterator it(log.begin(), log.end(), re), e; it != e; ++it) rates.push_back((*it)[1]);
  return rates;
}

// gpt-tiny on synthetic data, 6 iterations: the model of the two-rank runs from a file.
const std::string kStandaloneModel = std::string("--config ") + DTK_SOURCE_DIR +
                                     "/configs/gpt-tiny.pbtxt --dataset synthetic --set model.vocab_size=255 "
                                     "--set dataset.vocab_size=255 --set train.seq_length=32 "
                                     "--set train.train_iters=6 --set eval.eval_iters=0";

std::vector<std::string> loss_lines(const std::string& log) {
  std::vector<std::string> out;
  std::regex re("lm loss: ([0-9.E+-]+)");
  for (std::sregex_iterator it(log.begin(), log.end(), re), e; it != e; ++it) out.push_back((*it)[1]);
  return out;
}

}  // namespace

// A Megatron-DeepSpeed command line with a ZeRO stage-2 config on two ranks trains exactly as the
// same run given with DTK's own options (the losses equal to the printed digit), and not as the
// run that clips at the command line's --clip-grad, which DeepSpeed does not read.
TEST(MegatronDeepSpeed, RunFromADeepSpeedConfigEqualsTheSameRunInDtkOptions) {
  const std::string path = ds_file("run", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.3, "zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 20000},
    "steps_per_print": 1, "wall_clock_breakdown": false})");
  const std::string model =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
      "--max-position-embeddings 32 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
      "--train-iters 4 --lr 0.01 --log-interval 1 --eval-iters 0";
  const dtk_test::Result ds =
      dtk_test::run_dtk("launch --nproc_per_node 2 train --threads 1 --megatron_args '" + model +
                        " --deepspeed --deepspeed_config " + path + " --no-pipeline-parallel --clip-grad 1'");
  ASSERT_EQ(ds.code, 0) << ds.out;
  EXPECT_NE(ds.out.find("dtk: note: --megatron_args: --clip-grad 1 has no effect under --deepspeed"), std::string::npos)
      << ds.out;
  const auto own = [&](const std::string& clip) {
    return dtk_test::run_dtk("launch --nproc_per_node 2 train --threads 1 --megatron_args '" + model +
                             " --micro-batch-size 2 --global-batch-size 8 --clip-grad " + clip +
                             "' --strategy zero --set strategy.stage=2 --set strategy.overlap_comm=true "
                             "--set strategy.reduce_bucket_size=20000");
  };
  const dtk_test::Result same = own("0.3"), other = own("1");
  ASSERT_EQ(same.code, 0) << same.out;
  const auto a = loss_lines(ds.out), b = loss_lines(same.out);
  ASSERT_EQ(a.size(), 4u) << ds.out;
  EXPECT_EQ(a, b) << ds.out << "\n----\n" << same.out;
  EXPECT_NE(a, loss_lines(other.out)) << other.out;
}

// ---------------------------------------------------------------------------------------------
// `dtk train --deepspeed_config FILE`: DeepSpeed's engine alone, where the file's optimizer,
// scheduler, steps_per_print and tensorboard count as deepspeed.initialize reads them.

namespace {

// `dtk config --deepspeed_config FILE [extra]`: the resolved config text, or the error.
dtk_test::Result resolved(const std::string& name, const std::string& json, const std::string& extra = "") {
  return dtk_test::run_dtk("config --deepspeed_config " + ds_file(name, json) + " " + extra);
}

void expect_fields(const dtk_test::Result& r, const std::vector<std::string>& lines) {
  ASSERT_EQ(r.code, 0) << r.out;
  for (const auto& l : lines) EXPECT_NE(r.out.find(l), std::string::npos) << "missing '" << l << "' in\n" << r.out;
}

}  // namespace

// A DeepSpeedExamples-style config: Adam (AdamW by DeepSpeed's default) with its betas and decay,
// WarmupDecayLR, bf16, ZeRO-1, the print interval and TensorBoard.
TEST(StandaloneDeepSpeed, OptimizerSchedulerAndLoggingBecomeDtksOwn) {
  expect_fields(
      resolved("examples", R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 5,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.95], "eps": 1e-8,
                                                 "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 0.0003,
                                                          "warmup_num_steps": 100, "total_num_steps": 1000}},
        "gradient_clipping": 0.5, "bf16": {"enabled": true}, "zero_optimization": {"stage": 1},
        "tensorboard": {"enabled": true, "output_path": "runs", "job_name": "gpt"}})"),
      {"micro_batch_size: 4", "global_batch_size: 16", "clip_grad: 0.5", "params_dtype: \"bf16\"", "lr: 0.0003",
       "min_lr: 1e-06", "lr_warmup_init: 1e-06", "lr_decay_style: \"WarmupDecayLR\"", "lr_warmup_iters: 100",
       "lr_decay_iters: 1000", "lr_warmup_style: \"log\"", "weight_decay: 0.1", "log_interval: 5",
       "tensorboard_dir: \"runs/gpt\"", "name: \"zero\"", "key: \"stage\"\n    value: \"1\"", "name: \"adamw\"",
       "key: \"beta2\"\n    value: \"0.95\""});
}

// Which optimizer plugin steps: DeepSpeed's CPU Adam when the optimizer is offloaded, or for the
// L2 mode; torch's AdamW decays by 0.01 when the file gives no weight_decay; SGD with torch's
// defaults; no scheduler is a constant rate; WarmupCosineLR scales the config's rate.
TEST(StandaloneDeepSpeed, OptimizerTypesAndDefaults) {
  expect_fields(resolved("offload", R"({"train_batch_size": 8, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})"),
                {"name: \"cpu_adam\"", "key: \"adamw_mode\"\n    value: \"true\"", "lr: 0.001", "weight_decay: 0\n",
                 "lr_decay_style: \"constant\"", "key: \"offload_optimizer\"\n    value: \"cpu\""});
  expect_fields(resolved("l2", R"({"train_batch_size": 8, "optimizer": {"type": "adam",
        "params": {"adam_w_mode": false, "lr": 0.002}}})"),
                {"name: \"cpu_adam\"", "key: \"adamw_mode\"\n    value: \"false\"", "lr: 0.002", "name: \"ddp\""});
  expect_fields(resolved("torch", R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
        "params": {"torch_adam": true}}})"),
                {"name: \"adamw\"", "weight_decay: 0.01"});
  expect_fields(
      resolved("sgd", R"({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})"),
      {"name: \"sgd\"", "key: \"momentum\"\n    value: \"0\"", "key: \"nesterov\"\n    value: \"false\"", "lr: 0.1"});
  // The default config's rate (3e-4) scaled by the ratios; its optimizer stays.
  expect_fields(resolved("cosine", R"({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
        "params": {"total_num_steps": 500, "warmup_num_steps": 50, "warmup_min_ratio": 0.5, "warmup_type": "linear"}}})"),
                {"lr: 0.0003", "lr_warmup_init: 0.00015", "min_lr: 3e-08", "lr_decay_style: \"WarmupCosineLR\"",
                 "lr_warmup_style: \"linear\"", "lr_decay_iters: 500", "name: \"adamw\""});
  // DeepSpeed's LRRangeTest and OneCycle, their defaults where the file gives none.
  expect_fields(resolved("range", R"({"train_batch_size": 8, "scheduler": {"type": "LRRangeTest",
        "params": {"lr_range_test_step_size": 50, "lr_range_test_staircase": true}}})"),
                {"lr: 0.001", "lr_decay_style: \"LRRangeTest\"", "lr_range_test_step_size: 50",
                 "lr_range_test_step_rate: 1", "lr_range_test_staircase: true"});
  expect_fields(resolved("cycle", R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3,
        "cycle_first_step_size": 100, "cycle_first_stair_count": 4, "decay_step_size": 20, "decay_lr_rate": 0.1}}})"),
                {"lr: 0.001", "min_lr: 1e-05", "lr_decay_style: \"OneCycle\"", "cycle_first_step_size: 100",
                 "cycle_first_stair_count: 4", "decay_step_size: 20", "decay_lr_rate: 0.1", "cycle_momentum: true",
                 "cycle_min_mom: 0.8"});
  // The config's own scheduler settings do not leak into the file's: a second half left out is
  // the first's (DeepSpeed's default, also for null), a WarmupLR file drops the cycle.
  const std::string cfg = std::string(DTK_TEST_TMP) + "/cycle-base.pbtxt";
  std::filesystem::create_directories(DTK_TEST_TMP);
  std::ofstream(cfg) << "lr { lr_decay_style: \"OneCycle\" cycle_first_step_size: 5 cycle_second_step_size: 7 "
                        "cycle_second_stair_count: 2 lr_warmup_style: \"linear\" }\n";
  const dtk_test::Result leftover =
      resolved("cycle-leftover", R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle",
        "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 100, "cycle_second_stair_count": null}}})",
               "--config " + cfg);
  expect_fields(leftover, {"cycle_first_step_size: 100"});
  for (const char* gone : {"cycle_second_step_size", "cycle_second_stair_count", "lr_warmup_style"})
    EXPECT_EQ(leftover.out.find(gone), std::string::npos) << gone << " kept from the config:\n" << leftover.out;
  const dtk_test::Result warmup = resolved("cycle-to-warmup", R"({"train_batch_size": 8, "scheduler": {"type":
        "WarmupLR", "params": {"warmup_num_steps": 10}}})",
                                           "--config " + cfg);
  expect_fields(warmup, {"lr_decay_style: \"WarmupLR\""});
  EXPECT_EQ(warmup.out.find("cycle_"), std::string::npos) << warmup.out;
  // --set after the file wins, as after --megatron_args.
  expect_fields(resolved("set", R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})",
                         "--set lr.lr=0.5"),
                {"lr: 0.5"});
}

TEST(StandaloneDeepSpeed, RefusesWhatItCannotRun) {
  const auto refused = [](const std::string& name, const std::string& json, const std::string& needle,
                          const std::string& extra = "") {
    const dtk_test::Result r = resolved(name, json, extra);
    EXPECT_NE(r.code, 0) << name << ": " << r.out;
    EXPECT_NE(r.out.find("dtk: error: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << name << ": " << r.out;
  };
  const std::string b = R"("train_batch_size": 8, )";
  refused("lamb", "{" + b + R"("optimizer": {"type": "Lamb"}})",
          "optimizer.type \"Lamb\": DeepSpeed's optimizer is not built");
  refused("rmsprop", "{" + b + R"("optimizer": {"type": "RMSprop"}})", "not an optimizer DTK has: Adam, AdamW or SGD");
  refused("notype", "{" + b + R"("optimizer": {"params": {"lr": 0.1}}})", "parameters without a \"type\"");
  refused("betas", "{" + b + R"("optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})", "not [beta1, beta2]");
  refused("betarange", "{" + b + R"("optimizer": {"type": "Adam", "params": {"betas": [1.5, 0.9]}}})",
          "each in [0, 1)");
  refused("eps", "{" + b + R"("optimizer": {"type": "Adam", "params": {"eps": 0}}})", "needs eps > 0");
  refused("gradnorm", "{" + b + R"("optimizer": {"type": "Adam", "params": {"max_grad_norm": 1}}})",
          "clipping is the top-level gradient_clipping");
  refused("nesterov", "{" + b + R"("optimizer": {"type": "SGD", "params": {"nesterov": true}}})",
          "needs a momentum above 0");
  refused("amsgrad", "{" + b + R"("optimizer": {"type": "Adam", "params": {"amsgrad": true}}})", "AMSGrad");
  refused("sgdparam", "{" + b + R"("optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}})",
          "not a parameter of torch's SGD");
  refused("sgdzero", "{" + b + R"("optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 1}})",
          "zero_allow_untested_optimizer");
  // The config's optimizer stands for DeepSpeed's client optimizer, with DeepSpeed's checks.
  const std::string offload = R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  refused("clientoffload", "{" + b + offload + "}", "zero_force_ds_cpu_optimizer");
  refused("clientsgd", "{" + b + R"("zero_optimization": {"stage": 1}})", "zero_allow_untested_optimizer",
          "--optimizer sgd");
  refused("cpuadamgpu", "{" + b + R"("optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})",
          "cpu_adam steps host tensors", "--set train.device=cuda");
  refused("onecycle", "{" + b + R"("scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.01}}})",
          "OneCycle without params.cycle_min_lr (DeepSpeed needs it)");
  refused("cyclelist",
          "{" + b + R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": [0, 0], "cycle_max_lr": 1}}})",
          "scheduler.params.cycle_min_lr [...]: a list (a value per parameter group)");
  refused("cyclesteps", "{" + b + R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1,
          "cycle_first_step_size": 10.5}}})",
          "not a whole number of at least 1");
  refused("cyclemom", "{" + b + R"("scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1,
          "cycle_max_mom": 1}}})",
          "lr.cycle_max_mom is Adam's beta1, in [0, 1); got 1");
  refused("rangefloat",
          "{" + b + R"("scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 10.0}}})",
          "not a whole number (DeepSpeed's LRRangeTest asks for an int)");
  refused("rangeparam", "{" + b + R"("scheduler": {"type": "LRRangeTest", "params": {"warmup_num_steps": 5}}})",
          "not a parameter of DeepSpeed's LRRangeTest");
  refused("noparams", "{" + b + R"("scheduler": {"type": "WarmupLR"}})", "without \"params\"");
  refused("float", "{" + b + R"("scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}}})",
          "not a whole number of at least 1");
  refused("cosineset",
          "{" + b + R"("optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "scheduler": {"type": "WarmupCosineLR",
          "params": {"total_num_steps": 100}}})",
          "WarmupCosineLR ratios scaled 0.001", "--set lr.lr=0.01");
  refused("tbpath", "{" + b + R"("tensorboard": {"enabled": true, "output_path": "a\nb"}})",
          "tensorboard.output_path \"a\\x0ab\": holds a control character");
  refused("steplr", "{" + b + R"("scheduler": {"type": "StepLR"}})", "not a scheduler DTK has");
  refused("total", "{" + b + R"("scheduler": {"type": "WarmupDecayLR", "params": {}}})",
          "without params.total_num_steps");
  refused("wrongparam", "{" + b + R"("scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 5}}})",
          "not a parameter of DeepSpeed's WarmupLR");
  refused("warmuptype", "{" + b + R"("scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}})",
          "not log or linear");
  refused("list", "{" + b + R"("scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0, 0]}}})",
          "a list (a value per parameter group)");
  refused("section", "{" + b + R"("optimizer": "Adam"})", "not a section");
  refused("lastbatch", "{" + b + R"("scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 7}}})",
          "DTK runs only -1");

  refused("both", "{" + b + "}", "--deepspeed_config with --megatron_args", "--megatron_args '--num-layers 2'");
  // Megatron's --lr-decay-style takes only Megatron's styles.
  EXPECT_TRUE(has(dtk::core::map_megatron_args({"--lr-decay-style", "WarmupLR"}).refused,
                  "--lr-decay-style WarmupLR: not one of Megatron's"));
}

// OneCycle from a file, with ZeRO-2 on two ranks, trains as the same run in DTK's own options, to
// the printed digit, and not as the run whose beta1 does not cycle; its log shows the rate of
// the next update (1e-3 + 3e-3 k / 3 rising, then falling).
TEST(StandaloneDeepSpeed, OneCycleRunEqualsDtksOptions) {
  const std::string path = ds_file("run-one-cycle", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000}, "gradient_clipping": 0.3,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "weight_decay": 0.05}},
    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.004,
                                                 "cycle_first_step_size": 3, "cycle_min_mom": 0.5}}})");
  const std::string model = kStandaloneModel;
  const dtk_test::Result ds =
      dtk_test::run_dtk("launch --nproc_per_node 2 train --threads 1 --deepspeed_config " + path + " " + model);
  ASSERT_EQ(ds.code, 0) << ds.out;
  EXPECT_EQ(printed_rates(ds.out), (std::vector<std::string>{"2.000000E-03", "3.000000E-03", "4.000000E-03", "3.000000E-03",
                                             "2.000000E-03", "1.000000E-03"}))
      << ds.out;
  const auto own = [&](const std::string& momentum) {
    return dtk_test::run_dtk(
        "launch --nproc_per_node 2 train --threads 1 " + model +
        " --strategy zero --optimizer adamw --set strategy.stage=2 --set strategy.reduce_bucket_size=20000 "
        "--set train.micro_batch_size=2 --set train.global_batch_size=8 --set train.clip_grad=0.3 "
        "--set logging.log_interval=1 --set lr.weight_decay=0.05 --set lr.lr_decay_style=OneCycle "
        "--set lr.min_lr=0.001 --set lr.lr=0.004 --set lr.cycle_first_step_size=3 --set lr.cycle_min_mom=0.5 "
        "--set lr.cycle_momentum=" +
        momentum);
  };
  const dtk_test::Result same = own("true"), fixed = own("false");
  ASSERT_EQ(same.code, 0) << same.out;
  ASSERT_EQ(fixed.code, 0) << fixed.out;
  const auto a = loss_lines(ds.out);
  ASSERT_EQ(a.size(), 6u) << ds.out;
  EXPECT_EQ(a, loss_lines(same.out)) << ds.out << "\n----\n" << same.out;
  EXPECT_NE(a, loss_lines(fixed.out)) << fixed.out;
}

// DeepSpeed's step convention in a run: WarmupDecayLR, linear over 2 steps to 0.01 and down to 0
// at step 6, gives the updates 0, 0, 0.005, 0.01, 0.0075, 0.005 (DeepSpeed's first update runs
// before its scheduler's first step); the log line shows the next update's, as Megatron's does
// (0, 0.005, ...: Megatron's own linear warm-up would show 0.005, 0.01, ...). Two ranks from the
// file train as the same run in DTK's own options, to the printed digit.
TEST(StandaloneDeepSpeed, RunFollowsDeepSpeedsScheduleAndEqualsDtksOptions) {
  const std::string path = ds_file("run-standalone", R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.3, "steps_per_print": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000},
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.05}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                                      "total_num_steps": 6, "warmup_type": "linear"}}})");
  const std::string model = kStandaloneModel;
  const dtk_test::Result ds =
      dtk_test::run_dtk("launch --nproc_per_node 2 train --threads 1 --deepspeed_config " + path + " " + model);
  ASSERT_EQ(ds.code, 0) << ds.out;
  EXPECT_EQ(printed_rates(ds.out), (std::vector<std::string>{"0.000000E+00", "5.000000E-03", "1.000000E-02", "7.500000E-03",
                                             "5.000000E-03", "2.500000E-03"}))
      << ds.out;
  const dtk_test::Result own = dtk_test::run_dtk(
      "launch --nproc_per_node 2 train --threads 1 " + model +
      " --strategy zero --optimizer adamw --set strategy.stage=2 --set strategy.reduce_bucket_size=20000 "
      "--set train.micro_batch_size=2 --set train.global_batch_size=8 --set train.clip_grad=0.3 "
      "--set logging.log_interval=1 --set optimizer.beta2=0.95 --set lr.lr=0.01 --set lr.weight_decay=0.05 "
      "--set lr.lr_decay_style=WarmupDecayLR --set lr.lr_warmup_style=linear --set lr.lr_warmup_iters=2 "
      "--set lr.lr_decay_iters=6 --set lr.min_lr=0 --set lr.lr_warmup_init=0");
  ASSERT_EQ(own.code, 0) << own.out;
  const auto a = loss_lines(ds.out);
  ASSERT_EQ(a.size(), 6u) << ds.out;
  EXPECT_EQ(a, loss_lines(own.out)) << ds.out << "\n----\n" << own.out;
}

namespace {

// A DeepSpeed config's curriculum runs as DTK's own options, and differs from the run without it.
TEST(StandaloneDeepSpeed, CurriculumRunEqualsDtksOptions) {
  const std::string path = ds_file("run-curriculum", R"({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1, "curriculum_learning": {"enabled": true, "curriculum_type": "seqlen",
      "min_difficulty": 8, "max_difficulty": 32, "schedule_type": "fixed_root",
      "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8, "root_degree": 2}}})");
  // (No "scheduler": DeepSpeed's constant rate.)
  const std::string model = kStandaloneModel +
                            " --threads 1 --set logging.log_interval=1 --set lr.lr_warmup_iters=0 "
                            "--set lr.lr_decay_style=constant ";
  const dtk_test::Result ds = dtk_test::run_dtk("train --deepspeed_config " + path + " " + model);
  const dtk_test::Result own = dtk_test::run_dtk(
      "train " + model +
      " --set train.micro_batch_size=2 --set train.global_batch_size=4 --set train.curriculum_schedule=fixed_root "
      "--set train.curriculum_min_difficulty=8 --set train.curriculum_max_difficulty=32 "
      "--set train.curriculum_total_step=5 --set train.curriculum_difficulty_step=8 "
      "--set train.curriculum_root_degree=2");
  const dtk_test::Result plain =
      dtk_test::run_dtk("train " + model + " --set train.micro_batch_size=2 --set train.global_batch_size=4");
  ASSERT_EQ(ds.code, 0) << ds.out;
  ASSERT_EQ(own.code, 0) << own.out;
  ASSERT_EQ(plain.code, 0) << plain.out;
  const auto a = loss_lines(ds.out);
  ASSERT_EQ(a.size(), 6u) << ds.out;
  EXPECT_EQ(a, loss_lines(own.out)) << ds.out << "\n----\n" << own.out;
  EXPECT_NE(a, loss_lines(plain.out));
  EXPECT_NE(ds.out.find("curriculum seqlen:    16 |"), std::string::npos) << ds.out;
}

}  // namespace
