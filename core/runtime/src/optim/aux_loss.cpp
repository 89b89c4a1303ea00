#include "dtk/core/optim/aux_loss.hpp"

#include <dtk/tensor.hpp>

#include <atomic>
#include <map>
#include <mutex>

namespace dtk::core::aux_loss {
namespace {

// Read on autograd's threads while the training thread runs the backward.
std::atomic<double> g_scale{1.0};
std::atomic<int32_t> g_per_token{0};

// Recorded values (the forward's thread, or the backward's when a layer is recomputed there).
std::mutex g_mu;
std::map<std::string, at::Tensor> g_recorded;

double backward_scale() { return g_scale.load(std::memory_order_relaxed); }
int32_t per_token_loss() { return g_per_token.load(std::memory_order_relaxed); }

// Called from plugin frames: nothing may throw out of it.
void record(const char* name, dtk_tensor* value) {
  TensorHandle owned(value);
  if (!value || !name) return;
  try {
    const at::Tensor v = unwrap(value).detach().reshape({-1}).sum().to(at::kFloat);
    std::lock_guard<std::mutex> lock(g_mu);
    at::Tensor& sum = g_recorded[name];
    sum = sum.defined() ? sum + v.to(sum.device()) : v;
  } catch (...) {
  }
}

}  // namespace

void set_backward_scale(double scale, bool per_token) {
  g_scale.store(scale, std::memory_order_relaxed);
  g_per_token.store(per_token ? 1 : 0, std::memory_order_relaxed);
}

std::vector<std::pair<std::string, at::Tensor>> take_recorded() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::pair<std::string, at::Tensor>> out(g_recorded.begin(), g_recorded.end());
  g_recorded.clear();
  return out;
}

const dtk_aux_loss_ext* extension() {
  static const dtk_aux_loss_ext ext = {dtk_aux_loss_ext_STRUCT_SIZE, &backward_scale, &per_token_loss, &record};
  return &ext;
}

}  // namespace dtk::core::aux_loss
