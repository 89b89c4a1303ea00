// dtk — the DTK host. Subcommands: train, launch, plugins, preprocess, checkpoint, export, config, version, help.
#include <gflags/gflags.h>
#include <glog/logging.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "cmd_checkpoint.hpp"
#include "cmd_export.hpp"
#include "cmd_generate.hpp"
#include "cmd_preprocess.hpp"
#include "command_line.hpp"
#include "dtk/core/components/services.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/config/deepspeed_config.hpp"
#include "dtk/core/config/megatron_args.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/launch/distributed.hpp"
#include "dtk/core/memory/allocator.hpp"
#include "dtk/core/train/exit_conditions.hpp"
#include "dtk/core/train/exit_signals.hpp"
#include "dtk/core/train/pretrain.hpp"
#include "dtk/gemm.hpp"
#include "dtk/host/error_line.hpp"
#include "dtk/host/plugin_host.hpp"
#include "dtk/host/torch_standins.hpp"
#include "dtk/plugin.hpp"
#include "flags/flags.hpp"
#include "launch.hpp"
#include "run_config.hpp"
#include "test_hooks.hpp"
#include "tokenizer_flags.hpp"

namespace {

constexpr const char* kUsage = R"(dtk — the Domino Training Kit host

Usage:
  dtk train [--config FILE] [--model NAME] [--dataset NAME] [--step NAME] [--optimizer NAME]
            [--strategy NAME] [--set key=value]... [--data_path PATH] [--threads N]
            [--megatron_args "FLAGS" | @FILE]   Megatron-LM's pretrain_gpt.py flags (dtk config --megatron_table),
                                                Megatron-DeepSpeed's --deepspeed --deepspeed_config FILE among them
                                                (dtk config --deepspeed_table)
            [--deepspeed_config ds_config.json]  DeepSpeed's config as its engine reads it, optimizer and
                                                scheduler included (dtk config --deepspeed_table)
            [TOKENIZER: as preprocess] [--use_checkpoint_args] [--plugin_path DIR] [--bench_out FILE.json]
  dtk launch --nproc_per_node N [--master_port P] train ...   N processes on this machine
  dtk launch --nproc_per_node N --nnodes M --node_rank K --master_addr HOST [--master_port P] train ...
                                                      node K of M (run one launcher per node)
  dtk plugins list
  dtk plugins describe NAME [--kind KIND]
  dtk config [--config FILE] [--set key=value]...     print the resolved configuration
  dtk preprocess --input FILE --output_prefix PREFIX TOKENIZER     TOKENIZER (as Megatron's flags):
                 --vocab_file encoder.json --merge_file vocab.bpe (GPT2BPETokenizer, the default) |
                 --tokenizer_type T --tokenizer_model FILE (SentencePieceTokenizer, GPTSentencePiece-
                 Tokenizer, Llama2Tokenizer: a .model; HuggingFaceTokenizer: a tokenizer.json;
                 TikTokenizer: Megatron's tiktoken .json, with --tiktoken_pattern v1|v2) |
                 --tokenizer_type NullTokenizer --vocab_size N.  `dtk train` takes them too.
  dtk checkpoint inspect DIR [--noverify] [--all_tensors]   iteration, layout, tensors, checksums
  dtk checkpoint convert SRC DST [--tensor_model_parallel_size N] [--pipeline_model_parallel_size P]
                 [--virtual_pipeline_model_parallel_size V] [--expert_model_parallel_size E] [--noverify]
                                                      another tensor-, pipeline- and/or expert-parallel
                                                      size, or model chunks per pipeline rank
                 [--decoder_first_pipeline_num_layers F] [--decoder_last_pipeline_num_layers L]
                 [--account_for_embedding_in_pipeline_split] [--account_for_loss_in_pipeline_split]
                                                      another split of the layers over the stages
  dtk export hf CHECKPOINT OUT_DIR --vocab_file encoder.json --merge_file vocab.bpe [--noverify]
                                        a Hugging Face GPT2LMHeadModel folder (safetensors); a llama
                                        checkpoint: LlamaForCausalLM, Mistral-, Mixtral-, Qwen2-,
                                        Qwen3-, Qwen2Moe- or Qwen3MoeForCausalLM by its shape
                                        (tokenizer flags optional)
  dtk import hf HF_DIR SAVE_DIR         a GPT2LMHeadModel, LlamaForCausalLM, Mistral-, Mixtral-,
                                        Qwen2-, Qwen3-, Qwen2Moe- or Qwen3MoeForCausalLM folder as
                                        a checkpoint to fine-tune from
  dtk generate --load DIR --prompt TEXT | --prompts_file FILE [TOKENIZER: default the checkpoint's]
               [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P]
               [--seed S] [--batch_size B] [--noverify]   text from a checkpoint (key/value cache; TP: under launch)
  dtk --version

Examples:
  dtk train --config configs/gpt-tiny.pbtxt
  dtk train --config configs/gpt-tiny.pbtxt --set train.train_iters=50 --set model.num_layers=4
  dtk plugins describe gpt

Plugins are found in <prefix>/lib/dtk/plugins, in DTK_PLUGIN_PATH and in --plugin_path.
--set paths: any config field (lr.lr=3e-4, lr.lr_decay_style=cosine) or, below a plugin slot,
a plugin option (model.num_layers=4, dataset.data_path=my_text_document).

Distributed: `dtk launch --nproc_per_node 2 train --config ...` runs 2 data-parallel ranks over
Gloo (add --set distributed.tensor_model_parallel_size=2 for tensor parallelism). `dtk train`
also starts under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), SLURM srun
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID inside a step) and Open MPI's mpirun (OMPI_COMM_WORLD_*).
)";

dtk::host::PluginHost* g_loaded = nullptr;

// The config fields --megatron_args (or --deepspeed_config) set, and the flag (or key) behind
// each: an error naming such a field names the flag too (report_error), since that is what the
// user typed.
std::map<std::string, std::string> g_megatron_flag_of;
std::string g_flag_source = "--megatron_args";

bool command_reads(const std::string& cmd, const std::string& flag, const std::string& file);

}  // namespace

