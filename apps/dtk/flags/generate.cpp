// The flags of `dtk generate`.
//
// Each command's flags are defined apart from the code that reads them, without LibTorch: bin/dtk
// (front.cpp) links them too, so that `dtk launch` checks its ranks' command line once, before it
// starts them, without loading LibTorch. command_reads (main.cpp) tells which commands read a flag
// by the name of the file that defines it.
#include <gflags/gflags.h>

DEFINE_string(load, "", "generate: the checkpoint (a save directory: its tracker's iteration; or one iter_NNNNNNN).");
DEFINE_string(prompt, "", "generate: the text to continue.");
DEFINE_string(prompts_file, "", "generate: one prompt per line, continued in batches of --batch_size.");
DEFINE_int32(max_new_tokens, 64, "generate: tokens to add to each prompt (fewer when <|endoftext|> comes first).");
DEFINE_double(temperature, 1.0, "generate: softmax temperature; 0 = greedy (argmax).");
DEFINE_int32(top_k, 0, "generate: sample among the k most likely tokens (0 = all).");
DEFINE_double(top_p, 1.0, "generate: sample among the most likely tokens holding this much probability (1 = all).");
DEFINE_uint64(seed, 1234, "generate: the sampling seed (same seed, same text).");
DEFINE_int32(batch_size, 8, "generate: prompts per batch with --prompts_file.");
