// The SDK's dropout (sdk/layers/dropout.cpp, dtk::layers), used by the gpt and llama plugins: masks that
// are a function of (seed, element), drawn one seed per mask from the model's generator.
//   * the keep fraction is 1 - p within 5 standard deviations, elements and masks uncorrelated;
//   * a slice of rows is the same mask (Domino's chunks), backward regenerates the forward mask;
//   * a cloned generator draws the same mask (recomputation), the next draw another one;
//   * the tensor-operation version (keep_bits_on, apply_dropout_ops: the reference of DTK's GPU
//     kernel) makes the host's bits and values exactly;
//   * a sequence shard of a mask (sequence parallelism) is the whole mask's rows, both ways.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <dtk/layers/dropout.hpp>

namespace {

using dtk::layers::DropoutMask;
using dtk::layers::seeded_generator;

TEST(Dropout, KeepsOneMinusPAndDrawsIndependentBits) {
  for (double p : {0.1, 0.5, 0.9}) {
    at::Generator g = seeded_generator(7);
    const int64_t n = 1 << 22;
    const DropoutMask a = dtk::layers::draw_keep_mask({n}, p, g), b = dtk::layers::draw_keep_mask({n}, p, g);
    const at::Tensor ka = dtk::layers::keep_bits(a, n).to(at::kDouble), kb = dtk::layers::keep_bits(b, n).to(at::kDouble);
    const double sd = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(ka.mean().item<double>(), 1 - p, 5 * sd) << "p " << p;
    // Neighbours (the two halves of one hash) and two consecutive masks are independent:
    // P(both kept) = (1 - p)^2.
    const double neighbours = (ka.narrow(0, 0, n - 1) * ka.narrow(0, 1, n - 1)).mean().item<double>();
    EXPECT_NEAR(neighbours, (1 - p) * (1 - p), 6 * sd) << "p " << p;
    EXPECT_NEAR((ka * kb).mean().item<double>(), (1 - p) * (1 - p), 6 * sd) << "p " << p;
  }
}

TEST(Dropout, RowsAreSlicesAndBackwardUsesTheForwardMask) {
  at::Generator g = seeded_generator(3);
  at::Tensor x = at::randn({6, 5, 7}).requires_grad_(true);
  const DropoutMask m = dtk::layers::draw_keep_mask(x.sizes(), 0.3, g);
  at::Tensor y = dtk::layers::apply_dropout(x, m);
  const at::Tensor keep = dtk::layers::keep_bits(m, x.numel()).view(x.sizes());
  EXPECT_TRUE(at::allclose(y, x * keep / 0.7, 1e-6, 1e-6));
  // Rows 2..4 of the mask applied to rows 2..4 of x: the same values (Domino's chunks).
  EXPECT_TRUE(at::equal(dtk::layers::apply_dropout(x.detach().narrow(0, 2, 3), m.rows(2, 3)), y.detach().narrow(0, 2, 3)));
  const at::Tensor grad = at::randn(x.sizes());
  y.backward(grad);
  EXPECT_TRUE(at::allclose(x.grad(), grad * keep / 0.7, 1e-6, 1e-6));
  // bf16: the same mask, the value rounded once.
  const at::Tensor xb = x.detach().to(at::kBFloat16);
  EXPECT_TRUE(at::equal(dtk::layers::apply_dropout(xb, m), (xb.to(at::kFloat) * keep * static_cast<float>(1 / 0.7)).to(at::kBFloat16)));
}

TEST(Dropout, AClonedGeneratorDrawsTheSameMask) {
  at::Generator g = seeded_generator(11);
  at::Generator copy = g.clone();
  const DropoutMask a = dtk::layers::draw_keep_mask({1000}, 0.2, g);
  const DropoutMask b = dtk::layers::draw_keep_mask({1000}, 0.2, copy);
  EXPECT_TRUE(at::equal(dtk::layers::keep_bits(a, 1000), dtk::layers::keep_bits(b, 1000)));
  const DropoutMask c = dtk::layers::draw_keep_mask({1000}, 0.2, g);
  EXPECT_FALSE(at::equal(dtk::layers::keep_bits(a, 1000), dtk::layers::keep_bits(c, 1000)));
  EXPECT_FALSE(dtk::layers::draw_keep_mask({1000}, 0.0, g).defined());
}

// What a GPU run applies is made with tensor operations (int64 arithmetic standing in for
// uint64's): run here on the CPU, it must give the host loop's bits exactly, for any seed
// (including ones whose sums and products overflow), odd and even offsets (a mask starting in the
// high half of a hash), sizes around the hash pairs, and past the 2^24-element pieces it works in.
TEST(Dropout, TensorOperationBitsEqualTheHostLoop) {
  at::Generator g = seeded_generator(5);
  std::vector<uint64_t> seeds = {0, 1, 0x9E3779B97F4A7C15ULL, ~uint64_t{0}};
  for (int i = 0; i < 3; ++i) seeds.push_back(dtk::layers::draw_keep_mask({8}, 0.5, g).seed);
  for (uint64_t seed : seeds)
    for (double p : {0.1, 0.5, 0.9})
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{12345}, (int64_t{1} << 40) + 3})
        for (int64_t n : {1, 2, 3, 1023, 1024, 4099}) {
          DropoutMask m;
          m.seed = seed, m.p = p, m.offset = offset, m.row_numel = n;
          ASSERT_TRUE(at::equal(dtk::layers::keep_bits_on(m, n, at::kCPU), dtk::layers::keep_bits(m, n)))
              << "seed " << seed << " p " << p << " offset " << offset << " numel " << n;
        }
  DropoutMask big;
  big.seed = seeds.back(), big.p = 0.1, big.offset = 7;
  const int64_t n = (int64_t{1} << 24) + 5;
  EXPECT_TRUE(at::equal(dtk::layers::keep_bits_on(big, n, at::kCPU), dtk::layers::keep_bits(big, n)));
  // And applied (apply_dropout_ops, what DTK's GPU kernel is tested against on a GPU), the values
  // are the host's, value for value (a dropped negative element is -0 there, 0 here). In fp32
  // only: LibTorch 1.13's CPU multiplication by a scalar rounds the scale to bf16 for a bf16
  // tensor (a GPU's computes in fp32, as the host loop does).
  const at::Tensor x = at::randn({3, 1001});
  const DropoutMask m = dtk::layers::draw_keep_mask({3, 1001}, 0.3, g).rows(1, 2);
  const at::Tensor slice = x.narrow(0, 1, 2);
  EXPECT_TRUE(dtk::layers::apply_dropout_ops(slice, m).eq(dtk::layers::apply_dropout(slice, m)).all().item<bool>());
}

}  // namespace

