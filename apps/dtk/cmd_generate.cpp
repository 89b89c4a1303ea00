#include "cmd_generate.hpp"

#include <ATen/ATen.h>
#include <gflags/gflags.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cmd_export.hpp"
#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/core/checkpoint/checkpoint_model.hpp"
#include "dtk/core/comm/comm.hpp"
#include "dtk/core/export/generate.hpp"
#include "dtk/core/launch/distributed.hpp"
#include "dtk/data/utf8.hpp"
#include "dtk/host/plugin_host.hpp"
#include "dtk/text/tokenizer.hpp"
#include "flags/flags.hpp"
#include "tokenizer_flags.hpp"

namespace {

using dtk::host::HostError;

// A prompt and where it came from ("--prompt", or the file's line), to name it in an error.
struct Prompt {
  std::string text, where;
};

std::vector<Prompt> read_prompts() {
  if (!FLAGS_prompt.empty() && !FLAGS_prompts_file.empty())
    throw HostError("generate: give --prompt or --prompts_file, not both");
  // The tokenizer reads UTF-8; its error would not say which prompt.
  auto utf8 = [](const std::string& text, const std::string& where) {
    if (const size_t bad = dtk::data::find_invalid_utf8(text); bad != std::string::npos)
      throw HostError("generate: " + where + ": invalid UTF-8 at byte " + std::to_string(bad));
  };
  if (!FLAGS_prompt.empty()) {
    utf8(FLAGS_prompt, "--prompt");
    return {{FLAGS_prompt, "--prompt"}};
  }
  if (FLAGS_prompts_file.empty() && !gflags::GetCommandLineFlagInfoOrDie("prompt").is_default)
    throw HostError("generate: --prompt is empty: give the text to continue");
  if (FLAGS_prompts_file.empty()) throw HostError("generate: nothing to continue: give --prompt TEXT or --prompts_file FILE");
  if (std::filesystem::is_directory(FLAGS_prompts_file))
    throw HostError("generate: --prompts_file " + FLAGS_prompts_file + " is a directory, not a file of prompts");
  std::ifstream in(FLAGS_prompts_file);
  if (!in) throw HostError("generate: cannot read --prompts_file " + FLAGS_prompts_file);
  std::vector<Prompt> out;
  int64_t number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();  // CRLF files
    const std::string where = "--prompts_file " + FLAGS_prompts_file + " line " + std::to_string(number);
    utf8(line, where);
    // The echo and the model would read different prompts (a C string ends at the NUL).
    if (line.find('\0') != std::string::npos)
      throw HostError("generate: " + where + " holds a NUL byte: not a text prompt");
    if (!line.empty()) out.push_back({line, where});
  }
  if (out.empty()) throw HostError("generate: --prompts_file " + FLAGS_prompts_file + " holds no prompt");
  return out;
}

// The sampling flags, checked before anything is read.
void check_generate_flags() {
  if (FLAGS_load.empty()) throw HostError("generate: --load DIR (a checkpoint) is required");
  if (FLAGS_max_new_tokens < 1) throw HostError("generate: --max_new_tokens must be >= 1");
  if (!(FLAGS_temperature >= 0)) throw HostError("generate: --temperature must be >= 0");
  if (FLAGS_top_k < 0) throw HostError("generate: --top_k must be >= 0");
  if (!(FLAGS_top_p > 0 && FLAGS_top_p <= 1)) throw HostError("generate: --top_p must be in (0, 1]");
  if (FLAGS_batch_size < 1) throw HostError("generate: --batch_size must be >= 1");
}

// The configuration the checkpoint records, made to run here: one pipeline stage, fp32. The
// ranks of this process group are the checkpoint's tensor-parallel ranks (`*tp` of them).
dtk::config::RunConfig generation_config(const std::string& iter_dir, const dtk::host::PluginHost& plugins, int* tp) {
  dtk::config::RunConfig cfg;
  if (!dtk::core::read_recorded_config(iter_dir, &cfg, plugins, dtk::core::offline_checksum_check(FLAGS_verify)))
    throw HostError("generate: the configuration recorded in " + iter_dir + " does not parse");
  *tp = std::max(1, cfg.distributed().tensor_model_parallel_size());
  const dtk::core::LaunchEnv env = dtk::core::launch_env_from_environment();
  if (env.world_size != *tp)
    throw HostError("generate: " + iter_dir + " was saved at tensor-parallel size " + std::to_string(*tp) +
                    ": run `dtk launch --nproc_per_node " + std::to_string(*tp) +
                    " generate ...` (or convert it: dtk checkpoint convert --tensor_model_parallel_size " +
                    std::to_string(env.world_size) + ")");
  cfg.mutable_distributed()->set_pipeline_model_parallel_size(1);
  cfg.mutable_train()->set_params_dtype("fp32");
  return cfg;
}

