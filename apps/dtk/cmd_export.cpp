// `dtk export hf CHECKPOINT OUT_DIR [--vocab_file F --merge_file F]` and `dtk import hf`: see
// cmd_export.hpp. The tokenizer flags are defined in flags/tokenizer.cpp.
#include "cmd_export.hpp"

#include <gflags/gflags.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>

#include "dtk/core/checkpoint/checkpoint.hpp"
#include "dtk/core/components/components.hpp"

#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/core/checkpoint/checkpoint_convert.hpp"
#include "dtk/core/checkpoint/checkpoint_model.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/export/hf_gpt2.hpp"
#include "dtk/core/export/hf_llama.hpp"
#include "dtk/host/plugin_host.hpp"
#include "dtk/plugin.hpp"
#include "flags/flags.hpp"
#include "tokenizer_flags.hpp"

namespace {

// Tokenizer files that spell ids the model has no row for would ship a folder that breaks on the
// first such token: refused, with both sizes (require_tokenizer_fits).
void check_tokenizer_fits(const dtk::text::Tokenizer& tokenizer, int64_t model_vocab) {
  require_tokenizer_fits(tokenizer, model_vocab, "export hf");
}

// The files of tokenizer `c` and its BOS/EOS, read through dtk::text, for config.json and the
// folder (a tokenizer named but unreadable is an error: the export would ship a broken folder).
dtk::core::TokenizerFiles describe_tokenizer(const dtk::config::TokenizerConfig& c, int64_t model_vocab) {
  dtk::core::TokenizerFiles t;
  t.type = c.type(), t.model_file = c.model_file(), t.vocab_file = c.vocab_file(), t.merge_file = c.merge_file();
  if (!names_tokenizer(c)) return t;
  const auto tokenizer = load_tokenizer(tokenizer_spec_of(c));
  check_tokenizer_fits(*tokenizer, model_vocab);
  t.bos = tokenizer->bos() >= 0 ? tokenizer->bos() : (tokenizer->text_prefix().empty() ? -1 : tokenizer->text_prefix()[0]);
  t.eos = tokenizer->eod();
  t.made_tokenizer_json = tokenizer->hf_tokenizer_json();
  if (tokenizer->type() != "HuggingFaceTokenizer" && t.made_tokenizer_json.empty()) return t;
  if (t.bos >= 0) t.bos_text = tokenizer->decode(std::vector<int32_t>{static_cast<int32_t>(t.bos)});
  if (t.eos >= 0) t.eos_text = tokenizer->decode(std::vector<int32_t>{static_cast<int32_t>(t.eos)});
  if (tokenizer->files().size() > 1) t.config_file = tokenizer->files()[1];
  return t;
}

// What a shape has beyond a plain Llama's, as ", heads of 128 channels, query/key norms" or
// ", 8 experts (2 per token)"; "" for none. Experts of another width than the dense MLP's,
// weights not renormalised, a shared expert and dense layers among the sparse ones are named.
std::string shape_extras(const dtk::core::LlamaShape& s) {
  std::string t;
  if (s.head_dim * s.heads != s.hidden) t += ", heads of " + std::to_string(s.head_dim) + " channels";
  if (s.qk_norm) t += ", query/key norms";
  if (s.qkv_bias && !s.bias) t += ", query/key/value biases";
  if (s.window >= 0) t += ", a sliding window of " + std::to_string(s.window) + " earlier tokens";
  if (s.window >= 0 && !s.window_layers.empty())
    t += " in " + std::to_string(std::count(s.window_layers.begin(), s.window_layers.end(), true)) + " of " +
         std::to_string(s.layers) + " layers";
  if (!s.has_experts()) return t;
  t += ", " + std::to_string(s.experts) + " experts";
  if (s.moe_ffn != s.ffn) t += " of ffn " + std::to_string(s.moe_ffn);
  t += " (" + std::to_string(s.topk) + " per token" + (s.pre_softmax ? ", weights not renormalised" : "") + ")";
  if (s.shared_ffn > 0)
    t += std::string(", a ") + (s.shared_gate ? "gated " : "") + "shared expert of ffn " + std::to_string(s.shared_ffn);
  if (const int64_t dense = s.dense_layers(); dense > 0)
    t += ", " + std::to_string(dense) + " dense layer" + (dense > 1 ? "s" : "");
  return t;
}

// `dtk export hf` of a llama checkpoint: a LlamaForCausalLM folder, or MistralForCausalLM,
// MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM or
// Qwen3MoeForCausalLM where the shape is theirs (dtk/core/export/hf_llama.hpp).
int export_llama(const std::vector<std::string>& args, const dtk::config::RunConfig& cfg, int64_t iteration,
                 const std::string& iter_dir, const std::map<std::string, std::string>& options,
                 const std::map<std::string, int>& dims) {
  dtk::core::LlamaShape shape = dtk::core::llama_shape(options, cfg.train().seq_length());
  // The run's tokenizer as its config recorded it, the tokenizer flags over it (as for train).
  dtk::config::TokenizerConfig recorded = cfg.tokenizer();
  apply_tokenizer_flags(&recorded);
  const dtk::core::TokenizerFiles tok = describe_tokenizer(recorded, shape.vocab);
  const auto report = dtk::core::export_hf_llama(iter_dir, shape, args[2], tok, dims, FLAGS_verify);
  std::printf(
      "exported iteration %lld of %s to %s: %s, %lld layers, hidden %lld, %lld heads, %lld "
      "key/value heads, ffn %lld%s, vocab %lld, %lld positions, rope theta %g%s, %s; model.safetensors %lld "
      "tensors, %.1f MB; config.json%s%s\n",
      static_cast<long long>(iteration), args[1].c_str(), args[2].c_str(), shape.architecture().c_str(),
      static_cast<long long>(shape.layers), static_cast<long long>(shape.hidden), static_cast<long long>(shape.heads),
      static_cast<long long>(shape.groups), static_cast<long long>(shape.ffn), shape_extras(shape).c_str(),
      static_cast<long long>(shape.vocab), static_cast<long long>(shape.positions), shape.rope_theta,
      shape.llama3 ? ", llama3 rope scaling" : "", report.dtype.c_str(), static_cast<long long>(report.tensors),
      report.megabytes, report.tokenizer.empty() ? "" : " and ", report.tokenizer.c_str());
  if (shape.window >= 0 && shape.model_type().rfind("qwen", 0) == 0)
    std::printf(
        "note: transformers 4.53 and later window Qwen's layers as this config says (layer_types, from "
        "max_window_layers on); earlier versions' eager and SDPA attention do not\n");
  if (report.padding_rows > 0)
    std::printf("dropped %lld vocabulary padding rows: token ids %lld and above are not in the export (vocab_size %lld)\n",
                static_cast<long long>(report.padding_rows), static_cast<long long>(shape.vocab),
                static_cast<long long>(shape.vocab));
  if (shape.capacity_factor > 0)
    std::printf(
        "the model was trained dropping tokens over its experts' capacity (moe_expert_capacity_factor %g); "
        "Hugging Face's %s routes every token (dropless)\n",
        shape.capacity_factor, shape.architecture().c_str());
  if (report.tokenizer.empty())
    std::printf("no tokenizer files written: the checkpoint's config names no tokenizer.model_file (nor vocab_file and "
                "merge_file); --vocab_file and --merge_file add GPT-2's\n");
  return 0;
}

}  // namespace

