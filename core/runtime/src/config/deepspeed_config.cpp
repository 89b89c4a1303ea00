// DeepSpeed's JSON config -> DTK settings (dtk/core/config/deepspeed_config.hpp).
#include "dtk/core/config/deepspeed_config.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dtk/host/error.hpp"

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
    "DeepSpeed's monitor of its engine; Megatron's loop logs with --tensorboard-dir (logging.tensorboard_dir)";
constexpr const char* kZeroPlusPlus = "ZeRO++'s quantized or hierarchical communication is not built";

// The order is the docs table's.
const Rule kRules[] = {
    // Batch
    {"train_batch_size", Kind::kCustom, "train.global_batch_size",
     "must equal --global-batch-size when both are given"},
    {"train_micro_batch_size_per_gpu", Kind::kCustom, "train.micro_batch_size",
     "must equal --micro-batch-size when both are given"},
    {"gradient_accumulation_steps", Kind::kSet, "train.gradient_accumulation_steps",
     "global batch = micro x data-parallel size x this, checked at start"},
    // Precision
    {"fp16.enabled", Kind::kCustom, "train.params_dtype=fp16",
     "DeepSpeed casts the model to fp16 (a Megatron --bf16 with it is refused); fp32 masters always"},
    {"fp16.loss_scale", Kind::kCustom, "train.loss_scale", "0 (the default): dynamic; more: a static scale"},
    {"fp16.initial_scale_power", Kind::kCustom, "train.initial_loss_scale", "2^X (DeepSpeed's default 16: 65536)"},
    {"fp16.loss_scale_window", Kind::kCustom, "train.loss_scale_window", "DeepSpeed's default 1000"},
    {"fp16.hysteresis", Kind::kCustom, "train.hysteresis", "DeepSpeed's default 2"},
    {"fp16.min_loss_scale", Kind::kCustom, "train.min_loss_scale", "DeepSpeed's default 1"},
    {"fp16.consecutive_hysteresis", Kind::kOnly, "false",
     "DTK restores the hysteresis only when the scale grows (DeepSpeed's default), not after every clean step"},
    {"fp16.auto_cast", Kind::kOnly, "false", "DTK's fp16 parameters are fp16 themselves, not an autocast fp32 model"},
    {"fp16.fp16_master_weights_and_grads", Kind::kOnly, "false", "the optimizer steps fp32 masters always"},
    {"bf16.enabled", Kind::kCustom, "train.params_dtype=bf16",
     "DeepSpeed casts the model to bf16 (a Megatron --fp16 with it is refused); fp32 masters always"},
    {"bf16.immediate_grad_update", Kind::kIgnore, "", "gradients accumulate in fp32 either way"},
    {"amp.enabled", Kind::kOnly, "false",
     "Apex AMP is not built: DTK trains fp16 or bf16 parameters with fp32 masters (fp16.enabled, bf16.enabled)"},
    {"communication_data_type", Kind::kCustom, "",
     "fp32 (or absent): accepted, DTK reduces gradients in fp32 (DeepSpeed's default is the parameters' type); "
     "fp16, bf16: refused"},
    {"data_types.grad_accum_dtype", Kind::kOnly, "\"fp32\"", "DTK accumulates gradients in fp32"},
    {"gradient_clipping", Kind::kCustom, "train.clip_grad",
     "absent: 0, no clipping (DeepSpeed's default); Megatron's --clip-grad has no effect under --deepspeed "
     "(said at start when it differs)"},
    {"prescale_gradients", Kind::kIgnore, "", "where the average divides; DTK reduces in fp32, the same average"},
    {"gradient_predivide_factor", Kind::kIgnore, "",
     "where the average divides; DTK reduces in fp32, the same average"},
    {"sparse_gradients", Kind::kOnly, "false", "sparse embedding gradients are not in DTK's models"},
    // ZeRO
    {"zero_optimization.stage", Kind::kCustom, "strategy",
     "0: the ddp strategy (the other zero_optimization keys then have no effect, as in DeepSpeed); 1, 2, 3: the "
     "zero strategy, strategy.stage"},
    {"zero_optimization.allgather_partitions", Kind::kOnly, "true",
     "DTK all-gathers the updated partitions (an all-reduce instead is not built)"},
    {"zero_optimization.allgather_bucket_size", Kind::kSet, "strategy.allgather_bucket_size", ""},
    {"zero_optimization.overlap_comm", Kind::kCustom, "strategy.overlap_comm", "absent: on with stage 3, as DeepSpeed"},
    {"zero_optimization.reduce_scatter", Kind::kOnly, "true", "gradients are always reduce-scattered"},
    {"zero_optimization.reduce_bucket_size", Kind::kSet, "strategy.reduce_bucket_size", ""},
    {"zero_optimization.contiguous_gradients", Kind::kOnly, "true", "always on"},
    {"zero_optimization.offload_optimizer.device", Kind::kCustom, "strategy.offload_optimizer",
     "none, cpu, nvme; cpu and nvme step with the cpu_adam plugin (Megatron-DeepSpeed's --cpu-optimizer)"},
    {"zero_optimization.offload_optimizer.nvme_path", Kind::kCustom, "strategy.nvme_path", ""},
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
     "one folder for both tiers: must equal the optimizer's when both are given"},
    {"zero_optimization.offload_param.buffer_count", Kind::kSet, "strategy.param_buffer_count", ""},
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
    {"zero_optimization.cpu_offload_params", Kind::kCustom, "strategy.offload_param=cpu",
     "DeepSpeed's older key: true is offload_param.device cpu"},
    {"zero_optimization.cpu_offload_use_pin_memory", Kind::kIgnore, "", "host memory is always pinned"},
    {"zero_optimization.zero_hpz_partition_size", Kind::kOnly, "1", kZeroPlusPlus},
    {"zero_optimization.zero_quantized_weights", Kind::kOnly, "false", kZeroPlusPlus},
    {"zero_optimization.zero_quantized_nontrainable_weights", Kind::kOnly, "false", kZeroPlusPlus},
    {"zero_optimization.zero_quantized_gradients", Kind::kOnly, "false", kZeroPlusPlus},
    {"zero_optimization.mics_shard_size", Kind::kOnly, "-1", "MiCS's sub-group sharding is not built"},
    {"zero_optimization.mics_hierarchical_params_gather", Kind::kOnly, "false", "MiCS is not built"},
    {"zero_allow_untested_optimizer", Kind::kIgnore, "", "DTK's ZeRO steps any optimizer plugin"},
    {"zero_force_ds_cpu_optimizer", Kind::kCustom, "",
     "false: an offload with Megatron's Adam is accepted (its update on the host is the cpu_adam plugin's)"},
    {"aio", Kind::kIgnore, "", "fixed: 4 MiB blocks, 32 in flight, O_DIRECT where the filesystem allows"},
    {"activation_checkpointing", Kind::kIgnore, "",
     "where DeepSpeed keeps the recomputed layers' inputs (partitioned, contiguous, on the host); DTK keeps them "
     "whole on the device, the same results (recomputation itself: --recompute-*, --checkpoint-activations)"},
    // What Megatron-DeepSpeed passes DeepSpeed itself
    {"optimizer", Kind::kCustom, "",
     "no effect: Megatron-DeepSpeed passes DeepSpeed its own optimizer (--optimizer, --adam-*, --lr, "
     "--weight-decay), which DeepSpeed uses instead (said at start)"},
    {"scheduler", Kind::kCustom, "",
     "no effect: Megatron-DeepSpeed passes its own schedule (--lr-decay-style, --lr-warmup-*), which DeepSpeed uses "
     "instead (said at start)"},
    // Logging
    {"steps_per_print", Kind::kIgnore, "", "DeepSpeed's own print; the log line is --log-interval"},
    {"wall_clock_breakdown", Kind::kCustom, "logging.timing_log_level=2",
     "true: every timer in the log line (a --timing-log-level wins)"},
    {"memory_breakdown", Kind::kIgnore, "", "DeepSpeed's own print of memory use"},
    {"dump_state", Kind::kIgnore, "", "DeepSpeed's print of its state; `dtk config` prints DTK's"},
    {"tensorboard", Kind::kIgnore, "", kEngineMonitor},
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
    // Features DTK does not have
    {"curriculum_learning", Kind::kSection, "", "curriculum learning is not built"},
    {"data_efficiency", Kind::kSection, "", "DeepSpeed's data efficiency library is not built"},
    {"compression_training", Kind::kSection, "", "compression training is not built"},
    {"elasticity", Kind::kSection, "", "elastic training is not built"},
    {"autotuning", Kind::kSection, "", "DeepSpeed's autotuner is not built"},
    {"progressive_layer_drop", Kind::kSection, "", "progressive layer drop is not built"},
    {"eigenvalue", Kind::kSection, "", "eigenvalue computation is not built"},
    {"quantize_training", Kind::kSection, "", "quantized training is not built"},
    {"sparse_attention", Kind::kSection, "", "sparse attention is not built"},
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
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18)
      return std::to_string(static_cast<long long>(d));
    char buf[40];
    for (int digits = 6; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof buf, "%.*g", digits, d);
      if (std::strtod(buf, nullptr) == d) break;
    }
    return buf;
  }
  return v.dump();
}

