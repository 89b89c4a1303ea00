// `dtk checkpoint inspect DIR`: what a checkpoint holds and whether it is complete.
#pragma once

#include <string>
#include <vector>

// `args` are the words after "checkpoint" (gflags already parsed). Returns the exit status: 0 for
// a complete checkpoint, 1 (after one error line) for an incomplete or damaged one.
int run_checkpoint(const std::vector<std::string>& args);
