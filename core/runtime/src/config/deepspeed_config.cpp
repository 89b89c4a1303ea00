// DeepSpeed's JSON config -> DTK settings (dtk/core/config/deepspeed_config.hpp).
#include "dtk/core/config/deepspeed_config.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dtk/core/config/config.hpp"
#include "dtk/host/error.hpp"
#include "dtk/host/error_line.hpp"

namespace dtk::core {

using host::HostError;
using nlohmann::json;

namespace {

// kSet: the value (a number or a bool) goes to `target`. kOnly: `target` is the one value DTK
// runs (as JSON text), `note` says why another is refused. kIgnore: accepted, no effect here,
// `note` says why (a section with "enabled": false says nothing). kSection: a feature DTK does
// not have: accepted while its "enabled" is false, refused with `note` when true. kCustom:
// decided in custom() by value; `target` and `note` describe it for the docs.
enum class Kind { kSet, kOnly, kIgnore, kSection, kCustom };

struct Rule {
  const char* key;  // dotted path in the JSON object
  Kind kind;
  const char* target;
  const char* note;
};

constexpr const char* kSameResults = "the same results";
constexpr const char* kEngineMonitor =
    "DeepSpeed's monitor of its engine; DTK logs to TensorBoard (logging.tensorboard_dir: --tensorboard-dir with "
    "Megatron's flags, tensorboard.enabled with --deepspeed_config alone)";
constexpr const char* kZeroPlusPlus = "ZeRO++'s quantized or hierarchical communication is not built";

// The order is the docs table's.
const Rule kRules[] = {
    // Batch
    {"train_batch_size", Kind::kCustom, "train.global_batch_size",
     "must equal --global-batch-size when both are given"},
    {"train_micro_batch_size_per_gpu", Kind::kCustom, "train.micro_batch_size",
     "must equal --micro-batch-size when both are given"},
    {"gradient_accumulation_steps", Kind::kSet, "train.gradient_accumulation_steps",
     "global batch = micro x data-parallel size x this, checked at start; absent and not derived from the two "
     "above: 1, as DeepSpeed derives it"},
    // Precision
    {"fp16.enabled", Kind::kCustom, "train.params_dtype=fp16",
     "DeepSpeed casts the model to fp16 (a Megatron --bf16 with it is refused); fp32 masters always"},
    {"fp16.loss_scale", Kind::kCustom, "train.loss_scale", "0 (the default): dynamic; more: a static scale"},
    {"fp16.initial_scale_power", Kind::kCustom, "train.initial_loss_scale", "2^X (DeepSpeed's default 16: 65536)"},
    {"fp16.loss_scale_window", Kind::kCustom, "train.loss_scale_window",
     "DeepSpeed's default 1000; DTK doubles after this many clean steps (DeepSpeed 0.17.1 and later: one more "
     "after an overflow)"},
    {"fp16.hysteresis", Kind::kCustom, "train.hysteresis", "DeepSpeed's default 2"},
    {"fp16.min_loss_scale", Kind::kCustom, "train.min_loss_scale",
     "DeepSpeed's default 1; at the floor DTK skips on where DeepSpeed stops the run"},
    {"fp16.consecutive_hysteresis", Kind::kOnly, "false",
     "DTK restores the hysteresis only when the scale grows (DeepSpeed's default), not after every clean step"},
    {"fp16.auto_cast", Kind::kOnly, "false", "DTK's fp16 parameters are fp16 themselves, not an autocast fp32 model"},
    {"fp16.fp16_master_weights_and_grads", Kind::kOnly, "false", "the optimizer steps fp32 masters always"},
    {"bf16.enabled", Kind::kCustom, "train.params_dtype=bf16",
     "DeepSpeed casts the model to bf16 (a Megatron --fp16 with it is refused); fp32 masters always"},
    {"bf16.immediate_grad_update", Kind::kIgnore, "", "gradients accumulate in fp32 either way"},
    {"bf16.check_grad_overflow", Kind::kIgnore, "",
     "a step with gradients that are not finite is skipped (train.skipped_steps_limit says after how many in a row "
     "the run stops; --megatron_args: at the first, as Megatron)"},
    {"bf16.bf16_master_weights_and_grads", Kind::kOnly, "false", "the optimizer steps fp32 masters always"},
    {"bf16.bf16_optimizer_states", Kind::kOnly, "false", "the optimizer state is fp32 always"},
    {"bfloat16.enabled", Kind::kCustom, "train.params_dtype=bf16", "DeepSpeed's older name of bf16.enabled"},
    {"amp", Kind::kSection, "",
     "Apex AMP is not built: DTK trains fp16 or bf16 parameters with fp32 masters (fp16.enabled, bf16.enabled)"},
    {"communication_data_type", Kind::kCustom, "",
     "fp32 (or absent): accepted, DTK reduces gradients in fp32 (DeepSpeed's default is the parameters' type); "
     "fp16, bf16: refused"},
    {"data_types.grad_accum_dtype", Kind::kCustom, "",
     "fp32 (or absent): accepted, DTK accumulates gradients in fp32; fp16, bf16: refused"},
    {"gradient_clipping", Kind::kCustom, "train.clip_grad",
     "absent: 1.0, DeepSpeed's default since 0.19.3 (0, no clipping, before); Megatron's --clip-grad has no effect "
     "under --deepspeed (said at start when it differs)"},
    {"prescale_gradients", Kind::kIgnore, "", "where the average divides; DTK reduces in fp32, the same average"},
    {"gradient_predivide_factor", Kind::kIgnore, "",
     "where the average divides; DTK reduces in fp32, the same average"},
    {"sparse_gradients", Kind::kOnly, "false", "sparse embedding gradients are not in DTK's models"},
    // ZeRO
    {"zero_optimization", Kind::kCustom, "strategy", "DeepSpeed's older form true / false: stage 1 / stage 0"},
    {"zero_optimization.stage", Kind::kCustom, "strategy",
     "0: the ddp strategy (the other zero_optimization keys then have no effect, as in DeepSpeed); 1, 2, 3: the "
     "zero strategy, strategy.stage; 2 and 3 need Megatron-DeepSpeed's --no-pipeline-parallel (DeepSpeed's "
     "pipeline engine refuses them)"},
    {"zero_optimization.allgather_partitions", Kind::kIgnore, "", "DeepSpeed's ZeRO does not read it"},
    {"zero_optimization.allgather_bucket_size", Kind::kSet, "strategy.allgather_bucket_size", "stages 1, 2"},
    {"zero_optimization.overlap_comm", Kind::kCustom, "strategy.overlap_comm", "absent: on with stage 3, as DeepSpeed"},
    {"zero_optimization.reduce_scatter", Kind::kIgnore, "", "gradients are always reduce-scattered; the same results"},
    {"zero_optimization.reduce_bucket_size", Kind::kSet, "strategy.reduce_bucket_size", ""},
    {"zero_optimization.contiguous_gradients", Kind::kIgnore, "",
     "gradients are always copied into contiguous buckets; the same results"},
    {"zero_optimization.offload_optimizer.device", Kind::kCustom, "strategy.offload_optimizer",
     "none, cpu, nvme; cpu and nvme step with the cpu_adam plugin (Megatron-DeepSpeed's --cpu-optimizer, or the "
     "file's Adam with --deepspeed_config; another optimizer is refused unless zero_force_ds_cpu_optimizer is false); "
     "nvme at "
     "stages 1-2 is host memory, as DeepSpeed's; at stage 0 refused (DeepSpeed refuses its CPU Adam there)"},
    {"zero_optimization.offload_optimizer.nvme_path", Kind::kCustom, "strategy.nvme_path",
     "with device nvme at stage 3"},
    {"zero_optimization.offload_optimizer.buffer_count", Kind::kIgnore, "",
     "strategy.nvme_buffer_mb sizes DTK's buffer (two halves)"},
    {"zero_optimization.offload_optimizer.pin_memory", Kind::kIgnore, "", "host memory is always pinned"},
    {"zero_optimization.offload_optimizer.pipeline", Kind::kIgnore, "",
     "the swap file's reads and writes always overlap the update (two buffer halves)"},
    {"zero_optimization.offload_optimizer.pipeline_read", Kind::kIgnore, "",
     "the swap file's reads and writes always overlap the update (two buffer halves)"},
    {"zero_optimization.offload_optimizer.pipeline_write", Kind::kIgnore, "",
     "the swap file's reads and writes always overlap the update (two buffer halves)"},
    {"zero_optimization.offload_optimizer.fast_init", Kind::kIgnore, "", "DTK writes the swap file once at start"},
    {"zero_optimization.offload_optimizer.ratio", Kind::kOnly, "1",
     "the whole optimizer state is offloaded (a partial offload is not built)"},
    {"zero_optimization.offload_param.device", Kind::kCustom, "strategy.offload_param", "none, cpu, nvme (stage 3)"},
    {"zero_optimization.offload_param.nvme_path", Kind::kCustom, "strategy.nvme_path",
     "with device nvme; one folder for both tiers: must equal the optimizer's when both are on nvme"},
    {"zero_optimization.offload_param.buffer_count", Kind::kCustom, "strategy.param_buffer_count", "with device nvme"},
    {"zero_optimization.offload_param.buffer_size", Kind::kIgnore, "",
     "a buffer is one bucket chunk (reduce_bucket_size / data-parallel size)"},
    {"zero_optimization.offload_param.max_in_cpu", Kind::kIgnore, "",
     "the buffers are the only parameters in host memory"},
    {"zero_optimization.offload_param.pin_memory", Kind::kIgnore, "", "host memory is always pinned"},
    {"zero_optimization.stage3_prefetch_bucket_size", Kind::kSet, "strategy.stage3_prefetch_bucket_size", ""},
    {"zero_optimization.stage3_max_live_parameters", Kind::kSet, "strategy.stage3_max_live_parameters", ""},
    {"zero_optimization.stage3_param_persistence_threshold", Kind::kSet, "strategy.stage3_param_persistence_threshold",
     ""},
    {"zero_optimization.stage3_max_reuse_distance", Kind::kIgnore, "",
     "a module's parameters are released after use, except the last module's, kept for the backward"},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", Kind::kIgnore, "",
     "checkpoints always hold whole parameters"},
    {"zero_optimization.stage3_gather_fp16_weights_on_model_save", Kind::kIgnore, "",
     "checkpoints always hold whole parameters"},
    {"zero_optimization.sub_group_size", Kind::kIgnore, "",
     "a memory bound of DeepSpeed's stage-3 step; DTK steps each rank's partition in place, the same update"},
    {"zero_optimization.round_robin_gradients", Kind::kIgnore, "", "the order of gradient copies; the same results"},
    {"zero_optimization.elastic_checkpoint", Kind::kIgnore, "",
     "DTK's checkpoints hold whole tensors and re-partition at load"},
    {"zero_optimization.ignore_unused_parameters", Kind::kIgnore, "", "every parameter of DTK's models has a gradient"},
    {"zero_optimization.load_from_fp32_weights", Kind::kOnly, "true", "DTK resumes from the checkpoint's fp32 masters"},
    {"zero_optimization.memory_efficient_linear", Kind::kIgnore, "", kSameResults},
    {"zero_optimization.use_multi_rank_bucket_allreduce", Kind::kIgnore, "", kSameResults},
    {"zero_optimization.cpu_offload", Kind::kCustom, "strategy.offload_optimizer=cpu",
     "DeepSpeed's older key: true is offload_optimizer.device cpu"},
    {"zero_optimization.cpu_offload_param", Kind::kCustom, "strategy.offload_param=cpu",
     "DeepSpeed's older key: true is offload_param.device cpu"},
    {"zero_optimization.cpu_offload_use_pin_memory", Kind::kIgnore, "", "host memory is always pinned"},
    {"zero_optimization.zero_hpz_partition_size", Kind::kOnly, "1", kZeroPlusPlus},
    {"zero_optimization.zero_quantized_weights", Kind::kOnly, "false", kZeroPlusPlus},
    {"zero_optimization.zero_quantized_nontrainable_weights", Kind::kOnly, "false", kZeroPlusPlus},
    {"zero_optimization.zero_quantized_gradients", Kind::kOnly, "false", kZeroPlusPlus},
    {"zero_optimization.mics_shard_size", Kind::kOnly, "-1", "MiCS's sub-group sharding is not built"},
    {"zero_optimization.mics_hierarchical_params_gather", Kind::kOnly, "false", "MiCS is not built"},
    {"zero_optimization.stage3_model_persistence_threshold", Kind::kIgnore, "", "a memory bound; the same results"},
    {"zero_optimization.stage3_module_granularity_threshold", Kind::kIgnore, "", "the same results"},
    {"zero_allow_untested_optimizer", Kind::kCustom, "",
     "true: SGD with ZeRO (DeepSpeed refuses an optimizer it has not tested otherwise)"},
    {"zero_force_ds_cpu_optimizer", Kind::kCustom, "",
     "false: an offload with another Adam than DeepSpeed's CPU Adam (Megatron's, torch_adam) is accepted (its "
     "update on the host is the cpu_adam plugin's)"},
    {"aio", Kind::kIgnore, "", "fixed: 4 MiB blocks, 32 in flight, O_DIRECT where the filesystem allows"},
    {"activation_checkpointing", Kind::kIgnore, "",
     "where DeepSpeed keeps the recomputed layers' inputs (partitioned, contiguous, on the host); DTK keeps them "
     "whole on the device, the same results (recomputation itself: --recompute-*, --checkpoint-activations)"},
    // The optimizer and the schedule: the client's under Megatron-DeepSpeed, the file's standalone
    {"optimizer", Kind::kCustom, "",
     "with --megatron_args, no effect: Megatron-DeepSpeed passes DeepSpeed its own optimizer (--optimizer, "
     "--adam-*, --lr, --weight-decay), which DeepSpeed uses instead (said at start). With --deepspeed_config: "
     "the rows below; absent, the config's optimizer stands for the client's"},
    {"optimizer.type", Kind::kCustom, "",
     "--deepspeed_config, the optimizer plugin: Adam or AdamW (any case, as DeepSpeed reads them): adamw; cpu_adam "
     "with offload_optimizer (DeepSpeed's CPU Adam), or for adam_w_mode or bias_correction false on the CPU (cpu_adam "
     "steps host tensors: on a GPU offload the optimizer). SGD: sgd. Others refused"},
    {"optimizer.params.lr", Kind::kCustom, "lr.lr", "absent: 0.001, the default of DeepSpeed's Adam and torch's SGD"},
    {"optimizer.params.betas", Kind::kCustom, "optimizer.beta1, optimizer.beta2", "[b1, b2]; absent: [0.9, 0.999]"},
    {"optimizer.params.eps", Kind::kCustom, "optimizer.eps", "absent: 1e-8"},
    {"optimizer.params.weight_decay", Kind::kCustom, "lr.weight_decay",
     "constant; absent: 0 (DeepSpeed's Adams, torch's SGD), 0.01 with torch_adam in AdamW mode (torch's AdamW). "
     "DTK's parameter groups decay no biases or norms (Megatron's, as DeepSpeed's examples group them)"},
    {"optimizer.params.adam_w_mode", Kind::kCustom, "optimizer.adamw_mode",
     "absent: true (DeepSpeed's Adam is AdamW unless false); false: L2 decay in the gradient, cpu_adam"},
    {"optimizer.params.bias_correction", Kind::kCustom, "optimizer.bias_correction", "absent: true; false: cpu_adam"},
    {"optimizer.params.torch_adam", Kind::kCustom, "", "torch's Adam or AdamW: the same update"},
    {"optimizer.params.amsgrad", Kind::kOnly, "false", "AMSGrad is not built"},
    {"optimizer.params.fp32_optimizer_states", Kind::kOnly, "true", "the optimizer state is fp32"},
    {"optimizer.params.set_grad_none", Kind::kIgnore, "", "gradients are zeroed in place; the same update"},
    {"optimizer.params.foreach", Kind::kIgnore, "", "torch's implementation choice; the same update"},
    {"optimizer.params.fused", Kind::kIgnore, "", "torch's implementation choice; the same update"},
    {"optimizer.params.max_grad_norm", Kind::kCustom, "",
     "refused, as DeepSpeed refuses it: clipping is the top-level gradient_clipping"},
    {"optimizer.legacy_fusion", Kind::kIgnore, "", "DeepSpeed's older fp16 optimizer wrapper; the same update"},
    {"optimizer.params.momentum", Kind::kCustom, "optimizer.momentum", "SGD; absent: 0 (torch's default)"},
    {"optimizer.params.nesterov", Kind::kCustom, "optimizer.nesterov", "SGD; absent: false"},
    {"optimizer.params.dampening", Kind::kOnly, "0", "SGD's dampening is not built"},
    {"scheduler", Kind::kCustom, "",
     "with --megatron_args, no effect: Megatron-DeepSpeed passes its own schedule (--lr-decay-style, "
     "--lr-warmup-*), which DeepSpeed uses instead (said at start). With --deepspeed_config: the rows below; "
     "absent, a constant rate when the file gives the optimizer (DeepSpeed's), else the config's lr.* schedule"},
    {"scheduler.type", Kind::kCustom, "lr.lr_decay_style",
     "--deepspeed_config: WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest or OneCycle, with DeepSpeed's "
     "step count (the first update at the minimum, or 0 for WarmupCosineLR); torch's schedulers refused"},
    {"scheduler.params.warmup_min_lr", Kind::kCustom, "lr.lr_warmup_init, lr.min_lr", "absent: 0"},
    {"scheduler.params.warmup_max_lr", Kind::kCustom, "lr.lr",
     "absent: the optimizer's rate (WarmupLR), 0.001 (WarmupDecayLR)"},
    {"scheduler.params.warmup_num_steps", Kind::kCustom, "lr.lr_warmup_iters",
     "absent: 1000; at least 2 steps are taken, as DeepSpeed does"},
    {"scheduler.params.warmup_type", Kind::kCustom, "lr.lr_warmup_style", "log (absent) or linear"},
    {"scheduler.params.total_num_steps", Kind::kCustom, "lr.lr_decay_iters",
     "WarmupDecayLR and WarmupCosineLR: required, as in DeepSpeed"},
    {"scheduler.params.warmup_min_ratio", Kind::kCustom, "lr.lr_warmup_init",
     "WarmupCosineLR: this times the optimizer's rate; absent: 0"},
    {"scheduler.params.cos_min_ratio", Kind::kCustom, "lr.min_lr",
     "WarmupCosineLR: this times the optimizer's rate; absent: 0.0001"},
    {"scheduler.params.lr_range_test_min_lr", Kind::kCustom, "lr.lr", "LRRangeTest's first rate; absent: 0.001"},
    {"scheduler.params.lr_range_test_step_size", Kind::kCustom, "lr.lr_range_test_step_size",
     "LRRangeTest; absent: 2000"},
    {"scheduler.params.lr_range_test_step_rate", Kind::kCustom, "lr.lr_range_test_step_rate",
     "LRRangeTest; absent: 1.0"},
    {"scheduler.params.lr_range_test_staircase", Kind::kCustom, "lr.lr_range_test_staircase",
     "LRRangeTest; absent: false"},
    {"scheduler.params.cycle_min_lr", Kind::kCustom, "lr.min_lr", "OneCycle: required, as in DeepSpeed"},
    {"scheduler.params.cycle_max_lr", Kind::kCustom, "lr.lr", "OneCycle: required, as in DeepSpeed"},
    {"scheduler.params.cycle_first_step_size", Kind::kCustom, "lr.cycle_first_step_size", "OneCycle; absent: 2000"},
    {"scheduler.params.cycle_second_step_size", Kind::kCustom, "lr.cycle_second_step_size",
     "OneCycle; absent: the first's"},
    {"scheduler.params.cycle_first_stair_count", Kind::kCustom, "lr.cycle_first_stair_count", "OneCycle; absent: 0"},
    {"scheduler.params.cycle_second_stair_count", Kind::kCustom, "lr.cycle_second_stair_count",
     "OneCycle; absent: the first's"},
    {"scheduler.params.decay_step_size", Kind::kCustom, "lr.decay_step_size", "OneCycle; absent: 0 (no decay)"},
    {"scheduler.params.decay_lr_rate", Kind::kCustom, "lr.decay_lr_rate", "OneCycle; absent: 0"},
    {"scheduler.params.cycle_momentum", Kind::kCustom, "lr.cycle_momentum",
     "OneCycle; absent: true (Adam's beta1 cycles, beta2 is 0.99)"},
    {"scheduler.params.cycle_min_mom", Kind::kCustom, "lr.cycle_min_mom", "OneCycle; absent: 0.8"},
    {"scheduler.params.cycle_max_mom", Kind::kCustom, "lr.cycle_max_mom", "OneCycle; absent: 0.9"},
    {"scheduler.params.decay_mom_rate", Kind::kCustom, "lr.decay_mom_rate", "OneCycle; absent: 0"},
    {"scheduler.params.last_batch_iteration", Kind::kOnly, "-1",
     "a DeepSpeed scheduler resumed by hand; DTK resumes the schedule from its checkpoint"},
    // Logging
    {"steps_per_print", Kind::kCustom, "logging.log_interval",
     "--deepspeed_config: the log line every X iterations; with --megatron_args no effect (--log-interval)"},
    {"wall_clock_breakdown", Kind::kCustom, "logging.timing_log_level=2",
     "true: every timer in the log line (a --timing-log-level wins)"},
    {"memory_breakdown", Kind::kIgnore, "", "DeepSpeed's own print of memory use"},
    {"dump_state", Kind::kIgnore, "", "DeepSpeed's print of its state; `dtk config` prints DTK's"},
    {"dataloader_drop_last", Kind::kIgnore, "", "DeepSpeed's own data loader; Megatron's loop feeds the batches"},
    {"timers", Kind::kIgnore, "", "DeepSpeed's throughput timer; the log line shows tokens per second"},
    {"tensorboard", Kind::kCustom, "",
     "with --megatron_args, no effect: DeepSpeed's monitor of its engine; Megatron's loop logs with "
     "--tensorboard-dir. With --deepspeed_config: the rows below"},
    {"tensorboard.enabled", Kind::kCustom, "logging.tensorboard_dir",
     "--deepspeed_config, true: DTK's TensorBoard scalars (the log line's figures) to DeepSpeed's folder, "
     "output_path/job_name"},
    {"tensorboard.output_path", Kind::kCustom, "", "absent: \"\" (job_name under the working folder)"},
    {"tensorboard.job_name", Kind::kCustom, "", "absent: DeepSpeedJobName"},
    {"wandb", Kind::kIgnore, "", kEngineMonitor},
    {"csv_monitor", Kind::kIgnore, "", kEngineMonitor},
    {"comet", Kind::kIgnore, "", kEngineMonitor},
    {"flops_profiler", Kind::kIgnore, "", "DeepSpeed's profiler; DTK's is --profile (logging.profile_steps)"},
    {"comms_logger", Kind::kIgnore, "", "DeepSpeed's log of each collective"},
    {"pipeline", Kind::kIgnore, "",
     "DeepSpeed's pipeline engine; DTK pipelines by --pipeline-model-parallel-size (1F1B)"},
    {"seq_parallel_communication_data_type", Kind::kIgnore, "", "DeepSpeed-Ulysses is not used"},
    // Checkpoints
    {"checkpoint.tag_validation", Kind::kIgnore, "", "all ranks save one iteration folder, checked at load"},
    {"checkpoint.load_universal", Kind::kOnly, "false",
     "DeepSpeed's universal checkpoints are not read; DTK reads its own (Megatron's torch layout)"},
    {"checkpoint.use_node_local_storage", Kind::kIgnore, "", "every rank writes to checkpoint.save"},
    {"checkpoint.parallel_write", Kind::kIgnore, "", "every rank writes its own files"},
    // Curriculum learning: DeepSpeed's legacy section, as Megatron-DeepSpeed applies it
    {"curriculum_learning.enabled", Kind::kCustom, "",
     "true: the sequence-length curriculum of the rows below; false: the section is off; absent: off, as "
     "Megatron-DeepSpeed reads it (DeepSpeed's own reader fails)"},
    {"curriculum_learning.curriculum_type", Kind::kCustom, "",
     "\"seqlen\" or absent (each sample cut to the length, as Megatron-DeepSpeed's pipeline path does "
     "without reading the key); another metric is refused"},
    {"curriculum_learning.min_difficulty", Kind::kCustom, "train.curriculum_min_difficulty", "required"},
    {"curriculum_learning.max_difficulty", Kind::kCustom, "train.curriculum_max_difficulty",
     "required; at most the sequence length"},
    {"curriculum_learning.schedule_type", Kind::kCustom, "train.curriculum_schedule",
     "required: fixed_linear, fixed_root or fixed_discrete; custom (a Python function) is refused"},
    {"curriculum_learning.schedule_config.total_curriculum_step", Kind::kCustom, "train.curriculum_total_step",
     "fixed_linear, fixed_root: required"},
    {"curriculum_learning.schedule_config.difficulty_step", Kind::kCustom, "train.curriculum_difficulty_step",
     "fixed_linear, fixed_root: required"},
    {"curriculum_learning.schedule_config.root_degree", Kind::kCustom, "train.curriculum_root_degree",
     "fixed_root: required"},
    {"curriculum_learning.schedule_config.difficulty", Kind::kCustom, "train.curriculum_discrete_difficulty",
     "fixed_discrete: required, a list of lengths"},
    {"curriculum_learning.schedule_config.max_step", Kind::kCustom, "train.curriculum_discrete_max_step",
     "fixed_discrete: required, a list one shorter (the last iteration of each length but the last)"},
    // Features DTK does not have
    {"data_efficiency", Kind::kSection, "", "DeepSpeed's data efficiency library is not built"},
    {"elasticity", Kind::kSection, "", "elastic training is not built"},
    {"autotuning", Kind::kSection, "", "DeepSpeed's autotuner is not built"},
    {"progressive_layer_drop", Kind::kSection, "", "progressive layer drop is not built"},
    {"eigenvalue", Kind::kSection, "", "eigenvalue computation is not built"},
    {"quantize_training", Kind::kSection, "", "quantized training is not built"},
    {"sparse_attention", Kind::kSection, "", "sparse attention is not built"},
    {"compression_training", Kind::kSection, "", "compression training is not built"},
    {"hybrid_engine", Kind::kSection, "", "DeepSpeed-Chat's hybrid engine is not built"},
    {"weight_quantization", Kind::kSection, "", "weight quantization is not built"},
    {"nebula", Kind::kSection, "", "Nebula checkpoints are not written"},
    {"compile", Kind::kSection, "", "torch.compile does not apply: DTK is C++"},
    {"torch_autocast", Kind::kSection, "", "DTK's fp16/bf16 parameters are cast themselves, not autocast"},
};

const Rule* find_rule(const std::string& key) {
  for (const Rule& r : kRules)
    if (key == r.key) return &r;
  return nullptr;
}

bool is_prefix_of_a_rule(const std::string& key) {
  for (const Rule& r : kRules)
    if (std::string(r.key).rfind(key + ".", 0) == 0) return true;
  return false;
}

// A JSON number or bool as DTK's config text: whole numbers without a fraction (5e8 is
// 500000000), others in the fewest digits that read back the same.
std::string text_of(const json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer()) return std::to_string(v.get<long long>());
  if (v.is_number_unsigned()) return std::to_string(v.get<unsigned long long>());
  if (v.is_number_float()) return number_text(v.get<double>());
  return v.dump();
}

