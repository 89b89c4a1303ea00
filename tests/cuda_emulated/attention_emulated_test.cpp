// DTK's attention kernels (core/cuda/src/attention.cu) run on the CPU through the SIMT emulation
// (shim/simt_runtime.hpp, simt.hpp), against a reference in double: forward (output, log-sum-exp)
// and backward (dq, dk, dv), with and without dropout, bf16 and fp16, head_dim 64 and 128,
// sliding windows, grouped-query attention, strided operands, sequences that do and do not fill the 64-row tiles,
// and mask rows at odd offsets, through attention_forward and attention_backward (the host code's
// launch geometry and shared-memory opt-ins too). CI has no GPU: this is where the kernels'
// fragment layouts, tile walks, masks and copy ordering are proven; tests/cuda/gpu_kernels_test.cpp
// runs the same kernels on a GPU against LibTorch's ops.
#include "emulated_test.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "dropout_bits.cuh"
#include "dtk/cuda/attention.hpp"
#include "element.cuh"

namespace {

using AttentionEmulated = Emulated;

using dtk::cuda::AttentionArgs;
using dtk::cuda::AttentionGrads;
using dtk::cuda::AttentionLayout;
using dtk::cuda::DropoutBits;

struct Case {
  const char* name;
  int64_t batch, seq, heads, groups;
  double p;
  int64_t mask_offset;
  float input_scale;
  int64_t window = -1;  // the query at position p sees keys p - window to p; -1: every key up to p
  int64_t keys = 0;     // keys >= seq (0: seq): query i sits at position keys - seq + i
  int64_t pitch = 0;    // > 0: the mask is a block of columns of rows `pitch` apart (run_numel keys)
};

// An operand [batch, seq, heads, D] in a buffer with padded rows (its layout's strides).
template <class T>
struct Operand {
  AttentionLayout layout;
  std::vector<T> data;
  float at(int64_t b, int64_t i, int64_t h, int64_t d) const {
    return dtk::cuda::element::to_float(data[b * layout.batch + i * layout.seq + h * layout.head + d]);
  }
};

template <class T>
Operand<T> random_operand(const Case& c, int64_t rows, int64_t heads, int D, std::mt19937& rng) {
  Operand<T> o;
  o.layout.head = D;
  o.layout.seq = heads * D + 8;  // strided, as a slice of a projection
  o.layout.batch = rows * o.layout.seq;
  std::normal_distribution<float> normal(0.0f, c.input_scale);
  o.data.resize(c.batch * o.layout.batch);
  for (T& x : o.data) x = dtk::cuda::element::from_float<T>(normal(rng));
  return o;
}

// The reference's and the kernels' results, [batch, seq, heads, D] (dk, dv over groups).
struct Results {
  std::vector<double> out, lse, dq, dk, dv;
};

// Largest |a - b| relative to b's largest entry, or to `floor` where that is larger.
double relative_error(const std::vector<double>& a, const std::vector<double>& b, double floor = 1e-30) {
  double diff = 0, top = floor;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;  // an element the kernels did not write
    diff = std::max(diff, std::abs(a[i] - b[i]));
    top = std::max(top, std::abs(b[i]));
  }
  return diff / top;
}

