// dtk/core/cuda_support.hpp — what this dtk build can do with CUDA, for the host's messages
// (dtk --version, the refusal of train.device=cuda / distributed.backend=nccl). No CUDA types:
// the CUDA half itself is core/cuda (dtk/cuda/*.hpp) and core/runtime/src/cuda_glue.hpp.
#pragma once

#include <string>

namespace dtk::core {

// Whether this dtk can train on CUDA devices: built with core/cuda against a CUDA LibTorch, and
// a device is visible. Otherwise *why says, in one sentence, what is missing.
bool cuda_training_available(std::string* why);

// One line for `dtk --version`: what this build has of CUDA, NCCL and devices.
std::string cuda_build_summary();

}  // namespace dtk::core
