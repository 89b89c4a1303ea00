// dtk/recompute_modules.hpp — the names selective recomputation takes (Megatron-core's
// --recompute-modules, TransformerConfig.recompute_modules).
//
// Megatron names eleven modules; DTK's layers recompute three of them (core_attn, mlp, moe), each
// a bit of dtk_model_info.recompute_modules. The host's Megatron flag mapper and the SDK's decoder
// models read names through this one table, so that both refuse the same names: a Megatron module
// DTK's layers do not rerun (their sub-layers are not DTK's), or a name Megatron does not know.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "dtk/abi.h"

namespace dtk {

struct RecomputeModuleName {
  std::string_view name;
  int32_t bit;  // DTK_RECOMPUTE_*; 0: a Megatron module DTK's layers do not recompute
};

// Megatron-core's order (transformer_config.py).
inline constexpr std::array<RecomputeModuleName, 11> kRecomputeModules = {{
    {"core_attn", DTK_RECOMPUTE_CORE_ATTENTION},
    {"moe_act", 0},
    {"layernorm", 0},
    {"mla_up_proj", 0},
    {"mlp", DTK_RECOMPUTE_MLP},
    {"moe", DTK_RECOMPUTE_MOE},
    {"shared_experts", 0},
    {"gdn_norm_out", 0},
    {"gdp_in_proj", 0},
    {"gdp_qkv", 0},
    {"mhc", 0},
}};

// The module's DTK_RECOMPUTE_* bit, 0 for Megatron's others, -1 for a name Megatron does not know.
inline int32_t recompute_module_bit(std::string_view name) {
  for (const RecomputeModuleName& m : kRecomputeModules)
    if (m.name == name) return m.bit;
  return -1;
}

// "core_attn, mlp and moe" (recomputed = true) or all of Megatron's, comma-separated.
inline std::string recompute_module_list(bool recomputed) {
  std::string out, last;
  for (const RecomputeModuleName& m : kRecomputeModules) {
    if (recomputed && m.bit == 0) continue;
    if (!last.empty()) out += (out.empty() ? "" : ", ") + last;
    last = std::string(m.name);
  }
  return out.empty() ? last : out + (recomputed ? " and " : ", ") + last;
}

}  // namespace dtk