// Text from the file as it can be shown on one line (error_line: control bytes, a NUL that would
// end the line a terminal shows, as \xNN), at most 80 characters.
std::string printable(const std::string& text) {
  return host::error_line(text.substr(0, 80)) + (text.size() > 80 ? "..." : "");
}

// A value as an error shows it: a section or a list by its kind, not its contents.
std::string shown_value(const json& v) {
  if (v.is_object()) return "{...}";
  if (v.is_array()) return "[...]";
  if (v.is_string()) return "\"" + printable(v.get<std::string>()) + "\"";
  return v.dump();
}

// The stages that read a strategy option (DeepSpeed ignores the others' keys).
bool read_at_stage(const std::string& field, int stage) {
  if (field.rfind("strategy.stage3_", 0) == 0 || field == "strategy.offload_param" ||
      field == "strategy.param_buffer_count")
    return stage == 3;
  if (field == "strategy.allgather_bucket_size") return stage == 1 || stage == 2;
  return stage >= 1;
}

// The settings read so far that depend on other keys (the stage, the precision, the offload
// devices): applied once the whole file has been read (finish()).
struct Pending {
  struct Set {
    std::string field, value, key;
  };
  std::vector<Set> zero;  // strategy options, kept by the stage
  std::optional<bool> fp16, bf16, overlap_comm;
  std::vector<Set> fp16_scaling;  // train.* loss-scale fields, with fp16 only
  std::string optimizer_device = "none", optimizer_device_key, param_device = "none", param_device_key;
  std::optional<Set> optimizer_nvme_path, param_nvme_path, param_buffer_count;
  bool accumulation_given = false;
  // Standalone: the "optimizer", "scheduler" and "tensorboard" keys, read together once the stage
  // and the offload are known (the optimizer's type decides which parameters it takes), and the
  // sections among them that were given (an empty "params" says nothing else).
  std::map<std::string, json> engine;
  std::set<std::string> engine_sections;
  // The curriculum_learning keys, read together once "enabled" is known (finish_curriculum()).
  std::map<std::string, json> curriculum;
};

