// dtk/core/config/deepspeed_config.hpp — DeepSpeed's JSON config (ds_config.json) as DTK settings,
// read two ways:
//  - Megatron-DeepSpeed's command lines: `--deepspeed --deepspeed_config FILE` inside
//    `dtk train --megatron_args` (megatron_args.cpp combines it with the Megatron flags, which
//    give the optimizer and the schedule: the file's "optimizer" and "scheduler" do nothing);
//  - DeepSpeed's own engine: `dtk train --deepspeed_config FILE` (standalone), where the file's
//    "optimizer" (Adam, AdamW, SGD), "scheduler" (WarmupLR, WarmupDecayLR, WarmupCosineLR),
//    "steps_per_print" and "tensorboard" count as they do in deepspeed.initialize().
//
// One table (deepspeed_config.cpp) says, for every key DTK knows, the config path it sets, the
// only value DTK runs, or why it has no effect here. A key that is not in the table is refused,
// as are a duplicate key and a dotted one (a plain JSON reader would keep the last, or read the
// dotted name as another key): nothing is silently dropped. The docs'
// table (`dtk config --deepspeed_table`, in docs/user-guide.md) is printed from the same rules.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtk_config.pb.h"

namespace dtk::core {

// What a DeepSpeed config says, as DTK settings and as the values the command line's Megatron
// flags are checked against.
struct DeepSpeedConfig {
  int stage = 0;                              // zero_optimization.stage: 0 is the ddp strategy, 1-3 the zero strategy
  std::vector<std::string> sets;              // `path=value` assignments, in the file's order
  std::map<std::string, std::string> key_of;  // the config field each key set -> "FILE: key"
  std::vector<std::string> ignored;           // "FILE: key (why it has no effect here)"
  std::vector<std::string> refused;           // "FILE: key value: why DTK cannot run it"
  std::string precision = "fp32";             // fp16.enabled / bf16.enabled
  double gradient_clipping = 1.0;             // DeepSpeed's default since 0.19.3 when absent
  bool gradient_clipping_given = false;
  std::optional<long long> micro_batch, train_batch;  // train_micro_batch_size_per_gpu, train_batch_size
  std::string offload_optimizer = "none";             // the optimizer's offload device DeepSpeed uses
  std::string offload_optimizer_key;                  // the key that gave it, as written
  bool force_ds_cpu_optimizer = true;                 // zero_force_ds_cpu_optimizer
  bool allow_untested_optimizer = false;              // zero_allow_untested_optimizer
  std::vector<std::string> client_sections;           // "optimizer", "scheduler": present in the file
  std::string optimizer_plugin;  // standalone: the optimizer plugin the file's "optimizer" asks for ("": none)
  // Standalone WarmupCosineLR: the rate its ratios scaled into lr.lr_warmup_init and lr.min_lr
  // (a later --set lr.lr would leave them at the old rate's).
  std::optional<double> cosine_base_lr;
};

// Reads and maps FILE for Megatron-DeepSpeed. Never throws for a key DTK cannot run (it is listed in
// `refused`); throws HostError for a file that cannot be read or is not a JSON object.
DeepSpeedConfig read_deepspeed_config(const std::string& path);

// The same for DeepSpeed's engine alone (`dtk train --deepspeed_config`). configured: the run's
// config before the file (its lr.lr is the rate a WarmupCosineLR scales when the file names no
// optimizer).
DeepSpeedConfig read_standalone_deepspeed_config(const std::string& path, const config::RunConfig& configured);

// What DeepSpeed refuses of a client's optimizer (the configured plugin, where the file's
// "optimizer" does not decide it): SGD with ZeRO unless zero_allow_untested_optimizer, an offload
// with another optimizer than its CPU Adam unless zero_force_ds_cpu_optimizer is false.
std::vector<std::string> client_optimizer_refusals(const DeepSpeedConfig& ds, const std::string& optimizer);

// The table of every known key as Markdown (docs/user-guide.md holds a copy; a test compares).
std::string deepspeed_key_table();

}  // namespace dtk::core
