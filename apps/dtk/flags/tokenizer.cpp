// The tokenizer flags of preprocess, generate, export hf and train (tokenizer_flags.hpp reads
// them).
//
// Each command's flags are defined apart from the code that reads them, without LibTorch: bin/dtk
// (front.cpp) links them too, so that `dtk launch` checks its ranks' command line once, before it
// starts them, without loading LibTorch. command_reads (main.cpp) tells which commands read a flag
// by the name of the file that defines it.
#include <gflags/gflags.h>

DEFINE_string(tokenizer_type, "",
              "preprocess, generate, export hf, train: Megatron's --tokenizer-type (GPT2BPETokenizer, "
              "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer, "
              "TikTokenizer, NullTokenizer); default GPT2BPETokenizer.");
DEFINE_string(tokenizer_model, "",
              "preprocess, generate, export hf, train: a SentencePiece tokenizer.model, a Hugging Face "
              "tokenizer.json (or its folder), or TikTokenizer's vocabulary (.json).");
DEFINE_string(vocab_file, "", "preprocess, generate, export hf, train: GPT-2 vocabulary (encoder.json / vocab.json).");
DEFINE_string(merge_file, "", "preprocess, generate, export hf, train: GPT-2 BPE merges (vocab.bpe / merges.txt).");
DEFINE_int64(vocab_size, 0,
             "preprocess, generate: NullTokenizer's number of ids (its EOD is this id); TikTokenizer's size, "
             "special tokens included (default 131072).");
DEFINE_string(tiktoken_pattern, "", "TikTokenizer: the pre-tokenizer regex, v1 or v2 (default v2).");
DEFINE_int64(tiktoken_num_special_tokens, 0, "TikTokenizer: how many ids the special tokens take (default 1000).");
DEFINE_string(tokenizer_special_tokens, "",
              "TikTokenizer: its special tokens, space-separated (default <unk> <s> </s> <mask> <pad> <cls> <sep>).");
