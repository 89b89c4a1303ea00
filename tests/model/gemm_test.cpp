// dtk/gemm.hpp's bf16 and fp16 CPU products: the operands widened to fp32, one fp32 product with
// fp32 accumulation (the same engine as an fp32 product), the result rounded once to the narrow
// type, as a GPU's tensor cores compute it. Checked against:
//   * the same product computed by hand from widened copies (bit for bit: the plumbing, the
//     transposed operands, the bias and the accumulated c are each rounded once, not twice);
//   * the exact product (fp64) rounded to the type: at least as close as that rounding allows.
// LibTorch 1.13's own CPU bf16 at::mm accumulates in bf16 on a CPU without AVX512-BF16, which is
// why the layers do not use it; its error is printed for the record, not asserted (another CPU
// or LibTorch computes it otherwise), but for the attention check's sensitivity under 1.13.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <dtk/gemm.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/layers/dropout.hpp>

namespace {

// The types this CPU widens (bf16 only without AVX-512: with it LibTorch's oneDNN kernels keep
// them); none under DTK_CPU_GEMM=aten.
std::vector<at::ScalarType> widened_types() {
  std::vector<at::ScalarType> out;
  for (const at::ScalarType t : {at::kBFloat16, at::kHalf})
    if (dtk::cpu_widens(t)) out.push_back(t);
  return out;
}

std::string name(at::ScalarType t) { return t == at::kBFloat16 ? "bf16" : "fp16"; }

at::Tensor random(std::initializer_list<int64_t> shape, at::ScalarType type) { return at::randn(shape).to(type); }

// The widened product computed by hand: fp32 copies, dtk's fp32 product, one rounding.
at::Tensor by_hand(const at::Tensor& a, const at::Tensor& b, at::ScalarType type) {
  return dtk::mm(a.to(at::kFloat), b.to(at::kFloat)).to(type);
}

void expect_bit_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what << ": max difference "
                                    << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<float>();
}

TEST(NarrowProducts, MmIsTheWidenedProductRoundedOnce) {
  const char* engine = std::getenv("DTK_CPU_GEMM");
  if (!engine || std::string(engine) != "aten") ASSERT_TRUE(dtk::cpu_widens(at::kHalf)) << "fp16: widened on every CPU";
  at::manual_seed(11);
  for (const at::ScalarType type : widened_types()) {
    const at::Tensor a = random({37, 256}, type), b = random({256, 45}, type), bt = random({45, 256}, type);
    expect_bit_equal(dtk::mm(a, b), by_hand(a, b, type), name(type) + " mm");
    // A transposed operand, as the layers pass weight.t() and g.t().
    expect_bit_equal(dtk::mm(a, bt.t()), by_hand(a, bt.t(), type), name(type) + " mm with b transposed");
    const at::Tensor a_t = random({256, 37}, type);
    expect_bit_equal(dtk::mm(a_t.t(), b), by_hand(a_t.t(), b, type), name(type) + " mm with a transposed");
    at::Tensor c = at::empty({37, 45}, a.options());
    dtk::mm_out(c, a, b);
    expect_bit_equal(c, by_hand(a, b, type), name(type) + " mm_out");
  }
}

// c += a b: the sum of c and the product in fp32, rounded once (cuBLAS's beta = 1).
TEST(NarrowProducts, AddmmRoundsTheSumOnce) {
  at::manual_seed(12);
  for (const at::ScalarType type : widened_types()) {
    const at::Tensor a = random({24, 128}, type), b = random({128, 40}, type);
    at::Tensor c = random({24, 40}, type);
    const at::Tensor want = (c.to(at::kFloat) + dtk::mm(a.to(at::kFloat), b.to(at::kFloat))).to(type);
    const at::Tensor twice = (c.to(at::kFloat) + by_hand(a, b, type).to(at::kFloat)).to(type);
    dtk::addmm_(c, a, b);
    expect_bit_equal(c, want, name(type) + " addmm_");
    // The check can tell: rounding the product first, then the sum, differs somewhere.
    EXPECT_FALSE(at::equal(want, twice)) << name(type);
  }
}

// x [..., in] w^T + bias: the bias joins the fp32 sum before the one rounding.
TEST(NarrowProducts, LinearProductAddsTheBiasBeforeRounding) {
  at::manual_seed(13);
  for (const at::ScalarType type : widened_types()) {
    const at::Tensor x = random({3, 7, 64}, type), w = random({96, 64}, type), bias = random({96}, type);
    const at::Tensor wide = at::addmm(bias.to(at::kFloat), x.reshape({-1, 64}).to(at::kFloat), w.t().to(at::kFloat));
    const at::Tensor y = dtk::linear_product(x, w, bias);
    ASSERT_EQ(y.sizes(), (at::IntArrayRef{3, 7, 96}));
    // fp32 sums in another engine's order may differ in the last fp32 bits: compare after the
    // rounding, allowing the rare element whose fp32 value lay on a rounding boundary.
    const at::Tensor rounded = wide.to(type).view({3, 7, 96});
    EXPECT_GT(y.eq(rounded).to(at::kFloat).mean().item<float>(), 0.99f) << name(type);
    expect_bit_equal(dtk::linear_product(x, w), by_hand(x.reshape({-1, 64}), w.t(), type).view({3, 7, 96}),
                     name(type) + " without bias");
  }
}

