// The SDK's CPU kernels for the attention and the cross entropy (dtk::layers), against plain
// ATen computations of the same formulas:
//   * causal_attention_qkv (dtk/layers/attention.hpp): Megatron's CoreAttention on the fused
//     QKV projection — q k^T scaled, the future at -10000, softmax, dropout, times v — forward
//     and gradients, for sequence lengths that fill the 64-row blocks exactly, leave a partial
//     block or fit in one; recomputing the probabilities in backward (selective recomputation)
//     changes no bit; a dropout mask of rows (Domino's chunks) gives the rows of the whole; and
//     causal_attention over separate, grouped, strided operands, also with fewer queries than keys;
//   * the cross entropy's row passes (sdk/layers/softmax_rows.hpp): exp within 2 ulp, sums
//     within a few ulp for a GPT-2-wide row, widths that are not a multiple of the vector width,
//     NaN kept, -inf and very negative logits giving 0.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <dtk/layers/attention.hpp>
#include <dtk/layers/dropout.hpp>

#include "../../sdk/layers/softmax_rows.hpp"

namespace {

using dtk::layers::DropoutMask;
using dtk::layers::seeded_generator;

// Megatron's CoreAttention with plain ops: qkv [b, s, heads * 3 * hd] -> [b, s, heads * hd].
at::Tensor reference_attention(const at::Tensor& qkv, int64_t heads, const DropoutMask& keep) {
  const int64_t b = qkv.size(0), s = qkv.size(1), hd = qkv.size(2) / (3 * heads);
  const at::Tensor mixed = qkv.view({b, s, heads, 3 * hd}).transpose(1, 2);
  const at::Tensor q = mixed.narrow(-1, 0, hd), k = mixed.narrow(-1, hd, hd), v = mixed.narrow(-1, 2 * hd, hd);
  const at::Tensor scores = at::matmul(q * (1.0 / std::sqrt(static_cast<double>(hd))), k.transpose(-1, -2));
  const at::Tensor future = at::ones({s, s}, at::kBool).triu(1);
  at::Tensor probs = at::softmax(scores.masked_fill(future, -10000.0), -1);
  probs = dtk::layers::apply_dropout(probs, keep);
  return at::matmul(probs, v).transpose(1, 2).reshape({b, s, heads * hd});
}

struct Grads {
  at::Tensor out, d_qkv;
};
template <class Fn>
Grads run(const at::Tensor& qkv_value, const at::Tensor& d_out, Fn&& attention) {
  at::Tensor qkv = qkv_value.clone().requires_grad_(true);
  at::Tensor out = attention(qkv);
  out.backward(d_out);
  return {out.detach(), qkv.grad()};
}

TEST(CausalAttention, EqualsCoreAttentionForwardAndBackward) {
  for (const int64_t s : {64, 100, 256, 7}) {
    for (const double p : {0.0, 0.3}) {
      const int64_t b = 3, heads = 2, hd = 16;
      at::manual_seed(static_cast<uint64_t>(s));
      const at::Tensor qkv = at::randn({b, s, heads * 3 * hd});
      const at::Tensor d_out = at::randn({b, s, heads * hd});
      at::Generator g = seeded_generator(5);
      const DropoutMask keep = dtk::layers::draw_keep_mask({b, heads, s, s}, p, g);
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      const Grads mine = run(qkv, d_out, [&](const at::Tensor& x) {
        return dtk::layers::causal_attention_qkv(x, heads, scale, keep);
      });
      const Grads ref = run(qkv, d_out, [&](const at::Tensor& x) { return reference_attention(x, heads, keep); });
      // Selective recomputation: the probabilities formed again in backward, the same values.
      const Grads recomputed = run(qkv, d_out, [&](const at::Tensor& x) {
        return dtk::layers::causal_attention_qkv(x, heads, scale, keep, /*recompute_probs=*/true);
      });
      const std::string what = "s " + std::to_string(s) + ", dropout " + std::to_string(p);
      EXPECT_TRUE(at::allclose(mine.out, ref.out, 1e-5, 1e-5)) << what << ": max diff "
                                                                << (mine.out - ref.out).abs().max().item<double>();
      EXPECT_TRUE(at::allclose(mine.d_qkv, ref.d_qkv, 1e-5, 1e-5))
          << what << ": gradient max diff " << (mine.d_qkv - ref.d_qkv).abs().max().item<double>();
      EXPECT_TRUE(at::equal(recomputed.out, mine.out)) << what;
      EXPECT_TRUE(at::equal(recomputed.d_qkv, mine.d_qkv)) << what;
    }
  }
}

TEST(CausalAttention, TheFutureDoesNotLeakAndMaskRowsAreSlicesOfTheWhole) {
  const int64_t b = 4, s = 70, heads = 3, hd = 8;
  at::manual_seed(1);
  const at::Tensor qkv = at::randn({b, s, heads * 3 * hd});
  at::Generator g = seeded_generator(9);
  const DropoutMask keep = dtk::layers::draw_keep_mask({b, heads, s, s}, 0.2, g);
  const at::Tensor whole = dtk::layers::causal_attention_qkv(qkv, heads, 0.3, keep);
  // Sequences 1..2 with the mask's rows 1..2 (a Domino chunk): the same context.
  EXPECT_TRUE(at::equal(dtk::layers::causal_attention_qkv(qkv.narrow(0, 1, 2).contiguous(), heads, 0.3, keep.rows(1, 2)),
                        whole.narrow(0, 1, 2)));
  // Changing position 40 onwards changes nothing before it.
  at::Tensor later = qkv.clone();
  later.narrow(1, 40, s - 40).normal_();
  const at::Tensor changed = dtk::layers::causal_attention_qkv(later, heads, 0.3, keep);
  EXPECT_TRUE(at::equal(changed.narrow(1, 0, 40), whole.narrow(1, 0, 40)));
  EXPECT_FALSE(at::equal(changed.narrow(1, 40, 1), whole.narrow(1, 40, 1)));
}

TEST(CausalAttention, BadInputsAreRefused) {
  EXPECT_FALSE(dtk::layers::causal_attention_supported(at::randn({2, 4, 12}).to(at::kDouble)));
  EXPECT_FALSE(dtk::layers::causal_attention_supported(at::randn({2, 12, 4}).transpose(1, 2)));
  EXPECT_TRUE(dtk::layers::causal_attention_supported(at::randn({2, 4, 12})));
  try {
    dtk::layers::causal_attention_qkv(at::randn({2, 4, 12}), 5, 1.0, {});
    FAIL() << "12 columns accepted as 3 x 5 heads";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("12 projection columns are not 3 x 5 heads"), std::string::npos) << e.what();
  }
}

