// `dtk checkpoint inspect DIR [--noverify] [--all_tensors]` — a checkpoint's iteration, progress,
// parallel layout, writers, tensors, files with their SHA-256 against SHA256SUMS, and whether it is
// complete (exit 0) or not (one error line, exit 1). DIR is a save directory (the tracker's
// iteration) or an iter_NNNNNNN directory. The catalog code is dtk/core/checkpoint_catalog.hpp.
#include "cmd_checkpoint.hpp"

#include <gflags/gflags.h>

#include <cstdio>
#include <iostream>

#include "dtk/core/checkpoint_catalog.hpp"
#include "dtk/host/plugin_host.hpp"

DEFINE_bool(verify, true, "checkpoint inspect: hash every file against the checkpoint's SHA256SUMS.");
DEFINE_bool(all_tensors, false, "checkpoint inspect: list the optimizer's and strategy's tensors too.");

int run_checkpoint(const std::vector<std::string>& args) {
  if (args.empty() || args[0] != "inspect")
    throw dtk::host::HostError("usage: dtk checkpoint inspect DIR [--noverify] [--all_tensors]");
  if (args.size() != 2)
    throw dtk::host::HostError("usage: dtk checkpoint inspect DIR (one directory: a save directory or an iter_NNNNNNN one)");
  dtk::core::InspectOptions options;
  options.verify = FLAGS_verify;
  options.all_tensors = FLAGS_all_tensors;
  const std::string problem = dtk::core::inspect_checkpoint(args[1], options, std::cout);
  std::cout.flush();
  if (problem.empty()) return 0;
  std::fprintf(stderr, "dtk: error: checkpoint inspect: %s\n", problem.c_str());
  return 1;
}
