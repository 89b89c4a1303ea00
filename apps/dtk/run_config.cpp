// See run_config.hpp.
#include "run_config.hpp"

#include <cerrno>
#include <cstdlib>

#include "dtk/core/config/config.hpp"
#include "dtk/core/config/deepspeed_config.hpp"
#include "dtk/core/config/megatron_args.hpp"
#include "dtk/data/error.hpp"
#include "dtk/host/error.hpp"
#include "tokenizer_flags.hpp"

using dtk::host::HostError;

dtk::core::MegatronMapping apply_megatron_args(dtk::config::RunConfig& cfg, const std::string& megatron_args,
                                               bool with_megatron_defaults) {
  const dtk::core::MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(megatron_args));
  if (with_megatron_defaults && m.refused.empty())
    for (const auto& d : dtk::core::megatron_defaults()) dtk::core::apply_override(cfg, d);
  dtk::core::apply_megatron_mapping(cfg, m);
  return m;
}

namespace {

void clear_file_scheduled_fields(dtk::config::LrSchedule& lr) {
  lr.clear_lr_warmup_tokens(), lr.clear_lr_decay_tokens(), lr.clear_lr_warmup_style();
  lr.clear_lr_range_test_step_size(), lr.clear_lr_range_test_step_rate(), lr.clear_lr_range_test_staircase();
  lr.clear_cycle_first_step_size(), lr.clear_cycle_second_step_size(), lr.clear_cycle_first_stair_count();
  lr.clear_cycle_second_stair_count(), lr.clear_decay_step_size(), lr.clear_decay_lr_rate();
  lr.clear_cycle_momentum(), lr.clear_cycle_min_mom(), lr.clear_cycle_max_mom(), lr.clear_decay_mom_rate();
}

void clear_curriculum_fields(dtk::config::TrainingConfig& t) {
  t.clear_curriculum_schedule(), t.clear_curriculum_min_difficulty(), t.clear_curriculum_max_difficulty();
  t.clear_curriculum_total_step(), t.clear_curriculum_difficulty_step(), t.clear_curriculum_root_degree();
  t.clear_curriculum_discrete_difficulty(), t.clear_curriculum_discrete_max_step();
}

}  // namespace

dtk::core::MegatronMapping apply_deepspeed_config(dtk::config::RunConfig& cfg, const std::string& path,
                                                  dtk::core::DeepSpeedConfig* read) {
  const dtk::core::DeepSpeedConfig ds = dtk::core::read_standalone_deepspeed_config(path, cfg);
  if (read) *read = ds;
  dtk::core::MegatronMapping m;
  m.source = "--deepspeed_config";
  m.strategy = ds.stage == 0 ? "ddp" : "zero";
  m.optimizer = ds.optimizer_plugin;
  m.sets = ds.sets;
  m.ignored = ds.ignored;
  m.refused = ds.refused;
  m.flag_of = ds.key_of;
  // The file's schedule (or DeepSpeed's constant rate without one) counts steps and has only its
  // own parameters: the config's token counts, warm-up shape and other schedulers' settings are
  // cleared before the file's sets (which set what it gives; unset is DeepSpeed's default).
  for (const auto& set : ds.sets)
    if (set.rfind("lr.lr_decay_style=", 0) == 0) {
      clear_file_scheduled_fields(*cfg.mutable_lr());
      break;
    }
  // Likewise a curriculum the file turns on: its schedule's keys, DeepSpeed's defaults for none.
  for (const auto& set : ds.sets)
    if (set.rfind("train.curriculum_schedule=", 0) == 0) {
      clear_curriculum_fields(*cfg.mutable_train());
      break;
    }
  dtk::core::apply_megatron_mapping(cfg, m);
  return m;
}

