// DTK's own GPU kernels behind the SDK's layers (label `gpu`), each against its LibTorch-op
// reference on random inputs: the fused cross entropy of the output layer (dtk/cuda/
// cross_entropy.hpp, through fused_lm_head_loss: the kernel's path against the ops' path and the
// plain cross entropy of whole logits), RMSNorm forward and backward (dtk/cuda/rms_norm.hpp,
// through dtk::layers::rms_norm against rms_norm_ops), the residual add fused with LayerNorm and
// with RMSNorm (dtk/cuda/layer_norm.hpp, rms_norm.hpp, through add_layer_norm, add_bias_layer_norm
// and add_rms_norm against their _ops), bias + GELU (dtk/cuda/bias_gelu.hpp, bias_gelu against bias_gelu_ops),
// SwiGLU (dtk/cuda/swiglu.hpp, swiglu against swiglu_ops), rotary embeddings (dtk/cuda/rotary.hpp,
// apply_rotary against apply_rotary_ops), dropout (dtk/cuda/dropout.hpp, apply_dropout against
// apply_dropout_ops and the CPU's), the router jitter's noise (uniform_noise_on against
// uniform_noise_ops) and causal attention with dropout (dtk/cuda/attention.hpp,
// fused_attention against attention_ops); and each function with its kernel left out
// (model.unfused_kernels) running its reference exactly. Without a CUDA LibTorch and a GPU every
// test skips, saying why.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <dtk/layers/activations.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/layers/dropout.hpp>
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
  // Past 512 threads x 4 packs x 8 logits: the sweeps' second batch, its last one partial.
  check_cross_entropy(at::kBFloat16, 20000, 1e-5, 2e-2);
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
    if (fused) {  // DTK's kernel ran, not the ops
      EXPECT_NE(y.grad_fn()->name().find("FusedRmsNorm"), std::string::npos) << y.grad_fn()->name();
    }
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
  for (const int64_t hidden : {64, 100, 300, 768, 1024, 1100, 4096, 8192}) check_rms_norm(at::kFloat, hidden, 1e-5);
}

TEST(GpuKernels, RmsNormKernelEqualsOpsBf16) {
  SKIP_WITHOUT_CUDA();
  // One bf16 rounding step apart at most where the fp32 sums of squares differ in their last bit.
  for (const int64_t hidden : {64, 100, 512, 768, 1024, 4096}) check_rms_norm(at::kBFloat16, hidden, 2e-2);
}

// The residual add and a norm, fused against the ops: both outputs (the sum going on in the
// residual stream and the norm's output) with their own incoming gradients, so the backward adds
// the stream's gradient to the norm's; x's and the residual's gradients, the weight's and (for
// LayerNorm) the bias's. `rows` over the backward's 1024 blocks x 8 warps takes its loop over
// rows; hidden <= 768 (LayerNorm) or 1024 (RMSNorm) the warp-per-row backward, wider the
// block-per-row one (6144 and, with the bias, 4096: exactly 48 KB of dynamic shared memory, over
// the default limit with the static; 8192: LayerNorm's 64 KB). `norm_only`: only the norm's
// output is used (a final norm), so the sum gets no gradient of its own; `sum_only`: only the sum
// is used, so the norm's output gets none. `branch_bias` (LayerNorm): the residual's bias added in
// the kernel too (add_bias_layer_norm), its gradient the column sums of the residual's. `keep`
// (LayerNorm, defined): the residual's dropout in the kernel too (add_bias_dropout_layer_norm),
// against apply_dropout_ops' tensor-op bits; a mask over [rows, 1, hidden] elements.
void check_add_norm(bool layer, at::ScalarType type, int64_t rows, int64_t hidden, double tol, bool norm_only = false,
                    bool sum_only = false, bool branch_bias = false, const dtk::layers::DropoutMask& keep = {}) {
  const auto on = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(13);
  const at::Tensor x0 = (at::randn({rows, hidden}, on) * 2 + 0.5).to(type).view({-1, 1, hidden});
  const at::Tensor r0 = at::randn({rows, 1, hidden}, on).to(type);
  const at::Tensor w0 = (1 + 0.1 * at::randn({hidden}, on)).to(type);
  const at::Tensor b0 = (0.1 * at::randn({hidden}, on)).to(type);
  const at::Tensor c0 = (0.5 * at::randn({hidden}, on)).to(type);
  const at::Tensor dy = at::randn({rows, 1, hidden}, on).to(type), dsum = at::randn({rows, 1, hidden}, on).to(type);
  auto run = [&](bool fused) {
    at::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
    at::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    at::Tensor c = branch_bias ? c0.clone().requires_grad_(true) : at::Tensor();
    const auto out =
        layer ? (fused ? dtk::layers::add_bias_dropout_layer_norm(x, r, c, keep, w, b, 1e-5)
                       : dtk::layers::add_bias_dropout_layer_norm_ops(x, r, c, keep, w, b, 1e-5))
              : (fused ? dtk::layers::add_rms_norm(x, r, w, 1e-5) : dtk::layers::add_rms_norm_ops(x, r, w, 1e-5));
    if (fused) {  // DTK's kernel ran, not the ops
      EXPECT_NE(out.second.grad_fn()->name().find(layer ? "FusedAddLayerNorm" : "FusedAddRmsNorm"), std::string::npos)
          << out.second.grad_fn()->name();
      // With the bias: the kernel took it (x, the residual, its bias, w, b), not the ops' sum first.
      if (branch_bias) {
        EXPECT_EQ(out.second.grad_fn()->next_edges().size(), 5u);
      }
    }
    if (norm_only)
      torch::autograd::backward({out.second}, {dy});
    else if (sum_only)
      torch::autograd::backward({out.first}, {dsum});
    else
      torch::autograd::backward({out.first, out.second}, {dsum, dy});
    return std::vector<at::Tensor>{
        out.first.detach(), out.second.detach(), x.grad(), r.grad(),
        // Nothing reaches the norm's parameters when only the sum is used (undefined or zero).
        sum_only || !w.grad().defined() ? at::zeros({1}, on) : w.grad(),
        !layer || sum_only || !b.grad().defined() ? at::zeros({1}, on) : b.grad(),
        branch_bias ? c.grad() : at::zeros({1}, on)};
  };
  const auto fused = run(true), ops = run(false);
  const char* names[] = {"sum", "y", "dx", "dresidual", "dweight", "dbias", "dresidual_bias"};
  EXPECT_EQ(fused[1].scalar_type(), type);
  // The sum is elementwise (the bias's add, the mask, the add, each rounded to T where the ops
  // round): bit for bit in every type; so is the residual's gradient when only the sum is used.
  EXPECT_TRUE(at::equal(fused[0], ops[0])) << "sum, " << c10::toString(type) << ", " << rows << " x " << hidden;
  if (sum_only) {
    EXPECT_TRUE(at::equal(fused[3], ops[3])) << "dresidual (sum only), " << rows << " x " << hidden;
  }
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_LT(relative_error(fused[i], ops[i]), tol)
        << (layer ? "add_layer_norm " : "add_rms_norm ") << names[i] << ", " << rows << " x " << hidden
        << (branch_bias ? ", with the residual's bias" : "") << (keep.defined() ? ", with its dropout" : "");
  // Where the mask drops an element its branch gets no gradient at all, while x's goes on.
  if (keep.defined()) {
    const at::Tensor dropped = dtk::layers::keep_bits(keep, rows * hidden).logical_not().view({rows, 1, hidden});
    EXPECT_TRUE(fused[3].cpu().masked_select(dropped).eq(0).all().item<bool>()) << "dropped elements' gradient";
    EXPECT_GT(fused[2].cpu().masked_select(dropped).abs().sum().item<double>(), 0.0);
  }
}