void apply_command_line_model(dtk::config::RunConfig& cfg, const std::vector<std::string>& sets,
                              dtk::host::PluginHost& plugins, const std::string& where, const std::string& command) {
  using dtk::host::HostError;
  const std::string reads = command + " runs the model the checkpoint records";
  if (!FLAGS_config.empty()) throw HostError(reads + ": --config is not read (check a model option with --set model.K=V)");
  if (!FLAGS_megatron_args.empty())
    throw HostError(reads + ": --megatron_args is not read (check a model option with --set model.K=V)");
  // What the command line gives: --model and --set model.K=V.
  dtk::config::RunConfig line;
  line.mutable_model()->set_name(FLAGS_model.empty() ? cfg.model().name() : FLAGS_model);
  for (const auto& s : sets) {
    if (s.rfind("model.", 0) != 0)
      throw HostError(reads + ": --set " + s + " is not read (only model options: --set model.K=V)");
    dtk::core::apply_override(line, s);
  }
  std::vector<std::string> given;
  for (const auto& kv : line.model().options()) given.push_back(kv.first);
  // The model it describes: the checkpoint's with those changes (another plugin: its options only),
  // or with --use_checkpoint_args the checkpoint's with the line's exempt options, as `dtk train`.
  dtk::config::RunConfig run;
  *run.mutable_model() = line.model();
  if (FLAGS_use_checkpoint_args) {
    const std::string said = dtk::core::adopt_checkpoint_model(cfg.model(), run.mutable_model(), where, plugins);
    std::fprintf(stderr, "%s:%s\n", command.c_str(), said.c_str());
  } else {
    if (line.model().name() == cfg.model().name()) {
      *run.mutable_model() = cfg.model();
      for (const auto& [k, v] : line.model().options()) (*run.mutable_model()->mutable_options())[k] = v;
      // A setting the line changes may leave recorded options idle (recompute_activations=none
      // beside a recorded recompute_method=block): the plugin's defaults replace them.
      dtk::core::drop_idle_model_options(run.mutable_model(), plugins, given);
    }
    const std::string difference = dtk::core::model_difference(cfg.model(), run.model(), plugins, where);
    if (!difference.empty()) throw HostError(difference);
  }
  *cfg.mutable_model() = run.model();
}

