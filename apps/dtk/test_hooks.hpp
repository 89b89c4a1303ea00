// The test hooks of `dtk train` (dtk/core/train/hooks.hpp), from the environment:
//   DTK_TEST_NONFINITE_ITERS=3,7   makes those iterations' gradients infinite (the first
//                                  micro-batch's scaled loss times inf), to test the skipped-step
//                                  path of every strategy and the loss scaler; "3@1" does it on
//                                  world rank 1 only (the other ranks must skip with it).
// Unset: no hook, nothing in the loop changes.
#pragma once

#include "dtk/core/train/hooks.hpp"

namespace dtk::app {

// Throws HostError for a value that does not parse.
core::TrainerHooks trainer_hooks_from_environment();

}  // namespace dtk::app