// The flags' sampling, never choosing a vocabulary padding row nor an id the tokenizer cannot spell.
dtk::core::SamplingOptions sampling_options(const dtk::config::RunConfig& cfg,
                                            const dtk::text::Tokenizer& tokenizer) {
  dtk::core::SamplingOptions o;
  o.temperature = FLAGS_temperature;
  o.top_k = FLAGS_top_k;
  o.top_p = FLAGS_top_p;
  o.seed = FLAGS_seed;
  o.max_new_tokens = FLAGS_max_new_tokens;
  const int64_t spelled = static_cast<int64_t>(tokenizer.vocab_size());
  auto vocab = cfg.model().options().find("vocab_size");
  o.vocab_size = std::min<int64_t>(vocab != cfg.model().options().end() ? std::stoll(vocab->second) : spelled, spelled);
  o.eos = tokenizer.eod() < o.vocab_size ? tokenizer.eod() : -1;
  return o;
}

// The model's max_position_embeddings, else the sequence length it trained at.
int64_t max_positions_of(const dtk::config::RunConfig& cfg) {
  int64_t max_positions = cfg.train().seq_length();
  auto positions = cfg.model().options().find("max_position_embeddings");
  if (positions != cfg.model().options().end() && std::stoll(positions->second) > 0)
    max_positions = std::stoll(positions->second);
  return max_positions;
}

// What is generated from, on stderr (stdout holds only the text).
void print_generate_header(int64_t iteration, int tp) {
  char how[160];
  if (FLAGS_temperature == 0)
    std::snprintf(how, sizeof how, "greedy");
  else
    std::snprintf(how, sizeof how, "temperature %g, top_k %d, top_p %g, seed %llu", FLAGS_temperature, FLAGS_top_k,
                  FLAGS_top_p, static_cast<unsigned long long>(FLAGS_seed));
  std::fprintf(stderr, "generate: iteration %lld of %s, tensor-parallel size %d, %s\n",
               static_cast<long long>(iteration), FLAGS_load.c_str(), tp, how);
}

// Every prompt's ids, each checked to fit the model's positions with the tokens to add before
// anything is generated: a prompt too long would otherwise stop the run after the batches before
// it were printed. A prompt of no token (whitespace only) starts a document.
std::vector<std::vector<int64_t>> prompt_ids(const std::vector<Prompt>& prompts, const dtk::text::Tokenizer& tokenizer,
                                             int64_t max_positions) {
  std::vector<std::vector<int64_t>> ids(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (int32_t t : tokenizer.tokenize(prompts[i].text)) ids[i].push_back(t);
    if (ids[i].empty() && tokenizer.eod() >= 0) ids[i].push_back(tokenizer.eod());
    if (ids[i].empty()) throw HostError("generate: " + prompts[i].where + ": the prompt has no token");
    const int64_t n = static_cast<int64_t>(ids[i].size());
    if (n + FLAGS_max_new_tokens - 1 > max_positions)
      throw HostError("generate: " + prompts[i].where + ": " + std::to_string(n) +
                      (n == 1 ? " prompt token" : " prompt tokens") + " plus " + std::to_string(FLAGS_max_new_tokens) +
                      " new ones (--max_new_tokens) exceed the model's " + std::to_string(max_positions) +
                      " positions");
  }
  return ids;
}

// How one batch of prompts is continued and shown.
struct GenerateRun {
  const dtk_model_ref* model;
  const dtk::text::Tokenizer& tokenizer;
  const std::vector<Prompt>& prompts;
  const std::vector<std::vector<int64_t>>& ids;  // prompt_ids
  const dtk::core::SamplingOptions& options;
  int64_t max_positions;
  bool printer, stream;
};

// Prompts [first, first + n) in one batch. One prompt streams: its text, then each token's text
// as it is chosen. A batch prints each prompt with its continuation when the batch is done.
void generate_batch(const GenerateRun& run, size_t first, size_t n) {
  const int32_t eod = run.tokenizer.eod();
  const std::vector<std::vector<int64_t>> ids(run.ids.begin() + first, run.ids.begin() + first + n);
  if (run.stream && run.printer) {
    std::fputs(run.prompts[first].text.c_str(), stdout);
    std::fflush(stdout);
  }
  // The continuation is what decoding prompt + new tokens adds to decoding the prompt: a token's
  // text can depend on its neighbours (SentencePiece drops the space of a text's first word), and
  // a multi-byte character may span tokens (streaming prints its bytes when they are all there,
  // or as they arrive when the text so far is not whole UTF-8; the terminal joins them).
  const auto continuation = [&](const std::vector<int64_t>& prompt, const std::vector<int32_t>& added) {
    std::vector<int32_t> all;
    for (int64_t id : prompt)
      if (id != eod) all.push_back(static_cast<int32_t>(id));
    const size_t before = run.tokenizer.decode(all).size();
    all.insert(all.end(), added.begin(), added.end());
    const std::string text = run.tokenizer.decode(all);
    return text.size() > before ? text.substr(before) : std::string();
  };
  std::vector<int32_t> streamed;
  size_t printed = 0;
  auto on_token = [&](size_t, int64_t id) {
    if (!run.stream || !run.printer || id == eod) return;
    streamed.push_back(static_cast<int32_t>(id));
    const std::string text = continuation(ids[0], streamed);
    if (text.size() <= printed) return;
    std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
    std::fflush(stdout);
    printed = text.size();
  };
  std::vector<std::vector<int64_t>> out;
  try {
    out = dtk::core::generate(run.model, ids, run.options, run.max_positions, on_token);
  } catch (...) {
    // The error goes on a line of its own, not after the streamed text.
    if (run.stream && run.printer) std::fputs("\n", stdout);
    throw;
  }
  if (!run.printer) return;
  if (run.stream) {
    std::fputs("\n", stdout);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    std::vector<int32_t> text_ids;
    for (int64_t id : out[i])
      if (id != eod) text_ids.push_back(static_cast<int32_t>(id));
    std::printf("=== prompt %zu\n%s%s\n", first + i + 1, run.prompts[first + i].text.c_str(),
                continuation(ids[i], text_ids).c_str());
  }
  std::fflush(stdout);
}