TEST(GpuKernels, AddLayerNormKernelEqualsOpsFp32) {
  SKIP_WITHOUT_CUDA();
  for (const int64_t hidden : {64, 100, 300, 512, 768, 1000, 4096, 6144, 8192})
    check_add_norm(true, at::kFloat, 148, hidden, 1e-5);
  check_add_norm(true, at::kFloat, 2100, 64, 1e-5);
  check_add_norm(true, at::kFloat, 9000, 768, 1e-5);
  check_add_norm(true, at::kFloat, 9000, 1000, 1e-5);
  check_add_norm(true, at::kFloat, 300, 768, 1e-5, /*norm_only=*/true);
  check_add_norm(true, at::kFloat, 300, 768, 1e-5, /*norm_only=*/false, /*sum_only=*/true);
}

TEST(GpuKernels, AddLayerNormKernelEqualsOpsBf16) {
  SKIP_WITHOUT_CUDA();
  // The same bf16 roundings of fp32 values one ulp apart at most.
  // 64, 512, 768, 1024: the packed kernels' 1, 2, 3 and 4 packs a lane (core/cuda/src/pack.cuh).
  for (const int64_t hidden : {64, 100, 512, 768, 1024, 4096}) check_add_norm(true, at::kBFloat16, 148, hidden, 2e-2);
  check_add_norm(true, at::kBFloat16, 2100, 64, 2e-2);
  check_add_norm(true, at::kBFloat16, 9000, 768, 2e-2);
  check_add_norm(true, at::kHalf, 300, 768, 2e-2);
  check_add_norm(true, at::kHalf, 300, 4096, 2e-2);
}

// The row-parallel product's bias in the add + LayerNorm kernel (model.unfused_kernels' bias_add):
// the warp kernels (8, 16, 24 columns a lane), the block kernel (its third shared row), the loop
// over rows, fp32/bf16/fp16, the norm-only (a final norm) and sum-only backwards.
TEST(GpuKernels, AddBiasLayerNormKernelEqualsOps) {
  SKIP_WITHOUT_CUDA();
  for (const int64_t hidden : {100, 512, 768, 1000, 8192})
    check_add_norm(true, at::kFloat, 148, hidden, 1e-5, false, false, /*branch_bias=*/true);
  check_add_norm(true, at::kFloat, 9000, 768, 1e-5, false, false, true);
  check_add_norm(true, at::kFloat, 9000, 1000, 1e-5, false, false, true);
  check_add_norm(true, at::kFloat, 300, 768, 1e-5, /*norm_only=*/true, false, true);
  check_add_norm(true, at::kFloat, 300, 768, 1e-5, false, /*sum_only=*/true, true);
  check_add_norm(true, at::kBFloat16, 9000, 768, 2e-2, false, false, true);
  check_add_norm(true, at::kBFloat16, 148, 4096, 2e-2, false, false, true);
  check_add_norm(true, at::kHalf, 300, 768, 2e-2, false, false, true);
}

// Megatron's bias-dropout-add in the add + LayerNorm kernel (gpt with hidden dropout): each
// element's mask bit hashed in the kernel, forward on the branch and backward on its gradient,
// against the ops with the bits made by tensor operations: whole masks, a slice of rows (an odd
// offset: hidden 1001 and 129), a sequence shard (strided); with and without the bias; the warp
// kernels, the block kernel and the loop over rows; fp32/bf16/fp16; norm-only and sum-only.
TEST(GpuKernels, AddBiasDropoutLayerNormKernelEqualsOps) {
  SKIP_WITHOUT_CUDA();
  at::Generator gen = dtk::layers::seeded_generator(31);
  auto whole = [&](int64_t rows, int64_t hidden, double p) {
    return dtk::layers::draw_keep_mask({rows, 1, hidden}, p, gen);
  };
  auto slice = [&](int64_t rows, int64_t hidden) {
    return dtk::layers::draw_keep_mask({rows + 3, 1, hidden}, 0.1, gen).rows(1, rows);
  };
  // A sequence shard: the rows are [rows / 4 sequences, 4 of their 16 positions], each run of 4
  // rows 16 rows apart in the drawn mask (a kernel indexing the mask by row alone fails here).
  auto shard = [&](int64_t rows, int64_t hidden) {
    return dtk::layers::draw_keep_mask({rows / 4, 16, hidden}, 0.1, gen).sequence_rows(16, 4, 4);
  };
  for (const int64_t hidden : {100, 768, 1000, 8192}) {
    check_add_norm(true, at::kFloat, 148, hidden, 1e-5, false, false, /*branch_bias=*/true, whole(148, hidden, 0.1));
    check_add_norm(true, at::kFloat, 148, hidden, 1e-5, false, false, /*branch_bias=*/false, whole(148, hidden, 0.5));
  }
  check_add_norm(true, at::kFloat, 148, 1001, 1e-5, false, false, true, slice(148, 1001));
  check_add_norm(true, at::kFloat, 148, 129, 1e-5, false, false, true, slice(148, 129));
  check_add_norm(true, at::kFloat, 148, 768, 1e-5, false, false, true, shard(148, 768));
  check_add_norm(true, at::kFloat, 9000, 768, 1e-5, false, false, true, whole(9000, 768, 0.1));
  check_add_norm(true, at::kFloat, 300, 768, 1e-5, /*norm_only=*/true, false, true, whole(300, 768, 0.1));
  check_add_norm(true, at::kFloat, 300, 768, 1e-5, false, /*sum_only=*/true, true, whole(300, 768, 0.1));
  check_add_norm(true, at::kBFloat16, 9000, 768, 2e-2, false, false, true, whole(9000, 768, 0.1));
  check_add_norm(true, at::kBFloat16, 148, 4096, 2e-2, false, false, true, shard(148, 4096));
  check_add_norm(true, at::kHalf, 300, 768, 2e-2, false, false, true, whole(300, 768, 0.1));
}

