// dropout.cpp — see dropout.hpp.
#include <dtk/layers/dropout.hpp>
#include <dtk/capture.hpp>

#include "cuda_kernels.hpp"
#include "dropout_rows.hpp"
#include "recorded_seeds.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <type_traits>

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// splitmix64's output function of the pair index: two 32-bit uniforms per call.
inline uint64_t mix(uint64_t seed, uint64_t pair) {
  uint64_t z = seed + (pair + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

constexpr int64_t kBlock = 1024;  // elements whose uniforms are made at once (on the stack)

// out[i] = the 32-bit uniform of mask element first + i, i < count <= kBlock: the low half of
// word k / 2 for even k, the high half for odd k, i.e. the words' uint32 view (little-endian).
// The 64-bit multiplies vectorise with AVX-512DQ (x86-64-v4): a clone for it, chosen at load
// time (this file is built with -O3); 5x faster than scalar code on a Zen 4 core.
__attribute__((target_clones("arch=x86-64-v4", "default"))) void uniforms(uint64_t seed, int64_t first, int64_t count,
                                                                          uint32_t* out) {
  uint64_t words[kBlock / 2 + 1];
  const int64_t w0 = first >> 1, odd = first & 1, n = (odd + count + 1) >> 1;
  for (int64_t k = 0; k < n; ++k) words[k] = mix(seed, static_cast<uint64_t>(w0 + k));
  std::memcpy(out, reinterpret_cast<const uint32_t*>(words) + odd, sizeof(uint32_t) * static_cast<size_t>(count));
}

// The seed a loop on the CPU reads: the slot's value in a recorded step (the CPU probe, whose
// table is in host memory: the host's table is on the device of the tensors the masks apply to).
uint64_t cpu_seed(const DropoutMask& m) {
  if (!m.seed_slot.defined()) return m.seed;
  return static_cast<uint64_t>(*m.seed_slot.data_ptr<int64_t>());
}

// out[i] = the uniform of element i0 + i of a tensor under mask m (its runs when strided).
void mask_uniforms(const DropoutMask& m, int64_t i0, int64_t count, uint32_t* out) {
  const uint64_t seed = cpu_seed(m);
  if (m.run_numel <= 0) return uniforms(seed, m.offset + i0, count, out);
  while (count > 0) {
    const int64_t within = i0 % m.run_numel, n = std::min(count, m.run_numel - within);
    uniforms(seed, m.index(i0), n, out);
    out += n, i0 += n, count -= n;
  }
}

// out = x * keep * scale over contiguous data, in blocks of kBlock elements on the intra-op
// threads (the result does not depend on how the blocks are split).
at::Tensor masked_scale(const at::Tensor& x_in, const DropoutMask& m) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  const uint32_t thr = m.threshold();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "dtk_dropout", [&] {
    // As x.mul(scalar): the scale in fp32 (fp64 for double), low precision rounded once.
    using opmath = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    const opmath scale = static_cast<opmath>(1.0 / (1.0 - m.p));
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, (n + kBlock - 1) / kBlock, 16, [&](int64_t b0, int64_t b1) {
      uint32_t u[kBlock];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t i0 = b * kBlock, len = std::min(kBlock, n - i0);
        mask_uniforms(m, i0, len, u);
        const scalar_t* s = src + i0;
        scalar_t* d = dst + i0;
        for (int64_t i = 0; i < len; ++i)
          d[i] = u[i] >= thr ? static_cast<scalar_t>(static_cast<opmath>(s[i]) * scale) : static_cast<scalar_t>(0);
      }
    });
  });
  return out;
}

at::Tensor apply_mask(const at::Tensor& x, const DropoutMask& m) {
  if (x.device().is_cpu()) return masked_scale(x, m);
  // A GPU: DTK's kernel hashes each element's bits itself (dtk/cuda/dropout.hpp), the host loop's
  // arithmetic in one pass.
  if (gpu::dropout_applies(x)) return gpu::dropout_apply(x, m).view(x.sizes());
  // Other devices: the same bits, made there with tensor operations (dropout.hpp).
  return apply_dropout_ops(x, m);
}