namespace {

// `dtk --help`, or `dtk SUBCOMMAND --help`: the usage, then dtk's flags that subcommand reads (the
// rule that refuses the others, command_reads).
void print_help(int argc, char** argv) {
  std::string sub;
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-' && std::strcmp(argv[i], "help") != 0) {
      sub = argv[i];
      break;
    }
  std::fputs(kUsage, stdout);
  if (!is_command(sub)) return;
  std::vector<gflags::CommandLineFlagInfo> all;
  gflags::GetAllFlags(&all);
  std::printf("\nflags of `dtk %s`:\n", sub.c_str());
  int shown = 0;
  for (const auto& f : all) {
    // dtk's own flags (gflags also lists glog's, which every command takes).
    if (f.filename.find("apps/dtk/") == std::string::npos || !command_reads(sub, f.name, f.filename)) continue;
    std::printf("  --%-18s %-7s default: %-10s %s\n", f.name.c_str(), f.type.c_str(),
                f.default_value.empty() ? "''" : f.default_value.c_str(), f.description.c_str());
    ++shown;
  }
  if (shown == 0) std::printf("  (none)\n");
}

std::string exe_dir(const char* argv0) {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n > 0) {
    buf[n] = '\0';
    return std::filesystem::path(buf).parent_path().string();
  }
  return std::filesystem::absolute(argv0).parent_path().string();
}