TEST(GpuKernels, AddRmsNormKernelEqualsOpsFp32) {
  SKIP_WITHOUT_CUDA();
  for (const int64_t hidden : {64, 100, 300, 512, 768, 1024, 1100, 4096, 8192})
    check_add_norm(false, at::kFloat, 148, hidden, 1e-5);
  check_add_norm(false, at::kFloat, 2100, 64, 1e-5);
  check_add_norm(false, at::kFloat, 9000, 768, 1e-5);
  check_add_norm(false, at::kFloat, 300, 768, 1e-5, /*norm_only=*/true);
  check_add_norm(false, at::kFloat, 300, 768, 1e-5, /*norm_only=*/false, /*sum_only=*/true);
}

TEST(GpuKernels, AddRmsNormKernelEqualsOpsBf16) {
  SKIP_WITHOUT_CUDA();
  for (const int64_t hidden : {64, 100, 512, 768, 1024, 4096}) check_add_norm(false, at::kBFloat16, 148, hidden, 2e-2);
  check_add_norm(false, at::kBFloat16, 2100, 64, 2e-2);
  check_add_norm(false, at::kBFloat16, 9000, 768, 2e-2);
  check_add_norm(false, at::kHalf, 300, 768, 2e-2);
  check_add_norm(false, at::kHalf, 300, 4096, 2e-2);
}

// Bias + GELU, exact and tanh, fused against the ops: y, x's gradient and the bias's (the
// backward's column sums). 300 rows: more than the backward's 256 row groups.
void check_bias_gelu(at::ScalarType type, int64_t cols, bool tanh, double tol) {
  const auto on = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(17);
  const at::Tensor x0 = (at::randn({3, 100, cols}, on) * 2).to(type), b0 = at::randn({cols}, on).to(type);
  const at::Tensor dy = at::randn({3, 100, cols}, on).to(type);
  auto run = [&](bool fused) {
    at::Tensor x = x0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    const at::Tensor y = fused ? dtk::layers::bias_gelu(x, b, tanh) : dtk::layers::bias_gelu_ops(x, b, tanh);
    if (fused) {  // DTK's kernel ran, not the ops
      EXPECT_NE(y.grad_fn()->name().find("FusedBiasGelu"), std::string::npos) << y.grad_fn()->name();
    }
    torch::autograd::backward({y}, {dy});
    return std::vector<at::Tensor>{y.detach(), x.grad(), b.grad()};
  };
  const auto fused = run(true), ops = run(false);
  const char* names[] = {"y", "dx", "dbias"};
  EXPECT_EQ(fused[0].scalar_type(), type);
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_LT(relative_error(fused[i], ops[i]), tol)
        << "bias_gelu " << names[i] << ", " << cols << " columns" << (tanh ? ", tanh" : ", erf");
}

TEST(GpuKernels, BiasGeluKernelEqualsOpsFp32) {
  SKIP_WITHOUT_CUDA();
  for (const bool tanh : {false, true})
    for (const int64_t cols : {64, 100, 768, 3072}) check_bias_gelu(at::kFloat, cols, tanh, 1e-5);
}

TEST(GpuKernels, BiasGeluKernelEqualsOpsBf16) {
  SKIP_WITHOUT_CUDA();
  for (const bool tanh : {false, true})
    for (const int64_t cols : {64, 100, 768, 3072}) check_bias_gelu(at::kBFloat16, cols, tanh, 2e-2);
}

// SwiGLU's silu(gate) * up, fused against the ops: y and both inputs' gradients, on element
// counts that are no multiple of the block.
void check_swiglu(at::ScalarType type, int64_t cols, double tol) {
  const auto on = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(19);
  const at::Tensor g0 = (at::randn({3, 37, cols}, on) * 3).to(type), u0 = at::randn({3, 37, cols}, on).to(type);
  const at::Tensor dy = at::randn({3, 37, cols}, on).to(type);
  auto run = [&](bool fused) {
    at::Tensor g = g0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true);
    const at::Tensor y = fused ? dtk::layers::swiglu(g, u) : dtk::layers::swiglu_ops(g, u);
    if (fused) {  // DTK's kernel ran, not the ops
      EXPECT_NE(y.grad_fn()->name().find("FusedSwiglu"), std::string::npos) << y.grad_fn()->name();
    }
    torch::autograd::backward({y}, {dy});
    return std::vector<at::Tensor>{y.detach(), g.grad(), u.grad()};
  };
  const auto fused = run(true), ops = run(false);
  const char* names[] = {"y", "dgate", "dup"};
  EXPECT_EQ(fused[0].scalar_type(), type);
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_LT(relative_error(fused[i], ops[i]), tol) << "swiglu " << names[i] << ", " << cols << " columns";
}

