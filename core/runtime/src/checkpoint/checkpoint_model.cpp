// A checkpoint's recorded model against the run's (dtk/core/checkpoint/checkpoint_model.hpp).
#include "dtk/core/checkpoint/checkpoint_model.hpp"

#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>

#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/core/checkpoint/layout.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

const std::vector<std::string>& exempt_model_options() {
  // How the function is computed, not which: the fused output layer and its chunks, the
  // cross-entropy implementation, the GPU kernels left out, recomputation, Domino's chunked
  // schedule, the MoE layers' token dispatcher and its overlap. Training noise and the
  // initialisation: dropout (evaluation is the same either way; fine-tuning with another rate is
  // a normal choice) and the init std (the loaded weights replace it). The input length: the run's
  // (a learned position table's shape is checked when its weights load).
  static const std::vector<std::string> exempt = {
      "fused_lm_head",         "lm_head_chunk_tokens", "cross_entropy_impl",       "unfused_kernels",
      "recompute_activations", "recompute_method",     "recompute_num_layers",     "domino_chunks",
      "hidden_dropout",        "attention_dropout",    "init_method_std",          "seq_length",
      "recompute_modules",     "moe_token_dispatcher", "moe_shared_expert_overlap"};
  return exempt;
}

namespace {

bool exempt(const std::string& name) {
  const auto& e = exempt_model_options();
  return std::find(e.begin(), e.end(), name) != e.end();
}

std::map<std::string, std::string> options_of(const config::PluginChoice& c) {
  return std::map<std::string, std::string>(c.options().begin(), c.options().end());
}

}  // namespace

namespace {

// The first difference between the recorded model and the run's that changes the function: what
// the checkpoint has ("model.num_layers=2", "model plugin 'gpt'"), what the run has, and how to
// make the run match. Empty `recorded_text` when they agree.
struct Difference {
  std::string recorded_text, run_text, remedy;
};

// An option newer than some checkpoints (those saved before it, the importers' records) whose
// absence means a value: under another one the weights mean something else.
const char* value_when_unrecorded(const std::string& name) {
  return name == "apply_layernorm_1p" ? "false" : nullptr;  // norm weights w, not 1 + w
}

Difference first_difference(const config::PluginChoice& recorded, const config::PluginChoice& run,
                            host::PluginHost& plugins) {
  if (recorded.name() != run.name())
    return {"model plugin '" + recorded.name() + "'", "'" + run.name() + "'",
            "--model " + recorded.name() + " (and its options)"};
  const host::Plugin& plugin = plugins.get(DTK_KIND_MODEL, run.name());
  std::map<std::string, std::string> run_values;
  for (auto& [k, v] : host::resolve_options(plugin, options_of(run))) run_values[k] = v;
  for (const dtk_option_spec* spec : plugin.options()) {
    const std::string name = spec->name;
    if (exempt(name)) continue;
    auto rec = recorded.options().find(name);
    const char* unrecorded = value_when_unrecorded(name);
    if (rec == recorded.options().end() && !unrecorded) continue;  // not recorded: not compared
    const std::string recorded_value = rec != recorded.options().end() ? rec->second : unrecorded;
    const std::string& mine = run_values[name];
    if (host::same_option_value(spec->type, recorded_value, mine)) continue;
    // 0 = derived from the other options (ffn_hidden_size, max_position_embeddings,
    // num_query_groups): the value it stands for is the plugin's to derive, and these are shapes,
    // which the strict load of the weights checks (an import records 256 where a run says 0).
    if (spec->type == DTK_OPT_INT && spec->default_value && std::string(spec->default_value) == "0" &&
        (host::same_option_value(DTK_OPT_INT, recorded_value, "0") || host::same_option_value(DTK_OPT_INT, mine, "0")))
      continue;
    return {"model." + name + "=" + recorded_value, mine, "--set model." + name + "=" + recorded_value};
  }
  return {};
}

}  // namespace

