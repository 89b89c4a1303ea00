// `dtk preprocess` — Megatron-LM's tools/preprocess_data.py in C++ (see docs/data.md).
//
//   dtk preprocess --input corpus.jsonl[,more.jsonl|book.txt] --output_prefix data/my
//       (--vocab_file encoder.json --merge_file vocab.bpe | --tokenizer_type T --tokenizer_model F)
//       [--json_keys text] [--append_eod] [--workers N] [--skip_bad_lines]
//   dtk preprocess --decode --input data/my_text_document <the same tokenizer flags> [A:B]
#include "cmd_preprocess.hpp"

#include <dtk/plugin.hpp>  // one_line

#include <gflags/gflags.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "dtk/data/error.hpp"
#include "dtk/host/error_line.hpp"
#include "dtk/text/preprocess.hpp"
#include "flags/flags.hpp"
#include "tokenizer_flags.hpp"

namespace {

std::vector<std::string> split_comma(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t c = s.find(',', pos);
    const std::string item = s.substr(pos, c == std::string::npos ? std::string::npos : c - pos);
    if (!item.empty()) out.push_back(item);
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return out;
}

int64_t parse_index(const std::string& s, const std::string& whole) {
  size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(s, &used);
  } catch (...) {
    used = 0;
  }
  if (s.empty() || used != s.size() || v < 0) {
    throw dtk::data::DataError("invalid document range '" + whole + "' (expected A:B, A:, :B or A)");
  }
  return v;
}

}  // namespace

int run_preprocess(int argc, char** argv) {
  try {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (!tokenizer_flags_given())
      throw dtk::data::DataError(
          "no tokenizer: give --vocab_file and --merge_file (GPT-2's encoder.json and vocab.bpe; tools/setup.sh "
          "--vocab puts them in data/gpt2) or --tokenizer_type and --tokenizer_model");
    const auto tokenizer = dtk::text::make_tokenizer(tokenizer_spec_from_flags());
    if (FLAGS_decode) {
      if (FLAGS_input.empty()) throw dtk::data::DataError("--decode needs --input PREFIX");
      if (!FLAGS_output_prefix.empty())
        throw dtk::data::DataError("--decode prints the documents of --input; it writes no --output_prefix: drop it");
      if (args.size() > 1) throw dtk::data::DataError("unexpected argument '" + args[1] + "'");
      int64_t begin = 0, end = -1;
      if (!args.empty()) {
        const std::string& r = args[0];
        const size_t colon = r.find(':');
        if (colon == std::string::npos) {
          begin = parse_index(r, r);
          end = begin + 1;
        } else {
          if (colon > 0) begin = parse_index(r.substr(0, colon), r);
          if (colon + 1 < r.size()) end = parse_index(r.substr(colon + 1), r);
        }
      }
      std::string prefix = FLAGS_input;
      for (const char* ext : {".idx", ".bin"}) {
        if (prefix.size() > 4 && prefix.compare(prefix.size() - 4, 4, ext) == 0) prefix.resize(prefix.size() - 4);
      }
      dtk::text::decode_documents(prefix, *tokenizer, begin, end, std::cout);
      return 0;
    }
    if (!args.empty()) throw dtk::data::DataError("unexpected argument '" + args[0] + "'");
    dtk::text::PreprocessOptions o;
    o.inputs = split_comma(FLAGS_input);
    o.output_prefix = FLAGS_output_prefix;
    o.json_keys = split_comma(FLAGS_json_keys);
    o.tokenizer = tokenizer.get();
    o.append_eod = FLAGS_append_eod;
    o.workers = FLAGS_workers;
    o.skip_bad_lines = FLAGS_skip_bad_lines;
    if (!std::isfinite(FLAGS_log_interval_mb) || FLAGS_log_interval_mb < 0)
      throw dtk::data::DataError("--log_interval_mb must be 0 (never) or a positive number of MB, got " +
                                 std::to_string(FLAGS_log_interval_mb));
    o.log_interval_mb = FLAGS_log_interval_mb;
    o.log = &std::cerr;
    dtk::text::preprocess(o);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtk: error: preprocess: %s\n", dtk::host::error_line(dtk::one_line(e.what())).c_str());
    return 1;
  }
}