// The sections a standalone run reads key by key; under Megatron-DeepSpeed each is one row.
bool is_engine_section(const std::string& key) {
  return key == "optimizer" || key == "scheduler" || key == "tensorboard";
}

class Reader {
 public:
  // configured: the run's config before the file for `dtk train --deepspeed_config` (DeepSpeed's
  // engine alone); nullptr for Megatron-DeepSpeed's.
  Reader(std::string path, const config::RunConfig* configured)
      : path_(std::move(path)), standalone_(configured != nullptr) {
    if (configured) configured_lr_ = configured->lr().lr();
  }

  DeepSpeedConfig read(const json& root) {
    walk(root, "");
    finish();
    return std::move(out_);
  }

 private:
  std::string shown(const std::string& key) const { return path_ + ": " + printable(key); }
  void refuse(const std::string& key, const json& v, const std::string& why) {
    out_.refused.push_back(shown(key) + " " + shown_value(v) + ": " + why);
  }
  void set(const std::string& field, const std::string& value, const std::string& key) {
    out_.sets.push_back(field + "=" + value);
    out_.key_of[field] = shown(key);
  }

  void walk(const json& obj, const std::string& prefix) {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      const std::string key = prefix + it.key();
      const json& v = it.value();
      if (it.key().find('.') != std::string::npos) {
        refuse(key, v, "a key with a '.' (DeepSpeed reads sections, {\"a\": {\"b\": ...}}, not dotted names)");
        continue;
      }
      if (v.is_null()) {
        // OneCycle's second half takes None as "the first half's" (its default): absent here.
        if (key != "scheduler.params.cycle_second_step_size" && key != "scheduler.params.cycle_second_stair_count")
          refuse(key, v, "give a value or leave the key out (DeepSpeed fails on null)");
        continue;
      }
      if (v.is_string() && v.get<std::string>() == "auto") {
        refuse(key, v,
               "\"auto\" is Hugging Face Trainer's placeholder, filled in before DeepSpeed reads it; give the "
               "value");
        continue;
      }
      const Rule* r = find_rule(key);
      if (is_engine_section(key) && !(standalone_ && v.is_object())) {
        apply(*r, key, v);
      } else if (is_prefix_of_a_rule(key) && (v.is_object() || !r)) {  // a section (zero_optimization: also a bool)
        if (v.is_object()) pending_.engine_sections.insert(key);
        if (v.is_object())
          walk(v, key + ".");
        else
          refuse(key, v, std::string("a JSON ") + v.type_name() + ", not a section (a JSON object)");
      } else if (r) {
        apply(*r, key, v);
      } else {
        refuse(key, v, "not a DeepSpeed config key DTK knows (`dtk config --deepspeed_table` lists them)");
      }
    }
  }

  void apply(const Rule& r, const std::string& key, const json& v) {
    if (key.rfind("curriculum_learning.", 0) == 0) {
      pending_.curriculum[key] = v;
      return;
    }
    if (key.rfind("optimizer.", 0) == 0 || key.rfind("scheduler.", 0) == 0 || key.rfind("tensorboard.", 0) == 0)
      pending_.engine[key] = v;  // read by finish_engine(), also where the row only checks the value
    switch (r.kind) {
      case Kind::kSet: {
        const auto n = whole(key, v, std::string(r.target) == "strategy.stage3_param_persistence_threshold" ? 0 : 1);
        if (!n) return;
        if (key == "gradient_accumulation_steps") pending_.accumulation_given = true;
        if (std::string(r.target).rfind("strategy.", 0) == 0)
          pending_.zero.push_back({r.target, std::to_string(*n), key});
        else
          set(r.target, std::to_string(*n), key);
        return;
      }
      case Kind::kOnly:
        if (v.dump() != r.target && text_of(v) != r.target)
          refuse(key, v, std::string("DTK runs only ") + r.target + ": " + r.note);
        return;
      case Kind::kIgnore:
        if (v.is_object() && v.contains("enabled") && v["enabled"] == false) return;
        out_.ignored.push_back(shown(key) + " (" + r.note + ")");
        return;
      case Kind::kSection:
        // Accepted only where it is plainly off: {"enabled": false ...} or {}. Megatron-DeepSpeed
        // turns some on by their presence (compression_training) or by a value that is not false.
        if (v.is_object() && (v.empty() || (v.contains("enabled") && v["enabled"] == false))) return;
        refuse(key, v, std::string(r.note) + ": leave the section out, or give it \"enabled\": false");
        return;
      case Kind::kCustom:
        return custom(key, v);
    }
  }

  std::optional<bool> boolean(const std::string& key, const json& v) {
    if (v.is_boolean()) return v.get<bool>();
    refuse(key, v, "not true or false");
    return std::nullopt;
  }

  // A whole number of at least `least` (and below 2^63), or nullopt (refused).
  std::optional<long long> whole(const std::string& key, const json& v, long long least) {
    if (v.is_number_unsigned() && v.get<unsigned long long>() <= 9223372036854775807ULL &&
        static_cast<long long>(v.get<unsigned long long>()) >= least)
      return static_cast<long long>(v.get<unsigned long long>());
    if (v.is_number_integer() && !v.is_number_unsigned() && v.get<long long>() >= least) return v.get<long long>();
    if (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()) && v.get<double>() >= least &&
        v.get<double>() < 9.2e18)
      return static_cast<long long>(v.get<double>());
    refuse(key, v, "not a whole number of at least " + std::to_string(least) + " (below 2^63)");
    return std::nullopt;
  }

  // fp32 in any of DeepSpeed's spellings (absent is the same here).
  void fp32_only(const std::string& key, const json& v, const std::string& what) {
    std::string t = v.is_string() ? v.get<std::string>() : "";
    std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
    if (t != "fp32" && t != "float32" && t != "float") refuse(key, v, "DTK " + what + " in fp32 (fp32 or absent)");
  }

  void custom(const std::string& key, const json& v) {
    if (key == "train_batch_size" || key == "train_micro_batch_size_per_gpu") {
      const auto n = whole(key, v, 1);
      if (!n) return;
      const bool global = key == "train_batch_size";
      (global ? out_.train_batch : out_.micro_batch) = *n;
      set(global ? "train.global_batch_size" : "train.micro_batch_size", std::to_string(*n), key);
    } else if (key == "fp16.enabled" || key == "bf16.enabled" || key == "bfloat16.enabled") {
      const auto on = boolean(key, v);
      if (on && key[0] == 'f') pending_.fp16 = *on, fp16_key_ = key;
      if (on && key[0] == 'b') pending_.bf16 = pending_.bf16.value_or(false) || *on, bf16_key_ = key;
    } else if (key == "fp16.loss_scale") {
      if (!v.is_number() || v.get<double>() < 0) return refuse(key, v, "not a number >= 0 (0: dynamic)");
      if (v.get<double>() > 0) pending_.fp16_scaling.push_back({"train.loss_scale", text_of(v), key});
    } else if (key == "fp16.initial_scale_power") {
      const auto k = whole(key, v, 0);
      if (k && *k > 1000) return refuse(key, v, "2^X is past a double's range");
      if (k) pending_.fp16_scaling.push_back({"train.initial_loss_scale", text_of(json(std::ldexp(1.0, *k))), key});
    } else if (key == "fp16.loss_scale_window" || key == "fp16.hysteresis") {
      if (const auto n = whole(key, v, 1))
        pending_.fp16_scaling.push_back({"train." + key.substr(5), std::to_string(*n), key});
    } else if (key == "fp16.min_loss_scale") {
      if (!v.is_number() || !(v.get<double>() > 0)) return refuse(key, v, "not a number > 0");
      pending_.fp16_scaling.push_back({"train.min_loss_scale", text_of(v), key});
    } else if (key == "communication_data_type") {
      fp32_only(key, v, "reduces gradients");
    } else if (key == "data_types.grad_accum_dtype") {
      fp32_only(key, v, "accumulates gradients");
    } else if (key == "gradient_clipping") {
      if (!v.is_number() || v.get<double>() < 0) return refuse(key, v, "not a number >= 0");
      out_.gradient_clipping = v.get<double>(), out_.gradient_clipping_given = true;
      set("train.clip_grad", text_of(v), key);
    } else if (key == "zero_optimization") {  // the older bool form (a section is walked)
      if (!v.is_boolean())
        return refuse(key, v,
                      std::string("a JSON ") + v.type_name() +
                          ", not a section (a JSON object) nor DeepSpeed's older true / false");
      out_.stage = v.get<bool>() ? 1 : 0, stage_key_ = key;
    } else if (key == "zero_optimization.stage") {
      const auto n = whole(key, v, 0);
      if (n && *n > 3) return refuse(key, v, "not one of 0, 1, 2, 3");
      if (n) out_.stage = static_cast<int>(*n), stage_key_ = key;
    } else if (key == "zero_optimization.overlap_comm") {
      pending_.overlap_comm = boolean(key, v);
    } else if (key == "zero_optimization.offload_optimizer.device" || key == "zero_optimization.offload_param.device") {
      const std::string device = v.is_string() ? v.get<std::string>() : "";
      if (device != "none" && device != "cpu" && device != "nvme") return refuse(key, v, "not one of none, cpu, nvme");
      offload(key.find("offload_optimizer") != std::string::npos, device, key);
    } else if (key == "zero_optimization.cpu_offload" || key == "zero_optimization.cpu_offload_param") {
      const auto on = boolean(key, v);
      if (on && *on) offload(key == "zero_optimization.cpu_offload", "cpu", key);
    } else if (key == "zero_optimization.offload_optimizer.nvme_path" ||
               key == "zero_optimization.offload_param.nvme_path") {
      if (!v.is_string() || v.get<std::string>().empty()) return refuse(key, v, "not a folder's path");
      (key.find("offload_optimizer") != std::string::npos ? pending_.optimizer_nvme_path : pending_.param_nvme_path) =
          Pending::Set{"strategy.nvme_path", v.get<std::string>(), key};
    } else if (key == "zero_optimization.offload_param.buffer_count") {
      if (const auto n = whole(key, v, 2))
        pending_.param_buffer_count = Pending::Set{"strategy.param_buffer_count", std::to_string(*n), key};
    } else if (key == "zero_force_ds_cpu_optimizer" || key == "zero_allow_untested_optimizer") {
      if (const auto on = boolean(key, v))
        (key == "zero_force_ds_cpu_optimizer" ? out_.force_ds_cpu_optimizer : out_.allow_untested_optimizer) = *on;
    } else if (is_engine_section(key)) {
      if (standalone_)
        return refuse(key, v, std::string("a JSON ") + v.type_name() + ", not a section (a JSON object)");
      if (key != "tensorboard") return out_.client_sections.push_back(key);
      if (!(v.is_object() && v.contains("enabled") && v["enabled"] == false))
        out_.ignored.push_back(shown(key) + " (" + kEngineMonitor + ")");
    } else if (key == "optimizer.params.max_grad_norm") {
      refuse(key, v, "DeepSpeed refuses it: clipping is the top-level gradient_clipping");
    } else if (key == "steps_per_print") {
      if (!standalone_)
        return out_.ignored.push_back(shown(key) + " (DeepSpeed's own print; the log line is --log-interval)");
      if (const auto n = whole(key, v, 1)) set("logging.log_interval", std::to_string(*n), key);
    } else if (key == "wall_clock_breakdown") {
      const auto on = boolean(key, v);
      if (on && *on) set("logging.timing_log_level", "2", key);
    }
  }

  // One tier's device; the older bool keys and the device keys may not both name a tier (DeepSpeed
  // asserts it).
  void offload(bool optimizer, const std::string& device, const std::string& key) {
    std::string& have_key = optimizer ? pending_.optimizer_device_key : pending_.param_device_key;
    if (!have_key.empty())
      return out_.refused.push_back(shown(key) + ": with " + printable(have_key) +
                                    ", which names the same offload: give one (DeepSpeed asserts it)");
    (optimizer ? pending_.optimizer_device : pending_.param_device) = device;
    have_key = key;
  }

  // The keys that depend on others: precision and its loss scaling; the batch DeepSpeed derives;
  // the strategy by the stage, whose options DeepSpeed reads only where the stage has them.
  void finish() {
    finish_precision();
    finish_batch();
    finish_zero();
    finish_curriculum();  // read by Megatron-DeepSpeed's loop and by DeepSpeed's engine alike
    if (!standalone_) return;
    finish_optimizer();
    finish_scheduler();
    finish_tensorboard();
  }

  void finish_precision() {
    if (pending_.fp16.value_or(false) && pending_.bf16.value_or(false))
      out_.refused.push_back(path_ + ": " + fp16_key_ + " and " + bf16_key_ +
                             " are both true: give one (DeepSpeed asserts it)");
    if (pending_.fp16.value_or(false)) {
      out_.precision = "fp16";
      set("train.params_dtype", "fp16", fp16_key_);
      // DeepSpeed's defaults where Megatron's (DTK's) differ: an initial scale of 2^16.
      set("train.initial_loss_scale", "65536", fp16_key_);
      for (const auto& s : pending_.fp16_scaling) set(s.field, s.value, s.key);
    } else if (pending_.bf16.value_or(false)) {
      out_.precision = "bf16";
      set("train.params_dtype", "bf16", bf16_key_);
    }
    if (!out_.gradient_clipping_given)
      set("train.clip_grad", "1", "gradient_clipping (absent: DeepSpeed's default 1.0)");
  }

  // DeepSpeed's _set_batch_related_parameters: one of the batch sizes must be given; without the
  // accumulation steps and one of the two sizes, the steps are 1.
  void finish_batch() {
    if (!out_.train_batch && !out_.micro_batch)
      out_.refused.push_back(path_ +
                             ": neither train_batch_size nor train_micro_batch_size_per_gpu: DeepSpeed needs one "
                             "(it asserts it)");
    if (!pending_.accumulation_given && !(out_.train_batch && out_.micro_batch))
      set("train.gradient_accumulation_steps", "1", "gradient_accumulation_steps (absent: 1, as DeepSpeed derives it)");
  }

  void finish_zero() {
    auto& p = pending_;
    if (out_.stage == 0) {
      if (p.optimizer_device != "none")
        out_.refused.push_back(shown(p.optimizer_device_key) + " " + p.optimizer_device +
                               " at stage 0: DeepSpeed offloads the optimizer with ZeRO only (stage 1-3)");
      for (const auto& s : p.zero) out_.ignored.push_back(shown(s.key) + " (stage 0: DeepSpeed's ZeRO is off)");
      for (const auto* s : {&p.param_nvme_path, &p.optimizer_nvme_path, &p.param_buffer_count})
        if (*s) out_.ignored.push_back(shown((*s)->key) + " (stage 0: DeepSpeed's ZeRO is off)");
      if (p.param_device != "none")
        out_.ignored.push_back(shown(p.param_device_key) + " (stage 0: DeepSpeed's ZeRO is off)");
      if (p.overlap_comm)
        out_.ignored.push_back(shown("zero_optimization.overlap_comm") + " (stage 0: DeepSpeed's ZeRO is off)");
      return;
    }
    set("strategy.stage", std::to_string(out_.stage), stage_key_);
    const std::string at_stage = " (stage " + std::to_string(out_.stage) + ": ";
    for (const auto& s : p.zero) {
      if (read_at_stage(s.field, out_.stage))
        set(s.field, s.value, s.key);
      else
        out_.ignored.push_back(shown(s.key) + at_stage + "DeepSpeed does not read it at this stage)");
    }
    // The optimizer's tier: nvme swaps at stage 3 only (stages 1-2 offload to host memory).
    std::string optimizer = p.optimizer_device;
    if (optimizer == "nvme" && out_.stage < 3) {
      out_.ignored.push_back(shown(p.optimizer_device_key) + " nvme" + at_stage +
                             "DeepSpeed offloads to host memory; swapping to disk is stage 3's)");
      optimizer = "cpu";
    }
    out_.offload_optimizer = optimizer, out_.offload_optimizer_key = p.optimizer_device_key;
    if (optimizer != "none") set("strategy.offload_optimizer", optimizer, p.optimizer_device_key);
    const std::string param = out_.stage == 3 ? p.param_device : "none";
    if (p.param_device != "none" && out_.stage < 3)
      out_.ignored.push_back(shown(p.param_device_key) + at_stage + "DeepSpeed offloads parameters at stage 3 only)");
    if (param != "none") set("strategy.offload_param", param, p.param_device_key);
    // Each tier's nvme_path and the parameters' buffers count only on that tier's nvme.
    const auto on_nvme = [&](const std::optional<Pending::Set>& s, bool nvme, const char* tier) {
      if (!s) return false;
      if (nvme) return true;
      out_.ignored.push_back(shown(s->key) + " (the " + tier + " are not offloaded to nvme)");
      return false;
    };
    const bool optimizer_path = on_nvme(p.optimizer_nvme_path, optimizer == "nvme", "optimizer's state and masters");
    const bool param_path = on_nvme(p.param_nvme_path, param == "nvme", "parameters");
    if (optimizer_path && param_path && p.optimizer_nvme_path->value != p.param_nvme_path->value)
      out_.refused.push_back(shown(p.param_nvme_path->key) + " " + printable(p.param_nvme_path->value) +
                             ": DTK keeps both tiers' swap files in one folder: give " +
                             printable(p.optimizer_nvme_path->value) + " here too");
    if (optimizer_path)
      set("strategy.nvme_path", p.optimizer_nvme_path->value, p.optimizer_nvme_path->key);
    else if (param_path)
      set("strategy.nvme_path", p.param_nvme_path->value, p.param_nvme_path->key);
    if (on_nvme(p.param_buffer_count, param == "nvme", "parameters"))
      set(p.param_buffer_count->field, p.param_buffer_count->value, p.param_buffer_count->key);
    if (p.overlap_comm.value_or(out_.stage == 3))
      set("strategy.overlap_comm", "true", "zero_optimization.overlap_comm");
  }

  // --- Standalone: DeepSpeed's engine builds the optimizer and the schedule from the file ---

  const json* engine(const std::string& key) const {
    const auto it = pending_.engine.find(key);
    return it == pending_.engine.end() ? nullptr : &it->second;
  }
  bool any_under(const std::string& prefix) const {
    for (const auto& [key, v] : pending_.engine)
      if (key.rfind(prefix, 0) == 0) return true;
    return false;
  }
  // The section's parameters other than `allowed` are refused: DeepSpeed passes them to the
  // optimizer's or the scheduler's constructor, which fails on a name it does not take.
  void only_params(const std::string& prefix, const std::set<std::string>& allowed, const std::string& what) {
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    for (const auto& [key, v] : pending_.engine)
      if (key.rfind(prefix, 0) == 0 && !allowed.count(key.substr(prefix.size())))
        refuse(key, v, "not a parameter of " + what + " (" + list + ")");
  }
  bool flag(const std::string& key, bool absent) {
    const json* v = engine(key);
    if (!v) return absent;
    return boolean(key, *v).value_or(absent);
  }
  // A number of at least `least` (and at most `most`), `absent` when not given, nullopt when refused.
  std::optional<double> number(const std::string& key, double absent, double least, double most = HUGE_VAL) {
    const json* v = engine(key);
    if (!v) return absent;
    if (v->is_array()) {
      refuse(key, *v, "a list (a value per parameter group): DTK takes one value (lr.param_rules scale groups)");
      return std::nullopt;
    }
    if (!v->is_number() || !(v->get<double>() >= least && v->get<double>() <= most)) {
      refuse(key, *v, "not a number in [" + number_text(least) + ", " + number_text(most) + "]");
      return std::nullopt;
    }
    return v->get<double>();
  }
  // Sets `field` from `key`, or from DeepSpeed's default for it (the key named as absent).
  void set_number(const std::string& field, double value, const std::string& key) {
    set(field, number_text(value), engine(key) ? key : key + " (absent: DeepSpeed's default)");
  }

  // deepspeed.initialize's _configure_basic_optimizer: Adam/AdamW (DeepSpeed lowercases its own
  // optimizers' names) or, by torch.optim's exact name, SGD.
  void finish_optimizer() {
    const json* type = engine("optimizer.type");
    if (!type) {
      if (any_under("optimizer."))
        out_.refused.push_back(shown("optimizer") +
                               ": parameters without a \"type\" (DeepSpeed builds no optimizer from them): give "
                               "\"type\", or leave the section out");
      return;
    }
    const std::string name = type->is_string() ? type->get<std::string>() : "";
    std::string lower = name;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lower == "adam" || lower == "adamw") return adam(lower == "adamw");
    if (name == "SGD") return sgd();
    static const std::set<std::string> kDeepSpeeds = {"adagrad", "lamb",   "onebitadam", "zerooneadam", "onebitlamb",
                                                      "lion",    "muadam", "muadamw",    "musgd",       "muon"};
    refuse(
        "optimizer.type", *type,
        std::string(kDeepSpeeds.count(lower) ? "DeepSpeed's optimizer is not built here" : "not an optimizer DTK has") +
            ": Adam, AdamW or SGD");
  }

  void adam(bool adamw) {
    const std::string p = "optimizer.params.";
    only_params(p,
                {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad",
                 "fp32_optimizer_states", "set_grad_none", "foreach", "fused", "max_grad_norm"},
                "DeepSpeed's Adam");
    const bool w_mode = flag(p + "adam_w_mode", true);
    const bool decoupled = adamw || w_mode;  // "Adam" is AdamW unless adam_w_mode is false
    const bool torch_adam = flag(p + "torch_adam", false);
    const bool bias_correction = flag(p + "bias_correction", true);
    if (torch_adam && engine(p + "bias_correction") && engine(p + "bias_correction")->is_boolean())
      refuse(p + "bias_correction", *engine(p + "bias_correction"),
             "with torch_adam: torch's Adam takes no bias_correction (DeepSpeed fails on it)");
    // DeepSpeed's FusedAdam (decoupled, bias-corrected) is adamw; its CPU Adam when offloaded (a
    // torch Adam from the file too: the same update) is cpu_adam, which alone has the L2 mode and
    // uncorrected moments, and steps host tensors only.
    std::string plugin = "adamw";
    if (out_.offload_optimizer != "none") {
      plugin = "cpu_adam";
    } else if (!decoupled || !bias_correction) {
      plugin = "cpu_adam";  // on a GPU only with an offload (check_deepspeed_client)
    }
    out_.optimizer_plugin = plugin;
    lr_from_optimizer();
    const json* betas = engine(p + "betas");
    const auto beta_ok = [](const json& b) { return b.is_number() && b.get<double>() >= 0 && b.get<double>() < 1; };
    if (betas && !(betas->is_array() && betas->size() == 2 && beta_ok((*betas)[0]) && beta_ok((*betas)[1]))) {
      refuse(p + "betas", *betas, "not [beta1, beta2], each in [0, 1)");
    } else {
      set_number("optimizer.beta1", betas ? (*betas)[0].get<double>() : 0.9, p + "betas");
      set_number("optimizer.beta2", betas ? (*betas)[1].get<double>() : 0.999, p + "betas");
    }
    const json* eps = engine(p + "eps");
    if (eps && eps->is_number() && eps->get<double>() == 0)
      refuse(p + "eps", *eps, "DTK's Adam needs eps > 0 (0 divides by zero where a second moment is 0)");
    else if (const auto e = number(p + "eps", 1e-8, 0))
      set_number("optimizer.eps", *e, p + "eps");
    weight_decay(torch_adam && decoupled ? 0.01 : 0.0);
    if (plugin == "cpu_adam") {
      set("optimizer.adamw_mode", decoupled ? "true" : "false",
          engine(p + "adam_w_mode") ? p + "adam_w_mode" : "optimizer.type");
      set("optimizer.bias_correction", bias_correction ? "true" : "false", p + "bias_correction");
    }
  }

  void sgd() {
    const std::string p = "optimizer.params.";
    only_params(p, {"lr", "momentum", "dampening", "weight_decay", "nesterov", "foreach", "fused", "max_grad_norm"},
                "torch's SGD");
    // DeepSpeed asserts zero_allow_untested_optimizer for an optimizer its ZeRO was not tested with.
    for (const auto& r : client_optimizer_refusals(out_, "sgd"))
      out_.refused.push_back(shown("optimizer.type") + " SGD: " + r);
    out_.optimizer_plugin = "sgd";
    lr_from_optimizer();
    const auto momentum = number(p + "momentum", 0, 0);
    if (momentum) set_number("optimizer.momentum", *momentum, p + "momentum");
    const bool nesterov = flag(p + "nesterov", false);
    if (nesterov && momentum && *momentum == 0)
      refuse(p + "nesterov", *engine(p + "nesterov"), "needs a momentum above 0 (torch refuses it)");
    set("optimizer.nesterov", nesterov ? "true" : "false", p + "nesterov");
    weight_decay(0);
  }

  void lr_from_optimizer() {
    if (const auto lr = number("optimizer.params.lr", 0.001, 0)) {
      optimizer_lr_ = *lr;
      set_number("lr.lr", *lr, "optimizer.params.lr");
    }
  }
  void weight_decay(double absent) {
    if (const auto wd = number("optimizer.params.weight_decay", absent, 0)) {
      set_number("lr.weight_decay", *wd, "optimizer.params.weight_decay");
      set("lr.weight_decay_incr_style", "constant", "optimizer.params.weight_decay");
    }
  }

  // Where the file decides the schedule, what the config's schedule had that DeepSpeed's has not
  // (a floor, a warm-up start, Megatron's fractions, samples and WSD) is cleared first.
  void clear_schedule(const std::string& why) {
    for (const char* field :
         {"lr.min_lr", "lr.lr_warmup_init", "lr.lr_warmup_fraction", "lr.lr_warmup_samples", "lr.lr_decay_samples",
          "lr.lr_decay_iters", "lr.lr_wsd_decay_iters", "lr.lr_warmup_iters"})
      set(field, "0", why);
    set("lr.lr_wsd_decay_style", "", why);
  }

  // deepspeed/runtime/lr_schedules.py's WarmupLR, WarmupDecayLR, WarmupCosineLR as lr.* (the
  // styles of the same names compute them with DeepSpeed's step count).
  void finish_scheduler() {
    const json* type = engine("scheduler.type");
    if (!type) {
      if (any_under("scheduler.") || pending_.engine_sections.count("scheduler.params"))
        out_.refused.push_back(shown("scheduler") +
                               ": parameters without a \"type\": give \"type\", or leave the section out");
      else if (engine("optimizer.type")) {  // DeepSpeed keeps the optimizer's rate
        clear_schedule("scheduler (absent: DeepSpeed keeps the optimizer's rate)");
        set("lr.lr_decay_style", "constant", "scheduler (absent: DeepSpeed keeps the optimizer's rate)");
      }
      return;
    }
    const std::string name = type->is_string() ? type->get<std::string>() : "";
    const bool cosine = name == "WarmupCosineLR", cyclic = is_deepspeed_cycle_style(name);
    if (name != "WarmupLR" && name != "WarmupDecayLR" && !cosine && !cyclic)
      return refuse("scheduler.type", *type,
                    "not a scheduler DTK has: WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest or OneCycle");
    if (!pending_.engine_sections.count("scheduler.params"))
      return out_.refused.push_back(shown("scheduler") + ": " + name +
                                    " without \"params\" (DeepSpeed fails on it; {} takes its defaults)");
    if (cyclic) return name == "OneCycle" ? one_cycle() : range_test();
    const std::string p = "scheduler.params.";
    std::set<std::string> allowed = {"warmup_num_steps", "warmup_type", "last_batch_iteration"};
    for (const char* k : cosine ? std::vector<const char*>{"total_num_steps", "warmup_min_ratio", "cos_min_ratio"}
                                : std::vector<const char*>{"warmup_min_lr", "warmup_max_lr"})
      allowed.insert(k);
    if (name == "WarmupDecayLR") allowed.insert("total_num_steps");
    only_params(p, allowed, "DeepSpeed's " + name);
    clear_schedule("scheduler.type");
    set("lr.lr_decay_style", name, "scheduler.type");
    // DeepSpeed checks the warm-up is a positive int (10.0 is refused there too).
    const json* warmup = engine(p + "warmup_num_steps");
    if (warmup && !(warmup->is_number_integer() && warmup->get<long long>() >= 1))
      refuse(p + "warmup_num_steps", *warmup, "not a whole number of at least 1 (DeepSpeed's check)");
    else
      set("lr.lr_warmup_iters", warmup ? std::to_string(warmup->get<long long>()) : "1000",
          warmup ? p + "warmup_num_steps" : p + "warmup_num_steps (absent: 1000)");
    const json* shape = engine(p + "warmup_type");
    if (shape && !(shape->is_string() && (*shape == "log" || *shape == "linear")))
      refuse(p + "warmup_type", *shape, "not log or linear (DeepSpeed would warn and take log)");
    else
      set("lr.lr_warmup_style", shape ? shape->get<std::string>() : "log",
          shape ? p + "warmup_type" : p + "warmup_type (absent: log)");
    if (name != "WarmupLR") {
      const json* total = engine(p + "total_num_steps");
      if (!total)
        out_.refused.push_back(shown("scheduler") + ": " + name +
                               " without params.total_num_steps (DeepSpeed needs it)");
      else if (const auto t = whole(p + "total_num_steps", *total, 1))
        set("lr.lr_decay_iters", std::to_string(*t), p + "total_num_steps");
    }
    if (cosine) {  // ratios of the optimizer's rate: the file's, or the config's
      const double base = optimizer_lr_.value_or(configured_lr_);
      out_.cosine_base_lr = base;
      if (const auto r = number(p + "warmup_min_ratio", 0, 0, 1))
        set_number("lr.lr_warmup_init", *r * base, p + "warmup_min_ratio");
      if (const auto r = number(p + "cos_min_ratio", 0.0001, 0, 1))
        set_number("lr.min_lr", *r * base, p + "cos_min_ratio");
      return;
    }
    if (const auto min = number(p + "warmup_min_lr", 0, 0)) {
      set_number("lr.lr_warmup_init", *min, p + "warmup_min_lr");
      set_number("lr.min_lr", *min, p + "warmup_min_lr");
    }
    // WarmupLR's peak is the optimizer's rate unless given; WarmupDecayLR's is 0.001 unless given.
    if (engine(p + "warmup_max_lr") || name == "WarmupDecayLR")
      if (const auto max = number(p + "warmup_max_lr", 0.001, 0)) set_number("lr.lr", *max, p + "warmup_max_lr");
  }

  // A whole number of steps from `key` into `field`, DeepSpeed's default when absent (nothing
  // when it has none). OneCycle takes a float step size too (DTK counts whole updates: 10.0 is
  // 10); LRRangeTest wants an int.
  enum class Steps { kWhole, kInt };
  void steps(const std::string& key, const std::string& field, long long least, std::optional<long long> absent,
             Steps kind = Steps::kWhole) {
    const json* v = engine(key);  // (a null is not kept: see walk)
    if (v && kind == Steps::kInt && !v->is_number_integer())
      return refuse(key, *v, "not a whole number (DeepSpeed's LRRangeTest asks for an int)");
    if (v) {
      if (const auto n = whole(key, *v, least)) set(field, std::to_string(*n), key);
    } else if (absent) {
      set(field, std::to_string(*absent), key + " (absent: DeepSpeed's default)");
    }
  }
  void boolean_field(const std::string& key, const std::string& field, bool absent) {
    set(field, flag(key, absent) ? "true" : "false", engine(key) ? key : key + " (absent: DeepSpeed's default)");
  }

  // lr_schedules.py's LRRangeTest: the rate grows from lr_range_test_min_lr (lr.lr).
  void range_test() {
    const std::string p = "scheduler.params.";
    only_params(p,
                {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                 "lr_range_test_staircase", "last_batch_iteration"},
                "DeepSpeed's LRRangeTest");
    clear_schedule("scheduler.type");
    set("lr.lr_decay_style", "LRRangeTest", "scheduler.type");
    if (const auto min = number(p + "lr_range_test_min_lr", 0.001, 0))
      set_number("lr.lr", *min, p + "lr_range_test_min_lr");
    steps(p + "lr_range_test_step_size", "lr.lr_range_test_step_size", 1, 2000, Steps::kInt);
    if (const auto rate = number(p + "lr_range_test_step_rate", 1.0, -HUGE_VAL))
      set_number("lr.lr_range_test_step_rate", *rate, p + "lr_range_test_step_rate");
    boolean_field(p + "lr_range_test_staircase", "lr.lr_range_test_staircase", false);
  }

  // lr_schedules.py's OneCycle: the rate between cycle_min_lr (lr.min_lr) and cycle_max_lr (lr.lr),
  // Adam's beta1 between cycle_max_mom and cycle_min_mom.
  void one_cycle() {
    const std::string p = "scheduler.params.";
    only_params(p,
                {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"},
                "DeepSpeed's OneCycle");
    clear_schedule("scheduler.type");
    set("lr.lr_decay_style", "OneCycle", "scheduler.type");
    for (const auto& [key, field] : {std::pair{"cycle_min_lr", "lr.min_lr"}, std::pair{"cycle_max_lr", "lr.lr"}}) {
      if (!engine(p + key)) {
        out_.refused.push_back(shown("scheduler") + ": OneCycle without params." + key + " (DeepSpeed needs it)");
        continue;
      }
      if (const auto v = number(p + key, 0, 0)) set_number(field, *v, p + key);
    }
    steps(p + "cycle_first_step_size", "lr.cycle_first_step_size", 1, 2000);
    steps(p + "cycle_second_step_size", "lr.cycle_second_step_size", 0, std::nullopt);
    steps(p + "cycle_first_stair_count", "lr.cycle_first_stair_count", 0, 0);
    steps(p + "cycle_second_stair_count", "lr.cycle_second_stair_count", 0, std::nullopt);
    steps(p + "decay_step_size", "lr.decay_step_size", 0, 0);
    for (const char* key : {"decay_lr_rate", "decay_mom_rate"})
      if (const auto v = number(p + key, 0, -HUGE_VAL)) set_number(std::string("lr.") + key, *v, p + key);
    boolean_field(p + "cycle_momentum", "lr.cycle_momentum", true);
    for (const auto& [key, absent] : {std::pair{"cycle_min_mom", 0.8}, std::pair{"cycle_max_mom", 0.9}})
      if (const auto v = number(p + key, absent, 0, 1)) set_number(std::string("lr.") + key, *v, p + key);
  }

  // DeepSpeed's legacy curriculum_learning: read only when "enabled" is true (Megatron-DeepSpeed
  // turns the curriculum on by it; DeepSpeed's own reader fails on a section without it), then
  // with the keys DeepSpeed asserts.
  void finish_curriculum() {
    const std::map<std::string, json>& c = pending_.curriculum;
    if (c.empty()) return;
    const std::string p = "curriculum_learning.";
    const auto at = [&](const std::string& k) -> const json* {
      const auto it = c.find(p + k);
      return it == c.end() ? nullptr : &it->second;
    };
    const json* enabled = at("enabled");
    if (!enabled)
      return out_.ignored.push_back(shown("curriculum_learning") +
                                    " (no \"enabled\": off, as Megatron-DeepSpeed reads it; DeepSpeed's own reader "
                                    "fails on it)");
    const std::optional<bool> on = boolean(p + "enabled", *enabled);
    if (!on || !*on) return;
    const auto required = [&](const std::string& k, const std::string& why) -> const json* {
      const json* v = at(k);
      if (!v) out_.refused.push_back(shown(p + k) + ": required with \"enabled\": true (" + why + ")");
      return v;
    };
    // Megatron-DeepSpeed's pipeline path cuts by the length without reading curriculum_type:
    // absent is seqlen.
    if (const json* type = at("curriculum_type"))
      if (!type->is_string() || type->get<std::string>() != "seqlen")
        refuse(p + "curriculum_type", *type,
               "DTK's curriculum is by sequence length, \"seqlen\" (Megatron-DeepSpeed cuts each sample to it)");
    for (const char* k : {"min_difficulty", "max_difficulty"})
      if (const json* v = required(k, "DeepSpeed asserts it"))
        if (const auto n = whole(p + k, *v, 1)) set(std::string("train.curriculum_") + k, std::to_string(*n), p + k);
    const json* type = required("schedule_type", "fixed_linear, fixed_root or fixed_discrete");
    if (!type) return;
    const std::string schedule = type->is_string() ? type->get<std::string>() : "";
    if (schedule == "custom")
      return refuse(p + "schedule_type", *type,
                    "DeepSpeed's custom schedule is a Python function (set_custom_curriculum_learning_schedule); use "
                    "fixed_linear, fixed_root or fixed_discrete");
    if (schedule != "fixed_linear" && schedule != "fixed_root" && schedule != "fixed_discrete")
      return refuse(p + "schedule_type", *type, "not one of fixed_linear, fixed_root, fixed_discrete");
    set("train.curriculum_schedule", schedule, p + "schedule_type");
    finish_curriculum_schedule(schedule, at);
  }

  // The schedule_config keys the schedule reads (DeepSpeed asserts each), and a note for the others.
  template <class At>
  void finish_curriculum_schedule(const std::string& schedule, const At& at) {
    struct Key {
      const char* name;
      const char* field;
      bool read;
    };
    const bool discrete = schedule == "fixed_discrete";
    for (const Key& k : {Key{"total_curriculum_step", "train.curriculum_total_step", !discrete},
                         Key{"difficulty_step", "train.curriculum_difficulty_step", !discrete},
                         Key{"root_degree", "train.curriculum_root_degree", schedule == "fixed_root"},
                         Key{"difficulty", "train.curriculum_discrete_difficulty", discrete},
                         Key{"max_step", "train.curriculum_discrete_max_step", discrete}}) {
      const std::string key = std::string("curriculum_learning.schedule_config.") + k.name;
      const json* v = at(std::string("schedule_config.") + k.name);
      if (!k.read) {
        if (v) out_.ignored.push_back(shown(key) + " (schedule_type " + schedule + " does not read it)");
      } else if (!v) {
        out_.refused.push_back(shown(key) + ": required by schedule_type " + schedule + " (DeepSpeed asserts it)");
      } else if (std::strcmp(k.name, "root_degree") == 0) {
        if (v->is_number() && v->get<double>() > 0)
          set(k.field, text_of(*v), key);
        else
          refuse(key, *v, "not a number > 0");
      } else if (discrete) {
        if (!v->is_array() || v->empty()) {
          refuse(key, *v, "not a list of lengths or steps ([64, 128])");
          continue;
        }
        std::string list;
        for (const json& item : *v)
          if (const auto n = whole(key, item, 1)) list += (list.empty() ? "" : ",") + std::to_string(*n);
        set(k.field, list, key);
      } else if (const auto n = whole(key, *v, 1)) {
        set(k.field, std::to_string(*n), key);
      }
    }
  }

  // DeepSpeed's TensorBoard monitor writes to output_path/job_name when enabled.
  void finish_tensorboard() {
    if (!flag("tensorboard.enabled", false)) return;
    const auto text = [&](const std::string& key, const std::string& absent) -> std::optional<std::string> {
      const json* v = engine(key);
      if (!v) return absent;
      const bool control = v->is_string() &&
                           std::any_of(v->get_ref<const std::string&>().begin(), v->get_ref<const std::string&>().end(),
                                       [](unsigned char c) { return c < 0x20 || c == 0x7f; });
      if (!v->is_string() || control) {
        refuse(key, *v, control ? "holds a control character: not a folder's name" : "not a string");
        return std::nullopt;
      }
      return v->get<std::string>();
    };
    const auto output = text("tensorboard.output_path", ""), job = text("tensorboard.job_name", "DeepSpeedJobName");
    if (!output || !job) return;
    if (job->empty()) return out_.refused.push_back(shown("tensorboard.job_name") + ": empty (the folder's name)");
    set("logging.tensorboard_dir", output->empty() ? *job : (std::filesystem::path(*output) / *job).string(),
        engine("tensorboard.output_path") ? "tensorboard.output_path" : "tensorboard.job_name");
  }

  std::string path_;
  bool standalone_ = false;
  double configured_lr_ = 0;
  std::optional<double> optimizer_lr_;  // the file's optimizer's rate (given or DeepSpeed's default)
  std::string stage_key_ = "zero_optimization.stage", fp16_key_ = "fp16.enabled", bf16_key_ = "bf16.enabled";
  Pending pending_;
  DeepSpeedConfig out_;
};