// The settings read so far that depend on other keys (the stage, the precision): applied once
// the whole file has been read (finish()).
struct Pending {
  struct Set {
    std::string field, value, key;
  };
  std::vector<Set> zero;  // strategy options, kept by the stage
  std::optional<bool> fp16, bf16, overlap_comm;
  std::vector<Set> fp16_scaling;  // train.* loss-scale fields, with fp16 only
  std::string nvme_path, nvme_path_key;
};

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  DeepSpeedConfig read(const json& root) {
    walk(root, "");
    finish();
    return std::move(out_);
  }

 private:
  std::string shown(const std::string& key) const { return path_ + ": " + key; }
  void refuse(const std::string& key, const json& v, const std::string& why) {
    out_.refused.push_back(shown(key) + " " + (v.is_string() ? v.get<std::string>() : v.dump()) + ": " + why);
  }
  void set(const std::string& field, const std::string& value, const std::string& key) {
    out_.sets.push_back(field + "=" + value);
    out_.key_of[field] = shown(key);
  }

  void walk(const json& obj, const std::string& prefix) {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      const std::string key = prefix + it.key();
      const json& v = it.value();
      if (v.is_null()) continue;  // DeepSpeed reads null as the key's default
      if (v.is_string() && v.get<std::string>() == "auto") {
        refuse(key, v, "\"auto\" is filled in by Hugging Face's Trainer; give the value");
        continue;
      }
      if (const Rule* r = find_rule(key)) {
        apply(*r, key, v);
      } else if (v.is_object() && is_prefix_of_a_rule(key)) {
        walk(v, key + ".");
      } else {
        refuse(key, v, "not a DeepSpeed config key DTK knows (`dtk config --deepspeed_table` lists them)");
      }
    }
  }

  // A number or a bool, as config text; "" (and refused) otherwise.
  std::string scalar(const std::string& key, const json& v) {
    if (v.is_number() || v.is_boolean()) return text_of(v);
    refuse(key, v, std::string("a JSON ") + v.type_name() + ", not a number or a bool");
    return "";
  }

  void apply(const Rule& r, const std::string& key, const json& v) {
    switch (r.kind) {
      case Kind::kSet: {
        const std::string value = scalar(key, v);
        if (value.empty()) return;
        if (std::string(r.target).rfind("strategy.", 0) == 0)
          pending_.zero.push_back({r.target, value, key});
        else
          set(r.target, value, key);
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
        if (v.is_object() && v.contains("enabled") && v["enabled"] == true) refuse(key, v["enabled"], r.note);
        if (!v.is_object()) refuse(key, v, std::string("a section (a JSON object) is expected; ") + r.note);
        return;
      case Kind::kCustom:
        return custom(key, v);
    }
  }

  bool boolean(const std::string& key, const json& v) {
    if (!v.is_boolean()) refuse(key, v, "not true or false");
    return v.is_boolean() && v.get<bool>();
  }

  // A whole number of at least `least`, or nullopt (refused).
  std::optional<long long> whole(const std::string& key, const json& v, long long least) {
    if (v.is_number() && v.get<double>() == std::floor(v.get<double>()) && v.get<double>() >= least &&
        v.get<double>() < 9.2e18)
      return static_cast<long long>(v.get<double>());
    refuse(key, v, "not a whole number of at least " + std::to_string(least));
    return std::nullopt;
  }

  void custom(const std::string& key, const json& v) {
    if (key == "train_batch_size" || key == "train_micro_batch_size_per_gpu") {
      const auto n = whole(key, v, 1);
      if (!n) return;
      const bool global = key == "train_batch_size";
      (global ? out_.train_batch : out_.micro_batch) = *n;
      set(global ? "train.global_batch_size" : "train.micro_batch_size", std::to_string(*n), key);
    } else if (key == "fp16.enabled" || key == "bf16.enabled") {
      const bool on = boolean(key, v);
      (key[0] == 'f' ? pending_.fp16 : pending_.bf16) = on;
    } else if (key == "fp16.loss_scale") {
      if (!v.is_number() || v.get<double>() < 0) return refuse(key, v, "not a number >= 0 (0: dynamic)");
      if (v.get<double>() > 0) pending_.fp16_scaling.push_back({"train.loss_scale", text_of(v), key});
    } else if (key == "fp16.initial_scale_power") {
      const auto k = whole(key, v, 0);
      if (k && *k > 1000) return refuse(key, v, "2^X is past a double's range");
      if (k) pending_.fp16_scaling.push_back({"train.initial_loss_scale", text_of(json(std::ldexp(1.0, *k))), key});
    } else if (key == "fp16.loss_scale_window" || key == "fp16.hysteresis" || key == "fp16.min_loss_scale") {
      const std::string value = scalar(key, v);
      if (!value.empty()) pending_.fp16_scaling.push_back({"train." + key.substr(5), value, key});
    } else if (key == "communication_data_type") {
      if (!v.is_string() || v.get<std::string>() != "fp32")
        refuse(key, v, "DTK reduces gradients in fp32 (fp32 or absent)");
    } else if (key == "gradient_clipping") {
      if (!v.is_number() || v.get<double>() < 0) return refuse(key, v, "not a number >= 0");
      out_.gradient_clipping = v.get<double>();
      set("train.clip_grad", text_of(v), key);
    } else if (key == "zero_optimization.stage") {
      const auto n = whole(key, v, 0);
      if (n && *n > 3) return refuse(key, v, "not one of 0, 1, 2, 3");
      if (n) out_.stage = static_cast<int>(*n), stage_key_ = key;
    } else if (key == "zero_optimization.overlap_comm") {
      pending_.overlap_comm = boolean(key, v);
    } else if (key == "zero_optimization.offload_optimizer.device" || key == "zero_optimization.offload_param.device") {
      const std::string device = v.is_string() ? v.get<std::string>() : "";
      if (device != "none" && device != "cpu" && device != "nvme") return refuse(key, v, "not one of none, cpu, nvme");
      const bool optimizer = key.find("offload_optimizer") != std::string::npos;
      if (optimizer) out_.offload_optimizer = device;
      pending_.zero.push_back({optimizer ? "strategy.offload_optimizer" : "strategy.offload_param", device, key});
    } else if (key == "zero_optimization.cpu_offload" || key == "zero_optimization.cpu_offload_params") {
      if (!boolean(key, v)) return;
      const bool optimizer = key == "zero_optimization.cpu_offload";
      if (optimizer) out_.offload_optimizer = "cpu";
      pending_.zero.push_back({optimizer ? "strategy.offload_optimizer" : "strategy.offload_param", "cpu", key});
    } else if (key.size() > 10 && key.compare(key.size() - 10, 10, ".nvme_path") == 0) {
      if (!v.is_string() || v.get<std::string>().empty()) return refuse(key, v, "not a folder's path");
      if (!pending_.nvme_path.empty() && pending_.nvme_path != v.get<std::string>())
        return refuse(
            key, v,
            "DTK keeps both tiers' swap files in one folder: give " + pending_.nvme_path_key + "'s path here too");
      if (pending_.nvme_path.empty()) pending_.zero.push_back({"strategy.nvme_path", v.get<std::string>(), key});
      pending_.nvme_path = v.get<std::string>(), pending_.nvme_path_key = key;
    } else if (key == "zero_force_ds_cpu_optimizer") {
      out_.force_ds_cpu_optimizer = boolean(key, v);
    } else if (key == "optimizer" || key == "scheduler") {
      out_.client_sections.push_back(key);
    } else if (key == "wall_clock_breakdown") {
      if (boolean(key, v)) set("logging.timing_log_level", "2", key);
    }
  }

  // The keys that depend on others: precision and its loss scaling; the strategy by the stage,
  // whose options DeepSpeed reads only where the stage has them.
  void finish() {
    if (pending_.fp16.value_or(false) && pending_.bf16.value_or(false))
      out_.refused.push_back(path_ + ": fp16.enabled and bf16.enabled are both true: give one (DeepSpeed asserts it)");
    if (pending_.fp16.value_or(false)) {
      out_.precision = "fp16";
      set("train.params_dtype", "fp16", "fp16.enabled");
      // DeepSpeed's defaults where Megatron's (DTK's) differ: an initial scale of 2^16.
      set("train.initial_loss_scale", "65536", "fp16.initial_scale_power");
      for (const auto& s : pending_.fp16_scaling) set(s.field, s.value, s.key);
    } else if (pending_.bf16.value_or(false)) {
      out_.precision = "bf16";
      set("train.params_dtype", "bf16", "bf16.enabled");
    }
    if (out_.stage == 0) {
      for (const auto& s : pending_.zero) out_.ignored.push_back(shown(s.key) + " (stage 0: DeepSpeed's ZeRO is off)");
      if (out_.offload_optimizer != "none") out_.offload_optimizer = "none";
      if (pending_.overlap_comm)
        out_.ignored.push_back(shown("zero_optimization.overlap_comm") + " (stage 0: DeepSpeed's ZeRO is off)");
      return;
    }
    out_.strategy = "zero";
    set("strategy.stage", std::to_string(out_.stage), stage_key_);
    const auto stage3_only = [](const std::string& field) {
      return field.rfind("strategy.stage3_", 0) == 0 || field == "strategy.offload_param" ||
             field == "strategy.param_buffer_count";
    };
    for (const auto& s : pending_.zero) {
      if (out_.stage < 3 && stage3_only(s.field))
        out_.ignored.push_back(shown(s.key) + " (stage " + std::to_string(out_.stage) +
                               ": DeepSpeed reads it with stage 3 only)");
      else
        set(s.field, s.value, s.key);
    }
    if (pending_.overlap_comm.value_or(out_.stage == 3))
      set("strategy.overlap_comm", "true", "zero_optimization.overlap_comm");
  }

  std::string path_;
  std::string stage_key_ = "zero_optimization.stage";
  Pending pending_;
  DeepSpeedConfig out_;
};

// DeepSpeed refuses a key given twice in one object (its json.load hook); so does DTK, rather than
// keep the last as a plain parser would.
json parse_refusing_duplicates(const std::string& text, const std::string& path) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  const auto callback = [&](int, json::parse_event_t event, json& parsed) {
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
  } catch (const json::parse_error& e) {
    throw HostError(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!duplicate.empty())
    throw HostError(path + ": the key \"" + duplicate + "\" is given twice (DeepSpeed refuses it)");
  if (!j.is_object()) throw HostError(path + ": not a JSON object (a DeepSpeed config is {\"key\": value, ...})");
  return j;
}

}  // namespace

DeepSpeedConfig read_deepspeed_config(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw HostError(path + ": a directory, not a DeepSpeed config file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw HostError(path + ": cannot read the DeepSpeed config (" + std::strerror(errno) + ")");
  std::stringstream text;
  text << in.rdbuf();
  return Reader(path).read(parse_refusing_duplicates(text.str(), path));
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
        dtk = "refused with `\"enabled\": true`: " + note;
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