int run_export(const std::vector<std::string>& args, const std::vector<std::string>& sets,
               dtk::host::PluginHost& plugins) {
  using dtk::host::HostError;
  const char* usage =
      "usage: dtk export hf CHECKPOINT OUT_DIR [--vocab_file encoder.json --merge_file vocab.bpe] (GPT-2's files: "
      "required for a gpt model)";
  if (args.empty() || args[0] != "hf") throw HostError(std::string(usage) + " (formats: hf)");
  if (args.size() != 3) throw HostError(usage);
  int64_t iteration = 0;
  const std::string iter_dir = dtk::core::resolve_iteration_dir(args[1], &iteration, /*verify=*/false);
  dtk::config::RunConfig cfg;
  if (!dtk::core::read_recorded_config(iter_dir, &cfg, plugins, dtk::core::offline_checksum_check(FLAGS_verify)))
    throw HostError("export hf: the configuration recorded in " + iter_dir + " does not parse");
  apply_command_line_model(cfg, sets, plugins, args[1], "export hf");
  const std::string& name = cfg.model().name();
  if (name != "gpt" && name != "llama")
    throw HostError("export hf: " + iter_dir + " holds a '" + name +
                    "' model; export hf is for the gpt (GPT2LMHeadModel) and llama (LlamaForCausalLM) model plugins");
  if (name == "gpt" && (FLAGS_vocab_file.empty() || FLAGS_merge_file.empty()))
    throw HostError(
        "export hf: --vocab_file and --merge_file name the GPT-2 tokenizer files shipped with the model "
        "(data/gpt2/encoder.json and data/gpt2/vocab.bpe after tools/setup.sh --vocab)");
  const dtk::host::Plugin& plugin = plugins.get(DTK_KIND_MODEL, name);
  const auto resolved = dtk::host::resolve_options(
      plugin, std::map<std::string, std::string>(cfg.model().options().begin(), cfg.model().options().end()));
  const std::map<std::string, std::string> options(resolved.begin(), resolved.end());
  if (name == "llama") dtk::core::llama_shape(options, cfg.train().seq_length());  // refusals before any build
  // The plugin says how each parameter is split over tensor-parallel ranks (as for convert).
  const int tp = std::max(1, cfg.distributed().tensor_model_parallel_size());
  const auto dims = dtk::core::partition_dims(build_model(plugins, cfg, 0, tp).model->parameters());
  if (name == "llama") return export_llama(args, cfg, iteration, iter_dir, options, dims);
  const dtk::core::Gpt2Shape shape = dtk::core::gpt2_shape(options, cfg.train().seq_length());
  check_tokenizer_fits(*load_tokenizer({"GPT2BPETokenizer", "", FLAGS_vocab_file, FLAGS_merge_file, 0}), shape.vocab);
  const auto report =
      dtk::core::export_hf_gpt2(iter_dir, shape, args[2], FLAGS_vocab_file, FLAGS_merge_file, dims, FLAGS_verify);
  std::printf("exported iteration %lld of %s to %s: GPT2LMHeadModel, %lld layers, hidden %lld, %lld heads, vocab %lld, "
              "%lld positions, activation gelu, %s; model.safetensors %lld tensors, %.1f MB; config.json and the "
              "GPT-2 tokenizer files\n",
              static_cast<long long>(iteration), args[1].c_str(), args[2].c_str(), static_cast<long long>(shape.layers),
              static_cast<long long>(shape.hidden), static_cast<long long>(shape.heads),
              static_cast<long long>(shape.vocab), static_cast<long long>(shape.positions), report.dtype.c_str(),
              static_cast<long long>(report.tensors), report.megabytes);
  return 0;
}

