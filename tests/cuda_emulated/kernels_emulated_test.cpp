// DTK's elementwise and row kernels (core/cuda/src: bias + GELU, SwiGLU, rotary, RMSNorm, add +
// LayerNorm, the cross entropy; dropout and the jitter's noise against the hash written out here)
// run on the CPU through the SIMT emulation, each public function
// called twice on the same values: once with every pointer on a 16-byte boundary (the packed
// kernels: 16-byte loads of eight elements, several loads in flight) and once off it by one
// element (the scalar kernels, which a GPU run has held equal to LibTorch's ops). The packed
// kernels must give the scalar ones' bits where their arithmetic is the same per element, and
// agree within rounding where a row's sums are added in another order (norms, cross entropy).
#include "emulated_test.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dtk/cuda/bias_gelu.hpp"
#include "dtk/cuda/cross_entropy.hpp"
#include "dtk/cuda/dropout.hpp"
#include "dtk/cuda/layer_norm.hpp"
#include "dtk/cuda/rms_norm.hpp"
#include "dtk/cuda/rotary.hpp"
#include "dtk/cuda/swiglu.hpp"
#include "element.cuh"

namespace {

using KernelsEmulated = Emulated;

using dtk::cuda::ElementType;

// n elements of T on a 16-byte boundary, or one element past it.
template <class T>
class Buffer {
 public:
  Buffer(size_t n, bool aligned) : storage_((n * sizeof(T) + 32) / 16 + 1), n_(n) {
    data_ = reinterpret_cast<T*>(storage_.data()) + (aligned ? 0 : 1);
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  std::vector<T> values() const { return std::vector<T>(data_, data_ + n_); }

 private:
  std::vector<uint4> storage_;
  T* data_;
  size_t n_;
};

// The same random values in an aligned and an unaligned buffer.
template <class T>
struct Twin {
  Twin(size_t n, std::mt19937& rng, float scale = 1.0f) : aligned(n, true), unaligned(n, false) {
    std::normal_distribution<float> normal(0.0f, scale);
    for (size_t i = 0; i < n; ++i) aligned[i] = unaligned[i] = dtk::cuda::element::from_float<T>(normal(rng));
  }
  const T* get(bool packed) const { return packed ? aligned.data() : unaligned.data(); }
  Buffer<T> aligned, unaligned;
};

template <class T>
std::vector<uint16_t> bits(const Buffer<T>& b) {
  std::vector<uint16_t> r(b.size());
  std::memcpy(r.data(), b.data(), b.size() * sizeof(T));
  return r;
}

template <class T>
constexpr ElementType type_of() {
  return std::is_same_v<T, __nv_bfloat16> ? ElementType::kBFloat16 : ElementType::kFloat16;
}

template <class T>
const char* name_of() {
  return std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp16";
}

// Largest |a - b| over b's largest |b|.
template <class A, class B>
double relative_error(const A& a, const B& b) {
  double diff = 0, top = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    const double x = dtk::cuda::element::to_float(a[i]), y = dtk::cuda::element::to_float(b[i]);
    diff = std::max(diff, std::abs(x - y));
    top = std::max(top, std::abs(y));
  }
  return diff / top;
}

// run(true) and run(false); and a failure unless `packed_calls` of the aligned run's launches were
// of other kernels than the unaligned run's, position by position (the host code's packed variants,
// which the count names: it does not know which kernel is which).
template <class Run>
auto run_both(const Run& run, size_t packed_calls, const std::string& what) {
  simt::launched.clear();
  auto packed = run(true);
  const std::vector<const void*> aligned = std::exchange(simt::launched, {});
  auto scalar = run(false);
  size_t other = 0;
  for (size_t i = 0; i < std::min(aligned.size(), simt::launched.size()); ++i) other += aligned[i] != simt::launched[i];
  EXPECT_EQ(aligned.size(), simt::launched.size()) << what << ": launches";
  EXPECT_EQ(other, packed_calls) << what << ": launches of a packed kernel";
  simt::launched.clear();
  return std::make_pair(std::move(packed), std::move(scalar));
}

template <class T>
void check_bias_gelu(int64_t rows, int64_t cols) {
  std::mt19937 rng(3);
  const Twin<T> x(rows * cols, rng, 2.0f), b(cols, rng), dy(rows * cols, rng);
  for (const bool tanh : {false, true}) {
    const auto run = [&](bool packed) {
      Buffer<T> y(rows * cols, packed), dx(rows * cols, packed);
      std::vector<float> partial(dtk::cuda::bias_gelu_backward_groups(rows) * cols), dbias(cols);
      dtk::cuda::bias_gelu_forward(x.get(packed), b.get(packed), type_of<T>(), rows, cols, tanh, y.data(), nullptr);
      dtk::cuda::bias_gelu_backward(dy.get(packed), x.get(packed), b.get(packed), type_of<T>(), rows, cols, tanh,
                                    dx.data(), partial.data(), dbias.data(), nullptr);
      return std::make_tuple(bits(y), bits(dx), dbias);
    };
    const std::string what = std::string("bias_gelu ") + name_of<T>() + (tanh ? " tanh" : "") + ", " +
                             std::to_string(rows) + " x " + std::to_string(cols);
    const auto [packed, scalar] = run_both(run, 2, what);
    EXPECT_EQ(std::get<0>(packed), std::get<0>(scalar)) << what << " (y)";
    EXPECT_EQ(std::get<1>(packed), std::get<1>(scalar)) << what << " (dx)";
    EXPECT_EQ(std::get<2>(packed), std::get<2>(scalar)) << what << " (the bias's gradient)";
  }
}

// The counter-based hash as dtk/layers/dropout.hpp defines it, written out: element `index` of a
// draw is the low (even) or high (odd) 32 bits of splitmix64's output function of (seed, index / 2).
uint32_t hashed_uniform(uint64_t seed, int64_t index) {
  uint64_t z = seed + (static_cast<uint64_t>(index >> 1) + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<uint32_t>((index & 1) ? z >> 32 : z);
}

// Dropout's kernel and the router jitter's noise kernel (src/dropout.cu) against the hash above:
// a contiguous draw at an odd offset, a strided one (a sequence shard's runs), and the seed read
// from device memory (a recorded step's slot). The noise is low + u (high - low) / 2^32 in fp64,
// rounded once to fp32; dropout keeps x * scale where u >= threshold.
TEST_F(KernelsEmulated, DropoutAndNoiseKernelsAreTheHostsHash) {
  const uint64_t seed = 0x5DEECE66DULL * 977;
  dtk::cuda::DropoutBits contiguous;
  contiguous.seed = seed, contiguous.offset = 3;
  dtk::cuda::DropoutBits strided = contiguous;
  strided.offset = 5, strided.row_numel = 19, strided.run_numel = 7;
  dtk::cuda::DropoutBits slotted = contiguous;
  slotted.seed = 0, slotted.seed_at = &seed;
  const int64_t n = 1001;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  for (const auto& [name, bits] :
       {std::pair{"contiguous", contiguous}, std::pair{"strided", strided}, std::pair{"seed slot", slotted}}) {
    const auto index = [&, b = bits](int64_t i) {
      return b.run_numel > 0 ? b.offset + i / b.run_numel * b.row_numel + i % b.run_numel : b.offset + i;
    };
    std::vector<float> noise(n), kept(n);
    dtk::cuda::uniform_noise(n, bits, 0.9, 1.1, noise.data(), nullptr);
    dtk::cuda::DropoutBits mask = bits;
    mask.threshold = 0x4CCCCCCDu, mask.scale = 1.0f / 0.7f;  // p 0.3
    dtk::cuda::dropout_apply(x.data(), ElementType::kFloat32, n, mask, kept.data(), nullptr);
    int64_t dropped = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = hashed_uniform(seed, index(i));
      ASSERT_EQ(noise[i], static_cast<float>(static_cast<double>(u) * ((1.1 - 0.9) / 4294967296.0) + 0.9))
          << name << ", element " << i;
      ASSERT_EQ(kept[i], u >= mask.threshold ? x[i] * mask.scale : 0.0f) << name << ", element " << i;
      dropped += u < mask.threshold;
    }
    EXPECT_NEAR(static_cast<double>(dropped) / n, 0.3, 0.05) << name;
  }
}

TEST_F(KernelsEmulated, PackedBiasGeluEqualsTheScalarKernelBitForBit) {
  check_bias_gelu<__nv_bfloat16>(9, 768);  // two batches of 4 rows and one row left
  check_bias_gelu<__half>(6, 1024);
}

template <class T>
void check_swiglu(int64_t n) {
  std::mt19937 rng(5);
  const Twin<T> gate(n, rng, 2.0f), up(n, rng), dy(n, rng);
  const auto run = [&](bool packed) {
    Buffer<T> y(n, packed), dgate(n, packed), dup(n, packed);
    dtk::cuda::swiglu_forward(gate.get(packed), up.get(packed), type_of<T>(), n, y.data(), nullptr);
    dtk::cuda::swiglu_backward(dy.get(packed), gate.get(packed), up.get(packed), type_of<T>(), n, dgate.data(),
                               dup.data(), nullptr);
    return std::vector<std::vector<uint16_t>>{bits(y), bits(dgate), bits(dup)};
  };
  const std::string what = std::string("swiglu ") + name_of<T>() + ", " + std::to_string(n) + " elements";
  const auto [packed, scalar] = run_both(run, 2, what);
  EXPECT_EQ(packed, scalar) << what;
}

TEST_F(KernelsEmulated, PackedSwigluEqualsTheScalarKernelBitForBit) {
  check_swiglu<__nv_bfloat16>(4 * 2048);
  check_swiglu<__half>(300 * 8);
}

// Four pairs of channels a thread against one, all channels rotating and a quarter passing
// through; x a strided slice of a projection.
template <class T>
void check_rotary(int64_t dim) {
  std::mt19937 rng(7);
  const int64_t b = 2, s = 33, heads = 3, hd = 64, row = heads * 2 * hd;
  const Twin<T> projected(b * s * row, rng), dy(b * s * heads * hd, rng);
  std::vector<float> cos(b * s * dim), sin(b * s * dim);
  std::uniform_real_distribution<float> angle(-3.0f, 3.0f);
  for (size_t i = 0; i < cos.size(); ++i) {
    const float a = angle(rng);
    cos[i] = std::cos(a);
    sin[i] = std::sin(a);
  }
  const dtk::cuda::RotaryShape shape{b, s, heads, hd, dim, s * row, row, 2 * hd};
  const auto run = [&](bool packed) {
    Buffer<T> out(b * s * heads * hd, packed), dx(b * s * heads * hd, packed);
    dtk::cuda::rotary_forward(projected.get(packed), type_of<T>(), shape, cos.data(), sin.data(), out.data(), nullptr);
    const dtk::cuda::RotaryShape contiguous{b, s, heads, hd, dim, s * heads * hd, heads * hd, hd};
    dtk::cuda::rotary_backward(dy.get(packed), type_of<T>(), contiguous, cos.data(), sin.data(), dx.data(), nullptr);
    return std::vector<std::vector<uint16_t>>{bits(out), bits(dx)};
  };
  const std::string what = std::string("rotary ") + name_of<T>() + ", dim " + std::to_string(dim);
  const auto [packed, scalar] = run_both(run, 2, what);
  EXPECT_EQ(packed, scalar) << what;
}

TEST_F(KernelsEmulated, RotaryQuadsEqualThePairKernelBitForBit) {
  check_rotary<__nv_bfloat16>(64);
  check_rotary<__half>(48);
}

// add + RMSNorm forward and backward (the residual's sum kept, both gradients in), and RMSNorm
// alone, at widths of 1, 2, 3 and 4 packs a lane.
template <class T>
void check_rms_norm(int64_t rows, int64_t hidden) {
  std::mt19937 rng(11);
  const Twin<T> x(rows * hidden, rng), res(rows * hidden, rng), w(hidden, rng), dy(rows * hidden, rng),
      dsum(rows * hidden, rng);
  const auto run = [&](bool packed) {
    Buffer<T> sum(rows * hidden, packed), y(rows * hidden, packed), dx(rows * hidden, packed),
        y_alone(rows * hidden, packed), dx_alone(rows * hidden, packed);
    std::vector<float> rstd(rows), partial(dtk::cuda::rms_norm_backward_blocks(rows, hidden) * hidden), dweight(hidden),
        dweight_alone(hidden);
    dtk::cuda::add_rms_norm_forward(x.get(packed), res.get(packed), w.get(packed), type_of<T>(), rows, hidden, 1e-5,
                                    sum.data(), y.data(), rstd.data(), nullptr);
    dtk::cuda::add_rms_norm_backward(dy.get(packed), dsum.get(packed), sum.data(), w.get(packed), type_of<T>(), rows,
                                     hidden, rstd.data(), dx.data(), partial.data(), dweight.data(), nullptr);
    dtk::cuda::rms_norm_forward(x.get(packed), w.get(packed), type_of<T>(), rows, hidden, 1e-5, y_alone.data(),
                                rstd.data(), nullptr);
    dtk::cuda::rms_norm_backward(dy.get(packed), x.get(packed), w.get(packed), type_of<T>(), rows, hidden, rstd.data(),
                                 dx_alone.data(), partial.data(), dweight_alone.data(), nullptr);
    return std::make_tuple(sum.values(), y.values(), dx.values(), dweight, y_alone.values(), dx_alone.values(),
                           dweight_alone);
  };
  const std::string what = std::string("rms_norm ") + name_of<T>() + ", hidden " + std::to_string(hidden);
  const auto [packed, scalar] = run_both(run, 4, what);
  const double tol = std::is_same_v<T, __half> ? 2e-3 : 1e-2;  // an element's rounding, where sums differ in order
  EXPECT_EQ(relative_error(std::get<0>(packed), std::get<0>(scalar)), 0.0) << what << " (the sum)";
  EXPECT_LT(relative_error(std::get<1>(packed), std::get<1>(scalar)), tol) << what << " (y)";
  EXPECT_LT(relative_error(std::get<2>(packed), std::get<2>(scalar)), tol) << what << " (dx)";
  EXPECT_LT(relative_error(std::get<3>(packed), std::get<3>(scalar)), 1e-5) << what << " (dweight)";
  EXPECT_LT(relative_error(std::get<4>(packed), std::get<4>(scalar)), tol) << what << " (y, norm alone)";
  EXPECT_LT(relative_error(std::get<5>(packed), std::get<5>(scalar)), tol) << what << " (dx, norm alone)";
  EXPECT_LT(relative_error(std::get<6>(packed), std::get<6>(scalar)), 1e-5) << what << " (dweight, norm alone)";
}

TEST_F(KernelsEmulated, PackedRmsNormEqualsTheScalarKernel) {
  check_rms_norm<__nv_bfloat16>(19, 256);
  check_rms_norm<__nv_bfloat16>(11, 512);
  check_rms_norm<__half>(9, 768);
  check_rms_norm<__nv_bfloat16>(9, 1024);
}

// add + LayerNorm with the branch's bias and dropout on the branch, forward and backward.
template <class T>
void check_layer_norm(int64_t rows, int64_t hidden, bool dropout) {
  std::mt19937 rng(13);
  const Twin<T> x(rows * hidden, rng), res(rows * hidden, rng), res_bias(hidden, rng), w(hidden, rng), b(hidden, rng),
      dy(rows * hidden, rng), dsum(rows * hidden, rng);
  dtk::cuda::DropoutBits mask;
  mask.seed = 99;
  mask.threshold = static_cast<uint32_t>(0.1 * 4294967296.0);
  mask.scale = static_cast<float>(1.0 / 0.9);
  const dtk::cuda::DropoutBits* drop = dropout ? &mask : nullptr;
  const auto run = [&](bool packed) {
    Buffer<T> sum(rows * hidden, packed), y(rows * hidden, packed), dx(rows * hidden, packed),
        dres(rows * hidden, packed);
    std::vector<float> mean(rows), rstd(rows),
        partial(dtk::cuda::layer_norm_backward_blocks(rows, hidden) * 3 * hidden), dweight(hidden), dbias(hidden),
        dres_bias(hidden);
    dtk::cuda::add_layer_norm_forward(x.get(packed), res.get(packed), res_bias.get(packed), drop, w.get(packed),
                                      b.get(packed), type_of<T>(), rows, hidden, 1e-5, sum.data(), y.data(),
                                      mean.data(), rstd.data(), nullptr);
    dtk::cuda::add_layer_norm_backward(dy.get(packed), dsum.get(packed), sum.data(), w.get(packed), type_of<T>(), rows,
                                       hidden, mean.data(), rstd.data(), drop, dx.data(), dres.data(), partial.data(),
                                       dweight.data(), dbias.data(), dres_bias.data(), nullptr);
    return std::make_tuple(sum.values(), y.values(), dx.values(), dres.values(), dweight, dbias, dres_bias);
  };
  const std::string what = std::string("add_layer_norm ") + name_of<T>() + ", hidden " + std::to_string(hidden) +
                           (dropout ? ", dropout 0.1" : "");
  const auto [packed, scalar] = run_both(run, 2, what);
  const double tol = std::is_same_v<T, __half> ? 2e-3 : 1e-2;
  EXPECT_EQ(relative_error(std::get<0>(packed), std::get<0>(scalar)), 0.0) << what << " (the sum)";
  EXPECT_LT(relative_error(std::get<1>(packed), std::get<1>(scalar)), tol) << what << " (y)";
  EXPECT_LT(relative_error(std::get<2>(packed), std::get<2>(scalar)), tol) << what << " (dx)";
  EXPECT_LT(relative_error(std::get<3>(packed), std::get<3>(scalar)), tol) << what << " (the residual's gradient)";
  EXPECT_LT(relative_error(std::get<4>(packed), std::get<4>(scalar)), 1e-5) << what << " (dweight)";
  EXPECT_LT(relative_error(std::get<5>(packed), std::get<5>(scalar)), 1e-5) << what << " (dbias)";
  EXPECT_LT(relative_error(std::get<6>(packed), std::get<6>(scalar)), 1e-5) << what << " (the branch bias's gradient)";
}

TEST_F(KernelsEmulated, PackedAddLayerNormEqualsTheScalarKernel) {
  check_layer_norm<__nv_bfloat16>(19, 256, false);
  check_layer_norm<__half>(11, 512, true);
  check_layer_norm<__nv_bfloat16>(9, 768, true);
}

// The cross entropy's 16-byte sweeps against its element-at-a-time ones: a vocabulary of several
// batches of packs and a tail, targets inside, outside (-1) and at the last column.
template <class T>
void check_cross_entropy(int64_t vocab) {
  std::mt19937 rng(17);
  const int64_t n = 4, ld = (vocab + 7) / 8 * 8;
  const Twin<T> logits(n * ld, rng, 3.0f);
  const std::vector<int64_t> col = {0, vocab - 1, -1, vocab / 2};
  const auto run = [&](bool packed) {
    Buffer<T> x(n * ld, packed);
    std::memcpy(x.data(), logits.get(packed), n * ld * sizeof(T));
    std::vector<float> max(n), sum(n), loss(n);
    dtk::cuda::cross_entropy_rows(x.data(), type_of<T>(), n, vocab, ld, col.data(), max.data(), sum.data(), loss.data(),
                                  true, nullptr);
    return std::make_tuple(max, sum, loss, x.values());
  };
  const std::string what = std::string("cross entropy ") + name_of<T>() + ", vocab " + std::to_string(vocab);
  const auto [packed, scalar] = run_both(run, 1, what);
  EXPECT_EQ(std::get<0>(packed), std::get<0>(scalar)) << what << " (max)";
  EXPECT_LT(relative_error(std::get<1>(packed), std::get<1>(scalar)), 1e-5) << what << " (sum)";
  EXPECT_LT(relative_error(std::get<2>(packed), std::get<2>(scalar)), 1e-5) << what << " (loss)";
  EXPECT_LT(relative_error(std::get<3>(packed), std::get<3>(scalar)), 1e-2) << what << " (gradient)";
}

TEST_F(KernelsEmulated, PackedCrossEntropyEqualsTheScalarKernel) {
  check_cross_entropy<__nv_bfloat16>(20000);
  check_cross_entropy<__half>(2003);
}

}  // namespace
