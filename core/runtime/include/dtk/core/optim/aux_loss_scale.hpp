// The factor the backward under way applies to the step's loss, for layers whose own losses
// (a mixture-of-experts router's) reach the parameters through their backward: the host's
// dtk.ext.aux_loss.v1 extension (abi.h), Megatron-LM's MoEAuxLossAutoScaler.set_loss_scale.
#pragma once

#include <dtk/abi.h>

namespace dtk::core::aux_loss {

// Set by the micro-batch runner before each backward: the loss scale over the micro-batches
// (the loss scale alone with a per-token loss). Any thread may read it.
void set_backward_scale(double scale, bool per_token_loss);

const dtk_aux_loss_ext* extension();

}  // namespace dtk::core::aux_loss
