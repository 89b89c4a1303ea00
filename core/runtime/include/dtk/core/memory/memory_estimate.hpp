// dtk/core/memory/memory_estimate.hpp — before the first step: what a rank will hold, against what
// it may use (train.memory_limit_mb, a GPU's memory, or this machine's memory shared by its ranks),
// so an absurd size fails with one line instead of growing until the kernel or CUDA kills it.
//
// Parameters and the strategy's gradient and master buffers are counted as allocated; the
// optimizer state (allocated at the first step) as two fp32 values per optimized element (Adam);
// activations by the paper's formulas (Korthikanti et al. 2022, bytes per layer in 16-bit, twice
// in fp32): s b h (10 + 24 / t + 5 a s / (h t)) under tensor parallelism, s b h / t (34 + 5 a s / h)
// with sequence parallelism, their attention-score terms dropped with selective recomputation of
// core attention and the MLP's 16 s b h / t with that of the MLP (the paper's MLP is 4h wide, GELU:
// its two 4h activations; a SwiGLU MLP of 8h/3 keeps as much, other widths and MoE layers are
// counted as that), and with full recomputation 2 s b h (/ t with sequence parallelism) per checkpointed group plus
// one group's activations during its backward; under context parallelism 1 / cp of each (a2a:
// whole sequences of 1 / cp of the heads; all_gather: each query over the keys before it, and the
// gathered keys and values); times the micro-batches the schedule keeps alive
// at once, plus the output layer's (a chunk of logits, and its weight's and input's gradients, which
// the fused cross entropy computes in forward) and the prefetched batches.
#pragma once

#include <cstdint>
#include <string>

#include "dtk/abi.h"

namespace dtk::core {

// The DTK_RECOMPUTE_* modules a model recomputes (0 unless its granularity is selective); a
// selective model that names none (0, as every 2.15 model) recomputes core attention.
inline int32_t selective_recompute_modules(const dtk_model_info& info) {
  if (info.recompute_granularity != 2) return 0;
  const int32_t said = DTK_HAS_FIELD(dtk_model_info, &info, recompute_modules) ? info.recompute_modules : 0;
  return said != 0 ? said : DTK_RECOMPUTE_CORE_ATTENTION;
}

struct MemoryEstimateInputs {
  // The model (dtk_model_info) and the run.
  int64_t seq_length = 0, micro_batch_size = 0, hidden_size = 0, num_attention_heads = 1, num_layers = 0;
  int64_t vocab_size = 0;
  // Heads x channels per head where that is not hidden_size (dtk_model_info.kv_channels); 0: hidden_size.
  int64_t attention_width = 0;
  bool recompute = false;            // full
  bool selective_recompute = false;  // core attention
  bool recompute_mlp = false;        // selective: every layer's MLP (kept: its input alone)
  bool recompute_block = false;      // full: the first recompute_num_layers layers of a stage
  int64_t recompute_num_layers = 1;  // full: layers per group (uniform) or per stage (block)
  bool sequence_parallel = false;
  double dtype_bytes = 4;  // of the parameters: 4 (fp32) or 2
  int tp_size = 1, pp_size = 1, pp_rank = 0, virtual_stages = 1;
  int cp_size = 1;           // context parallelism: each rank holds 1 / cp of every sequence
  bool cp_gathers_keys = false;  // ... and its attention gathers the keys and values (all_gather)
  int64_t rank_layers = -1;  // this pipeline rank's layers, all its chunks (-1: num_layers / pp_size)
  int64_t micro_batches_per_step = 1;
  // What the strategy holds (dtk_memory_usage) and the optimizer steps.
  int64_t parameter_bytes = 0, gradient_bytes = 0, master_bytes = 0, host_bytes = 0;
  int64_t optimized_elements = 0;
  bool optimizer_on_host = false;
  // A device budget (train.memory_limit_mb or a GPU) leaves out what lives in host memory.
  bool device_budget = false;
  bool on_gpu = false;  // training on a GPU (the output layer's chunks are larger there)
};

// Bytes by kind, per rank.
struct MemoryEstimate {
  double params = 0;  // parameters, gradients and masters on the budgeted memory
  double optimizer = 0, activations = 0, logits = 0, batches = 0, gradients_in_flight = 0;
  double total() const { return params + optimizer + activations + logits + batches + gradients_in_flight; }
};

MemoryEstimate estimate_memory(const MemoryEstimateInputs& in);

// The one-line refusal when `e` exceeds `budget` bytes ("" when it fits). `budget_name` says whose
// budget it is ("of train.memory_limit_mb", "of cuda:0", ...). lower_bound: `e` holds the
// parameters and the run's activations only, before the strategy's gradients and optimizer state.
std::string memory_refusal(const MemoryEstimate& e, int64_t budget, const std::string& budget_name,
                           bool lower_bound = false);

}  // namespace dtk::core
