// dtk/layers/dropout.hpp — dropout whose keep-mask is a function of (seed, element index), drawn once per
// mask from the model's generators.
//
// torch's dropout draws a Bernoulli per element from a sequential generator and keeps the mask
// for backward: on a 2-core CPU that costs about 6% of a GPT step (bernoulli_ in the eager
// PyTorch peer's profile, docs/benchmarks.md) and a byte per element of memory. Here a mask is
// one 64-bit seed taken from the generator (so the generator's state, which checkpoints keep,
// still decides every mask, and recomputation with a cloned generator draws the same one);
// element i of a tensor of the mask's shape is kept when the 32-bit hash of (seed, i) is at
// least p * 2^32 (splitmix64, two elements per hash). Backward recomputes the bits instead of
// storing them, and a slice of rows is the same mask with an offset: Domino's chunks use exactly
// the plain layer's masks.
//
// On a GPU DTK's kernel (dtk/cuda/dropout.hpp) hashes each element's bits in the one pass that
// applies them; on other devices the same bits are made there with tensor operations
// (keep_bits_on). Either way a CPU and a GPU run draw the same masks without hashing on the host
// or copying masks over.
#pragma once

#include <dtk/model.hpp>

#include <cstdint>

namespace dtk::layers {

// The dropout generators: hidden and embedding dropout from Megatron's DEFAULT stream, attention
// dropout from the TENSOR_PARALLEL stream (differs per TP rank). CPU generators on every device.
struct DropoutRng {
  at::Generator hidden;     // DTK_RNG_DEFAULT
  at::Generator attention;  // DTK_RNG_TENSOR_PARALLEL
  // Copies of both generators (a recomputed layer's: it draws the masks the forward drew).
  DropoutRng clone();
  // Both generators seeded from the host's RNG streams (dtk::rng_seed).
  static DropoutRng from_host();
  // Checkpoint entries "rng.hidden" and "rng.attention" (uint8 generator states), so a resumed
  // run draws the masks an uninterrupted one would.
  void save(TensorList& state);
  // Restores them; an entry that is absent (a non-strict load) keeps the current stream.
  void load(const TensorList& state);
};

// A CPU generator seeded with `seed`: a model's own stream for parameter initialisation (draw
// the master weight on the CPU, then move it: the same weights on every device) and for dropout.
at::Generator seeded_generator(uint64_t seed);

// A keep-mask over a tensor of some shape, element by element in row-major order. Undefined
// (p == 0) means keep everything.
struct DropoutMask {
  uint64_t seed = 0;
  // While the host records the step into a CUDA graph the seed is not a constant: it is the value
  // in this one-element int64 tensor on the compute device, which the host draws anew from the
  // mask's generator before each replay (dtk/capture.hpp). Undefined otherwise. A kernel applying
  // the mask reads it there when it is defined (`seed` is then not the seed).
  at::Tensor seed_slot;
  double p = 0;           // drop probability
  int64_t offset = 0;     // index of this mask's first element in the drawn mask
  int64_t row_numel = 0;  // elements per index of the first dimension of the drawn mask
  // A strided view (sequence parallelism's shard): when run_numel > 0, element i of the tensor
  // is element offset + (i / run_numel) * row_numel + i % run_numel of the drawn mask.
  int64_t run_numel = 0;
  bool columns_block = false;  // made by columns(): rows() of it would count runs, not rows (refused)
  bool defined() const { return p > 0; }
  // An element is kept when its 32-bit uniform is at least threshold() (round(p * 2^32)), and then
  // multiplied by scale() (1 / (1 - p) in fp32): what every kernel applying the mask is given.
  uint32_t threshold() const;
  float scale() const;
  // Rows [start, start + length) of the first dimension (a Domino chunk of the micro-batch).
  DropoutMask rows(int64_t start, int64_t length) const;
  // Indices [start, start + length) of the second dimension, of `seq` (a sequence shard of a
  // mask drawn for [b, seq, ...]); rows() of the result are rows of the shard.
  DropoutMask sequence_rows(int64_t seq, int64_t start, int64_t length) const;
  // Elements [start, start + length) of each run of `width` consecutive elements (of an unsliced
  // mask or rows() of one; slicing the result throws): a block of columns of a mask drawn for
  // [..., width] (context parallelism's keys, ContextParallel::gathered_probs_shape).
  DropoutMask columns(int64_t width, int64_t start, int64_t length) const;
  // The index in the drawn mask of element i of the tensor the mask is applied to.
  int64_t index(int64_t i) const {
    return run_numel > 0 ? offset + i / run_numel * row_numel + i % run_numel : offset + i;
  }
};

// One draw of hashed uniforms for tensors of `shape` (advances `gen` by one 64-bit draw, or takes a
// seed slot while the host records the step): a mask with p 0, which applies nothing but whose
// rows() and sequence_rows() slice it as a mask's. For noise other than a mask (uniform_noise_on).
DropoutMask draw_uniforms(at::IntArrayRef shape, at::Generator& gen);
// Draws one mask for tensors of `shape` (advances `gen` by one 64-bit draw); undefined for p 0.
// While the host records the step, the mask holds a seed slot the host draws from `gen` before
// each replay, and the draws of a generator cloned meanwhile (DropoutRng::clone) repeat those of
// its source.
DropoutMask draw_keep_mask(at::IntArrayRef shape, double p, at::Generator& gen);
// x * keep / (1 - p) (inverted dropout; the scale in fp32), differentiable in x; nothing is
// saved for backward but the seed. x's first dimension must match the mask's rows.
at::Tensor apply_dropout(const at::Tensor& x, const DropoutMask& keep);
// apply_dropout's arithmetic, (x * keep) * (1 / (1 - p)), with the bits made by tensor operations
// on x's device (keep_bits_on): the reference DTK's GPU dropout kernel (dtk/cuda/dropout.hpp),
// which apply_dropout runs on a GPU, is tested against. The mask must be defined.
at::Tensor apply_dropout_ops(const at::Tensor& x, const DropoutMask& keep);
// Inverted dropout drawing its mask from `gen` (identity when not training or p == 0).
at::Tensor dropout(const at::Tensor& x, double p, bool training, at::Generator& gen);

// Uniform(low, high) per element of a tensor under `draw` ([numel], fp32 on `device`): element i is
// low + u_i * ((high - low) / 2^32) (in fp64, rounded once to fp32), u_i the 32-bit uniform a mask
// of that draw compares with its threshold. On a GPU DTK's kernel makes it in one pass
// (dtk/cuda/dropout.hpp), elsewhere uniform_noise_ops; neither reads a recorded seed on the host,
// so a CPU and a GPU run, a recomputation and every slice of the draw see the same noise
// (Megatron's router input jitter, dtk/layers/moe.hpp).
at::Tensor uniform_noise_on(const DropoutMask& draw, int64_t numel, double low, double high, const at::Device& device);
// The same noise made with tensor operations on `device`: the reference the GPU kernel is tested
// against.
at::Tensor uniform_noise_ops(const DropoutMask& draw, int64_t numel, double low, double high, const at::Device& device);

// The mask's bits as a bool tensor [numel] (tests).
at::Tensor keep_bits(const DropoutMask& keep, int64_t numel);
// The same bits made with tensor operations on `device`: what a GPU run applies. Equal to
// keep_bits bit for bit (tests/model check it on the CPU).
at::Tensor keep_bits_on(const DropoutMask& keep, int64_t numel, const at::Device& device);

}  // namespace dtk::layers
