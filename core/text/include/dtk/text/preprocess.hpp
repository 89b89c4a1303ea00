// dtk::data — `dtk preprocess`: text or jsonl -> Megatron {prefix}_{key}_document.bin/.idx.
//
// Like Megatron-LM's tools/preprocess_data.py:
//  * jsonl: one JSON object per line = one document per key (--json_keys, default "text");
//    a value may be a string or a list of strings (one sequence each). Empty lines are skipped.
//  * Each text is the tokenizer's tokenize(text) (Llama2Tokenizer's starts with <s>). Documents
//    that tokenize to no token get no sequence but still an entry in the document index (as
//    Megatron); --append_eod appends the tokenizer's EOD to non-empty documents.
// DTK additions:
//  * Plain-text inputs (any other extension): the WHOLE FILE is one document of key "text".
//    It is encoded in parallel chunks cut only where the tokenizer says encoding splits
//    (Tokenizer::next_cut), so the ids are exactly those of encoding the file in one piece;
//    a tokenizer with no such cut (SentencePiece) encodes each file on one thread.
//  * Parallel encoding over `workers` threads with ordered output; progress on the log stream.
//  * A bad line (invalid JSON, invalid UTF-8, missing key) is an error naming file:line, or
//    is skipped and counted with skip_bad_lines.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "dtk/text/tokenizer.hpp"

namespace dtk::text {

struct PreprocessOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  std::vector<std::string> json_keys{"text"};
  const Tokenizer* tokenizer = nullptr;  // required
  bool append_eod = false;
  int workers = 1;  // <= 0: all hardware threads
  bool skip_bad_lines = false;
  double log_interval_mb = 64;   // progress line every this many input MB (<= 0: none)
  std::ostream* log = nullptr;   // progress / summary (nullptr: silent)
  size_t batch_bytes = 1 << 20;  // work unit: jsonl lines / plain-text chunk size
};

struct PreprocessStats {
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t input_bytes = 0;
  int64_t bad_lines = 0;
  int64_t batches = 0;  // work units encoded: batches of jsonl lines, chunks of plain text
  double seconds = 0;
  std::vector<std::string> output_prefixes;  // one per key
};

// Throws DataError with a one-line message on any bad input.
PreprocessStats preprocess(const PreprocessOptions& options);

// Writes the text of documents [begin, end) of the dataset at `prefix` to `out`
// (end = -1: to the last). Throws DataError.
void decode_documents(const std::string& prefix, const Tokenizer& tokenizer, int64_t begin, int64_t end,
                      std::ostream& out);

}  // namespace dtk::text