// A key given twice in one object is refused rather than kept last, as a plain JSON reader keeps
// it; nesting deeper than a config ever is (a broken or hostile file) is refused before it can
// exhaust the stack.
json parse_config(const std::string& text, const std::string& path) {
  constexpr int kMaxDepth = 32;
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  const auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxDepth)
      throw HostError(path + ": nested deeper than " + std::to_string(kMaxDepth) +
                      " levels (a DeepSpeed config is a few levels deep)");
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    if (event == json::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    if (event == json::parse_event_t::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
        duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  json j;
  try {
    j = json::parse(text, callback);
  } catch (const json::exception& e) {
    throw HostError(path + ": not valid JSON (" + printable(e.what()) + ")");
  }
  if (!duplicate.empty())
    throw HostError(path + ": the key \"" + printable(duplicate) +
                    "\" is given twice in one section (a JSON reader would keep the last without a word)");
  if (!j.is_object()) throw HostError(path + ": not a JSON object (a DeepSpeed config is {\"key\": value, ...})");
  return j;
}

// The file's text: a regular file of at most 16 MiB.
std::string file_text(const std::string& path) {
  if (path.empty()) throw HostError("an empty path, not a DeepSpeed config file");
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(status)) throw HostError(path + ": a directory, not a DeepSpeed config file");
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
    throw HostError(path + ": not a regular file (a pipe or a device), not a DeepSpeed config file");
  constexpr std::uintmax_t kMaxBytes = 16u << 20;
  if (std::filesystem::exists(status) && std::filesystem::file_size(path, ec) > kMaxBytes)
    throw HostError(path + ": larger than 16 MiB, not a DeepSpeed config file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw HostError(path + ": cannot read the DeepSpeed config (" + std::strerror(errno) + ")");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

DeepSpeedConfig read_deepspeed_config(const std::string& path) {
  return Reader(path, nullptr).read(parse_config(file_text(path), path));
}

DeepSpeedConfig read_standalone_deepspeed_config(const std::string& path, const config::RunConfig& configured) {
  return Reader(path, &configured).read(parse_config(file_text(path), path));
}

std::vector<std::string> client_optimizer_refusals(const DeepSpeedConfig& ds, const std::string& optimizer) {
  std::vector<std::string> refused;
  // DeepSpeed tests its ZeRO with its own optimizers (Adam and the like), not torch's SGD.
  if (optimizer == "sgd" && ds.stage >= 1 && !ds.allow_untested_optimizer)
    refused.push_back("the sgd optimizer with zero_optimization.stage " + std::to_string(ds.stage) +
                      ": DeepSpeed refuses an optimizer its ZeRO was not tested with (zero_allow_untested_optimizer: "
                      "true allows it)");
  // ZeRO-Offload steps on the host with DeepSpeed's CPU Adam (the cpu_adam plugin).
  if (ds.offload_optimizer != "none" && optimizer != "cpu_adam") {
    const std::string offload =
        ds.offload_optimizer_key + " " + ds.offload_optimizer + " with the " + optimizer + " optimizer";
    if (optimizer != "adamw")
      refused.push_back(offload + ": the offloaded step is Adam's (cpu_adam)");
    else if (ds.force_ds_cpu_optimizer)
      refused.push_back(offload +
                        ": DeepSpeed refuses ZeRO-Offload with an optimizer other than its CPU Adam (the cpu_adam "
                        "plugin; zero_force_ds_cpu_optimizer: false allows it)");
  }
  return refused;
}

std::string deepspeed_key_table() {
  std::string out = "| DeepSpeed config key | DTK |\n|---|---|\n";
  for (const Rule& r : kRules) {
    const std::string note = r.note;
    std::string dtk;
    switch (r.kind) {
      case Kind::kSet:
        dtk = std::string("`") + r.target + "`" + (note.empty() ? "" : " (" + note + ")");
        break;
      case Kind::kOnly:
        dtk = std::string("`") + r.target + "` only: " + note;
        break;
      case Kind::kIgnore:
        dtk = "no effect: " + note;
        break;
      case Kind::kSection:
        dtk = "refused unless `\"enabled\": false` (or `{}`): " + note;
        break;
      case Kind::kCustom:
        dtk = (*r.target ? std::string("`") + r.target + "`" + (note.empty() ? "" : "; ") : "") + note;
        break;
    }
    out += std::string("| `") + r.key + "` | " + dtk + " |\n";
  }
  return out;
}

}  // namespace dtk::core
