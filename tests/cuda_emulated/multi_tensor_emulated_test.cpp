// DTK's multi-tensor kernels (core/cuda/src: the fused AdamW and the sum of squares behind the
// gradient norm) run on the CPU through the SIMT emulation, against references in double: more
// tensors than one launch carries, empty tensors, tensors that end inside, at and just past a
// block's chunk, each element type, and sentinels between the tensors that must stay untouched.
// What this proves is the launches' bookkeeping (which block updates which elements of which
// tensor) and the arithmetic; tests/cuda/ runs the same kernels on a GPU against LibTorch's.
#include "emulated_test.hpp"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "dtk/cuda/adamw.hpp"
#include "dtk/cuda/squares.hpp"
#include "element.cuh"

namespace {

using MultiTensorEmulated = Emulated;

using dtk::cuda::ElementType;

constexpr int64_t kGap = 5;             // sentinel elements before each tensor in an arena
constexpr float kSentinel = -12288.0f;  // exact in bf16 and fp16

// Where tensors of the given sizes start in one arena, each after kGap sentinels.
std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes, int64_t* total) {
  std::vector<int64_t> offsets;
  int64_t at = 0;
  for (const int64_t n : sizes) {
    offsets.push_back(at + kGap);
    at += kGap + n;
  }
  *total = at + kGap;
  return offsets;
}

bool is_sentinel(float x) { return x == kSentinel; }

// 40 tensors (two launches' worth): sizes around AdamW's 16384-element chunks and the sum of
// squares' 65536-element slices, and some empty.
std::vector<int64_t> tensor_sizes() {
  std::vector<int64_t> sizes = {16385, 1, 0, 7, 16384, 70000, 65536, 0};
  for (int i = 0; sizes.size() < 40; ++i) sizes.push_back(3 + 97 * i);
  return sizes;
}

template <class G>
void check_adamw(bool grad_bf16) {
  const std::vector<int64_t> sizes = tensor_sizes();
  int64_t total = 0;
  const std::vector<int64_t> offsets = offsets_of(sizes, &total);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(total, kSentinel), m(total, kSentinel), v(total, kSentinel);
  std::vector<G> g(total, dtk::cuda::element::from_float<G>(kSentinel));
  for (size_t t = 0; t < sizes.size(); ++t)
    for (int64_t i = offsets[t]; i < offsets[t] + sizes[t]; ++i) {
      p[i] = normal(rng);
      m[i] = 0.1f * normal(rng);
      v[i] = 0.01f * std::abs(normal(rng));
      g[i] = dtk::cuda::element::from_float<G>(1024.0f * normal(rng));  // loss scale 1024
    }

  // torch.optim.AdamW's step 3 with lr 1e-3, weight decay 0.1, betas (0.9, 0.95), eps 1e-8.
  const double lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8, step = 3, scale = 1.0 / 1024;
  dtk::cuda::AdamWScalars k;
  k.beta1 = static_cast<float>(b1);
  k.beta2 = static_cast<float>(b2);
  k.one_minus_beta1 = static_cast<float>(1 - b1);
  k.one_minus_beta2 = static_cast<float>(1 - b2);
  k.decay = static_cast<float>(1 - lr * wd);
  k.step_size = static_cast<float>(lr / (1 - std::pow(b1, step)));
  k.inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(1 - std::pow(b2, step)));
  k.eps = static_cast<float>(eps);
  k.inv_grad_scale = static_cast<float>(scale);

  std::vector<double> want_p(total), want_m(total), want_v(total), m_terms(total);
  for (int64_t i = 0; i < total; ++i) {
    if (is_sentinel(p[i])) continue;
    const double grad = double{dtk::cuda::element::to_float(g[i])} * scale;
    want_m[i] = b1 * m[i] + (1 - b1) * grad;
    m_terms[i] = std::abs(b1 * m[i]) + std::abs((1 - b1) * grad);  // m's rounding is relative to these
    want_v[i] = b2 * v[i] + (1 - b2) * grad * grad;
    const double denom = std::sqrt(want_v[i]) / std::sqrt(1 - std::pow(b2, step)) + eps;
    want_p[i] = p[i] * (1 - lr * wd) - lr / (1 - std::pow(b1, step)) * want_m[i] / denom;
  }

  std::vector<dtk::cuda::AdamWTensor> tensors;
  for (size_t t = 0; t < sizes.size(); ++t)
    tensors.push_back(
        {p.data() + offsets[t], g.data() + offsets[t], m.data() + offsets[t], v.data() + offsets[t], sizes[t]});
  dtk::cuda::fused_adamw(tensors, grad_bf16, k, nullptr);

  int64_t wrong = 0, sentinels_changed = 0;
  for (int64_t i = 0; i < total; ++i) {
    if (is_sentinel(dtk::cuda::element::to_float(g[i]))) {
      sentinels_changed += !is_sentinel(p[i]) + !is_sentinel(m[i]) + !is_sentinel(v[i]);
      continue;
    }
    const bool close = std::abs(p[i] - want_p[i]) <= 2e-7 * std::max(1.0, std::abs(want_p[i])) &&
                       std::abs(m[i] - want_m[i]) <= 1e-6 * m_terms[i] &&
                       std::abs(v[i] - want_v[i]) <= 1e-6 * want_v[i];
    if (!close && wrong++ < 5)
      ADD_FAILURE() << "element " << i << ": p " << p[i] << " (want " << want_p[i] << "), m " << m[i] << " ("
                    << want_m[i] << "), v " << v[i] << " (want " << want_v[i] << ")";
  }
  EXPECT_EQ(wrong, 0) << "elements updated wrongly, twice or not at all";
  EXPECT_EQ(sentinels_changed, 0) << "elements outside every tensor written";
}