template <class T, int D>
void check_case(const Case& c) {
  std::mt19937 rng(7);
  const int64_t B = c.batch, S = c.seq, H = c.heads, G = c.groups, per_group = H / G;
  const int64_t K = c.keys == 0 ? S : c.keys, pitch = c.pitch == 0 ? K : c.pitch;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const Operand<T> q = random_operand<T>(c, S, H, D, rng), k = random_operand<T>(c, K, G, D, rng),
                   v = random_operand<T>(c, K, G, D, rng);
  Operand<T> dout;
  dout.layout = {S * H * D, H * D, D};
  {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    dout.data.resize(B * S * H * D);
    for (T& x : dout.data) x = dtk::cuda::element::from_float<T>(normal(rng));
  }
  DropoutBits bits;
  bits.seed = 0x1234567ULL;
  bits.threshold = static_cast<uint32_t>(std::llround(c.p * 4294967296.0));
  bits.scale = static_cast<float>(1.0 / (1.0 - c.p));
  bits.offset = c.mask_offset;
  if (c.pitch > 0) bits.row_numel = pitch, bits.run_numel = K;
  const auto z = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    if (c.p == 0) return 1.0;
    return dtk::cuda::dropout_bits::kept_at(bits, bits.offset + ((b * H + h) * S + i) * pitch + j) ? double{bits.scale}
                                                                                                   : 0.0;
  };

  // The reference, in double from the rounded inputs.
  Results ref;
  ref.out.assign(B * S * H * D, 0.0);
  ref.lse.assign(B * H * S, 0.0);
  ref.dq.assign(B * S * H * D, 0.0);
  ref.dk.assign(B * K * G * D, 0.0);
  ref.dv.assign(B * K * G * D, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / per_group;
      std::vector<double> prob(S * K, 0.0);
      // Query i's keys: from its window's first (0 without a window) to its position K - S + i.
      const auto last = [&](int64_t i) { return K - S + i; };
      const auto first = [&](int64_t i) { return c.window < 0 ? 0 : std::max<int64_t>(0, last(i) - c.window); };
      for (int64_t i = 0; i < S; ++i) {
        double top = -INFINITY;
        for (int64_t j = first(i); j <= last(i); ++j) {
          double s = 0;
          for (int d = 0; d < D; ++d) s += double{q.at(b, i, h, d)} * k.at(b, j, g, d);
          prob[i * K + j] = s * scale;
          top = std::max(top, prob[i * K + j]);
        }
        double sum = 0;
        for (int64_t j = first(i); j <= last(i); ++j) sum += std::exp(prob[i * K + j] - top);
        for (int64_t j = first(i); j <= last(i); ++j) prob[i * K + j] = std::exp(prob[i * K + j] - top) / sum;
        ref.lse[(b * H + h) * S + i] = top + std::log(sum);
        for (int d = 0; d < D; ++d) {
          double o = 0;
          for (int64_t j = first(i); j <= last(i); ++j) o += prob[i * K + j] * z(b, h, i, j) * v.at(b, j, g, d);
          ref.out[((b * S + i) * H + h) * D + d] = o;
        }
      }
      for (int64_t i = 0; i < S; ++i) {
        double delta = 0;
        for (int d = 0; d < D; ++d) delta += double{dout.at(b, i, h, d)} * ref.out[((b * S + i) * H + h) * D + d];
        for (int64_t j = first(i); j <= last(i); ++j) {
          double dp = 0;
          for (int d = 0; d < D; ++d) dp += double{dout.at(b, i, h, d)} * v.at(b, j, g, d);
          const double pz = prob[i * K + j] * z(b, h, i, j);
          const double ds = prob[i * K + j] * (z(b, h, i, j) * dp - delta) * scale;
          for (int d = 0; d < D; ++d) {
            ref.dq[((b * S + i) * H + h) * D + d] += ds * k.at(b, j, g, d);
            ref.dk[((b * K + j) * G + g) * D + d] += ds * q.at(b, i, h, d);
            ref.dv[((b * K + j) * G + g) * D + d] += pz * dout.at(b, i, h, d);
          }
        }
      }
    }

  // The kernels, through the public functions.
  AttentionArgs a;
  a.q = q.data.data();
  a.k = k.data.data();
  a.v = v.data.data();
  a.q_layout = q.layout;
  a.k_layout = k.layout;
  a.v_layout = v.layout;
  a.type = std::is_same_v<T, __half> ? dtk::cuda::ElementType::kFloat16 : dtk::cuda::ElementType::kBFloat16;
  a.shape = {B, S, H, G, D, c.keys};
  a.scale = scale;
  a.dropout = c.p > 0 ? &bits : nullptr;
  a.window = c.window;
  // NaN where the kernels write: every element they leave out shows (a key no query sees gets 0).
  const T unset = dtk::cuda::element::from_float<T>(NAN);
  std::vector<T> out(B * S * H * D, unset), dq(B * S * H * D, unset), dk(B * K * G * D, unset),
      dv(B * K * G * D, unset);
  std::vector<float> lse(B * H * S, NAN), delta(B * H * S);
  dtk::cuda::attention_forward(a, out.data(), lse.data(), nullptr);
  AttentionGrads grads;
  grads.dq = dq.data();
  grads.dk = dk.data();
  grads.dv = dv.data();
  grads.dq_layout = dout.layout;
  grads.dk_layout = grads.dv_layout = {K * G * D, G * D, D};
  grads.delta = delta.data();
  dtk::cuda::attention_backward(a, dout.data.data(), out.data(), lse.data(), grads, nullptr);

  const auto widen = [](const auto& xs) {
    std::vector<double> r;
    for (const auto& x : xs) r.push_back(dtk::cuda::element::to_float(x));
    return r;
  };
  const bool half = std::is_same_v<T, __half>;
  const double tol = half ? 5e-3 : 2e-2;
  const std::string what = std::string(c.name) + (half ? ", fp16" : ", bf16") + ", head_dim " + std::to_string(D);
  EXPECT_LT(relative_error(widen(out), ref.out), tol) << what << " (output)";
  double lse_error = 0;
  for (size_t i = 0; i < lse.size(); ++i)  // (NaN: a row the forward did not write)
    lse_error = std::isnan(lse[i]) ? INFINITY : std::max(lse_error, std::abs(lse[i] - ref.lse[i]));
  EXPECT_LT(lse_error, 1e-3 * c.input_scale * c.input_scale * D) << what << " (log-sum-exp)";
  // Each gradient relative to the largest entry of the three (as the GPU test does): with one
  // position dq and dk are exactly 0 in the reference and rounding in the kernels.
  double largest = 0;
  for (const std::vector<double>* grad : {&ref.dq, &ref.dk, &ref.dv})
    for (double x : *grad) largest = std::max(largest, std::abs(x));
  EXPECT_LT(relative_error(widen(dq), ref.dq, 0.1 * largest), 2 * tol) << what << " (dq)";
  EXPECT_LT(relative_error(widen(dk), ref.dk, 0.1 * largest), 2 * tol) << what << " (dk)";
  EXPECT_LT(relative_error(widen(dv), ref.dv, 0.1 * largest), 2 * tol) << what << " (dv)";
}

