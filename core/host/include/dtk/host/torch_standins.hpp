// dtk/host/torch_standins.hpp — the host starts on empty stand-ins for the libraries
// LibTorch links but never calls (cmake/DtkTorchStandins.cmake: 0.3 s of every process's start
// on Debian's LibTorch).
//
// bin/dtk puts <prefix>/lib/dtk/torch-standins first in LD_LIBRARY_PATH for the host it executes;
// the host puts the user's LD_LIBRARY_PATH back before anything else runs, so that what it starts
// sees the environment the user gave. The ranks of a `dtk launch` that bin/dtk runs are bin/dtk
// again and get the stand-ins from it; a launch the host runs itself (one naming a LibTorch flag)
// starts its ranks on the real libraries: slower to start, the same run.
//
//   DTK_TORCH_STANDINS=off   the real libraries (for a plugin that calls one of them)
#pragma once

#include <string>

namespace dtk::host {

// Whether the stand-ins are wanted: DTK_TORCH_STANDINS unset, empty or "on" (true) or "off"
// (false); any other value ends the process with one `dtk: error:` line (exit 2).
bool torch_standins_wanted();

// For bin/dtk, before it executes the host: `standins_dir` first in LD_LIBRARY_PATH, the user's
// value kept aside, unless the folder does not exist (a LibTorch that links only what it uses) or
// DTK_TORCH_STANDINS=off.
void pass_torch_standins_on(const std::string& standins_dir);

// For the host, first thing in main(): the user's LD_LIBRARY_PATH back (or unset, as it was).
void restore_library_path();

// How many stand-ins this process loaded (read from the loader's list of objects): for messages.
int torch_standins_loaded();

}  // namespace dtk::host
