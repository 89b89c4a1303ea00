// dropout_rows.hpp — a dropout mask applied to a run of elements, for kernels that work row by row
// (attention.cpp), and a mask kept for an autograd function's backward (dropout.cpp, norms.cpp).
// Internal to dtk::layers, not installed. Same bits and arithmetic as apply_dropout (dropout.hpp).
#pragma once

#include <dtk/layers/dropout.hpp>

#include <cstdint>
#include <string>

namespace torch::autograd {
struct AutogradContext;
}

namespace dtk::layers {

// Keeps `mask` in ctx's saved data under `key` (its seed, p, offset and strides: nothing the size
// of the tensor), and reads it back in the backward.
void save_mask(torch::autograd::AutogradContext* ctx, const std::string& key, const DropoutMask& mask);
DropoutMask saved_mask(torch::autograd::AutogradContext* ctx, const std::string& key);

// out[i] = in[i] * (1 / (1 - p)) (the scale in fp32) where element keep.offset + first + i of the
// mask is kept, else 0, for i < count. `in` and `out` may be the same array.
void scale_kept(const DropoutMask& keep, int64_t first, int64_t count, const float* in, float* out);

// out[i] = 1 / (1 - p) (fp32) where element keep.offset + first + i is kept, else 0: the
// multipliers scale_kept applies, for a row used twice.
void keep_multipliers(const DropoutMask& keep, int64_t first, int64_t count, float* out);

// Whether an attention kernel can apply `keep` to probabilities [b, heads, s, t] row by row: none
// (undefined), a mask drawn for that shape (or rows() of one), or a block of t columns of a wider
// one (DropoutMask::columns: context parallelism's chunks).
bool mask_fits_probs(const DropoutMask& keep, int64_t heads, int64_t s, int64_t t);

}  // namespace dtk::layers