// splitmix64 in int64 tensor arithmetic: multiplication wraps as uint64's does (two's
// complement), and a logical right shift is the arithmetic one with the sign bits masked off.
// The seed is the mask's constant, or its slot's value (added on the device: no host read).
at::Tensor mix_words(const DropoutMask& m, const at::Tensor& pair) {
  auto u = [](uint64_t v) { return static_cast<int64_t>(v); };
  auto shr = [](const at::Tensor& z, int k) {
    return at::bitwise_and(at::bitwise_right_shift(z, k), static_cast<int64_t>((uint64_t{1} << (64 - k)) - 1));
  };
  at::Tensor z = (pair + 1).mul_(u(0x9E3779B97F4A7C15ULL));
  if (m.seed_slot.defined())
    z.add_(m.seed_slot.to(z.device()));
  else
    z.add_(u(m.seed));
  z = at::bitwise_xor(z, shr(z, 30)).mul_(u(0xBF58476D1CE4E5B9ULL));
  z = at::bitwise_xor(z, shr(z, 27)).mul_(u(0x94D049BB133111EBULL));
  return at::bitwise_xor(z, shr(z, 31));
}

}  // namespace

at::Tensor apply_dropout_ops(const at::Tensor& x, const DropoutMask& m) {
  const at::Tensor keep = keep_bits_on(m, x.numel(), x.device()).view(x.sizes());
  return (x * keep).mul(1.0 / (1.0 - m.p));
}

namespace {

struct Dropout : public torch::autograd::Function<Dropout> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, DropoutMask m) {
    save_mask(ctx, "keep", m);
    return apply_mask(x, m);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {apply_mask(grad[0], saved_mask(ctx, "keep")), at::Tensor()};
  }
};

}  // namespace

void save_mask(AutogradContext* ctx, const std::string& key, const DropoutMask& m) {
  ctx->saved_data[key + ".seed"] = static_cast<int64_t>(m.seed);
  if (m.seed_slot.defined()) ctx->saved_data[key + ".seed_slot"] = m.seed_slot;
  ctx->saved_data[key + ".p"] = m.p;
  ctx->saved_data[key + ".offset"] = m.offset;
  ctx->saved_data[key + ".row_numel"] = m.row_numel;
  ctx->saved_data[key + ".run_numel"] = m.run_numel;
}

DropoutMask saved_mask(AutogradContext* ctx, const std::string& key) {
  DropoutMask m;
  m.seed = static_cast<uint64_t>(ctx->saved_data[key + ".seed"].toInt());
  if (auto slot = ctx->saved_data.find(key + ".seed_slot"); slot != ctx->saved_data.end())
    m.seed_slot = slot->second.toTensor();
  m.p = ctx->saved_data[key + ".p"].toDouble();
  m.offset = ctx->saved_data[key + ".offset"].toInt();
  m.row_numel = ctx->saved_data[key + ".row_numel"].toInt();
  m.run_numel = ctx->saved_data[key + ".run_numel"].toInt();
  return m;
}

DropoutRng DropoutRng::clone() {
  DropoutRng copy;
  {
    std::lock_guard<std::mutex> l1(hidden.mutex());
    std::lock_guard<std::mutex> l2(attention.mutex());
    copy = {hidden.clone(), attention.clone()};
  }
  if (capturing() && recorded_seeds::available()) {
    recorded_seeds::note_clone(hidden, copy.hidden);
    recorded_seeds::note_clone(attention, copy.attention);
  }
  return copy;
}

DropoutRng DropoutRng::from_host() {
  return {seeded_generator(rng_seed(DTK_RNG_DEFAULT)), seeded_generator(rng_seed(DTK_RNG_TENSOR_PARALLEL))};
}

