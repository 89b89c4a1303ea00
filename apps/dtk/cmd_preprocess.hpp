// `dtk preprocess`: text/jsonl -> Megatron indexed dataset, and back (--decode).
#pragma once

// Called by the dtk main after gflags parsing; argv[0] is "preprocess", argv[1..] the
// remaining positional arguments. Returns the process exit status.
int run_preprocess(int argc, char** argv);