void check_deepspeed_client(const dtk::config::RunConfig& cfg, const dtk::core::DeepSpeedConfig& ds,
                            const std::string& path) {
  const std::string& optimizer = cfg.optimizer().name();
  if (optimizer != ds.optimizer_plugin) {
    const std::vector<std::string> refused = dtk::core::client_optimizer_refusals(ds, optimizer);
    if (!refused.empty()) {
      std::string list;
      for (const auto& r : refused) list += (list.empty() ? "" : "; ") + path + ": " + r;
      throw HostError("--deepspeed_config: " + list);
    }
  }
  // DeepSpeed's L2-mode or uncorrected Adam is cpu_adam's alone, which steps host tensors.
  if (optimizer == "cpu_adam" && ds.optimizer_plugin == "cpu_adam" && ds.offload_optimizer == "none" &&
      cfg.train().device() != "cpu")
    throw HostError("--deepspeed_config: " + path +
                    " asks for the cpu_adam optimizer (Adam with adam_w_mode or "
                    "bias_correction false, which only it has) on " +
                    cfg.train().device() +
                    " without an offload: cpu_adam steps host tensors; set zero_optimization.offload_optimizer, or "
                    "leave those parameters out");
  if (ds.cosine_base_lr && cfg.lr().lr() != *ds.cosine_base_lr)
    throw HostError("--deepspeed_config: lr.lr is " + dtk::core::number_text(cfg.lr().lr()) + ", but " + path +
                    "'s WarmupCosineLR ratios scaled " + dtk::core::number_text(*ds.cosine_base_lr) +
                    " (as DeepSpeed, they scale the optimizer's rate): give the rate as the file's "
                    "optimizer.params.lr, not with --set");
}

namespace {

// A plugin option that holds a whole number, or -1 when absent.
long long int_option(const dtk::config::PluginChoice& slot, const std::string& name, const std::string& path) {
  const auto it = slot.options().find(name);
  if (it == slot.options().end()) return -1;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (errno || it->second.empty() || *end || v < 0)
    throw HostError("config: " + path + "='" + it->second + "' is not a whole number");
  return v;
}

// The step masks and resets at Megatron's tokenizer.eod: causal_lm's eod_token is the
// tokenizer's (its default 50256 is GPT-2's). A different explicit value is refused.
void apply_end_of_document(dtk::config::RunConfig& cfg, int32_t eod, const std::string& which) {
  if (eod < 0 || cfg.step().name() != "causal_lm") return;
  auto& options = *cfg.mutable_step()->mutable_options();
  auto it = options.find("eod_token");
  if (it != options.end() && it->second != std::to_string(eod))
    throw HostError("config: step.eod_token " + it->second + " is not the end-of-document token " +
                    std::to_string(eod) + " of " + which + ": drop step.eod_token");
  options["eod_token"] = std::to_string(eod);
}

}  // namespace

void apply_tokenizer_files(dtk::config::RunConfig& cfg) {
  auto& tk = *cfg.mutable_tokenizer();
  if (!names_tokenizer(tk)) {
    if (tk.vocab_size() != 0)
      throw HostError("config: tokenizer.vocab_size is derived from the tokenizer, which is not set");
    return;
  }
  const auto tokenizer = load_tokenizer(tokenizer_spec_of(tk));
  const long long n = tokenizer->vocab_size();
  const std::string which = tokenizer->type() + (tokenizer->files().empty() ? "" : " " + tokenizer->files()[0]);
  // A config written by `dtk config` carries the derived size: it must still be the tokenizer's.
  if (tk.vocab_size() != 0 && tk.vocab_size() != n)
    throw HostError("config: tokenizer.vocab_size " + std::to_string(tk.vocab_size()) + " is not the " +
                    std::to_string(n) + " tokens of " + which + " (it is derived from the tokenizer)");
  tk.set_vocab_size(n);
  // Megatron builds the embedding from the tokenizer's size (padded); a different explicit size
  // would train a model the tokenizer cannot use.
  const long long model_vocab = int_option(cfg.model(), "vocab_size", "model.vocab_size");
  if (model_vocab >= 0 && model_vocab != n)
    throw HostError("config: model.vocab_size " + std::to_string(model_vocab) + " differs from the tokenizer's " +
                    std::to_string(n) + " tokens (" + which +
                    "); Megatron derives the size from the tokenizer: drop model.vocab_size");
  (*cfg.mutable_model()->mutable_options())["vocab_size"] = std::to_string(n);
  const long long data_vocab = int_option(cfg.dataset(), "vocab_size", "dataset.vocab_size");
  // Random tokens (Megatron's --mock-data) are drawn from the tokenizer's ids: the synthetic
  // dataset's own default (GPT-2's 50257) would exceed a smaller tokenizer's model.
  if (data_vocab < 0 && cfg.dataset().name() == "synthetic")
    (*cfg.mutable_dataset()->mutable_options())["vocab_size"] = std::to_string(n);
  if (data_vocab > n)
    throw HostError("config: dataset.vocab_size " + std::to_string(data_vocab) + " is larger than the tokenizer's " +
                    std::to_string(n) + " tokens (" + which +
                    "): the data holds ids this tokenizer cannot produce (another tokenizer's data?)");
  apply_end_of_document(cfg, tokenizer->eod(), which);
}
