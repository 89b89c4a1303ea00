#include "dtk/core/optim/aux_loss_scale.hpp"

#include <atomic>

namespace dtk::core::aux_loss {
namespace {

// Read on autograd's threads while the training thread runs the backward.
std::atomic<double> g_scale{1.0};
std::atomic<int32_t> g_per_token{0};

double backward_scale() { return g_scale.load(std::memory_order_relaxed); }
int32_t per_token_loss() { return g_per_token.load(std::memory_order_relaxed); }

}  // namespace

void set_backward_scale(double scale, bool per_token) {
  g_scale.store(scale, std::memory_order_relaxed);
  g_per_token.store(per_token ? 1 : 0, std::memory_order_relaxed);
}

const dtk_aux_loss_ext* extension() {
  static const dtk_aux_loss_ext ext = {dtk_aux_loss_ext_STRUCT_SIZE, &backward_scale, &per_token_loss};
  return &ext;
}

}  // namespace dtk::core::aux_loss