dtk::config::RunConfig resolve_config(const std::vector<std::string>& sets) {
  // `--megatron_args ''` (an unset shell variable, usually) would silently train Megatron's defaults.
  if (FLAGS_megatron_args.find_first_not_of(" \t\n") == std::string::npos &&
      !gflags::GetCommandLineFlagInfoOrDie("megatron_args").is_default)
    throw dtk::host::HostError("--megatron_args is empty (an unset variable?): give Megatron's flags, or drop it");
  // So would any of these given an empty value: each reads as not given.
  for (const char* flag : {"config", "model", "dataset", "step", "optimizer", "strategy", "data_path", "bench_out",
                           "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "deepspeed_config",
                           "tiktoken_pattern", "tokenizer_special_tokens"}) {
    const gflags::CommandLineFlagInfo info = gflags::GetCommandLineFlagInfoOrDie(flag);
    if (!info.is_default && info.current_value.empty())
      throw dtk::host::HostError(std::string("--") + flag + " is empty (an unset variable?): give a value, or drop it");
  }
  dtk::config::RunConfig cfg =
      FLAGS_config.empty() ? dtk::core::default_config() : dtk::core::load_config(FLAGS_config);
  std::map<std::string, std::string> megatron_values;  // what each Megatron flag set
  dtk::core::MegatronMapping notes;                    // the mapping's notes to say (rank 0)
  const auto value_at = [](const dtk::config::RunConfig& c, const std::string& path) {
    try {
      return dtk::core::config_value(c, path);
    } catch (const std::exception&) {
      return std::string("(none)");  // a plugin option of a slot switched since
    }
  };
  // Megatron-DeepSpeed reads DeepSpeed's config inside its command line, with its own optimizer.
  if (!FLAGS_deepspeed_config.empty() && !FLAGS_megatron_args.empty())
    throw dtk::host::HostError(
        "--deepspeed_config with --megatron_args: Megatron-DeepSpeed names its DeepSpeed config among its flags; "
        "give --megatron_args '... --deepspeed --deepspeed_config " +
        FLAGS_deepspeed_config + "'");
  // A Megatron command line or DeepSpeed's config first: the plugin flags, --data_path and --set
  // below override it.
  dtk::core::DeepSpeedConfig deepspeed;  // what --deepspeed_config's file says
  if (!FLAGS_megatron_args.empty() || !FLAGS_deepspeed_config.empty()) {
    const dtk::core::MegatronMapping mapping =
        FLAGS_megatron_args.empty() ? apply_deepspeed_config(cfg, FLAGS_deepspeed_config, &deepspeed)
                                    : apply_megatron_args(cfg, FLAGS_megatron_args, FLAGS_config.empty());
    const std::vector<std::string>& ignored = mapping.ignored;
    for (const auto& [path, flag] : mapping.flag_of) megatron_values[path] = value_at(cfg, path);
    g_megatron_flag_of = mapping.flag_of;
    g_flag_source = mapping.source;
    // Said once (rank 0): what the command line asked for that has no effect here.
    // (on stderr: `dtk config --megatron_args ... > run.pbtxt` keeps a clean file).
    const std::string rank = dtk::core::rank_prefix();
    const char* what = FLAGS_megatron_args.empty() ? "key(s)" : "flag(s)";
    if (!ignored.empty() && (rank.empty() || rank == "[rank 0] ")) {
      std::string list;
      for (const auto& i : ignored) list += (list.empty() ? "" : "; ") + i;
      std::fprintf(stderr, "dtk: note: %s: %zu %s accepted with no effect here: %s\n", mapping.source.c_str(),
                   ignored.size(), what, list.c_str());
    }
    if (rank.empty() || rank == "[rank 0] ") notes = mapping;  // said below, once the overrides are known
  }
  // Switching a slot to another plugin drops the options the config gave the previous one
  // (they belong to that plugin); --set slot.key=value after it configures the new one.
  auto choose = [](dtk::config::PluginChoice* slot, const std::string& name, const char* flag) {
    if (name.empty() || name == slot->name()) return;
    // The options belong to the plugin the config named: another plugin starts from its defaults
    // (a config's gpt sizes never reach --model llama), and the user should know.
    if (slot->options_size() > 0)
      LOG(WARNING) << "--" << flag << " " << name << " replaces the config's " << slot->name() << ": its "
                   << slot->options_size() << " option(s) are dropped, " << name
                   << "'s defaults apply (--set " << flag << ".NAME=VALUE sets them)";
    slot->set_name(name);
    slot->clear_options();
  };
  choose(cfg.mutable_model(), FLAGS_model, "model");
  choose(cfg.mutable_dataset(), FLAGS_dataset, "dataset");
  choose(cfg.mutable_step(), FLAGS_step, "step");
  choose(cfg.mutable_optimizer(), FLAGS_optimizer, "optimizer");
  choose(cfg.mutable_strategy(), FLAGS_strategy, "strategy");
  if (!FLAGS_data_path.empty()) (*cfg.mutable_dataset()->mutable_options())["data_path"] = FLAGS_data_path;
  if (FLAGS_threads != 0) cfg.mutable_train()->set_threads(FLAGS_threads);
  if (!FLAGS_bench_out.empty()) cfg.mutable_logging()->set_bench_out(FLAGS_bench_out);
  if (FLAGS_use_checkpoint_args) cfg.mutable_checkpoint()->set_use_checkpoint_args(true);
  apply_tokenizer_flags(cfg.mutable_tokenizer());
  for (const auto& s : sets) dtk::core::apply_override(cfg, s);
  apply_tokenizer_files(cfg);
  if (!FLAGS_deepspeed_config.empty()) check_deepspeed_client(cfg, deepspeed, FLAGS_deepspeed_config);
  // A field something after the flags changed (--set, --data_path, a switched plugin) is not
  // credited to the flag.
  for (auto it = g_megatron_flag_of.begin(); it != g_megatron_flag_of.end();)
    it = value_at(cfg, it->first) == megatron_values[it->first] ? std::next(it) : g_megatron_flag_of.erase(it);
  // What the flags do differently here; a note about a field something after them changed is no
  // longer true ("runs as all_gather" under --set distributed.cp_comm_type=a2a), and is not said.
  for (const std::string& note : notes.notes) {
    const auto field = notes.note_field.find(note);
    if (field == notes.note_field.end() || value_at(cfg, field->second) == megatron_values[field->second])
      std::fprintf(stderr, "dtk: note: %s: %s\n", notes.source.c_str(), note.c_str());
  }
  return cfg;
}

