// The flags of `dtk preprocess`.
//
// Each command's flags are defined apart from the code that reads them, without LibTorch: bin/dtk
// (front.cpp) links them too, so that `dtk launch` checks its ranks' command line once, before it
// starts them, without loading LibTorch. command_reads (main.cpp) tells which commands read a flag
// by the name of the file that defines it.
#include <gflags/gflags.h>

DEFINE_string(input, "",
              "preprocess: input files, comma-separated; *.jsonl/*.json = one JSON document per line, "
              "anything else = plain text, one document per file. With --decode: the dataset prefix.");
DEFINE_string(output_prefix, "", "preprocess: output prefix; writes PREFIX_{key}_document.{bin,idx}.");
DEFINE_string(json_keys, "text", "preprocess: comma-separated JSON keys to extract (one output per key).");
DEFINE_bool(append_eod, false, "preprocess: append the tokenizer's end-of-document token to every non-empty document.");
DEFINE_int32(workers, 0, "preprocess: encoder threads (0 = all cores).");
DEFINE_bool(decode, false, "preprocess: print the text of a preprocessed dataset (--input PREFIX [A:B]).");
DEFINE_bool(skip_bad_lines, false,
            "preprocess: skip (and count) lines with bad JSON or invalid UTF-8 instead of failing.");
DEFINE_double(log_interval_mb, 64, "preprocess: print progress every this many input MB (0 = never).");