// causal_attention over separate operands (llama's q, k, v; context parallelism's all_gather
// chunks) against attention_ops (Megatron's CoreAttention in plain ops) with the same mask:
// self-attention and s queries over t > s earlier keys (query i at position t - s + i, the mask
// triu(t - s + 1)), grouped queries, strided views of one projection, dropout masks of [b, heads,
// s, t] and a block of columns of a wider one; recomputed probabilities change no bit.
TEST(CausalAttention, SeparateOperandsEqualCoreAttention) {
  struct Case {
    int64_t b, s, t, heads, groups, hd;
    double p;
    bool columns;  // the mask a block of t columns of [b, heads, s, 2 t + 3] rows, at column 3
  };
  const Case cases[] = {{2, 100, 100, 4, 2, 16, 0.0, false},
                        {2, 70, 70, 3, 3, 8, 0.3, false},
                        {1, 64, 200, 4, 1, 16, 0.2, false},
                        {2, 37, 130, 6, 2, 8, 0.25, true},
                        {3, 1, 65, 2, 2, 8, 0.1, true}};
  for (const Case& c : cases) {
    at::manual_seed(static_cast<uint64_t>(c.s * 1000 + c.t));
    const int64_t per_group = c.heads / c.groups;
    // One projection per position: per group its queries, its key, its value (strided views).
    const at::Tensor projected = at::randn({c.b, c.t, c.groups, (per_group + 2) * c.hd});
    const at::Tensor d_out = at::randn({c.b, c.s, c.heads * c.hd});
    at::Generator g = seeded_generator(11);
    const DropoutMask keep =
        c.columns ? dtk::layers::draw_keep_mask({c.b, c.heads, c.s, 2 * c.t + 3}, c.p, g).columns(2 * c.t + 3, 3, c.t)
                  : dtk::layers::draw_keep_mask({c.b, c.heads, c.s, c.t}, c.p, g);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
    const at::Tensor future = at::ones({c.s, c.t}, at::kBool).triu(c.t - c.s + 1).view({1, 1, c.s, c.t});
    const auto run_with = [&](int how) {  // 0 the kernel, 1 recomputing, 2 the reference
      at::Tensor x = projected.clone().requires_grad_(true);
      const std::vector<at::Tensor> parts = x.split_with_sizes({per_group * c.hd, c.hd, c.hd}, -1);
      // The queries of the last s positions, [b, s, heads, hd]; keys and values [b, t, groups, hd].
      const at::Tensor q = parts[0].narrow(1, c.t - c.s, c.s).reshape({c.b, c.s, c.heads, c.hd});
      EXPECT_TRUE(how == 2 || dtk::layers::causal_attention_applies(q, parts[1], parts[2], keep));
      const at::Tensor out = how == 2 ? dtk::layers::attention_ops(q, parts[1], parts[2], scale, future, keep)
                                      : dtk::layers::causal_attention(q, parts[1], parts[2], scale, keep, how == 1);
      out.backward(d_out);
      return Grads{out.detach(), x.grad()};
    };
    const Grads mine = run_with(0), recomputed = run_with(1), ref = run_with(2);
    const std::string what = "b " + std::to_string(c.b) + ", " + std::to_string(c.s) + " over " + std::to_string(c.t) +
                             ", " + std::to_string(c.heads) + "/" + std::to_string(c.groups) + ", dropout " +
                             std::to_string(c.p) + (c.columns ? ", mask columns" : "");
    EXPECT_TRUE(at::allclose(mine.out, ref.out, 1e-5, 1e-5))
        << what << ": max diff " << (mine.out - ref.out).abs().max().item<double>();
    EXPECT_TRUE(at::allclose(mine.d_qkv, ref.d_qkv, 1e-5, 1e-5))
        << what << ": gradient max diff " << (mine.d_qkv - ref.d_qkv).abs().max().item<double>();
    EXPECT_TRUE(at::equal(recomputed.out, mine.out)) << what;
    EXPECT_TRUE(at::equal(recomputed.d_qkv, mine.d_qkv)) << what;
  }
  // What it does not take: a bf16 operand, fewer keys than queries, a mask of another shape.
  const at::Tensor q = at::randn({1, 8, 2, 4}), kv = at::randn({1, 8, 1, 4});
  EXPECT_TRUE(dtk::layers::causal_attention_applies(q, kv, kv, {}));
  EXPECT_FALSE(dtk::layers::causal_attention_applies(q.to(at::kBFloat16), kv, kv, {}));
  EXPECT_FALSE(dtk::layers::causal_attention_applies(q, kv.narrow(1, 0, 7), kv.narrow(1, 0, 7), {}));
  at::Generator g = seeded_generator(3);
  EXPECT_FALSE(dtk::layers::causal_attention_applies(q, kv, kv, dtk::layers::draw_keep_mask({1, 2, 8, 9}, 0.1, g)));
}

