// dtk/core/export/generate.hpp — text generation with a model plugin's key/value cache (`dtk generate`).
//
// The model is driven through its ordinary forward with the generation names of docs/models.md
// ("kv_cache_length", "kv_cache.<layer>", ...): the first call runs the prompts (left-padded to
// one length, padding masked and positions counted from each prompt's first token) and allocates
// the caches, every later call one new token per sequence. Under tensor parallelism each rank
// holds its heads' cache and its vocabulary slice of the logits; the slices are gathered, tensor-
// parallel rank 0 chooses the tokens and broadcasts them, so every rank continues alike.
#pragma once

#include <dtk/abi.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace at {
class Tensor;
}

namespace dtk::core {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: all tokens
  double top_p = 1.0;        // nucleus: the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 1234;
  int64_t max_new_tokens = 32;
  int64_t eos = -1;          // a sequence ends after this token (-1: never)
  int64_t vocab_size = 0;    // sample among ids below this (the rest is padding); 0: all
};

// The next token of each row of `logits` [b, V] (fp32), by the options; `generator` a CPU
// generator seeded once per run.
at::Tensor sample_next(const at::Tensor& logits, const SamplingOptions& o, void* generator);

// Throws (one line) when a prompt of `longest_prompt` tokens and `max_new_tokens` new ones do not
// fit the model's `max_positions` (the last new token is never fed back: prompt + new - 1).
void check_generation_fits(int64_t longest_prompt, int64_t max_new_tokens, int64_t max_positions);

// Continuations of `prompts` (token ids, each non-empty), generated in one batch. `on_token(i,
// id)` is called on every rank as sequence i gets a token (streaming). `max_positions`: the
// model's max_position_embeddings (prompt + new tokens must fit).
std::vector<std::vector<int64_t>> generate(const dtk_model_ref* model, const std::vector<std::vector<int64_t>>& prompts,
                                           const SamplingOptions& options, int64_t max_positions,
                                           const std::function<void(size_t, int64_t)>& on_token = nullptr);

}  // namespace dtk::core