dtk::host::PluginHost& load_plugins(const char* argv0) {
  static dtk::host::PluginHost* plugins =
      new dtk::host::PluginHost(dtk::core::host_torch_version(), dtk::core::host_services());
  std::vector<std::string> extra;
  if (!FLAGS_plugin_path.empty()) extra.push_back(FLAGS_plugin_path);
  plugins->discover(exe_dir(argv0), extra);
  return *plugins;
}

// One warning per plugin file that could not be loaded (the run goes on without it).
void warn_broken_plugins(const dtk::host::PluginHost& plugins) {
  for (const auto& b : plugins.broken()) std::fprintf(stderr, "dtk: warning: skipped %s\n", b.reason.c_str());
}

int cmd_plugins(const std::vector<std::string>& args, const char* argv0) {
  if (args.empty()) throw dtk::host::HostError("usage: dtk plugins list | dtk plugins describe NAME");
  if (args[0] != "list" && args[0] != "describe")
    throw dtk::host::HostError("plugins: unknown subcommand '" + args[0] +
                               "' (usage: dtk plugins list | dtk plugins describe NAME)");
  const size_t takes = args[0] == "list" ? 1 : 2;  // describe NAME
  if (args.size() > takes) throw dtk::host::HostError("plugins " + args[0] + ": unexpected argument '" + args[takes] + "'");
  auto& plugins = load_plugins(argv0);
  if (args[0] == "list") {
    std::printf("%-16s %-10s %-9s %-5s %s\n", "NAME", "KIND", "VERSION", "ABI", "FILE");
    for (const auto* p : plugins.list())
      std::printf("%-16s %-10s %-9s %u.%-3u %s\n", p->entry->name, dtk::host::kind_name(p->kind()), p->entry->version,
                  p->entry->abi_major, p->entry->abi_minor, p->path.c_str());
    // Files on the plugin path that could not be loaded block nothing else; they are listed.
    for (const auto& b : plugins.broken())
      std::printf("%-16s %-10s %-9s %-5s %s\n  %s\n", "(broken)", "-", "-", "-", b.path.c_str(), b.reason.c_str());
    return 0;
  }
  if (args.size() < 2) throw dtk::host::HostError("usage: dtk plugins describe NAME [--kind KIND]");
  const dtk::host::Plugin* p = nullptr;
  if (FLAGS_kind.empty() && !gflags::GetCommandLineFlagInfoOrDie("kind").is_default)
    throw dtk::host::HostError("plugins describe: --kind is empty: give model, dataset, step, optimizer or strategy");
  if (!FLAGS_kind.empty()) {
    const int32_t kind = dtk::host::kind_from_name(FLAGS_kind);
    if (!kind)
      throw dtk::host::HostError("--kind '" + FLAGS_kind + "': not one of model, dataset, step, strategy, optimizer");
    p = &plugins.get(kind, args[1]);
  } else {
    p = plugins.find_any(args[1]);
    if (!p) {
      std::vector<std::string> names;
      for (const auto* q : plugins.list()) names.push_back(q->name());
      std::string msg = "unknown plugin '" + args[1] + "'";
      std::string guess = dtk::host::did_you_mean(args[1], names);
      if (!guess.empty()) msg += "; did you mean '" + guess + "'?";
      throw dtk::host::HostError(msg + plugins.broken_hint());
    }
  }
  const char* types[] = {"?", "bool", "int", "float", "string", "enum"};
  std::printf("%s (%s plugin, version %s, ABI %u.%u%s%s)\n  %s\n  file: %s\n\noptions:\n", p->entry->name,
              dtk::host::kind_name(p->kind()), p->entry->version, p->entry->abi_major, p->entry->abi_minor,
              p->entry->torch_version ? ", LibTorch " : "", p->entry->torch_version ? p->entry->torch_version : "",
              p->entry->description ? p->entry->description : "", p->path.c_str());
  const auto options = p->options();
  if (options.empty()) std::printf("  (none)\n");
  // Columns as wide as their longest entry.
  auto type_of = [&](const dtk_option_spec* o) {
    std::string type = types[o->type >= 1 && o->type <= 5 ? o->type : 0];
    if (o->type == DTK_OPT_ENUM && o->choices) type += " {" + std::string(o->choices) + "}";
    return type;
  };
  auto default_of = [](const dtk_option_spec* o) {
    return o->default_value ? "'" + std::string(o->default_value) + "'" : std::string("(required)");
  };
  int wn = 0, wt = 0, wd = 0;
  for (const auto* o : options) {
    wn = std::max(wn, static_cast<int>(std::strlen(o->name)));
    wt = std::max(wt, static_cast<int>(type_of(o).size()));
    wd = std::max(wd, static_cast<int>(default_of(o).size()));
  }
  // An option that acts only with other settings says which (ABI 2.7's acts_with).
  auto help_of = [](const dtk_option_spec* o) {
    const std::string needs = dtk::host::acts_with_text(*o);
    return std::string(o->help ? o->help : "") + (needs.empty() ? "" : " Only with " + needs + ".");
  };
  for (const auto* o : options)
    std::printf("  %-*s  %-*s  default: %-*s  %s\n", wn, o->name, wt, type_of(o).c_str(), wd, default_of(o).c_str(),
                help_of(o).c_str());
  return 0;
}

