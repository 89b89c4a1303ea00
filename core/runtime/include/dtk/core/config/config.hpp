// dtk/core/config/config.hpp — the run configuration: defaults, pbtxt files, --set overrides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtk_config.pb.h"

namespace dtk::core {

// The built-in defaults (what an empty config means).
// train.rampup_batch_size, parsed ("START INCREMENT SAMPLES"); throws HostError naming the field.
struct RampUp {
  int64_t start = 0, increment = 0, samples = 0;
};
RampUp parse_rampup(const std::string& text);

// train.step_batch_size_schedule, parsed as Megatron's StepBatchsizeNumMicroBatchesCalculator
// parses it: entries "THRESHOLD:BATCH" split at spaces or commas, each number a decimal with an
// optional K/M/B/T suffix (int(float(x) * multiplier)), thresholds in tokens divided by
// seq_length, sorted; the first 0, strictly increasing, batches positive. Throws HostError naming
// the field and the entry.
struct BatchStep {
  int64_t first_sample = 0;  // from the iteration whose consumed samples reach this
  int64_t batch = 0;
  std::string entry;  // as written, for messages
};
std::vector<BatchStep> parse_step_batch_schedule(const std::string& text, int64_t seq_length);

config::RunConfig default_config();

// Defaults, then the protobuf-text file at `path` merged on top. Throws HostError naming the
// file, line and column on a parse error.
config::RunConfig load_config(const std::string& path);

// Applies "dotted.path=value": a config field (lr.lr=3e-4, model.name=gpt) or, below a
// plugin slot, a plugin option (model.num_layers=4). Throws HostError for unknown fields
// (with a suggestion) and ill-typed values.
void apply_override(config::RunConfig& cfg, const std::string& assignment);

// The textual value of a field by dotted path (scalars as text, messages in text format,
// plugin options by "slot.key"). Throws HostError if there is no such field.
std::string config_value(const config::RunConfig& cfg, const std::string& path);

// Checks values that no single field can (positive sizes, known enums, divisibility).
void validate_config(const config::RunConfig& cfg);

std::string to_text(const config::RunConfig& cfg);

// A double as a person writes it, in the fewest digits that read back the same (0.3, not
// 0.300000; 500000000, not 5e+08).
std::string number_text(double v);

// True for DeepSpeed's schedulers as lr.lr_decay_style (WarmupLR, WarmupDecayLR, WarmupCosineLR,
// LRRangeTest, OneCycle).
bool is_deepspeed_style(const std::string& style);
// The three of them with a warm-up (WarmupLR, WarmupDecayLR, WarmupCosineLR).
bool is_deepspeed_warmup_style(const std::string& style);
// The two without one (LRRangeTest, OneCycle: lr.lr_range_test_*, lr.cycle_*).
bool is_deepspeed_cycle_style(const std::string& style);
// The warm-up's shape: lr.lr_warmup_style, or when "" the style's own (DeepSpeed's log, linear).
std::string warmup_style_of(const config::LrSchedule& lr);

}  // namespace dtk::core