namespace {

// Sequence parallelism's shard of a mask drawn for [b, s, h] (DropoutMask::sequence_rows): the
// bits of rows [start, start + length) of dim 1, on the host and with tensor operations (a GPU's
// path), and a Domino chunk of the shard; h odd, so runs start in either half of a hash.
TEST(Dropout, ASequenceShardIsTheWholeMasksRows) {
  at::Generator g = seeded_generator(13);
  const int64_t b = 3, s = 8, h = 5;
  const DropoutMask whole = dtk::layers::draw_keep_mask({b, s, h}, 0.3, g);
  const at::Tensor bits = dtk::layers::keep_bits(whole, b * s * h).view({b, s, h});
  for (const auto& [start, length] : {std::pair<int64_t, int64_t>{0, 4}, {4, 4}, {3, 2}}) {
    const DropoutMask shard = whole.sequence_rows(s, start, length);
    const at::Tensor want = bits.narrow(1, start, length).reshape({-1});
    EXPECT_TRUE(at::equal(dtk::layers::keep_bits(shard, b * length * h), want)) << start << "+" << length;
    EXPECT_TRUE(at::equal(dtk::layers::keep_bits_on(shard, b * length * h, at::kCPU), want)) << start << "+" << length;
    EXPECT_TRUE(at::equal(dtk::layers::keep_bits(shard.rows(1, 2), 2 * length * h),
                          bits.narrow(0, 1, 2).narrow(1, start, length).reshape({-1})));
    const at::Tensor x = at::randn({b, s, h});
    EXPECT_TRUE(at::equal(dtk::layers::apply_dropout(x.narrow(1, start, length), shard),
                          dtk::layers::apply_dropout(x, whole).narrow(1, start, length)));
  }
}

}  // namespace

namespace {

// Context parallelism's all_gather (DropoutMask::columns): a block of columns of a mask drawn for
// [b, heads, rows, width], of Domino's rows of it too, is the whole mask's bits there, on the host
// and with tensor operations; the dropout it applies is the whole one's slice. Odd widths, so runs
// start in either half of a hash.
TEST(Dropout, ColumnsAreTheWholeMasksBlock) {
  at::Generator g = seeded_generator(17);
  const int64_t b = 3, heads = 2, rows = 3, width = 13;
  const DropoutMask whole = dtk::layers::draw_keep_mask({b, heads, rows, width}, 0.3, g);
  const at::Tensor bits = dtk::layers::keep_bits(whole, b * heads * rows * width).view({b, heads, rows, width});
  for (const auto& [start, length] : {std::pair<int64_t, int64_t>{0, 5}, {6, 7}, {3, 1}}) {
    const DropoutMask block = whole.columns(width, start, length);
    const int64_t n = b * heads * rows * length;
    const at::Tensor want = bits.narrow(3, start, length).reshape({-1});
    EXPECT_TRUE(at::equal(dtk::layers::keep_bits(block, n), want)) << start << "+" << length;
    EXPECT_TRUE(at::equal(dtk::layers::keep_bits_on(block, n, at::kCPU), want)) << start << "+" << length;
    EXPECT_TRUE(at::equal(dtk::layers::keep_bits(whole.rows(1, 2).columns(width, start, length), n / b * 2),
                          bits.narrow(0, 1, 2).narrow(3, start, length).reshape({-1})));
    const at::Tensor x = at::randn({b, heads, rows, width});
    EXPECT_TRUE(at::equal(dtk::layers::apply_dropout(x.narrow(3, start, length).contiguous(), block),
                          dtk::layers::apply_dropout(x, whole).narrow(3, start, length)));
  }
  // Nothing slices a block; a block must lie inside the rows.
  EXPECT_THROW(whole.columns(width, 0, 5).columns(5, 0, 2), dtk::Error);
  EXPECT_THROW(whole.columns(width, 0, 5).rows(1, 1), dtk::Error);
  EXPECT_THROW(whole.columns(width, 0, 5).sequence_rows(rows, 0, 1), dtk::Error);
  EXPECT_THROW(whole.columns(width, 10, 5), dtk::Error);
  EXPECT_THROW(whole.columns(7, 0, 5), dtk::Error);  // 2 x 3 x 13 elements per row of dim 0: not runs of 7
}

}  // namespace