// The one error line of a failed command, with the Megatron flags it names (control bytes
// escaped, a very long message cut: dtk/host/error_line.hpp).
void report_error(const std::string& message) {
  dtk::host::print_error_line(message + dtk::core::megatron_flag_legend(message, g_megatron_flag_of, g_flag_source));
}

// `dtk config`: checked as `dtk train` checks it before any work: the fields, and each slot's
// plugin and options (a typo in an option is found here, not at the start of a long run).
int cmd_config(const std::vector<std::string>& sets, const char* argv0) {
  const dtk::config::RunConfig cfg = resolve_config(sets);
  dtk::core::validate_config(cfg);
  dtk::core::save_on_signals(cfg.train());  // the signal names, as `dtk train` checks them at start
  auto& plugins = load_plugins(argv0);
  const std::pair<int32_t, const dtk::config::PluginChoice*> slots[] = {{DTK_KIND_MODEL, &cfg.model()},
                                                                        {DTK_KIND_DATASET, &cfg.dataset()},
                                                                        {DTK_KIND_STEP, &cfg.step()},
                                                                        {DTK_KIND_OPTIMIZER, &cfg.optimizer()},
                                                                        {DTK_KIND_STRATEGY, &cfg.strategy()}};
  for (const auto& [kind, choice] : slots)
    dtk::host::resolve_options(plugins.get(kind, choice->name()),
                               std::map<std::string, std::string>(choice->options().begin(), choice->options().end()));
  std::fputs(dtk::core::to_text(cfg).c_str(), stdout);
  return 0;
}

