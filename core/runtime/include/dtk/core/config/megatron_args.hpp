// dtk/core/config/megatron_args.hpp — Megatron-LM / DeepSpeed-Domino pretraining command lines as DTK
// configuration: `dtk train --megatron_args "<flags>"` (or `--megatron_args @FILE`).
//
// One table (megatron_args.cpp) says, for every flag DTK knows, the config path it sets, or why it
// is ignored (accepted, no effect here) or refused. The mapper and the docs table
// (`dtk config --megatron_table`, pasted into docs/user-guide.md and checked by a test) both read
// it. A flag that is not in the table is refused: nothing is silently dropped.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "dtk_config.pb.h"

namespace dtk::core {

struct MegatronMapping {
  // What the user typed: "--megatron_args", or "--deepspeed_config" for DeepSpeed's config alone
  // (apps/dtk/run_config.cpp maps it into the same shape), to name it in errors.
  std::string source = "--megatron_args";
  // Plugin choices ("" keeps the configured one), then `path=value` overrides in order.
  std::string model, dataset, optimizer, strategy;
  std::vector<std::string> sets;
  // Megatron's values for the chosen model's options where the plugin's defaults differ: applied
  // before `sets` when the mapping switches the model (a configured model keeps its options).
  std::vector<std::string> model_defaults;
  std::vector<std::string> ignored;
  std::vector<std::string> notes;  // what a flag does differently here than in Megatron, said at start  // "--flag: why
                                   // it has no effect here"
  // A note -> the config field it describes, where a later override of that field makes it untrue
  // (the host then does not say it).
  std::map<std::string, std::string> note_field;
  std::vector<std::string> refused;  // "--flag value: why DTK cannot run it"
  // The config field each flag set ("lr.lr_wsd_decay_style" -> "--lr-wsd-decay-style"), so that
  // a later error about the field can name the flag the user typed (megatron_flag_legend).
  std::map<std::string, std::string> flag_of;
};

// Splits a command line as a shell would for a flat flag list: whitespace, '...' and "..."
// quoting, backslash-newline continuations, `#` comments to the end of a line. `@FILE` as the
// whole text reads the flags from FILE. Throws HostError on an unreadable file or an open quote.
std::vector<std::string> split_megatron_args(const std::string& text);

// Maps the flags. Never throws for an unknown or unsupported flag: it is listed in `refused`.
MegatronMapping map_megatron_args(const std::vector<std::string>& args);

// The values Megatron uses for what a command line leaves out, where DTK's defaults differ
// (as `path=value`): applied before the mapping when no --config file is given.
const std::vector<std::string>& megatron_defaults();

// Applies `m` to `cfg`: plugin choices (a switched slot drops the old plugin's options), then the
// overrides. Throws HostError with every refused flag in one line when `m.refused` is not empty,
// and names the flag whose value a config field rejects.
void apply_megatron_mapping(config::RunConfig& cfg, const MegatronMapping& m);

// For an error message about config fields: " (--megatron_args: FIELD is --FLAG, ...)" for each
// field of `flag_of` the message names, "" when it names none.
std::string megatron_flag_legend(const std::string& message, const std::map<std::string, std::string>& flag_of,
                                 const std::string& source = "--megatron_args");

// The table of every known flag as Markdown (docs/user-guide.md holds a copy; a test compares).
std::string megatron_flag_table();

}  // namespace dtk::core