BuiltModel build_model(dtk::host::PluginHost& plugins, const dtk::config::RunConfig& cfg, int tp_rank, int tp_size,
                       int stage, const dtk::PipelineSplit& split, int ep_rank, int ep_size) {
  const dtk::host::Plugin& plugin = plugins.get(DTK_KIND_MODEL, cfg.model().name());
  BuiltModel b;
  b.options = std::make_unique<dtk::host::OptionValues>(dtk::host::resolve_options(
      plugin, std::map<std::string, std::string>(cfg.model().options().begin(), cfg.model().options().end())));
  dtk_build_context c{};
  c.struct_size = dtk_build_context_STRUCT_SIZE;  // ABI rule 2: the size up to the last field
  c.options = b.options->get();
  c.device = {DTK_DEVICE_CPU, -1};
  const std::string& dtype = cfg.train().params_dtype();
  c.params_dtype = dtype == "bf16" ? DTK_DTYPE_BFLOAT16 : dtype == "fp16" ? DTK_DTYPE_FLOAT16 : DTK_DTYPE_FLOAT32;
  c.tp_rank = tp_rank, c.tp_size = tp_size, c.pp_rank = stage, c.pp_size = split.stages, c.dp_rank = 0, c.dp_size = 1;
  c.pre_process = stage == 0, c.post_process = stage == split.stages - 1;
  c.ep_rank = ep_rank, c.ep_size = ep_size;  // the routed experts of that expert-parallel rank
  dtk::put_pipeline_split(split, c);
  c.seq_length = cfg.train().seq_length();
  c.micro_batch_size = std::max<int64_t>(1, cfg.train().micro_batch_size());
  c.seed = cfg.train().seed();
  b.model = std::make_unique<dtk::core::ModelInstance>(plugin, c);
  return b;
}

namespace {

// The model plugin `plugin` of `model_options`, built, given the imported weights (the vocabulary
// padded as Megatron pads it) and loaded strictly; its state is the checkpoint written to `save`.
void write_imported(dtk::host::PluginHost& plugins, const std::string& plugin_name,
                    const std::map<std::string, std::string>& model_options, int64_t seq_length,
                    const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& hf_dir,
                    const std::string& save) {
  using dtk::host::HostError;
  dtk::config::RunConfig cfg = dtk::core::default_config();
  cfg.mutable_model()->set_name(plugin_name);
  cfg.mutable_model()->clear_options();
  for (const auto& [key, value] : model_options) (*cfg.mutable_model()->mutable_options())[key] = value;
  cfg.mutable_train()->set_seq_length(seq_length);
  cfg.mutable_train()->set_params_dtype("fp32");
  const dtk::host::Plugin& plugin = plugins.get(DTK_KIND_MODEL, plugin_name);
  BuiltModel built = build_model(plugins, cfg, 0, 1);
  dtk::core::ModelInstance& model = *built.model;
  std::map<std::string, at::Tensor> weights(tensors.begin(), tensors.end());
  dtk::TensorList state;
  for (const auto& [name, current] : model.state_save()) {
    auto it = weights.find(name);
    if (it == weights.end()) {
      if (name.rfind("rng.", 0) != 0)
        throw HostError("import hf: the " + plugin_name + " model has a tensor '" + name + "' the Hugging Face model lacks");
      state.emplace_back(name, current);
      continue;
    }
    at::Tensor value = it->second.to(current.scalar_type());
    // The vocabulary padded as Megatron pads it: zero rows after the real ones.
    if (value.dim() == 2 && current.dim() == 2 && value.size(0) < current.size(0) && value.size(1) == current.size(1))
      value = at::cat({value, at::zeros({current.size(0) - value.size(0), value.size(1)}, value.options())}, 0);
    state.emplace_back(name, value);
    weights.erase(it);
  }
  if (!weights.empty())
    throw HostError("import hf: the " + plugin_name + " model has no tensor '" + weights.begin()->first + "' (from " +
                    hf_dir + ")");
  model.state_load(state, /*strict=*/true);
  const dtk_plugin_entry* e = plugin.entry;
  const std::string writer = std::string("plugin.model=") + e->name + " " + e->version + " (ABI " +
                             std::to_string(e->abi_major) + "." + std::to_string(e->abi_minor) + ")";
  dtk::core::write_weights_checkpoint(save, model.state_save(), dtk::core::to_text(cfg), {writer});
}

std::string set_flags(const std::map<std::string, std::string>& model_options) {
  std::string sets;
  for (const auto& [key, value] : model_options) {
    const std::string set = "model." + key + "=" + value;
    // A value a shell would read otherwise (moe_layer_freq's list, [1,0,1]) is quoted.
    const bool plain = value.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-,") ==
                       std::string::npos;
    sets += " --set " + (plain ? set : "'" + set + "'");
  }
  return sets;
}

// The tokenizer a Hugging Face folder ships, as the flags that select it for fine-tuning.
std::string folder_tokenizer_flags(const std::string& hf_dir) {
  const std::filesystem::path dir(hf_dir);
  std::error_code ec;
  if (std::filesystem::is_regular_file(dir / "tokenizer.json", ec))
    return " --tokenizer_type HuggingFaceTokenizer --tokenizer_model " + hf_dir;
  if (std::filesystem::is_regular_file(dir / "tokenizer.model", ec))
    return " --tokenizer_type Llama2Tokenizer --tokenizer_model " + (dir / "tokenizer.model").string();
  return "";
}

}  // namespace