// Megatron refuses a run without the model's shape or without data (validate_args); a command line
// missing them trained DTK's default GPT-2 on random tokens. A --config, or the flag or --set
// that gives the value, stands in for the Megatron flag.
void refuse_partial_megatron_run(const dtk::config::RunConfig& cfg, const std::vector<std::string>& sets) {
  if (FLAGS_megatron_args.empty() || !FLAGS_config.empty()) return;
  const auto given = [&](const std::string& field) {
    return g_megatron_flag_of.count(field) > 0 ||
           std::any_of(sets.begin(), sets.end(), [&](const std::string& s) { return s.rfind(field + "=", 0) == 0; });
  };
  std::vector<std::string> missing;
  if (!cfg.checkpoint().use_checkpoint_args() && FLAGS_model.empty())
    for (const auto& [field, flag] : {std::pair<const char*, const char*>{"model.num_layers", "--num-layers"},
                                      {"model.hidden_size", "--hidden-size"},
                                      {"model.num_attention_heads", "--num-attention-heads"}})
      if (!given(field)) missing.push_back(flag);
  const bool data = FLAGS_dataset.size() || FLAGS_data_path.size() || given("dataset.name") ||
                    given("dataset.data_path") || given("dataset.train_data_path") ||
                    given("dataset.valid_data_path") || given("dataset.test_data_path");
  if (!data) missing.push_back("--data-path (or --mock-data for random tokens)");
  if (missing.empty()) return;
  std::string list;
  for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
  throw dtk::host::HostError("--megatron_args: no " + list +
                             ": Megatron requires them (without --config, DTK would train its default model on "
                             "random tokens)");
}

// `dtk train`: the run configuration is set before any plugin's init() can ask for it.
int cmd_train(const std::vector<std::string>& args, const std::vector<std::string>& sets, const char* argv0) {
  if (!args.empty()) throw dtk::host::HostError("train: unexpected argument '" + args[0] + "'");
  dtk::config::RunConfig cfg = resolve_config(sets);
  refuse_partial_megatron_run(cfg, sets);
  dtk::core::set_run_config(cfg);
  auto& plugins = load_plugins(argv0);
  g_loaded = &plugins;
  warn_broken_plugins(plugins);
  int rc = dtk::core::pretrain(cfg, plugins, dtk::app::trainer_hooks_from_environment());
  plugins.shutdown();
  return rc;
}

// Whether `dtk CMD` reads the flag defined in `file` (gflags are global: without this check a flag
// of another command, generate's --seed given to train say, would parse and do nothing).
bool command_reads(const std::string& cmd, const std::string& flag, const std::string& file) {
  const auto in = [&](std::initializer_list<const char*> cmds) {
    for (const char* c : cmds)
      if (cmd == c) return true;
    return false;
  };
  const auto defined_in = [&](const std::string& name) {
    return file.size() >= name.size() && file.compare(file.size() - name.size(), name.size(), name) == 0 &&
           (file.size() == name.size() || file[file.size() - name.size() - 1] == '/');
  };
  if (defined_in("flags/generate.cpp")) return cmd == "generate";
  if (defined_in("flags/preprocess.cpp")) return cmd == "preprocess";
  if (defined_in("flags/checkpoint.cpp")) return cmd == "checkpoint";
  if (defined_in("flags/tokenizer.cpp")) return in({"train", "config", "preprocess", "generate", "export"});
  if (!defined_in("flags/common.cpp")) return true;  // not dtk's (glog's --v, --logtostderr, ...)
  if (flag == "plugin_path" || flag == "threads") return true;
  if (flag == "kind") return cmd == "plugins";
  if (flag == "verify") return cmd == "checkpoint" || cmd == "export" || cmd == "generate";
  if (flag == "megatron_table" || flag == "deepspeed_table") return cmd == "config";
  // export and generate take --model and --use_checkpoint_args, and refuse --config and
  // --megatron_args themselves, with their reason (apply_command_line_model).
  if (flag == "config" || flag == "model" || flag == "megatron_args" || flag == "use_checkpoint_args")
    return in({"train", "config", "export", "generate"});
  return in({"train", "config"});
}

// What a flag of another command most likely meant under train/config (Megatron's names).
std::string train_equivalent(const std::string& flag) {
  static const std::map<std::string, std::string> kMeant = {
      {"seed", "--set train.seed=N"},
      {"load", "--set checkpoint.load=DIR"},
      {"verify", "--set checkpoint.no_verify_checksums=true"},
      {"tensor_model_parallel_size", "--set distributed.tensor_model_parallel_size=N"},
      {"pipeline_model_parallel_size", "--set distributed.pipeline_model_parallel_size=N"},
      {"virtual_pipeline_model_parallel_size", "--set distributed.virtual_pipeline_model_parallel_size=N"},
      {"expert_model_parallel_size", "--set distributed.expert_model_parallel_size=N"},
      {"decoder_first_pipeline_num_layers", "--set distributed.decoder_first_pipeline_num_layers=N"},
      {"decoder_last_pipeline_num_layers", "--set distributed.decoder_last_pipeline_num_layers=N"},
      {"account_for_embedding_in_pipeline_split", "--set distributed.account_for_embedding_in_pipeline_split=true"},
      {"account_for_loss_in_pipeline_split", "--set distributed.account_for_loss_in_pipeline_split=true"}};
  const auto it = kMeant.find(flag);
  return it == kMeant.end() ? "" : it->second;
}