TEST_F(MultiTensorEmulated, FusedAdamWEqualsTorchsAdamWOnEveryElement) {
  check_adamw<float>(false);
  check_adamw<__nv_bfloat16>(true);
}

// The tensors of tensor_sizes() as fp32, then bf16, fp16 and fp32 again (a launch takes one
// element type), each element's square summed in long double for the reference.
TEST_F(MultiTensorEmulated, SumOfSquaresEqualsTheSumInLongDouble) {
  const std::vector<int64_t> sizes = tensor_sizes();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<__nv_bfloat16>> bf16;
  std::vector<std::vector<__half>> fp16;
  std::vector<dtk::cuda::SquaresTensor> tensors;
  long double want = 0;
  const auto add = [&](auto& store, int64_t n, ElementType type) {
    auto& x = store.emplace_back(n);
    for (auto& e : x) {
      e = dtk::cuda::element::from_float<std::decay_t<decltype(e)>>(normal(rng));
      const long double d = dtk::cuda::element::to_float(e);
      want += d * d;
    }
    tensors.push_back({x.data(), n, type});
  };
  for (const int64_t n : sizes) add(f32, n, ElementType::kFloat32);
  for (int i = 0; i < 5; ++i) add(bf16, sizes[i], ElementType::kBFloat16);
  for (int i = 0; i < 5; ++i) add(fp16, sizes[5 - i], ElementType::kFloat16);
  for (int i = 0; i < 2; ++i) add(f32, sizes[i], ElementType::kFloat32);

  int64_t slices = 0;
  for (const auto& t : tensors) slices += (t.n + 65535) / 65536;
  const int64_t workspace = dtk::cuda::sum_of_squares_workspace(tensors);
  EXPECT_EQ(workspace, slices);
  std::vector<double> space(workspace + 4, kSentinel);
  double out = NAN;
  dtk::cuda::sum_of_squares(tensors, space.data(), &out, nullptr);
  EXPECT_NEAR(out, static_cast<double>(want), 1e-13 * static_cast<double>(want));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(space[workspace + i], kSentinel) << "written past the workspace";

  // Nothing to sum (no tensor, or only empty ones): 0, through the one-double workspace.
  for (const std::vector<dtk::cuda::SquaresTensor>& none :
       {std::vector<dtk::cuda::SquaresTensor>{},
        std::vector<dtk::cuda::SquaresTensor>{{f32[2].data(), 0, ElementType::kFloat32}}}) {
    ASSERT_EQ(dtk::cuda::sum_of_squares_workspace(none), 1);
    double one = NAN;
    out = NAN;
    dtk::cuda::sum_of_squares(none, &one, &out, nullptr);
    EXPECT_EQ(out, 0.0);
  }
}

}  // namespace