TEST(GpuKernels, SwigluKernelEqualsOps) {
  SKIP_WITHOUT_CUDA();
  for (const int64_t cols : {64, 100, 2048}) {
    check_swiglu(at::kFloat, cols, 1e-5);
    check_swiglu(at::kBFloat16, cols, 2e-2);
  }
}

// The packed kernels (2-byte elements 16 bytes at a time, core/cuda/src/pack.cuh; rotary's four
// pairs a thread) against the scalar ones, which the same call takes for inputs 2 bytes off the 16-byte boundary: the
// same arithmetic per element, so the same bits (bias + GELU's bias gradient too: each column's rows are summed in the
// same order). 5000 rows: more than 4 a row group in the forward (1024 groups) and the backward (256), so the packed
// loops run whole batches of 4 rows, further passes and a partial last batch.
at::Tensor unaligned_copy(const at::Tensor& t) {
  const at::Tensor buffer = at::empty({t.numel() + 1}, t.options());
  at::Tensor view = buffer.narrow(0, 1, t.numel()).view(t.sizes());
  view.copy_(t);
  return view;
}

TEST(GpuKernels, PackedKernelsEqualTheScalarOnesBitForBit) {
  SKIP_WITHOUT_CUDA();
  const auto on = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(23);
  for (const at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    const at::Tensor x0 = (at::randn({5000, 768}, on) * 2).to(type), b0 = at::randn({768}, on).to(type);
    const at::Tensor u0 = at::randn({5000, 768}, on).to(type), dy = at::randn({5000, 768}, on).to(type);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(unaligned_copy(x0).data_ptr()) % 16, 2u);
    for (const bool tanh : {false, true}) {
      auto gelu = [&](const at::Tensor& x_in) {
        at::Tensor x = x_in.requires_grad_(true), b = b0.clone().requires_grad_(true);
        const at::Tensor y = dtk::layers::bias_gelu(x, b, tanh);
        EXPECT_NE(y.grad_fn()->name().find("FusedBiasGelu"), std::string::npos) << y.grad_fn()->name();
        torch::autograd::backward({y}, {dy});
        return std::vector<at::Tensor>{y.detach(), x.grad(), b.grad()};
      };
      const auto packed = gelu(x0.clone()), scalar = gelu(unaligned_copy(x0));
      for (size_t i = 0; i < packed.size(); ++i)
        EXPECT_TRUE(at::equal(packed[i], scalar[i])) << "bias_gelu output " << i << ", " << c10::toString(type);
    }
    auto swiglu = [&](const at::Tensor& g_in) {
      at::Tensor g = g_in.requires_grad_(true), u = u0.clone().requires_grad_(true);
      const at::Tensor y = dtk::layers::swiglu(g, u);
      EXPECT_NE(y.grad_fn()->name().find("FusedSwiglu"), std::string::npos) << y.grad_fn()->name();
      torch::autograd::backward({y}, {dy});
      return std::vector<at::Tensor>{y.detach(), g.grad(), u.grad()};
    };
    const auto packed = swiglu(x0.clone()), scalar = swiglu(unaligned_copy(x0));
    for (size_t i = 0; i < packed.size(); ++i)
      EXPECT_TRUE(at::equal(packed[i], scalar[i])) << "swiglu output " << i << ", " << c10::toString(type);
    // Rotary: four pairs a thread against one, all channels rotating and a quarter passing through.
    const at::Tensor q0 = at::randn({2, 33, 3, 64}, on).to(type), dq = at::randn({2, 33, 3, 64}, on).to(type);
    for (const int64_t dim : {64, 48}) {
      const at::Tensor angles = at::randn({2, 33, 1, dim}, on) * 3;
      const at::Tensor cos = angles.cos(), sin = angles.sin();
      // The backward reads only the incoming gradient: off the boundary too for the pairs' run.
      auto rotary = [&](const at::Tensor& x_in, const at::Tensor& dy_in) {
        at::Tensor x = x_in.requires_grad_(true);
        const at::Tensor y = dtk::layers::apply_rotary(x, cos, sin);
        EXPECT_NE(y.grad_fn()->name().find("FusedRotary"), std::string::npos) << y.grad_fn()->name();
        torch::autograd::backward({y}, {dy_in});
        return std::vector<at::Tensor>{y.detach(), x.grad()};
      };
      const auto quads = rotary(q0.clone(), dq), pairs = rotary(unaligned_copy(q0), unaligned_copy(dq));
      for (size_t i = 0; i < quads.size(); ++i)
        EXPECT_TRUE(at::equal(quads[i], pairs[i])) << "rotary output " << i << ", dim " << dim;
    }
  }
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
    if (fused) {  // DTK's kernel ran, not the ops
      EXPECT_NE(y.grad_fn()->name().find("FusedRotary"), std::string::npos) << y.grad_fn()->name();
    }
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

// Dropout (dtk/cuda/dropout.hpp through apply_dropout): the kernel's bits and arithmetic against
// the CPU's hashing (every type) and the tensor-op reference on the GPU (fp32), value for value,
// forward and backward;
// whole masks, a slice of rows (an odd offset) and a sequence shard (a strided mask), p 0.1 and 0.5.
TEST(GpuKernels, DropoutKernelEqualsOpsAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  // Value for value: the tensor-op reference writes x * 0 for a dropped element (-0 for a negative
  // x), the kernel and the CPU 0.
  auto same_values = [](const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() && a.eq(b).all().item<bool>();
  };
  at::Generator gen = dtk::layers::seeded_generator(29);
  for (const double p : {0.1, 0.5}) {
    const dtk::layers::DropoutMask whole = dtk::layers::draw_keep_mask({4, 37, 129}, p, gen);
    struct Case {
      const char* name;
      dtk::layers::DropoutMask mask;
      int64_t rows, seq;  // the shape [rows, seq, 129] it applies to
    };
    const Case cases[] = {{"whole", whole, 4, 37},
                          {"rows 1-2", whole.rows(1, 2), 2, 37},
                          {"sequence shard", whole.sequence_rows(37, 5, 11), 4, 11}};
    for (const auto& [name, mask, rows, seq] : cases) {
      for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const at::Tensor x0 = at::randn({rows, seq, 129}).to(type);
        at::Tensor x = x0.to(at::kCUDA).requires_grad_(true);
        const at::Tensor y = dtk::layers::apply_dropout(x, mask);
        const std::string what = std::string(name) + ", p " + std::to_string(p) + ", " + c10::toString(type);
        // The tensor ops in fp32 only: how a multiplication by a scalar rounds the scale for
        // bf16/fp16 is LibTorch's choice (the CPU's 1.13 rounds it to bf16); the host loop's is fixed.
        if (type == at::kFloat) {
          EXPECT_TRUE(same_values(y, dtk::layers::apply_dropout_ops(x.detach(), mask))) << what;
        }
        EXPECT_TRUE(same_values(y.cpu(), dtk::layers::apply_dropout(x0, mask))) << what << " (against the CPU)";
        const at::Tensor dy = at::randn({rows, seq, 129}).to(type);
        torch::autograd::backward({y}, {dy.to(at::kCUDA)});
        EXPECT_TRUE(same_values(x.grad().cpu(), dtk::layers::apply_dropout(dy, mask))) << what << " (backward)";
      }
    }
  }
}