// The flags' tokenizer, else the one the checkpoint was trained with.
std::unique_ptr<dtk::text::Tokenizer> generation_tokenizer(const dtk::config::RunConfig& cfg, const std::string& iter_dir) {
  if (tokenizer_flags_given()) {
    auto given = load_tokenizer(tokenizer_spec_from_flags());
    // Another tokenizer than the one trained with would turn the prompts into other ids without a
    // word (files moved elsewhere are fine: the same kind and size).
    const auto& recorded = cfg.tokenizer();
    const std::string recorded_type = recorded.type().empty() ? "GPT2BPETokenizer" : recorded.type();
    if (names_tokenizer(recorded) && recorded.vocab_size() > 0 &&
        (given->type() != recorded_type || static_cast<int64_t>(given->vocab_size()) != recorded.vocab_size()))
      throw HostError("generate: the tokenizer flags give a " + given->type() + " of " +
                      std::to_string(given->vocab_size()) + " tokens, but " + iter_dir + " was trained with a " +
                      recorded_type + " of " + std::to_string(recorded.vocab_size()) +
                      " tokens: drop the tokenizer flags to use the one it records");
    return given;
  }
  if (!names_tokenizer(cfg.tokenizer()))
    throw HostError("generate: " + iter_dir +
                    " records no tokenizer: give --vocab_file and --merge_file, or --tokenizer_type and "
                    "--tokenizer_model");
  return load_tokenizer(tokenizer_spec_of(cfg.tokenizer()));
}

}  // namespace

int run_generate(const std::vector<std::string>& sets, dtk::host::PluginHost& plugins) {
  check_generate_flags();
  const std::vector<Prompt> prompts = read_prompts();

  int64_t iteration = 0;
  const std::string iter_dir = dtk::core::resolve_iteration_dir(FLAGS_load, &iteration, /*verify=*/false);
  int tp = 1;
  dtk::config::RunConfig cfg = generation_config(iter_dir, plugins, &tp);
  apply_command_line_model(cfg, sets, plugins, FLAGS_load, "generate");
  const auto tokenizer_ptr = generation_tokenizer(cfg, iter_dir);
  const dtk::text::Tokenizer& tokenizer = *tokenizer_ptr;
  // Prompt ids the model has no row for would fail at the first forward step, far from the cause.
  if (auto vocab = cfg.model().options().find("vocab_size"); vocab != cfg.model().options().end())
    require_tokenizer_fits(tokenizer, std::strtoll(vocab->second.c_str(), nullptr, 10), "generate");
  const int64_t max_positions = max_positions_of(cfg);
  const std::vector<std::vector<int64_t>> ids = prompt_ids(prompts, tokenizer, max_positions);
  // Each process runs every expert: an expert-parallel checkpoint's directories are read together.
  // A context-parallel run's model is whole on each rank: generation runs it on whole sequences.
  cfg.mutable_distributed()->set_expert_model_parallel_size(1);
  cfg.mutable_distributed()->set_context_parallel_size(1);
  dtk::core::init_distributed(cfg);
  const dtk::core::Topology& topo = dtk::core::topology();

  // This rank's model, its weights from the checkpoint (verified against SHA256SUMS).
  BuiltModel built = build_model(plugins, cfg, topo.tp_rank, tp);
  built.model->state_load(dtk::core::read_model_state(iter_dir, topo.tp_rank, FLAGS_verify), /*strict=*/true);
  built.model->set_training(false);

  const dtk::core::SamplingOptions o = sampling_options(cfg, tokenizer);
  const GenerateRun run{built.model->ref(),   tokenizer,          prompts, ids, o, max_positions,
                        topo.world_rank == 0, prompts.size() == 1};
  if (run.printer) print_generate_header(iteration, tp);
  for (size_t first = 0; first < prompts.size(); first += static_cast<size_t>(FLAGS_batch_size))
    generate_batch(run, first, std::min(prompts.size() - first, static_cast<size_t>(FLAGS_batch_size)));
  dtk::core::shutdown_distributed();
  return 0;
}