// A flag (or --set) the command does not read is refused, naming the command that does.
void refuse_flags_of_other_commands(const std::string& cmd, const std::vector<std::string>& sets) {
  if (!is_command(cmd)) return;
  if (!sets.empty() &&
      (cmd == "checkpoint" || cmd == "import" || cmd == "preprocess" || cmd == "plugins" || cmd == "version"))
    throw dtk::host::HostError(cmd + ": --set " + sets.front() + " is not read by dtk " + cmd + " (it takes no --set)");
  std::vector<gflags::CommandLineFlagInfo> all;
  gflags::GetAllFlags(&all);
  for (const auto& f : all) {
    if (f.is_default || command_reads(cmd, f.name, f.filename)) continue;
    std::string owners;
    const bool refused_there = f.name == "config" || f.name == "megatron_args";  // by export and generate
    for (const std::string& other : command_names())
      if (other != cmd && command_reads(other, f.name, f.filename) &&
          !(refused_there && (other == "export" || other == "generate")))
        owners += (owners.empty() ? "" : ", ") + std::string(other);
    const std::string meant = (cmd == "train" || cmd == "config") ? train_equivalent(f.name) : "";
    throw dtk::host::HostError(cmd + ": --" + f.name + " is not read by dtk " + cmd + " (it is a flag of dtk " +
                               owners + ")" + (meant.empty() ? ": drop it" : ": did you mean " + meant + "?"));
  }
}

// `dtk version` and `dtk --version`: the build, its CUDA side, and LibTorch's stand-ins.
void print_version() {
  std::printf("dtk %s\n%s\n", gflags::VersionString(), dtk::core::cuda_build_summary().c_str());
  if (const int n = dtk::host::torch_standins_loaded())
    std::printf(
        "LibTorch: %d of its dependencies that it never calls stood in by empty libraries "
        "(lib/dtk/torch-standins; DTK_TORCH_STANDINS=off loads the real ones)\n",
        n);
}

// The command named by argv[1] (flags already parsed out of argc/argv).
int run_command(int argc, char** argv, const std::vector<std::string>& sets) {
  const std::string cmd = argv[1];
  refuse_flags_of_other_commands(cmd, sets);
  std::vector<std::string> args(argv + 2, argv + argc);
  // An empty argument is most often a variable that was never set ("$OUT"): say so before a
  // command takes it for a path.
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].empty())
      throw dtk::host::HostError(cmd + ": argument " + std::to_string(i + 1) +
                                 " is empty (an unset variable?): give a value, or drop it");
  const char* argv0 = argv[0];
  if (cmd == "version") {
    if (!args.empty()) throw dtk::host::HostError("version: unexpected argument '" + args[0] + "'");
    print_version();
    return 0;
  }
  if (cmd == "plugins") return cmd_plugins(args, argv0);
  if (cmd == "config" && FLAGS_megatron_table) {
    std::fputs(dtk::core::megatron_flag_table().c_str(), stdout);
    return 0;
  }
  if (cmd == "config" && FLAGS_deepspeed_table) {
    std::fputs(dtk::core::deepspeed_key_table().c_str(), stdout);
    return 0;
  }
  if (cmd == "config") return cmd_config(sets, argv0);
  if (cmd == "train") return cmd_train(args, sets, argv0);
  if (cmd == "preprocess") {
    return run_preprocess(argc - 1, argv + 1);
  }
  if (cmd == "checkpoint")
    return run_checkpoint(args, [argv0]() -> dtk::host::PluginHost& { return load_plugins(argv0); });
  if (cmd == "export") return run_export(args, sets, load_plugins(argv0));
  if (cmd == "import") return run_import(args, load_plugins(argv0));
  if (cmd == "generate") {
    if (!args.empty()) throw dtk::host::HostError("generate: unexpected argument '" + args[0] + "'");
    return run_generate(sets, load_plugins(argv0));
  }
  throw dtk::host::HostError(
      "unknown command '" + cmd +
      "' (commands: train, plugins, config, preprocess, checkpoint, export, import, generate, version; see --help)");
}