int run_import(const std::vector<std::string>& args, dtk::host::PluginHost& plugins) {
  using dtk::host::HostError;
  const char* usage =
      "usage: dtk import hf HF_DIR SAVE_DIR (a GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, "
      "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM folder -> "
      "a checkpoint)";
  if (args.empty() || args[0] != "hf") throw HostError(std::string(usage) + " (formats: hf)");
  if (args.size() != 3) throw HostError(usage);
  const std::string& save = args[2];
  dtk::core::require_new_or_empty_folder(save, "import hf");
  if (const std::string type = dtk::core::hf_model_type(args[1]); dtk::core::llama_model_type(type)) {
    const dtk::core::HfLlamaImport imported = dtk::core::import_hf_llama(args[1]);
    const dtk::core::LlamaShape& s = imported.shape;
    write_imported(plugins, "llama", imported.model_options, s.positions, imported.tensors, args[1], save);
    std::printf(
        "imported %s into %s (iteration 0): llama model, %lld layers, hidden %lld, %lld heads, %lld key/value "
        "heads, ffn %lld%s, vocab %lld, %lld positions, rope theta %g%s\nfine-tune from it with:\n  dtk train "
        "--model llama --set checkpoint.load=%s --set checkpoint.finetune=true%s ...\n",
        args[1].c_str(), save.c_str(), static_cast<long long>(s.layers), static_cast<long long>(s.hidden),
        static_cast<long long>(s.heads), static_cast<long long>(s.groups), static_cast<long long>(s.ffn),
        shape_extras(s).c_str(), static_cast<long long>(s.vocab), static_cast<long long>(s.positions), s.rope_theta,
        s.llama3 ? ", llama3 rope scaling" : "", save.c_str(),
        (set_flags(imported.model_options) + folder_tokenizer_flags(args[1])).c_str());
    return 0;
  }
  const dtk::core::HfImport imported = dtk::core::import_hf_gpt2(args[1]);
  const dtk::core::Gpt2Shape& shape = imported.shape;
  // The gpt model of that shape, built by its plugin: its own state (the dropout generators
  // included) with the imported weights in it, loaded strictly, is what the checkpoint holds.
  write_imported(plugins, "gpt", imported.model_options, shape.positions, imported.tensors, args[1], save);
  std::printf("imported %s into %s (iteration 0): gpt model, %lld layers, hidden %lld, %lld heads, vocab %lld, "
              "%lld positions, activation %s\nfine-tune from it with:\n  dtk train --set checkpoint.load=%s "
              "--set checkpoint.finetune=true%s ...\n",
              args[1].c_str(), save.c_str(), static_cast<long long>(shape.layers), static_cast<long long>(shape.hidden),
              static_cast<long long>(shape.heads), static_cast<long long>(shape.vocab),
              static_cast<long long>(shape.positions), shape.openai_gelu ? "gelu_new (model.openai_gelu=true)" : "gelu",
              save.c_str(), set_flags(imported.model_options).c_str());
  return 0;
}