// The router input jitter's noise (dtk/cuda/dropout.hpp's uniform_noise, through uniform_noise_on)
// against uniform_noise_ops on the GPU and on the CPU, value for value: a whole draw, rows of it
// and a sequence shard (odd offsets: the hash's word pairs split), an odd length, a seed slot read
// on the device.
TEST(GpuKernels, UniformNoiseKernelEqualsOpsAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  at::Generator gen = dtk::layers::seeded_generator(31);
  const dtk::layers::DropoutMask whole = dtk::layers::draw_uniforms({4, 37, 129}, gen);
  // The same draw with its seed in a device slot, as a recorded step holds it.
  dtk::layers::DropoutMask slotted = whole;
  slotted.seed_slot =
      at::full({1}, static_cast<int64_t>(whole.seed), at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  slotted.seed = 0;
  // More elements than one grid-stride pass and one piece of the ops (2^24), from an odd offset.
  dtk::layers::DropoutMask large = dtk::layers::draw_uniforms({(int64_t{1} << 24) + 8}, gen);
  large.offset = 3;
  struct Case {
    const char* name;
    dtk::layers::DropoutMask draw;
    int64_t numel;
  };
  const Case cases[] = {{"whole", whole, 4 * 37 * 129},
                        {"2^24 + 5 elements", large, (int64_t{1} << 24) + 5},
                        {"rows 1-2", whole.rows(1, 2), 2 * 37 * 129},
                        {"sequence shard", whole.sequence_rows(37, 5, 11), 4 * 11 * 129},
                        {"seed slot", slotted, 4 * 37 * 129}};
  for (const auto& [name, draw, n] : cases) {
    const at::Tensor got = dtk::layers::uniform_noise_on(draw, n, 0.99, 1.01, at::kCUDA);
    ASSERT_TRUE(got.is_cuda()) << name;
    EXPECT_TRUE(got.eq(dtk::layers::uniform_noise_ops(draw, n, 0.99, 1.01, at::kCUDA)).all().item<bool>()) << name;
    const dtk::layers::DropoutMask& on_host = std::string(name) == "seed slot" ? whole : draw;  // the host's seed
    EXPECT_TRUE(got.cpu().eq(dtk::layers::uniform_noise_ops(on_host, n, 0.99, 1.01, at::kCPU)).all().item<bool>())
        << name << " (against the CPU)";
  }
}

// Causal attention with dropout on the probabilities (dtk/cuda/attention.hpp, through
// fused_attention) against attention_ops in fp32 on the same inputs with the same mask: q, k, v
// strided in one projection as gpt's layer splits it, or grouped as llama's (6 heads reading 2
// key/value groups), sequences that do and do not fill the 64-row tiles, head_dim 64 and 128,
// bf16 and fp16, p 0 (the kernel's own softmax), 0.1 to 0.5 (a mask in the wrong place is off by
// whole probabilities, far past the tolerance), peaked scores (inputs x 5: a softmax that did not
// subtract its running maximum overflows), mask rows at odd offsets (3 x 65 x 65 per sequence: the
// hash's word pairs split between lanes), sliding windows of 0, 70 and 100 (against the ops with
// window_mask's mask); and a Domino chunk (rows of the mask) equal to its rows
// of the whole batch, forward and gradients bit for bit (the same blocks in the same order), and a
// second backward equal to the first bit for bit (no atomics: runs are reproducible).
TEST(GpuKernels, AttentionKernelEqualsOps) {
  SKIP_WITHOUT_CUDA();
  at::Generator gen = dtk::layers::seeded_generator(41);
  struct Case {
    const char* name;
    int64_t b, s, heads, groups, hd;
    double p, input_scale;
    at::ScalarType type;
    int64_t window = -1;  // a sliding window (--window-size W,0); -1: none
  };
  const Case cases[] = {
      {"gpt-like, no dropout", 2, 200, 4, 4, 64, 0.0, 1, at::kBFloat16},
      {"window 70, p 0.1", 2, 300, 4, 4, 64, 0.1, 1, at::kBFloat16, 70},
      {"window 0, grouped 4/2", 2, 150, 4, 2, 64, 0.2, 1, at::kHalf, 0},
      {"window 100, no dropout, grouped 6/2, head_dim 128", 2, 260, 6, 2, 128, 0.0, 1, at::kBFloat16, 100},
      {"gpt-like, p 0.1", 2, 200, 4, 4, 64, 0.1, 1, at::kBFloat16},
      {"p 0.5", 2, 130, 2, 2, 64, 0.5, 1, at::kHalf},
      {"grouped 6/2, head_dim 128", 2, 97, 6, 2, 128, 0.1, 1, at::kBFloat16},
      {"grouped 6/2, head_dim 128", 2, 97, 6, 2, 128, 0.1, 1, at::kHalf},
      {"peaked scores", 2, 150, 2, 2, 64, 0.1, 5, at::kBFloat16},
      {"odd mask offsets", 3, 65, 3, 3, 64, 0.3, 1, at::kBFloat16},
      {"one tile", 3, 64, 2, 2, 64, 0.2, 1, at::kBFloat16},
      {"one position", 2, 1, 2, 2, 64, 0.1, 1, at::kHalf}};
  for (const Case& c : cases) {
    const int64_t per_group = c.heads / c.groups;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
    // A projection [b, s, groups, (per_group + 2) * hd]: per group its queries, its key, its value
    // (gpt's [b, s, heads, 3 * hd] where per_group is 1).
    const at::Tensor projected0 =
        at::randn({c.b, c.s, c.groups, (per_group + 2) * c.hd}, at::TensorOptions().device(at::kCUDA)) * c.input_scale;
    const auto split = [&](const at::Tensor& projected) {
      std::vector<at::Tensor> parts = projected.split_with_sizes({per_group * c.hd, c.hd, c.hd}, -1);
      parts[0] = parts[0].reshape({projected.size(0), c.s, c.heads, c.hd});  // a view where per_group is 1
      return parts;
    };
    const dtk::layers::DropoutMask keep = dtk::layers::draw_keep_mask({c.b, c.heads, c.s, c.s}, c.p, gen);
    const at::Tensor dout = at::randn({c.b, c.s, c.heads * c.hd}, at::TensorOptions().device(at::kCUDA)).to(c.type);
    const std::string what = std::string(c.name) + ", " + c10::toString(c.type);

    at::Tensor projected = projected0.to(c.type).requires_grad_(true);
    const std::vector<at::Tensor> qkv = split(projected);
    ASSERT_TRUE(dtk::layers::fused_attention_applies(qkv[0], qkv[1], qkv[2], keep, {})) << what;
    EXPECT_FALSE(
        dtk::layers::fused_attention_applies(qkv[0], qkv[1], qkv[2], keep, dtk::layers::unfused_kernels("attention")));
    const at::Tensor out = dtk::layers::fused_attention(qkv[0], qkv[1], qkv[2], scale, keep, c.window);
    torch::autograd::backward({out}, {dout});

    at::Tensor reference = projected0.to(c.type).to(at::kFloat).requires_grad_(true);
    const std::vector<at::Tensor> rqkv = split(reference);
    const at::Tensor causal =
        c.window >= 0 ? dtk::layers::window_mask({}, c.s, c.s, c.window, at::kCUDA)
                      : at::ones({c.s, c.s}, at::TensorOptions().dtype(at::kBool).device(at::kCUDA)).triu(1);
    const at::Tensor expected = dtk::layers::attention_ops(rqkv[0], rqkv[1], rqkv[2], scale, causal, keep);
    torch::autograd::backward({expected}, {dout.to(at::kFloat)});

    const double tol = c.type == at::kHalf ? 5e-3 : 2e-2;
    EXPECT_LT(relative_error(out, expected), tol) << what;
    // The gradient's parts (q, k, v) each, relative to the whole gradient's largest entry: the
    // keys' and values' sum over the group's heads and the key tiles. (With one position the
    // queries' and keys' gradients are exactly 0 in the reference and the kernel's are rounding.)
    const double floor = 0.1 * reference.grad().abs().max().item<double>();
    for (int part = 0; part < 3; ++part)
      EXPECT_LT(relative_error(split(projected.grad())[part], split(reference.grad())[part], floor), 2 * tol)
          << what << " (gradient, part " << part << ")";
    const at::Tensor first_grad = projected.grad().clone();
    projected.mutable_grad() = at::Tensor();
    torch::autograd::backward({dtk::layers::fused_attention(qkv[0], qkv[1], qkv[2], scale, keep, c.window)}, {dout});
    EXPECT_TRUE(at::equal(projected.grad(), first_grad)) << what << " (a second backward)";

    // A Domino chunk: the last sequence alone with its rows of the mask.
    if (c.b > 1) {
      at::Tensor last = projected.detach().narrow(0, c.b - 1, 1).clone().requires_grad_(true);
      const std::vector<at::Tensor> lqkv = split(last);
      const at::Tensor chunk =
          dtk::layers::fused_attention(lqkv[0], lqkv[1], lqkv[2], scale, keep.rows(c.b - 1, 1), c.window);
      EXPECT_TRUE(at::equal(chunk, out.detach().narrow(0, c.b - 1, 1))) << what << " (a chunk of the batch)";
      torch::autograd::backward({chunk}, {dout.narrow(0, c.b - 1, 1)});
      const std::vector<at::Tensor> chunk_grad = split(last.grad()), whole_grad = split(projected.grad());
      for (int part = 0; part < 3; ++part)
        EXPECT_TRUE(at::equal(chunk_grad[part], whole_grad[part].narrow(0, c.b - 1, 1)))
            << what << " (a chunk's gradient, part " << part << ")";
    }
  }
}

// A chunk of queries over the keys from the sequence's start to the chunk's end, as context
// parallelism's all_gather runs each of a rank's two chunks (ContextParallel::attend_whole_keys):
// s queries at positions t - s .. t - 1 over t keys (the causal diagonal bottom-right aligned),
// the keys and values narrowed from one gathered [b, whole, groups, 2 hd] tensor, the dropout mask
// a block of t columns of a [b, heads, s, 2 whole] mask (DropoutMask::columns). Against
// attention_ops with the chunk's rows of the causal mask (triu(t - s + 1)) or of window_mask,
// output and the gradients of q and of the gathered keys and values.
TEST(GpuKernels, AttentionChunkOverEarlierKeysEqualsOps) {
  SKIP_WITHOUT_CUDA();
  at::Generator gen = dtk::layers::seeded_generator(47);
  struct Case {
    const char* name;
    int64_t b, s, whole, t, column, heads, groups, hd;
    double p;
    at::ScalarType type;
    int64_t window = -1;
  };
  const Case cases[] = {{"CP 2, chunk 3 of 4, p 0.1", 2, 128, 512, 512, 512, 4, 4, 64, 0.1, at::kBFloat16},
                        {"CP 2, chunk 1 of 4, no dropout", 2, 128, 512, 256, 0, 4, 4, 64, 0.0, at::kBFloat16},
                        {"odd lengths, grouped 6/2, head_dim 128", 1, 90, 360, 270, 360, 6, 2, 128, 0.2, at::kHalf},
                        {"window 50, grouped 4/2", 2, 100, 400, 300, 0, 4, 2, 64, 0.1, at::kBFloat16, 50}};
  for (const Case& c : cases) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
    const auto on = at::TensorOptions().device(at::kCUDA);
    const at::Tensor q0 = at::randn({c.b, c.s, c.heads, c.hd}, on),
                     kv0 = at::randn({c.b, c.whole, c.groups, 2 * c.hd}, on);
    const dtk::layers::DropoutMask keep =
        dtk::layers::draw_keep_mask({c.b, c.heads, c.s, 2 * c.whole}, c.p, gen).columns(2 * c.whole, c.column, c.t);
    const at::Tensor dout = at::randn({c.b, c.s, c.heads * c.hd}, on).to(c.type);
    const std::string what = std::string(c.name) + ", " + c10::toString(c.type);
    // The kernel on the narrow type, the reference in fp32 from the same rounded values.
    std::vector<at::Tensor> grads[2], outs;
    for (int ref = 0; ref < 2; ++ref) {
      at::Tensor q = q0.to(c.type), kv = kv0.to(c.type);
      if (ref) q = q.to(at::kFloat), kv = kv.to(at::kFloat);
      q.requires_grad_(true), kv.requires_grad_(true);
      const at::Tensor seen = kv.narrow(1, 0, c.t), k = seen.narrow(-1, 0, c.hd), v = seen.narrow(-1, c.hd, c.hd);
      at::Tensor out;
      if (!ref) {
        ASSERT_TRUE(dtk::layers::fused_attention_applies(q, k, v, keep, {})) << what;
        out = dtk::layers::fused_attention(q, k, v, scale, keep, c.window);
      } else {
        const at::Tensor mask =
            c.window >= 0 ? dtk::layers::window_mask({}, c.s, c.t, c.window, at::kCUDA)
                          : at::ones({c.s, c.t}, on.dtype(at::kBool)).triu(c.t - c.s + 1).view({1, 1, c.s, c.t});
        out = dtk::layers::attention_ops(q, k, v, scale, mask, keep);
      }
      torch::autograd::backward({out}, {ref ? dout.to(at::kFloat) : dout});
      outs.push_back(out.detach());
      grads[ref] = {q.grad(), kv.grad()};
    }
    const double tol = c.type == at::kHalf ? 5e-3 : 2e-2;
    EXPECT_LT(relative_error(outs[0], outs[1]), tol) << what;
    const double floor = 0.1 * std::max(grads[1][0].abs().max().item<double>(), grads[1][1].abs().max().item<double>());
    EXPECT_LT(relative_error(grads[0][0], grads[1][0], floor), 2 * tol) << what << " (queries' gradient)";
    EXPECT_LT(relative_error(grads[0][1], grads[1][1], floor), 2 * tol) << what << " (keys' and values' gradient)";
  }
}