namespace {
at::Tensor generator_state(at::Generator& g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
}  // namespace

void DropoutRng::save(TensorList& state) {
  state.emplace_back("rng.hidden", generator_state(hidden));
  state.emplace_back("rng.attention", generator_state(attention));
}

void DropoutRng::load(const TensorList& state) {
  for (auto [name, gen] : {std::pair<const char*, at::Generator*>{"rng.hidden", &hidden},
                           std::pair<const char*, at::Generator*>{"rng.attention", &attention}}) {
    const at::Tensor* src = find(state, name);
    if (!src) continue;
    if (src->scalar_type() != at::kByte)
      throw Error(std::string("tensor '") + name + "': a generator state must be uint8");
    std::lock_guard<std::mutex> lock(gen->mutex());
    gen->set_state(src->contiguous());
  }
}

at::Generator seeded_generator(uint64_t seed) {
  at::Generator base = at::globalContext().defaultGenerator(at::kCPU);
  at::Generator g;
  {
    std::lock_guard<std::mutex> lock(base.mutex());
    g = base.clone();
  }
  g.set_current_seed(seed);
  return g;
}

uint32_t DropoutMask::threshold() const {
  return static_cast<uint32_t>(std::min(4294967295.0, std::round(p * 4294967296.0)));
}

float DropoutMask::scale() const { return static_cast<float>(1.0 / (1.0 - p)); }

DropoutMask DropoutMask::rows(int64_t start, int64_t length) const {
  if (columns_block) throw Error("dropout: rows of a columns() block: take the rows first, then the columns");
  DropoutMask m = *this;
  m.offset += start * row_numel;
  return m;
}

DropoutMask DropoutMask::sequence_rows(int64_t seq, int64_t start, int64_t length) const {
  // Nothing drawn (an undefined mask; draw_uniforms' p-0 draws have rows): nothing to slice.
  if (!defined() && row_numel == 0) return *this;
  if (run_numel > 0 || seq <= 0 || row_numel % seq != 0)
    throw Error("dropout: sequence_rows needs an unsliced mask whose rows hold the sequence");
  DropoutMask m = *this;
  const int64_t inner = row_numel / seq;
  m.offset += start * inner;
  m.run_numel = length * inner;
  return m;
}

DropoutMask DropoutMask::columns(int64_t width, int64_t start, int64_t length) const {
  if (!defined() && row_numel == 0) return *this;
  if (run_numel > 0 || width <= 0 || start < 0 || length <= 0 || start + length > width ||
      (row_numel > 0 && row_numel % width != 0))
    throw Error("dropout: columns needs an unsliced mask whose rows hold runs of " + std::to_string(width) +
                " elements, and a block inside them");
  DropoutMask m = *this;
  m.offset += start;
  m.row_numel = width;
  m.run_numel = length;
  m.columns_block = true;
  return m;
}

DropoutMask draw_uniforms(at::IntArrayRef shape, at::Generator& gen) {
  DropoutMask m;
  if (capturing()) {
    // Each mask's seed is drawn on the host, and a CUDA graph would replay one mask forever: the
    // host draws it into a slot before each replay instead (recorded_seeds.hpp).
    m.seed_slot = recorded_seeds::next(gen);
  } else {
    std::lock_guard<std::mutex> lock(gen.mutex());
    m.seed = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
  }
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  m.row_numel = shape.empty() || shape[0] == 0 ? numel : numel / shape[0];
  return m;
}

DropoutMask draw_keep_mask(at::IntArrayRef shape, double p, at::Generator& gen) {
  if (p <= 0.0) return {};
  DropoutMask m = draw_uniforms(shape, gen);
  m.p = p;
  return m;
}

at::Tensor apply_dropout(const at::Tensor& x, const DropoutMask& keep) {
  if (!keep.defined()) return x;
  if (at::GradMode::is_enabled() && x.requires_grad()) return Dropout::apply(x, keep);
  return apply_mask(x, keep);
}

at::Tensor dropout(const at::Tensor& x, double p, bool training, at::Generator& gen) {
  if (!training || p <= 0.0) return x;
  return apply_dropout(x, draw_keep_mask(x.sizes(), p, gen));
}

void scale_kept(const DropoutMask& keep, int64_t first, int64_t count, const float* in, float* out) {
  const uint32_t thr = keep.threshold();
  const float scale = keep.scale();  // as masked_scale
  uint32_t u[kBlock];
  for (int64_t i0 = 0; i0 < count; i0 += kBlock) {
    const int64_t len = std::min(kBlock, count - i0);
    mask_uniforms(keep, first + i0, len, u);
    for (int64_t i = 0; i < len; ++i) out[i0 + i] = u[i] >= thr ? in[i0 + i] * scale : 0.0f;
  }
}

void keep_multipliers(const DropoutMask& keep, int64_t first, int64_t count, float* out) {
  const uint32_t thr = keep.threshold();
  const float scale = keep.scale();
  uint32_t u[kBlock];
  for (int64_t i0 = 0; i0 < count; i0 += kBlock) {
    const int64_t len = std::min(kBlock, count - i0);
    mask_uniforms(keep, first + i0, len, u);
    for (int64_t i = 0; i < len; ++i) out[i0 + i] = u[i] >= thr ? scale : 0.0f;
  }
}

bool mask_fits_probs(const DropoutMask& keep, int64_t heads, int64_t s, int64_t t) {
  return !keep.defined() || (keep.run_numel == 0 && keep.row_numel == heads * s * t) ||
         (keep.columns_block && keep.run_numel == t && keep.row_numel >= t);
}

at::Tensor keep_bits(const DropoutMask& keep, int64_t numel) {
  at::Tensor out = at::empty({numel}, at::kBool);
  bool* dst = out.data_ptr<bool>();
  const uint32_t thr = keep.threshold();
  uint32_t u[kBlock];
  for (int64_t i0 = 0; i0 < numel; i0 += kBlock) {
    const int64_t len = std::min(kBlock, numel - i0);
    mask_uniforms(keep, i0, len, u);
    for (int64_t i = 0; i < len; ++i) dst[i0 + i] = u[i] >= thr;
  }
  return out;
}

namespace {

// The 32-bit uniforms of elements [i0, i0 + len) of a tensor under `m`, as int64 in [0, 2^32) on
// `device`, made by tensor operations (mix_words): what keep_bits_on compares and
// uniform_noise_on scales.
at::Tensor piece_uniforms(const DropoutMask& m, int64_t i0, int64_t len, const at::Device& device) {
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  if (m.run_numel > 0) {
    // A strided view: each element's index in the drawn mask, its pair's word, and the word's
    // low (even index) or high (odd) half.
    const at::Tensor i = at::arange(i0, i0 + len, longs);
    const at::Tensor index =
        at::div(i, m.run_numel, "floor").mul_(m.row_numel).add_(i.remainder(m.run_numel)).add_(m.offset);
    const at::Tensor words = mix_words(m, at::div(index, 2, "floor"));
    const at::Tensor high = at::bitwise_and(at::bitwise_right_shift(words, 32), static_cast<int64_t>(0xFFFFFFFF));
    const at::Tensor low = at::bitwise_and(words, static_cast<int64_t>(0xFFFFFFFF));
    return at::where(index.remainder(2).eq(1), high, low);
  }
  const int64_t first = m.offset + i0;
  const int64_t w0 = first >> 1, odd = first & 1, n = (odd + len + 1) >> 1;
  const at::Tensor words = mix_words(m, at::arange(w0, w0 + n, longs));
  // Element k of the pair list is the low (even) or high (odd) half of its word: the words'
  // int32 view, little-endian, as uniforms() copies them; read as unsigned.
  return words.view(at::kInt).narrow(0, odd, len).to(at::kLong).bitwise_and_(static_cast<int64_t>(0xFFFFFFFF));
}

// out[i] = f(the uniforms of elements [i0, i0 + len)) in pieces of at most 2^24 elements (a few
// int64 temporaries of 128 MiB), so a large attention mask does not need gigabytes of them.
template <typename F>
at::Tensor by_pieces(int64_t numel, const at::TensorOptions& options, F f) {
  at::Tensor out = at::empty({numel}, options);
  constexpr int64_t kPiece = int64_t{1} << 24;
  for (int64_t i0 = 0; i0 < numel; i0 += kPiece) {
    const int64_t len = std::min(kPiece, numel - i0);
    out.narrow(0, i0, len).copy_(f(i0, len));
  }
  return out;
}

}  // namespace

at::Tensor keep_bits_on(const DropoutMask& keep, int64_t numel, const at::Device& device) {
  const auto thr = static_cast<int64_t>(keep.threshold());
  return by_pieces(numel, at::TensorOptions().dtype(at::kBool).device(device),
                   [&](int64_t i0, int64_t len) { return piece_uniforms(keep, i0, len, device).ge(thr); });
}

at::Tensor uniform_noise_on(const DropoutMask& draw, int64_t numel, double low, double high, const at::Device& device) {
  if (gpu::uniform_noise_applies(device)) return gpu::uniform_noise(draw, numel, low, high, device);
  return uniform_noise_ops(draw, numel, low, high, device);
}

at::Tensor uniform_noise_ops(const DropoutMask& draw, int64_t numel, double low, double high,
                             const at::Device& device) {
  // The product and the sum in fp64, as the GPU kernel rounds them; the noise rounded to fp32 once.
  return by_pieces(numel, at::TensorOptions().dtype(at::kFloat).device(device), [&](int64_t i0, int64_t len) {
    return piece_uniforms(draw, i0, len, device).to(at::kDouble).mul_((high - low) / 4294967296.0).add_(low);
  });
}

}  // namespace dtk::layers