std::string model_difference(const config::PluginChoice& recorded, const config::PluginChoice& run,
                             host::PluginHost& plugins, const std::string& where) {
  const Difference d = first_difference(recorded, run, plugins);
  if (d.recorded_text.empty()) return "";
  return "checkpoint " + where + " was trained with " + d.recorded_text + " but this run has " + d.run_text +
         "; pass " + d.remedy + " or --use_checkpoint_args";
}

bool read_recorded_config(const std::string& iter_dir, config::RunConfig* out, const host::PluginHost& plugins,
                          const ChecksumCheck& check) {
  if (!google::protobuf::TextFormat::ParseFromString(checkpoint_config_text(iter_dir, check), out)) return false;
  if (out->has_model()) drop_idle_model_options(out->mutable_model(), plugins);
  return true;
}

void drop_idle_model_options(config::PluginChoice* model, const host::PluginHost& plugins,
                             const std::vector<std::string>& given) {
  // A model plugin not installed here leaves the recording as it is: using it fails anyway.
  const host::Plugin* plugin = plugins.find(DTK_KIND_MODEL, model->name());
  if (!plugin) return;
  std::map<std::string, std::string> options = options_of(*model);
  host::drop_idle_options(*plugin, &options, given);
  model->clear_options();
  for (const auto& [k, v] : options) (*model->mutable_options())[k] = v;
}

std::string adopt_checkpoint_model(const config::PluginChoice& recorded, config::PluginChoice* run,
                                   const std::string& where, const host::PluginHost& plugins) {
  config::PluginChoice adopted = recorded;
  std::string kept;
  std::vector<std::string> given;
  if (recorded.name() == run->name())
    for (const auto& [k, v] : run->options())
      if (exempt(k)) {
        (*adopted.mutable_options())[k] = v;
        kept += (kept.empty() ? "" : ", ") + k + "=" + v;
        given.push_back(k);
      }
  // The run's setting may leave recorded options idle (recompute_activations=none beside a recorded
  // recompute_num_layers=2): the plugin's defaults replace them.
  drop_idle_model_options(&adopted, plugins, given);
  *run = adopted;
  return " checkpoint.use_checkpoint_args: the model is the one " + where + " records: '" + recorded.name() + "', " +
         std::to_string(adopted.options_size()) + " option(s)" + (kept.empty() ? "" : "; this run's " + kept);
}

namespace {

// The model recorded in the checkpoint a run loads: the iteration the load will take. That is the
// tracker's (else the newest) when it passes the load's verdict, and with fallback the newest
// complete one below it (any, when the tracker holds no number), in turn. False when none records
// one that reads.
bool recorded_model(const config::CheckpointConfig& ck, const host::PluginHost& plugins, config::PluginChoice* out,
                    std::string* why) {
  int64_t iteration = -1;
  std::string iter_dir;
  try {
    iter_dir = resolve_iteration_dir(ck.load(), &iteration, /*verify=*/false);
  } catch (const std::exception& e) {
    *why = e.what();
    if (!ck.fallback() || (iteration = older_complete_iteration(ck.load(), -1)) < 0) return false;
    iter_dir = checkpoint_iter_dir(ck.load(), iteration);
  }
  while (true) {
    try {
      if (!ck.no_verify_checksums()) require_complete_iteration(ck.load(), iteration);
      config::RunConfig saved;
      if (!read_recorded_config(iter_dir, &saved, plugins, ChecksumCheck{!ck.no_verify_checksums()}))
        throw HostError("the configuration recorded in " + iter_dir + " does not parse");
      *out = saved.model();
      return true;
    } catch (const std::exception& e) {
      *why = e.what();
    }
    if (!ck.fallback()) return false;
    iteration = older_complete_iteration(ck.load(), iteration);
    if (iteration < 0) return false;
    iter_dir = checkpoint_iter_dir(ck.load(), iteration);
  }
}

}  // namespace