// --version and --help anywhere on the command line answer before anything is parsed. Returns
// whether one did.
bool answered_version_or_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--version") || !std::strcmp(argv[i], "-V")) {
      print_version();
      return true;
    }
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "help")) {
      print_help(argc, argv);
      return true;
    }
  }
  return false;
}

}  // namespace

namespace {
// `dtk train`: a signal of train.save_on_signals before its handler exists is held, not fatal
// (exit_conditions.hpp). bin/dtk (front.cpp) holds them before it executes this host, and `dtk
// launch` in its ranks; this .preinit_array hook, which runs before any shared library's
// constructors (LibTorch's static initialisers take about a second before main), holds them when
// libexec/dtk is run directly. The mask survives the allocator's re-exec. `dtk launch` holds them
// too, until its forwarding handlers exist (launch.cpp).
// glibc passes (argc, argv, envp) to preinit functions.
void hold_exit_signals_before_the_libraries(int argc, char** argv, char**) {
  if (dtk::core::holds_exit_signals(argc, argv)) dtk::core::block_exit_signals();
}
__attribute__((section(".preinit_array"), used)) void (*const kHoldExitSignals)(int, char**, char**) =
    &hold_exit_signals_before_the_libraries;
}  // namespace

int main(int argc, char** argv) {
  dtk::core::use_caching_allocator(argc, argv);  // may re-execute dtk with tcmalloc preloaded
  dtk::host::restore_library_path();             // bin/dtk's LibTorch stand-ins are loaded now
  try {
    dtk::cpu_gemm_engine();  // a bad DTK_CPU_GEMM is refused before anything runs (dtk/gemm.hpp)
  } catch (const std::exception& e) {
    report_error(e.what());
    return 2;
  }
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  gflags::SetVersionString(std::string(DTK_VERSION) + " (ABI " + std::to_string(DTK_ABI_MAJOR) + "." +
                           std::to_string(DTK_ABI_MINOR) + ", LibTorch " + dtk::core::host_torch_version() + ")");
  gflags::SetUsageMessage(kUsage);
  // `dtk launch ...`: its own flags, then a whole dtk command line for the children.
  if (argc >= 2 && !std::strcmp(argv[1], "launch")) return launch_command(argc - 2, argv + 2);
  if (answered_version_or_help(argc, argv)) return 0;
  try {
    std::vector<std::string> sets = extract_sets(&argc, argv);
    check_flags(argc, argv);  // unknown flags: our one-line error with a suggestion
    gflags::ParseCommandLineFlags(&argc, &argv, true);
    if (argc < 2) {
      std::fputs(kUsage, stderr);
      report_error("no command given (train, launch, plugins, config, preprocess, checkpoint, export, import; see dtk --help)");
      return 2;
    }
    return run_command(argc, argv, sets);
  } catch (const std::filesystem::filesystem_error& e) {
    // The library's "filesystem error: status: ... [path]" as a sentence: what could not be
    // read and why (a link loop, a permission, a vanished directory).
    VLOG(1) << "the error in full: " << e.what();
    std::string paths = e.path1().empty() ? std::string("a path") : e.path1().string();
    if (!e.path2().empty()) paths += " (with " + e.path2().string() + ")";
    report_error(dtk::core::rank_prefix() + "cannot access " + paths + ": " + e.code().message());
  } catch (const std::exception& e) {
    // LibTorch's errors carry a C++ backtrace in what(): the user gets the message only (the
    // whole text goes to the log at verbosity 1: --v=1). A multi-process run names the rank:
    // "dtk: error: [rank R] ...".
    VLOG(1) << "the error in full: " << e.what();
    report_error(dtk::core::rank_prefix() + dtk::one_line(e.what()));
  } catch (...) {
    report_error(dtk::core::rank_prefix() + "unknown exception");
  }
  if (g_loaded) g_loaded->shutdown();  // plugins get their deinit() on error paths too
  return 1;
}