namespace rows = dtk::layers::softmax_rows;

TEST(SoftmaxRows, ExpSumAndGradientMatchDoublePrecision) {
  for (const int64_t width : {50304, 1, 7, 8, 9, 1023, 1025}) {
    at::manual_seed(static_cast<uint64_t>(width));
    const int64_t n = 3;
    at::Tensor x = at::randn({n, width}) * 8;
    if (width > 1) {
      x[1][0] = -std::numeric_limits<float>::infinity();  // a -inf logit: probability 0
      x[2][width - 1] = -1e30f;                           // far below the range of exp
    }
    const at::Tensor xd = x.to(at::kDouble);
    std::vector<float> max(n), sum(n), target(n);
    std::vector<int64_t> col{0, width - 1, -1};
    at::Tensor y = x.clone();
    rows::row_max(y.data_ptr<float>(), n, width, width, max.data());
    rows::exp_sum(y.data_ptr<float>(), n, width, width, max.data(), col.data(), sum.data(), target.data(), true);
    const at::Tensor ref_max = std::get<0>(xd.max(1));
    // exp of the fp32 difference, as the kernel (and at::exp after sub_) takes it.
    const at::Tensor ref_exp = (x - ref_max.to(at::kFloat).unsqueeze(1)).to(at::kDouble).exp();
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(max[i], ref_max[i].item<double>()) << "width " << width << " row " << i;
      const double ref_sum = ref_exp[i].sum().item<double>();
      EXPECT_NEAR(sum[i], ref_sum, 4e-7 * ref_sum) << "width " << width << " row " << i;
      const float want_target = col[i] >= 0 ? x[i][col[i]].item<float>() - max[i] : 0.0f;
      EXPECT_EQ(target[i], want_target) << "width " << width << " row " << i;
    }
    // Every exp within 2 ulp (relative 2.4e-7) of the double result; exp(-inf) exactly 0.
    const at::Tensor rel = ((y.to(at::kDouble) - ref_exp).abs() / ref_exp.clamp_min(1e-30));
    EXPECT_LT(rel.masked_select(ref_exp > 1e-37).max().item<double>(), 2.4e-7) << "width " << width;
    if (width > 1) {
      EXPECT_EQ(y[1][0].item<float>(), 0.0f);
    }
    rows::normalize_minus_onehot(y.data_ptr<float>(), n, width, width, sum.data(), col.data());
    at::Tensor onehot = at::zeros({n, width}, at::kDouble);
    for (int64_t i = 0; i < n; ++i)
      if (col[i] >= 0) onehot[i][col[i]] = 1.0;
    const at::Tensor ref_grad = at::softmax(xd, 1) - onehot;
    EXPECT_TRUE(at::allclose(y.to(at::kDouble), ref_grad, 1e-6, 1e-7)) << "width " << width;
  }
}

TEST(SoftmaxRows, ANanLogitMakesTheRowsSumNan) {
  at::Tensor x = at::randn({2, 100});
  x[0][37] = std::numeric_limits<float>::quiet_NaN();
  float max[2], sum[2];
  rows::row_max(x.data_ptr<float>(), 2, 100, 100, max);
  rows::exp_sum(x.data_ptr<float>(), 2, 100, 100, max, nullptr, sum, nullptr, false);
  EXPECT_TRUE(std::isnan(sum[0]));
  EXPECT_FALSE(std::isnan(sum[1]));
}

}  // namespace