TEST_F(AttentionEmulated, KernelsEqualTheReference) {
  // Each case small enough that the emulation (a thread per CUDA thread) runs in seconds.
  check_case<__nv_bfloat16, 64>({"two tiles, no dropout, peaked scores", 1, 100, 1, 1, 0.0, 0, 4.0f});
  check_case<__nv_bfloat16, 64>({"three tiles, two sequences, p 0.2", 2, 130, 1, 1, 0.2, 0, 1.0f});
  check_case<__half, 64>({"grouped 4/2, p 0.3, odd mask offsets", 1, 65, 4, 2, 0.3, 3 * 65 * 65 + 1, 1.0f});
  check_case<__nv_bfloat16, 128>({"head_dim 128, grouped 2/1, p 0.1", 1, 70, 2, 1, 0.1, 0, 1.0f});
  check_case<__half, 64>({"one position", 1, 1, 2, 2, 0.1, 0, 1.0f});
  // A multi-tile walk again with each copy landing as it is issued (the fixture resets it).
  dtk::cuda::warp::copies_land_at_once = true;
  check_case<__nv_bfloat16, 64>({"three tiles, copies landing at once", 1, 130, 2, 1, 0.2, 0, 1.0f});
}

// Sliding windows (Megatron's --window-size W,0): walks that start past the first key tile (the
// forward's and dQ's, with the first tile's buffer other than 0) and stop before the last query
// tile (the key pass), tiles where some rows see none of the keys (their max still -inf), a tile
// wholly inside a window after a walk's first (window 200), and windows of 0 (each query only
// itself), within one tile and wider than the sequence (the kernels take it as none).
TEST_F(AttentionEmulated, SlidingWindowsEqualTheReference) {
  check_case<__nv_bfloat16, 64>({"window 10, four tiles, p 0.2", 1, 200, 1, 1, 0.2, 0, 1.0f, 10});
  check_case<__half, 64>({"window 70, grouped 2/1, odd mask offsets", 1, 200, 2, 1, 0.3, 7, 1.0f, 70});
  check_case<__nv_bfloat16, 128>({"window 0, head_dim 128, no dropout", 1, 140, 1, 1, 0.0, 0, 2.0f, 0});
  check_case<__half, 64>({"window 64, peaked scores", 1, 193, 1, 1, 0.1, 0, 4.0f, 64});
  check_case<__nv_bfloat16, 64>({"window 500 over 130 positions", 1, 130, 1, 1, 0.2, 0, 1.0f, 500});
  check_case<__half, 64>({"window 200 over 330 positions", 1, 330, 1, 1, 0.1, 0, 1.0f, 200});
}

