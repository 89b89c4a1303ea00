// dtk/core/perf/flops.hpp — parameter counts and the FLOPs model behind TFLOP/s and MFU.
#pragma once

#include <dtk/model.hpp>  // dtk::Param

#include <cstdint>
#include <vector>

namespace dtk::core {

// Training FLOPs per token = 2cN + 4cLhs (the matmuls with the N parameters, and attention's
// QK^T and AV over s positions in each of L layers of width h), c = 3 passes (forward, and a
// backward that costs two) or c = 4 with full recomputation. N counts the WHOLE model: a rank
// holding a tensor-parallel shard counts it tp_size times (Megatron shards evenly), tied
// weights once. TFLOP/s per device divides the run's total by its world size. A mixture of
// experts' weights (dtk_param_info.expert) count in N at the share of them a token runs, topk of
// num_experts, or of their own layer's count (dtk_param_info.layer_experts, DeepSpeed's pyramid MoE)
// (Megatron's MoE FLOPs count the routed experts only).
struct ModelStats {
  int64_t num_parameters = 0;    // on this rank (what Megatron's "number of parameters" line says)
  int64_t model_parameters = 0;  // the whole model
  int64_t active_parameters = 0;  // N: what one token's products read (model_parameters without MoE)
  int passes = 3;                // c
  double flops_per_token = 0;
  double attention_flops_per_position = 0;  // 4cLh: flops_per_token's part per position of s
};
// The experts of each of the model's MoE layers (dtk_model_info.num_experts); 0 for a dense model
// and for a model built before ABI 2.9.
inline int32_t num_experts(const dtk_model_info& info) {
  return info.struct_size >= dtk_model_info_STRUCT_SIZE_2_9 ? info.num_experts : 0;
}
// How wide the attention's queries, scores and context are: num_attention_heads x kv_channels
// (ABI 2.15; Megatron's query_projection_size), hidden_size for a model that reports no width (0)
// or was built before 2.15.
inline int64_t attention_width(const dtk_model_info& info) {
  return info.struct_size >= dtk_model_info_STRUCT_SIZE_2_15 && info.kv_channels > 0
             ? info.num_attention_heads * info.kv_channels
             : info.hidden_size;
}

// s is the run's train.seq_length (what each sample holds), not the model's declared context
// (info.seq_length, which a model may set longer for export). With pipeline stages (pp_size > 1)
// N sums every stage's parameters (a collective over the pipeline group: every stage calls it),
// a tied weight counted on the first stage only. Under expert parallelism (ep_size > 1) each rank
// holds 1 / ep_size of every layer's routed experts.
ModelStats model_stats(const std::vector<Param>& params, const dtk_model_info& info, int64_t seq_length, int tp_size,
                       int pp_rank = 0, int pp_size = 1, int ep_size = 1);

}  // namespace dtk::core