// A step recorded into a CUDA graph reads each mask's seed on the device (DropoutMask::seed_slot,
// which the host fills before every replay). Every path applying a mask gives, with the seed in a
// slot, exactly the outputs and gradients of the same mask with the seed as a constant: dropout's
// kernel, the ops fall-back, the add + LayerNorm kernel's residual dropout and the attention
// kernel. The slotted mask's constant is made wrong, so a path that ignored the slot fails.
TEST(GpuKernels, SeedSlotsReadOnTheDeviceGiveTheConstantSeedsMasks) {
  SKIP_WITHOUT_CUDA();
  at::Generator gen = dtk::layers::seeded_generator(43);
  const auto on = at::TensorOptions().device(at::kCUDA);
  auto slotted = [&](dtk::layers::DropoutMask m) {
    m.seed_slot = at::full({1}, static_cast<int64_t>(m.seed), on.dtype(at::kLong));
    m.seed ^= 0x5DEECE66DULL;
    return m;
  };
  // Each function's output and its input's gradient, for the constant seed and for the slot.
  auto expect_same = [&](const std::string& what, const at::Tensor& x0,
                         const std::function<at::Tensor(const at::Tensor&, const dtk::layers::DropoutMask&)>& f,
                         const dtk::layers::DropoutMask& mask) {
    std::vector<at::Tensor> got[2];
    for (int use_slot = 0; use_slot < 2; ++use_slot) {
      at::Tensor x = x0.clone().requires_grad_(true);
      const at::Tensor y = f(x, use_slot ? slotted(mask) : mask);
      torch::autograd::backward({y}, {at::ones_like(y)});
      got[use_slot] = {y.detach(), x.grad()};
    }
    EXPECT_TRUE(at::equal(got[0][0], got[1][0])) << what << ": output";
    EXPECT_TRUE(at::equal(got[0][1], got[1][1])) << what << ": gradient";
  };
  const dtk::layers::DropoutMask mask = dtk::layers::draw_keep_mask({4, 37, 129}, 0.3, gen);
  for (const auto type : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = at::randn({4, 37, 129}, on).to(type);
    expect_same(std::string("dropout kernel, ") + c10::toString(type), x, &dtk::layers::apply_dropout, mask);
    expect_same("dropout kernel, a sequence shard", x.narrow(1, 5, 11), &dtk::layers::apply_dropout,
                mask.sequence_rows(37, 5, 11));
  }
  expect_same("the ops", at::randn({4, 37, 129}, on), &dtk::layers::apply_dropout_ops, mask);

  const at::Tensor residual = at::randn({300, 1, 768}, on).to(at::kBFloat16);
  const at::Tensor w = (1 + 0.1 * at::randn({768}, on)).to(at::kBFloat16), b = at::zeros({768}, on).to(at::kBFloat16);
  expect_same(
      "add + LayerNorm with the residual's dropout", at::randn({300, 1, 768}, on).to(at::kBFloat16),
      [&](const at::Tensor& x, const dtk::layers::DropoutMask& keep) {
        const auto out = dtk::layers::add_bias_dropout_layer_norm(x, residual, at::Tensor(), keep, w, b, 1e-5);
        return out.first + out.second;
      },
      dtk::layers::draw_keep_mask({300, 1, 768}, 0.1, gen));

  const int64_t batch = 2, seq = 130, heads = 2, hd = 64;
  const at::Tensor qkv = at::randn({batch, seq, heads, 3 * hd}, on).to(at::kBFloat16);
  const dtk::layers::DropoutMask keep = dtk::layers::draw_keep_mask({batch, heads, seq, seq}, 0.1, gen);
  expect_same(
      "attention kernel", qkv,
      [&](const at::Tensor& projected, const dtk::layers::DropoutMask& k) {
        const std::vector<at::Tensor> parts = projected.split(hd, -1);
        EXPECT_TRUE(dtk::layers::fused_attention_applies(parts[0], parts[1], parts[2], k, {}));
        return dtk::layers::fused_attention(parts[0], parts[1], parts[2], 1.0 / 8.0, k);
      },
      keep);
}

