// See run_config.hpp.
#include "run_config.hpp"

#include <cerrno>
#include <cstdlib>

#include "dtk/core/config/config.hpp"
#include "dtk/core/config/megatron_args.hpp"
#include "dtk/data/error.hpp"
#include "dtk/data/gpt2_tokenizer.hpp"
#include "dtk/host/error.hpp"

using dtk::host::HostError;

std::vector<std::string> apply_megatron_args(dtk::config::RunConfig& cfg, const std::string& megatron_args,
                                             bool with_megatron_defaults) {
  const dtk::core::MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(megatron_args));
  if (with_megatron_defaults && m.refused.empty())
    for (const auto& d : dtk::core::megatron_defaults()) dtk::core::apply_override(cfg, d);
  dtk::core::apply_megatron_mapping(cfg, m);
  return m.ignored;
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

}  // namespace

void apply_tokenizer_files(dtk::config::RunConfig& cfg) {
  auto& tk = *cfg.mutable_tokenizer();
  if (tk.vocab_file().empty() && tk.merge_file().empty()) {
    if (tk.vocab_size() != 0)
      throw HostError("config: tokenizer.vocab_size is derived from tokenizer.vocab_file, which is not set");
    return;
  }
  if (tk.vocab_file().empty() || tk.merge_file().empty())
    throw HostError(std::string("config: tokenizer.") + (tk.vocab_file().empty() ? "merge_file" : "vocab_file") +
                    " is set but tokenizer." + (tk.vocab_file().empty() ? "vocab_file" : "merge_file") +
                    " is not (GPT-2 BPE needs both: --vocab-file and --merge-file)");
  long long n = 0;
  try {
    n = static_cast<long long>(dtk::data::Gpt2Tokenizer(tk.vocab_file(), tk.merge_file()).vocab_size());
  } catch (const dtk::data::DataError& e) {
    throw HostError("tokenizer: " + std::string(e.what()));
  }
  // A config written by `dtk config` carries the derived size: it must still be the file's.
  if (tk.vocab_size() != 0 && tk.vocab_size() != n)
    throw HostError("config: tokenizer.vocab_size " + std::to_string(tk.vocab_size()) + " is not the " +
                    std::to_string(n) + " tokens of " + tk.vocab_file() + " (it is derived from the file)");
  tk.set_vocab_size(n);
  // Megatron builds the embedding from the tokenizer's size (padded); a different explicit size
  // would train a model the tokenizer cannot use.
  const long long model_vocab = int_option(cfg.model(), "vocab_size", "model.vocab_size");
  if (model_vocab >= 0 && model_vocab != n)
    throw HostError("config: model.vocab_size " + std::to_string(model_vocab) + " differs from the tokenizer's " +
                    std::to_string(n) + " tokens (" + tk.vocab_file() +
                    "); Megatron derives the size from the tokenizer: drop model.vocab_size");
  (*cfg.mutable_model()->mutable_options())["vocab_size"] = std::to_string(n);
  const long long data_vocab = int_option(cfg.dataset(), "vocab_size", "dataset.vocab_size");
  if (data_vocab > n)
    throw HostError("config: dataset.vocab_size " + std::to_string(data_vocab) + " is larger than the tokenizer's " +
                    std::to_string(n) + " tokens (" + tk.vocab_file() +
                    "): the data holds ids this tokenizer cannot produce (another tokenizer's data?)");
}
