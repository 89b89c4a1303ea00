// The tokenizer a command works with, from its flags (Megatron's --tokenizer-type,
// --tokenizer-model, --vocab-file, --merge-file, --vocab-size spelled with underscores) or from a
// run configuration's `tokenizer` block. Used by preprocess, generate, export and train.
#pragma once

#include <memory>
#include <string>

#include "dtk/text/tokenizer.hpp"
#include "dtk_config.pb.h"

// Whether any tokenizer flag is on the command line.
bool tokenizer_flags_given();
dtk::text::TokenizerSpec tokenizer_spec_from_flags();
dtk::text::TokenizerSpec tokenizer_spec_of(const dtk::config::TokenizerConfig& config);
// Whether the configuration names a tokenizer at all.
bool names_tokenizer(const dtk::config::TokenizerConfig& config);
// The tokenizer flags given on the command line, written over a run configuration's tokenizer
// block (`dtk train --tokenizer_type ... --tokenizer_model ...` as `--set tokenizer.type=...`).
void apply_tokenizer_flags(dtk::config::TokenizerConfig* config);

// make_tokenizer() with its DataError turned into one HostError line ("tokenizer: ...").
std::unique_ptr<dtk::text::Tokenizer> load_tokenizer(const dtk::text::TokenizerSpec& spec);

// A tokenizer that spells ids the model has no row for (GPT-2's 50257 beside a 1000-token model)
// is not the one it was trained with: one HostError line, "<command>: the tokenizer (TYPE) has N
// tokens but the model only M: ...". Used by `dtk export hf` (before writing tokenizer files) and
// `dtk generate` (before the first prompt).
void require_tokenizer_fits(const dtk::text::Tokenizer& tokenizer, int64_t model_vocab, const std::string& command);