// Against the exact product: the widened product is the exact one rounded to bf16 but for the
// rare element within fp32 rounding of a bf16 boundary; LibTorch's own CPU kernel is shown beside.
TEST(NarrowProducts, Bf16ProductsAreAsExactAsOneRounding) {
  if (!dtk::cpu_widens(at::kBFloat16)) GTEST_SKIP() << "this CPU's bf16 products are LibTorch's (AVX-512)";
  at::manual_seed(14);
  for (const int64_t k : {256, 1024}) {
    const at::Tensor a = random({64, k}, at::kBFloat16), b = random({k, 96}, at::kBFloat16);
    const at::Tensor exact = at::mm(a.to(at::kDouble), b.to(at::kDouble));
    const at::Tensor ours = dtk::mm(a, b), aten = at::mm(a, b), once = exact.to(at::kBFloat16);
    const double same = ours.eq(once).to(at::kFloat).mean().item<float>();
    const double err = (ours.to(at::kDouble) - exact).abs().mean().item<double>();
    const double err_once = (once.to(at::kDouble) - exact).abs().mean().item<double>();
    const double err_aten = (aten.to(at::kDouble) - exact).abs().mean().item<double>();
    std::printf("k %lld: mean |error| against fp64: dtk::mm %.4g, one rounding %.4g, LibTorch at::mm %.4g\n",
                static_cast<long long>(k), err, err_once, err_aten);
    EXPECT_GT(same, 0.995) << "k " << k;
    EXPECT_LT(err, 1.01 * err_once) << "k " << k;
  }
}

// Where autograd records the product, LibTorch computes it (gradients flow); a mixed-type product
// is LibTorch's to refuse.
TEST(NarrowProducts, RecordedAndMixedProductsGoToLibTorch) {
  at::manual_seed(15);
  const at::Tensor a = random({8, 16}, at::kBFloat16).requires_grad_(), b = random({16, 4}, at::kBFloat16);
  const at::Tensor y = dtk::mm(a, b);
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().sizes(), a.sizes());
  EXPECT_THROW(dtk::mm(random({8, 16}, at::kBFloat16), random({16, 4}, at::kFloat)), c10::Error);
}

// The attention's score and context products (dtk::layers::attention_ops) take the same rule,
// forward and backward: against the same ops with the widening written out (ATen's autograd
// through the casts), every value and gradient agrees but for rare last-bit differences of fp32
// sums taken in another order; LibTorch's own bf16 batched products miss by far more.
TEST(NarrowProducts, AttentionProductsAreWidenedBothWays) {
  if (!dtk::cpu_widens(at::kBFloat16)) GTEST_SKIP() << "this CPU's bf16 products are LibTorch's (AVX-512)";
  at::manual_seed(16);
  const int64_t b = 2, s = 24, heads = 4, groups = 2, hd = 32;
  const double scale = 0.125;
  const at::Tensor mask = at::ones({s, s}, at::kBool).triu(1);
  const at::Tensor q0 = random({b, s, heads, hd}, at::kBFloat16), k0 = random({b, s, groups, hd}, at::kBFloat16);
  const at::Tensor v0 = random({b, s, groups, hd}, at::kBFloat16), g = random({b, s, heads * hd}, at::kBFloat16);
  // The ops of attention_ops with `product` for its two batched products.
  auto attention = [&](auto&& product, std::vector<at::Tensor>& grads) {
    at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    const auto repeat = [&](const at::Tensor& x) {
      return x.unsqueeze(2).expand({b, groups, heads / groups, s, hd}).reshape({b, heads, s, hd});
    };
    const at::Tensor scores = product(q.transpose(1, 2) * scale, repeat(k.transpose(1, 2)).transpose(-1, -2));
    const at::Tensor probs = at::softmax(scores.to(at::kFloat).masked_fill(mask, -10000.0), -1).to(at::kBFloat16);
    const at::Tensor out = product(probs, repeat(v.transpose(1, 2))).transpose(1, 2).reshape({b, s, heads * hd});
    out.backward(g);
    grads = {q.grad(), k.grad(), v.grad()};
    return out.detach();
  };
  std::vector<at::Tensor> ours_grads, widened_grads, plain_grads;
  at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
  const at::Tensor ours = dtk::layers::attention_ops(q, k, v, scale, mask, dtk::layers::DropoutMask{});
  ours.backward(g);
  ours_grads = {q.grad(), k.grad(), v.grad()};
  const at::Tensor widened =
      attention([](const at::Tensor& x,
                   const at::Tensor& y) { return at::matmul(x.to(at::kFloat), y.to(at::kFloat)).to(x.scalar_type()); },
                widened_grads);
  const at::Tensor plain =
      attention([](const at::Tensor& x, const at::Tensor& y) { return at::matmul(x, y); }, plain_grads);
  auto agreement = [](const at::Tensor& x, const at::Tensor& y) { return x.eq(y).to(at::kFloat).mean().item<float>(); };
  const char* names[] = {"dq", "dk", "dv"};
  EXPECT_GT(agreement(ours, widened), 0.99f) << "context";
  for (int i = 0; i < 3; ++i) EXPECT_GT(agreement(ours_grads[i], widened_grads[i]), 0.99f) << names[i];
  // What the check tells apart: LibTorch's own bf16 products.
  float plain_worst = agreement(plain, widened);
  for (int i = 0; i < 3; ++i) plain_worst = std::min(plain_worst, agreement(plain_grads[i], widened_grads[i]));
  std::printf("LibTorch's bf16 batched products agree with the widened ones on %.1f%% of some output\n",
              100.0 * plain_worst);
#if TORCH_VERSION_MAJOR < 2  // 1.13's bf16 bmm accumulates in bf16; 2.x's may not
  EXPECT_LT(plain_worst, 0.9f);
#endif
}

}  // namespace
