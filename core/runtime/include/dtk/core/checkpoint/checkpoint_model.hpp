// dtk/core/checkpoint/checkpoint_model.hpp — a checkpoint carries its model: the model plugin and
// options recorded with it (the "config" entry, checkpoint.hpp) against the run's.
//
// Loading a checkpoint into a model that computes another function (another rotary base, norm
// epsilon, vocabulary, tied or untied output, ...) gives wrong losses and wrong text without a
// word, or a shape error far from its cause. So every path that loads a checkpoint (train's
// checkpoint.load, with or without finetune; `dtk generate`; `dtk export hf`) compares:
//
//  * the model plugin's name, then each option the checkpoint records that this run's plugin
//    declares, by value (numbers as numbers: 5e5 == 500000), both sides with the plugin's defaults
//    filled in. An option the record does not name (a checkpoint written before the option
//    existed, or by a DTK that recorded only the options given) is not compared, nor an integer
//    option whose default 0 means "derived" (ffn_hidden_size, max_position_embeddings,
//    num_query_groups) when either side says 0: those are shapes, which loading the weights checks.
//  * except the options that do not change the function the model computes: how it is computed
//    (fused output layer, its chunking, the cross-entropy implementation, recomputation, Domino's
//    chunks), the dropout rates (training noise; evaluation and the loaded weights are the same
//    either way, and fine-tuning with other dropout is a normal choice), the initialisation
//    (overwritten by the loaded weights) and the sequence length (the run's input size: a
//    learned position table's shape is checked when the weights load). The list is
//    exempt_model_options(), in one place; a third-party plugin using these names gets the same.
//
// A difference is one HostError line naming the option and both values. With
// checkpoint.use_checkpoint_args (Megatron's --use-checkpoint-args) the checkpoint's model plugin
// and options replace the run's instead (only the exempt options the run gave explicitly stay the
// run's), which also lets a run name no model at all.
#pragma once

#include <string>
#include <vector>

#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/host/plugin_host.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

// The model options that do not change the function the model computes (see above).
const std::vector<std::string>& exempt_model_options();

// The configuration a checkpoint iteration records (checkpoint_config_text), parsed, its model's
// idle options dropped (drop_idle_model_options). False when it does not parse; throws as
// checkpoint_config_text does when there is none (or, checked, when the file is damaged).
bool read_recorded_config(const std::string& iter_dir, config::RunConfig* out, const host::PluginHost& plugins,
                          const ChecksumCheck& check);

// The model options that act only with another setting (their acts_with, ABI 2.7: gpt's
// lm_head_chunk_tokens without fused_lm_head=true, llama's rope_* without rope_scaling=llama3)
// and that the other settings leave idle, removed from `model` so the plugin's default stands in:
// a run recorded them before such values were refused, and they did nothing then. Options in
// `given` (the command line's own) stay, for the host to refuse. A model plugin not installed
// here is left as recorded.
void drop_idle_model_options(config::PluginChoice* model, const host::PluginHost& plugins,
                             const std::vector<std::string>& given = {});

// The checkpoint's recorded model against the run's. `recorded` as the checkpoint holds it, `run`
// as this run gives it; `plugins` resolves both against the plugins' option specs. Returns "" when
// they agree, else the one-line refusal naming `where` (the checkpoint as the user named it), the
// option and both values.
std::string model_difference(const config::PluginChoice& recorded, const config::PluginChoice& run,
                             host::PluginHost& plugins, const std::string& where);

// Replaces the run's model with the recorded one (checkpoint.use_checkpoint_args): the recorded
// plugin and options, and the exempt options `run` sets explicitly when the plugin is the same.
// Returns the log line that says so.
std::string adopt_checkpoint_model(const config::PluginChoice& recorded, config::PluginChoice* run,
                                   const std::string& where, const host::PluginHost& plugins);

// For `dtk train` before anything is built: when checkpoint.load names a checkpoint, reads the model
// it records (the tracker's iteration, else the newest) and either refuses a difference
// (model_difference) or, with checkpoint.use_checkpoint_args, adopts it. Returns the line to log
// ("" when there is nothing to say). A checkpoint that records no configuration (written by
// another program) is not compared.
std::string reconcile_checkpoint_model(config::RunConfig& cfg, host::PluginHost& plugins);

// A save folder's owner (checkpoint.save, checkpoint.overwrite_other_run): the model recorded in
// its newest checkpoint that records one. Returns "" when the folder has none or it is this run's
// model (compared as a load compares, model_difference), else the one-line refusal naming the
// folder, the iteration, the option and both values. "" too with checkpoint.overwrite_other_run.
std::string save_folder_owner_difference(const config::RunConfig& cfg, host::PluginHost& plugins);

// A run that does not continue its save folder's checkpoints (it does not load from the folder)
// and ends at `last_iteration`, before the folder's newest (its tracker's) iteration: its saves
// would move the tracker back, and checkpoint.keep_last would keep the older run's higher
// iterations over this run's. Returns the one-line refusal, "" when none applies or with
// checkpoint.overwrite_other_run.
// `by_tokens`: the run ends there because of train.train_tokens (the hint names both ends).
std::string save_folder_ahead_of_run(const config::CheckpointConfig& ck, int64_t last_iteration,
                                     bool by_tokens = false);

}  // namespace dtk::core