std::string reconcile_checkpoint_model(config::RunConfig& cfg, host::PluginHost& plugins) {
  const auto& ck = cfg.checkpoint();
  if (ck.load().empty()) return "";
  config::PluginChoice recorded;
  std::string why;
  if (!recorded_model(ck, plugins, &recorded, &why)) {
    // The load itself reports what is wrong with the checkpoint; a run that asked for its model
    // cannot be built without it.
    if (ck.use_checkpoint_args())
      throw HostError("checkpoint.use_checkpoint_args: cannot read the model recorded in " + ck.load() + ": " + why);
    return "";
  }
  if (ck.use_checkpoint_args()) return adopt_checkpoint_model(recorded, cfg.mutable_model(), ck.load(), plugins);
  const std::string difference = model_difference(recorded, cfg.model(), plugins, ck.load());
  if (!difference.empty()) throw HostError(difference);
  return "";
}

namespace {
bool loads_from_save_folder(const config::CheckpointConfig& ck) {
  if (ck.load().empty()) return false;
  std::error_code ec;
  return std::filesystem::equivalent(ck.load(), ck.save(), ec);
}
}  // namespace

std::string save_folder_owner_difference(const config::RunConfig& cfg, host::PluginHost& plugins) {
  const auto& ck = cfg.checkpoint();
  if (ck.save().empty() || ck.overwrite_other_run()) return "";
  // The owner: the model recorded in the newest iteration that records one. A folder without
  // checkpoints, or whose checkpoints record no configuration that reads (another program's, or
  // damaged ones: the load reports those), has none to compare.
  const std::vector<int64_t> iterations = list_checkpoint_iterations(ck.save());
  for (auto it = iterations.rbegin(); it != iterations.rend(); ++it) {
    const std::string iter_dir = checkpoint_iter_dir(ck.save(), *it);
    config::RunConfig saved;
    try {
      if (!read_recorded_config(iter_dir, &saved, plugins, ChecksumCheck{!ck.no_verify_checksums()})) continue;
    } catch (const std::exception&) {
      continue;
    }
    if (!saved.has_model() || saved.model().name().empty()) continue;
    Difference d = first_difference(saved.model(), cfg.model(), plugins);
    // The same model with another seed is another run too, unless this run continues the folder's
    // own checkpoints (it loads from it: a resumed run may change its seed, as in Megatron).
    if (d.recorded_text.empty() && !loads_from_save_folder(ck) && saved.train().seed() != cfg.train().seed())
      d = {"train.seed=" + std::to_string(saved.train().seed()), std::to_string(cfg.train().seed()), ""};
    if (d.recorded_text.empty()) return "";
    return "checkpoint.save '" + ck.save() + "' holds another run's checkpoints (" +
           std::filesystem::path(iter_dir).filename().string() + " was trained with " + d.recorded_text +
           " but this run has " + d.run_text + "): save into another folder, or pass --set " +
           "checkpoint.overwrite_other_run=true to write into this one";
  }
  return "";
}

std::string save_folder_ahead_of_run(const config::CheckpointConfig& ck, int64_t last_iteration, bool by_tokens) {
  if (ck.save().empty() || ck.overwrite_other_run() || loads_from_save_folder(ck)) return "";
  const std::vector<int64_t> iterations = list_checkpoint_iterations(ck.save());
  if (iterations.empty()) return "";
  // The folder's newest as a load finds it (a tracker that does not read is the load's to report).
  int64_t newest = iterations.back();
  try {
    newest = tracked_or_newest_iteration(ck.save(), newest);
  } catch (const std::exception&) {
  }
  if (newest <= last_iteration) return "";
  return "checkpoint.save '" + ck.save() + "' holds checkpoints up to iteration " + std::to_string(newest) +
         " and this run does not load from it and ends at iteration " + std::to_string(last_iteration) +
         ": its saves would take the tracker back to older iterations; continue that run (--set checkpoint.load=" +
         ck.save() + " with train.train_iters past " + std::to_string(newest) +
         (by_tokens ? " and train.train_tokens past the tokens of iteration " + std::to_string(newest) : "") +
         "), save into another folder, or pass --set checkpoint.overwrite_other_run=true";
}

}  // namespace dtk::core