// model.unfused_kernels: a function told to leave its kernel out runs exactly its ops reference
// on the GPU (bit for bit: the same ops), and the kernel's autograd function is not in the graph.
TEST(GpuKernels, KernelsLeftOutRunTheOpsReferences) {
  SKIP_WITHOUT_CUDA();
  const auto on = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::manual_seed(23);
  const dtk::layers::FusedKernels none = dtk::layers::unfused_kernels("all");
  const at::Tensor x = at::randn({4, 9, 64}, on).requires_grad_(true), r = at::randn({4, 9, 64}, on);
  const at::Tensor w = at::randn({64}, on), b = at::randn({64}, on);
  auto not_fused = [](const at::Tensor& y, const char* what) {
    EXPECT_EQ(y.grad_fn()->name().find("Fused"), std::string::npos) << what << ": " << y.grad_fn()->name();
  };
  auto same = [](const at::Tensor& a, const at::Tensor& e, const char* what) { EXPECT_TRUE(at::equal(a, e)) << what; };
  const auto [ls, ly] = dtk::layers::add_layer_norm(x, r, w, b, 1e-5, none);
  not_fused(ly, "add_layer_norm");
  same(ly, dtk::layers::add_layer_norm_ops(x, r, w, b, 1e-5).second, "add_layer_norm");
  const auto [bs, by] = dtk::layers::add_bias_layer_norm(x, r, b, w, b, 1e-5, none);
  not_fused(by, "add_bias_layer_norm");
  same(by, dtk::layers::add_bias_layer_norm_ops(x, r, b, w, b, 1e-5).second, "add_bias_layer_norm");
  // bias_add alone left out: the bias added by the ops, then the add + norm kernel.
  const auto [bs2, by2] =
      dtk::layers::add_bias_layer_norm(x, r, b, w, b, 1e-5, dtk::layers::unfused_kernels("bias_add"));
  same(by2, dtk::layers::add_layer_norm(x, r + b, w, b, 1e-5).second, "add_bias_layer_norm without bias_add");
  // The kernel's inputs: x, the branch already biased, w, b (with bias_add on, five: the bias too).
  EXPECT_EQ(by2.grad_fn()->next_edges().size(), 4u) << by2.grad_fn()->name();
  EXPECT_EQ(dtk::layers::add_bias_layer_norm(x, r, b, w, b, 1e-5).second.grad_fn()->next_edges().size(), 5u);
  EXPECT_FALSE(dtk::layers::layer_norm_takes_branch_bias(x, w, b, dtk::layers::unfused_kernels("bias_add")));
  // The branch's dropout too: without bias_add the bias's add and the dropout (its own kernel) come
  // first, then the add + norm kernel; without any kernel, those ops and the plain add + norm.
  at::Generator gen = dtk::layers::seeded_generator(37);
  const dtk::layers::DropoutMask keep = dtk::layers::draw_keep_mask({4, 9, 64}, 0.2, gen);
  const auto [ds, dy] = dtk::layers::add_bias_dropout_layer_norm(x, r, b, keep, w, b, 1e-5, none);
  not_fused(dy, "add_bias_dropout_layer_norm");
  same(dy, dtk::layers::add_layer_norm_ops(x, dtk::layers::apply_dropout(r + b, keep), w, b, 1e-5).second,
       "add_bias_dropout_layer_norm");
  const auto [ds2, dy2] =
      dtk::layers::add_bias_dropout_layer_norm(x, r, b, keep, w, b, 1e-5, dtk::layers::unfused_kernels("bias_add"));
  same(dy2, dtk::layers::add_layer_norm(x, dtk::layers::apply_dropout(r + b, keep), w, b, 1e-5).second,
       "add_bias_dropout_layer_norm without bias_add");
  EXPECT_EQ(dy2.grad_fn()->next_edges().size(), 4u) << dy2.grad_fn()->name();
  EXPECT_EQ(dtk::layers::add_bias_dropout_layer_norm(x, r, b, keep, w, b, 1e-5).second.grad_fn()->next_edges().size(),
            5u);
  EXPECT_TRUE(dtk::layers::layer_norm_takes_branch_bias(x, w, b, {}));
  const auto [rs, ry] = dtk::layers::add_rms_norm(x, r, w, 1e-5, none);
  not_fused(ry, "add_rms_norm");
  same(ry, dtk::layers::add_rms_norm_ops(x, r, w, 1e-5).second, "add_rms_norm");
  const at::Tensor n = dtk::layers::rms_norm(x, w, 1e-5, none);
  not_fused(n, "rms_norm");
  same(n, dtk::layers::rms_norm_ops(x, w, 1e-5), "rms_norm");
  const at::Tensor g = dtk::layers::bias_gelu(x, b, /*tanh=*/true, none);
  not_fused(g, "bias_gelu");
  same(g, dtk::layers::bias_gelu_ops(x, b, true), "bias_gelu");
  const at::Tensor sw = dtk::layers::swiglu(x, r, none);
  not_fused(sw, "swiglu");
  same(sw, dtk::layers::swiglu_ops(x, r), "swiglu");
  const at::Tensor q = x.view({4, 9, 2, 32});
  const at::Tensor angles = at::randn({4, 9, 1, 32}, at::TensorOptions().device(at::kCUDA)) * 3;
  const at::Tensor ro = dtk::layers::apply_rotary(q, angles.cos(), angles.sin(), none);
  not_fused(ro, "apply_rotary");
  same(ro, dtk::layers::apply_rotary_ops(q, angles.cos(), angles.sin()), "apply_rotary");
}

}  // namespace
