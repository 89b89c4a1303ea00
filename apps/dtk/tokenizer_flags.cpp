#include "tokenizer_flags.hpp"
#include "flags/flags.hpp"

#include "dtk/host/error.hpp"

#include <gflags/gflags.h>

#include <sstream>

#include "dtk/data/error.hpp"

using dtk::host::HostError;

bool tokenizer_flags_given() {
  return !FLAGS_tokenizer_type.empty() || !FLAGS_tokenizer_model.empty() || !FLAGS_vocab_file.empty() ||
         !FLAGS_merge_file.empty() || FLAGS_vocab_size != 0 || !FLAGS_tiktoken_pattern.empty() ||
         FLAGS_tiktoken_num_special_tokens != 0 || !FLAGS_tokenizer_special_tokens.empty();
}

namespace {
std::vector<std::string> words_of(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}
}  // namespace

dtk::text::TokenizerSpec tokenizer_spec_from_flags() {
  dtk::text::TokenizerSpec s;
  s.type = FLAGS_tokenizer_type;
  s.model_file = FLAGS_tokenizer_model;
  s.vocab_file = FLAGS_vocab_file;
  s.merge_file = FLAGS_merge_file;
  s.vocab_size = FLAGS_vocab_size;
  s.tiktoken_pattern = FLAGS_tiktoken_pattern;
  s.tiktoken_num_special_tokens = FLAGS_tiktoken_num_special_tokens;
  s.special_tokens = words_of(FLAGS_tokenizer_special_tokens);
  return s;
}

dtk::text::TokenizerSpec tokenizer_spec_of(const dtk::config::TokenizerConfig& c) {
  dtk::text::TokenizerSpec s;
  s.type = c.type();
  s.model_file = c.model_file();
  s.vocab_file = c.vocab_file();
  s.merge_file = c.merge_file();
  s.vocab_size = c.null_vocab_size();
  s.tiktoken_pattern = c.tiktoken_pattern();
  s.tiktoken_num_special_tokens = c.tiktoken_num_special_tokens();
  s.special_tokens = words_of(c.special_tokens());
  return s;
}

bool names_tokenizer(const dtk::config::TokenizerConfig& c) {
  return !c.type().empty() || !c.model_file().empty() || !c.vocab_file().empty() || !c.merge_file().empty() ||
         c.null_vocab_size() != 0 || !c.tiktoken_pattern().empty() || c.tiktoken_num_special_tokens() != 0 ||
         !c.special_tokens().empty();
}

std::unique_ptr<dtk::text::Tokenizer> load_tokenizer(const dtk::text::TokenizerSpec& spec) {
  try {
    return dtk::text::make_tokenizer(spec);
  } catch (const dtk::data::DataError& e) {
    throw HostError("tokenizer: " + std::string(e.what()));
  }
}

void require_tokenizer_fits(const dtk::text::Tokenizer& tokenizer, int64_t model_vocab, const std::string& command) {
  if (model_vocab <= 0 || static_cast<int64_t>(tokenizer.vocab_size()) <= model_vocab) return;
  throw HostError(command + ": the tokenizer (" + tokenizer.type() + ") has " + std::to_string(tokenizer.vocab_size()) +
                  " tokens but the model only " + std::to_string(model_vocab) +
                  ": not the tokenizer it was trained with");
}

void apply_tokenizer_flags(dtk::config::TokenizerConfig* c) {
  if (!FLAGS_tokenizer_type.empty()) c->set_type(FLAGS_tokenizer_type);
  if (!FLAGS_tokenizer_model.empty()) c->set_model_file(FLAGS_tokenizer_model);
  if (!FLAGS_vocab_file.empty()) c->set_vocab_file(FLAGS_vocab_file);
  if (!FLAGS_merge_file.empty()) c->set_merge_file(FLAGS_merge_file);
  if (FLAGS_vocab_size != 0) c->set_null_vocab_size(FLAGS_vocab_size);
  if (!FLAGS_tiktoken_pattern.empty()) c->set_tiktoken_pattern(FLAGS_tiktoken_pattern);
  if (FLAGS_tiktoken_num_special_tokens != 0) c->set_tiktoken_num_special_tokens(FLAGS_tiktoken_num_special_tokens);
  if (!FLAGS_tokenizer_special_tokens.empty()) c->set_special_tokens(FLAGS_tokenizer_special_tokens);
}
