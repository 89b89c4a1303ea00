// dtk/layers/layer_pattern.hpp — which layers a per-layer option covers, as Megatron-LM's
// --moe-layer-freq and --window-attn-skip-freq take it: an integer N (what N means is the
// option's: every N-th layer is an MoE layer; every N-th layer keeps full attention), or a Python
// list of 0 and 1, one per layer of the whole model, in the alphabet Megatron's _eval_pattern
// reads: lists, '+', '*' with a count on either side, parentheses ("[1,0,1,0]", "[0]*3+[1]*11",
// "([1]*3+[0]*1)*3"), quoted or spaced as Megatron's scripts write it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtk::layers {

struct LayerPattern {
  int64_t every = 0;        // the integer N given (flags empty)
  std::vector<bool> flags;  // or one flag per layer
};

// Throws std::invalid_argument saying what it cannot read.
LayerPattern parse_layer_pattern(const std::string& text);

}  // namespace dtk::layers
