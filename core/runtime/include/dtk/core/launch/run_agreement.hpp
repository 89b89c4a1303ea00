// dtk/core/launch/run_agreement.hpp — every rank runs the same configuration with the same plugins.
//
// Ranks started with different configurations (say model.num_layers 2 on one and 3 on another,
// under torchrun-style environment variables) used to meet for the first time inside a
// collective with mismatched sizes, where Gloo aborts the process (gloo::EnforceNotMet). At
// start, right after the rendezvous and before any process group or model is built, the ranks
// compare what they will run through the store (distributed.cpp); on a mismatch each differing
// rank reports, in one line, the first setting where it differs from rank 0, and the others say
// how many differ.
#pragma once

#include <string>
#include <vector>

#include "dtk_config.pb.h"

namespace dtk::core {

// The run as "path=value" lines: every config field that is set (map entries by key), then
// "plugin.<kind>=<name> <version> (ABI M.m)" lines from `plugins`. train.threads is left out (it
// may differ between machines).
std::vector<std::string> describe_run(const config::RunConfig& cfg, const std::vector<std::string>& plugins);

// "<path> is '<value>' here and '<value>' on rank 0": the first line of `mine` that rank 0's
// description lacks (or the first of rank 0's that `mine` lacks); "" when they are equal.
std::string first_difference(const std::vector<std::string>& mine, const std::vector<std::string>& rank0);

// The description as one text, and back.
std::string join_lines(const std::vector<std::string>& lines);
std::vector<std::string> split_lines(const std::string& text);

}  // namespace dtk::core