// Fewer queries than keys (a context-parallel chunk of queries over the keys from the sequence's
// start to the chunk's end, distributed.cp_comm_type=all_gather): query i at position keys - seq
// + i, the diagonal bottom-right aligned. Offsets on and off the tiles' edges, the mask a block of
// columns of a wider one (ContextParallel::gathered_probs_shape), a window that leaves a key tile
// no query sees (the key pass writes zeros), grouped queries, one query.
TEST_F(AttentionEmulated, FewerQueriesThanKeysEqualTheReference) {
  check_case<__nv_bfloat16, 64>({"64 queries over 192 keys, p 0.2", 1, 64, 2, 1, 0.2, 0, 1.0f, -1, 192});
  check_case<__half, 64>(
      {"50 queries over 150 keys, grouped 4/2, p 0.3, mask columns", 1, 50, 4, 2, 0.3, 203, 1.0f, -1, 150, 400});
  check_case<__nv_bfloat16, 64>(
      {"70 queries over 200 keys, window 40, two sequences, p 0.1", 2, 70, 1, 1, 0.1, 0, 1.0f, 40, 200});
  // (Peaked scores in fp16: with one query row dq and dk are differences of near-equal terms, which
  // bf16's rounding of the output, whose row sum with dO the gradients subtract, leaves at ~10%.)
  check_case<__half, 128>({"one query over 65 keys, head_dim 128, peaked", 1, 1, 2, 1, 0.0, 0, 4.0f, -1, 65});
  check_case<__nv_bfloat16, 128>({"two queries over 66 keys, head_dim 128", 1, 2, 2, 1, 0.1, 0, 1.0f, -1, 66});
  check_case<__half, 64>(
      {"100 queries over 130 keys, mask columns at an odd offset", 1, 100, 1, 1, 0.2, 131, 1.0f, -1, 130, 260});
}

// The least shared memory a block (the device's opt-in limit) for which attention_supported takes
// head_dim `d`, found by bisection on the emulated device's limit.
int64_t least_shared_supported(int64_t d) {
  int lo = 48 * 1024, hi = static_cast<int>(simt::kMostShared);  // not taken at lo, taken at hi
  simt::device.shared_optin = lo;
  EXPECT_FALSE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kBFloat16, d, 0)) << "head_dim " << d;
  simt::device.shared_optin = hi;
  EXPECT_TRUE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kBFloat16, d, 0)) << "head_dim " << d;
  while (hi - lo > 1) {
    simt::device.shared_optin = lo + (hi - lo) / 2;
    (dtk::cuda::attention_supported(dtk::cuda::ElementType::kBFloat16, d, 0) ? hi : lo) = simt::device.shared_optin;
  }
  return hi;
}

// attention_supported against the launches on GPUs with less shared memory a block than an H100:
// at the least limit it takes, each head size's forward and backward launch and match the
// reference (a launch past the limit is refused: the test fails); one byte less, it refuses the
// head size. An A100 (163 KB) and an RTX 4090 (99 KB; 8.9) as the layers would meet them, and a
// V100 (7.0: no bf16 mma.sync, ldmatrix or cp.async) refused at any size.
TEST_F(AttentionEmulated, HostCodeFitsEachGpusSharedMemory) {
  for (const int64_t d : {64, 128}) {
    const int least = static_cast<int>(least_shared_supported(d));
    simt::device = {8, least};
    if (d == 64)
      check_case<__half, 64>({"at head_dim 64's least shared memory", 1, 70, 2, 2, 0.1, 0, 1.0f});
    else
      check_case<__nv_bfloat16, 128>({"at head_dim 128's least shared memory", 1, 70, 2, 1, 0.1, 0, 1.0f});
    simt::device = {8, least - 1};
    EXPECT_FALSE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kFloat16, d, 0)) << "head_dim " << d;
  }
  simt::device = {8, 166912};  // an A100
  EXPECT_TRUE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kBFloat16, 128, 0));
  simt::device = {8, 101376};  // an RTX 4090
  EXPECT_TRUE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kBFloat16, 64, 0));
  EXPECT_FALSE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kBFloat16, 128, 0));
  simt::device = {7, 98304};  // a V100
  for (const int64_t d : {64, 128})
    for (const auto type : {dtk::cuda::ElementType::kBFloat16, dtk::cuda::ElementType::kFloat16})
      EXPECT_FALSE(dtk::cuda::attention_supported(type, d, 0)) << "a V100, head_dim " << d;
  simt::device = {};
  EXPECT_FALSE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kFloat32, 64, 0)) << "fp32";
  EXPECT_FALSE(dtk::cuda::attention_supported(dtk::cuda::ElementType::kBFloat16, 96, 0)) << "head_dim 96";
}

}  // namespace
