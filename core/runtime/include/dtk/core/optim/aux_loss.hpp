// A layer's own losses inside the model (a mixture-of-experts router's load-balancing and
// z-losses): the factor the backward under way applies to the step's loss, which they take as
// their gradient, and the values they record for the log. The host's dtk.ext.aux_loss.v1
// extension (abi.h); Megatron-LM's MoEAuxLossAutoScaler.set_loss_scale and its MoE metrics tracker.
#pragma once

#include <dtk/abi.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace dtk::core::aux_loss {

// Set by the micro-batch runner before each backward: the loss scale over the micro-batches
// (the loss scale alone with a per-token loss). Any thread may read it.
void set_backward_scale(double scale, bool per_token_loss);

// What the layers recorded since the last call, summed per name (sorted by name), and cleared.
std::vector<std::pair<std::string, at::Tensor>> take_recorded();

const dtk_aux_loss_ext* extension();

}  // namespace dtk::core::aux_loss
