// DTK's own GPU kernels behind the SDK's layers (label `gpu`), each against its LibTorch-op
// reference on random inputs: the fused cross entropy of the output layer (dtk/cuda/
// cross_entropy.hpp, through fused_lm_head_loss: the kernel's path against the ops' path and the
// plain cross entropy of whole logits), RMSNorm forward and backward (dtk/cuda/rms_norm.hpp,
// through dtk::layers::rms_norm against rms_norm_ops) and rotary embeddings (dtk/cuda/rotary.hpp,
// apply_rotary against apply_rotary_ops). Without a CUDA LibTorch and a GPU every
// test skips, saying why.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <dtk/layers/lm_head.hpp>
#include <dtk/layers/norms.hpp>
#include <dtk/layers/rotary.hpp>

namespace {

using dtk::layers::CrossEntropyRows;

#define SKIP_WITHOUT_CUDA()                                                                              \
  do {                                                                                                   \
    if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA LibTorch and a GPU (this LibTorch has no CUDA device)"; \
  } while (0)

// max |a - b| / max(|b|, floor): a relative error that tolerates entries near zero.
double relative_error(const at::Tensor& a, const at::Tensor& b, double floor = 1e-3) {
  const at::Tensor af = a.to(at::kDouble).cpu(), bf = b.to(at::kDouble).cpu();
  return (af - bf).abs().max().item<double>() / std::max(bf.abs().max().item<double>(), floor);
}

struct HeadResult {
  at::Tensor loss, gx, gw;
};

// Loss and gradients of the fused output layer with a given incoming gradient per token.
HeadResult head(const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& labels, const at::Tensor& g,
                CrossEntropyRows rows, int64_t chunk) {
  at::Tensor x = x0.detach().clone().requires_grad_(true), w = w0.detach().clone().requires_grad_(true);
  const at::Tensor loss = dtk::layers::fused_lm_head_loss(x, w, labels, dtk::layers::TPGroup{}, chunk, rows);
  torch::autograd::backward({loss}, {g});
  return {loss.detach(), x.grad(), w.grad()};
}

void check_cross_entropy(at::ScalarType type, int64_t vocab, double loss_tol, double grad_tol) {
  const auto on = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(7);
  const int64_t b = 3, s = 100, h = 64;
  const at::Tensor x = at::randn({b, s, h}, on).to(type);
  const at::Tensor w = (at::randn({vocab, h}, on) * 0.5).to(type);
  const at::Tensor labels = at::randint(vocab, {b, s}, on.dtype(at::kLong));
  // A mean's gradient for most tokens, a different one (a loss mask) for a few: both backward paths.
  at::Tensor g = at::full({b, s}, 1.0 / (b * s), on);
  g.view({-1}).narrow(0, 17, 5).zero_();
  for (const int64_t chunk : {int64_t{0}, int64_t{64}}) {
    const HeadResult kernel = head(x, w, labels, g, CrossEntropyRows::kAuto, chunk);
    const HeadResult ops = head(x, w, labels, g, CrossEntropyRows::kOps, chunk);
    EXPECT_LT(relative_error(kernel.loss, ops.loss), loss_tol) << "loss, chunk " << chunk;
    EXPECT_LT(relative_error(kernel.gx, ops.gx), grad_tol) << "x's gradient, chunk " << chunk;
    EXPECT_LT(relative_error(kernel.gw, ops.gw), grad_tol) << "W's gradient, chunk " << chunk;
    // And the plain cross entropy of whole fp32 logits from the same (rounded) products.
    const at::Tensor logits = at::matmul(x, w.t()).to(at::kFloat);
    const at::Tensor plain = at::cross_entropy_loss(logits.view({-1, vocab}), labels.view({-1}), {}, 0).view({b, s});
    EXPECT_LT(relative_error(kernel.loss, plain), loss_tol) << "against whole logits, chunk " << chunk;
  }
}

TEST(GpuKernels, CrossEntropyKernelEqualsOpsFp32) {
  SKIP_WITHOUT_CUDA();
  check_cross_entropy(at::kFloat, 1000, 1e-5, 1e-5);  // rows of 16-byte multiples: vector loads
  check_cross_entropy(at::kFloat, 1003, 1e-5, 1e-5);  // odd rows: the scalar loop
}

TEST(GpuKernels, CrossEntropyKernelEqualsOpsBf16) {
  SKIP_WITHOUT_CUDA();
  // The same bf16 products; D rounded to bf16 in both (the ops round their fp32 D before the GEMMs).
  check_cross_entropy(at::kBFloat16, 1024, 1e-5, 2e-2);
  check_cross_entropy(at::kBFloat16, 1001, 1e-5, 2e-2);
}

void check_rms_norm(at::ScalarType type, int64_t hidden, double tol) {
  const auto on = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(11);
  const at::Tensor x0 = (at::randn({4, 37, hidden}, on) * 3).to(type);
  const at::Tensor w0 = (1 + 0.1 * at::randn({hidden}, on)).to(type);
  const at::Tensor dy = at::randn({4, 37, hidden}, on).to(type);
  auto run = [&](bool fused) {
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const at::Tensor y = fused ? dtk::layers::rms_norm(x, w, 1e-5) : dtk::layers::rms_norm_ops(x, w, 1e-5);
    torch::autograd::backward({y}, {dy});
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad()};
  };
  const auto fused = run(true), ops = run(false);
  EXPECT_EQ(fused[0].scalar_type(), type);
  EXPECT_LT(relative_error(fused[0], ops[0]), tol) << "y, hidden " << hidden;
  EXPECT_LT(relative_error(fused[1], ops[1]), tol) << "dx, hidden " << hidden;
  EXPECT_LT(relative_error(fused[2], ops[2]), tol) << "dweight, hidden " << hidden;
}

TEST(GpuKernels, RmsNormKernelEqualsOpsFp32) {
  SKIP_WITHOUT_CUDA();
  for (const int64_t hidden : {64, 100, 768, 4096}) check_rms_norm(at::kFloat, hidden, 1e-5);
}

TEST(GpuKernels, RmsNormKernelEqualsOpsBf16) {
  SKIP_WITHOUT_CUDA();
  // One bf16 rounding step apart at most where the fp32 sums of squares differ in their last bit.
  for (const int64_t hidden : {64, 100, 768, 4096}) check_rms_norm(at::kBFloat16, hidden, 2e-2);
}

// Rotary embeddings on strided queries/keys (a split of a fused projection, as llama's), with all
// channels rotating and with a quarter passing through (rotary_percent 0.75).
void check_rotary(at::ScalarType type, int64_t dim, double tol) {
  const auto on = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(5);
  const int64_t b = 2, s = 33, heads = 3, hd = 64;
  const at::Tensor projected = at::randn({b, s, heads, 2 * hd}, on).to(type);
  const at::Tensor angles = at::randn({b, s, 1, dim}, on) * 3;
  const at::Tensor cos = angles.cos(), sin = angles.sin();
  const at::Tensor dy = at::randn({b, s, heads, hd}, on).to(type);
  auto run = [&](bool fused) {
    at::Tensor p = projected.clone().requires_grad_(true);
    const at::Tensor x = p.narrow(-1, hd, hd);  // strided: unit stride in the head dimension only
    const at::Tensor y = fused ? dtk::layers::apply_rotary(x, cos, sin) : dtk::layers::apply_rotary_ops(x, cos, sin);
    torch::autograd::backward({y}, {dy});
    return std::vector<at::Tensor>{y.detach(), p.grad()};
  };
  const auto fused = run(true), ops = run(false);
  EXPECT_LT(relative_error(fused[0], ops[0]), tol) << "rotary forward, dim " << dim;
  EXPECT_LT(relative_error(fused[1], ops[1]), tol) << "rotary backward, dim " << dim;
}

TEST(GpuKernels, RotaryKernelEqualsOps) {
  SKIP_WITHOUT_CUDA();
  // The kernel rounds each product and the sum as the ops do: equal to fp32's last bits, and in
  // bf16 the same roundings of the same fp32 values.
  for (const int64_t dim : {64, 48}) {
    check_rotary(at::kFloat, dim, 1e-6);
    check_rotary(at::kBFloat16, dim, 1e-2);
  }
}

}  // namespace
