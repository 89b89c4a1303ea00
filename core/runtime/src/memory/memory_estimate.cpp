#include "dtk/core/memory/memory_estimate.hpp"

#include <algorithm>
#include <cmath>

namespace dtk::core {

namespace {

// Chunk-forwards a stage holds at once. 1F1B: stage s holds the activations of up to p - s
// micro-batches. Interleaved: its warm-up forwards plus one, each through one of its v chunks.
int64_t chunk_forwards_alive(const MemoryEstimateInputs& in) {
  const int64_t num_micro = in.micro_batches_per_step, v = in.virtual_stages, p = in.pp_size, r = in.pp_rank;
  if (v <= 1) return std::min<int64_t>(p - r, num_micro) * v;
  return num_micro == p ? num_micro * v : std::min<int64_t>(num_micro * v, 2 * (p - r - 1) + (v - 1) * p + 1);
}

// The paper's activation bytes of one layer for one micro-batch kept for backward (no full
// recomputation), in the parameters' dtype.
double layer_activation_bytes(const MemoryEstimateInputs& in) {
  const double s = static_cast<double>(in.seq_length), b = static_cast<double>(in.micro_batch_size);
  const double h = static_cast<double>(in.hidden_size),
               a = static_cast<double>(std::max<int64_t>(1, in.num_attention_heads));
  const double t = std::max(1, in.tp_size);
  // The attention scores, probabilities and their dropout mask: 5 a s^2 b, split over TP ranks
  // (and, below, over context-parallel ranks: under a2a each holds whole sequences of 1 / cp of the
  // heads).
  double scores = in.selective_recompute ? 0.0 : 5.0 * a * s / h / t;
  // all_gather: each of a rank's two chunks of s / (2 cp) queries attends over the keys up to its
  // own end (chunks r and 2 cp - 1 - r: (2 cp + 1) s / (2 cp) keys in all), (2 cp + 1) / (4 cp) of
  // a2a's scores. It keeps those keys and values too, unless it recomputes core attention (which
  // gathers them again): with grouped-query attention each chunk's copy at the queries' width w
  // (attention_ops widens the groups), 2 (2 cp + 1) s b w / t bytes in 16-bit where the share's
  // own keys and values are 4 s b w / t of the rest below; multi-head attention keeps views of the
  // gathered ones, 4 (cp - 1) s b w / t more, which the first bounds from above.
  const double cp = std::max(1, in.cp_size);
  double gathered = 0.0;
  if (in.cp_gathers_keys && cp > 1) {
    scores *= (2.0 * cp + 1.0) / (4.0 * cp);
    const double width = in.attention_width > 0 ? static_cast<double>(in.attention_width) : h;
    if (!in.selective_recompute) gathered = 2.0 * (2.0 * cp - 1.0) * width / h / t;
  }
  // Everything else: 34 s b h, of which 24 inside the TP blocks (split) and 10 outside (split
  // only under sequence parallelism). Of the 24, the queries, keys, values and the context (8 s b h)
  // are the attention's width: heads wider than hidden / heads (Qwen3's) hold that much more.
  const double wider = in.attention_width > 0 ? 8.0 * (static_cast<double>(in.attention_width) / h - 1.0) / t : 0.0;
  // A recomputed MLP keeps its input (the norm's output, counted among the 10 or 34) but not
  // dense_h_to_4h's output nor the activation's (4h wide each: 16 s b h of the 24, split).
  const double mlp = in.recompute_mlp ? 16.0 / t : 0.0;
  const double rest = (in.sequence_parallel ? 34.0 / t : 10.0 + 24.0 / t) + wider - mlp;
  // Under context parallelism each rank keeps 1 / cp of every other activation.
  return s / cp * b * h * (rest + scores + gathered) * (in.dtype_bytes / 2.0);
}

}  // namespace

MemoryEstimate estimate_memory(const MemoryEstimateInputs& in) {
  // This rank's positions of each sequence (its share under context parallelism).
  const double s = static_cast<double>(in.seq_length) / std::max(1, in.cp_size),
               b = static_cast<double>(in.micro_batch_size);
  const double h = static_cast<double>(in.hidden_size);
  // (A rank of an uneven split may hold no layer: only the embedding or the output layer.)
  const int64_t stage_layers =
      in.rank_layers >= 0 ? in.rank_layers : std::max<int64_t>(1, in.num_layers / std::max(1, in.pp_size));
  const double per_layer = layer_activation_bytes(in);
  double stage = static_cast<double>(stage_layers) * per_layer;
  if (in.recompute && stage_layers > 0) {
    // Each checkpointed group keeps its input (2 s b h in 16-bit); the layers outside groups keep
    // everything; the group being recomputed holds its layers' activations during its backward.
    const int64_t k = std::min<int64_t>(std::max<int64_t>(1, in.recompute_num_layers), stage_layers);
    const int64_t groups = in.recompute_block ? k : (stage_layers + k - 1) / k;
    const int64_t plain = in.recompute_block ? stage_layers - k : 0;
    const double input = s * b * h * in.dtype_bytes / (in.sequence_parallel ? std::max(1, in.tp_size) : 1);
    stage = static_cast<double>(groups) * input + static_cast<double>(plain) * per_layer +
            static_cast<double>(in.recompute_block ? 1 : k) * per_layer;
  }
  const int64_t chunk_forwards = chunk_forwards_alive(in), v = in.virtual_stages;
  const double in_flight = std::max(1.0, static_cast<double>(chunk_forwards) / static_cast<double>(v));
  MemoryEstimate e;
  e.activations = in_flight * stage;
  // The output layer lives on the last stage (dtk/layers/lm_head.hpp): a chunk of fp32 logits and
  // their gradient at a time (512 rows on the CPU, about 1 GiB of logits on a GPU), and what its
  // fused cross entropy computes in forward and keeps for backward, the weight's fp32 gradient
  // [vocab / t, h] and the input's [s b, h], once per micro-batch alive there: one, or all of
  // them where the interleaved schedule runs every forward first (as many micro-batches as stages).
  if (in.pp_rank == in.pp_size - 1) {
    const double vocab = static_cast<double>(in.vocab_size) / in.tp_size;
    const double chunk = in.on_gpu ? std::max(128.0, std::floor((1 << 30) / (4.0 * vocab) / 128.0) * 128.0) : 512.0;
    const double heads = v > 1 && in.micro_batches_per_step == in.pp_size ? in.micro_batches_per_step : 1.0;
    e.logits = std::min(s * b, chunk) * vocab * 4.0 * 2.0 + heads * (vocab * h * 4.0 + s * b * h * in.dtype_bytes);
  }
  // The loader's queue and the batch in use; the interleaved schedule fetches a step's micro-batches
  // first, and holds up to its warm-up plus 2 p + 1 stage outputs' gradients on their way back.
  // (Whole samples: a context-parallel rank splits them in its step.)
  e.batches = (v > 1 ? 4.0 + static_cast<double>(in.micro_batches_per_step) : 5.0) * b *
              (static_cast<double>(in.seq_length) + 1) * 8.0;
  e.gradients_in_flight =
      v > 1 ? static_cast<double>(chunk_forwards + 2 * in.pp_size + 1) * s * b * h * in.dtype_bytes : 0.0;
  // What lives in host memory (offload) is outside a device budget (not outside the machine's).
  e.optimizer = in.device_budget && in.optimizer_on_host ? 0.0 : 8.0 * static_cast<double>(in.optimized_elements);
  e.params = static_cast<double>(in.parameter_bytes + in.gradient_bytes + in.master_bytes -
                                 (in.device_budget ? in.host_bytes : 0));
  return e;
}

std::string memory_refusal(const MemoryEstimate& e, int64_t budget, const std::string& budget_name, bool lower_bound) {
  if (budget <= 0 || e.total() <= static_cast<double>(budget)) return "";
  auto mb = [](double bytes) { return std::to_string(static_cast<int64_t>(bytes / (1 << 20))) + " MB"; };
  const std::string state =
      lower_bound ? "parameters " + mb(e.params)
                  : "parameters, gradients and masters " + mb(e.params) + ", optimizer state " + mb(e.optimizer);
  return "config: this run needs " + std::string(lower_bound ? "at least " : "about ") + mb(e.total()) + " per rank" +
         (lower_bound ? " before gradients and optimizer state" : "") + " (" + state + ", activations " +
         mb(e.activations + e.logits + e.gradients_in_flight) + ", batches " + mb(e.batches) + "), more than the " +
         mb(static_cast<double>(budget)) + " " + budget_name + "; " +
         // Where the model's own state is already too much, a smaller batch does not help.
         (e.params + e.optimizer > static_cast<double>(budget)
              ? "the model's state alone is more: a smaller model, more tensor or pipeline parallel ranks, or "
                "--strategy zero (stage 3, offload)"
              : "lower train.micro_batch_size or train.seq_length") +
         ", or set train.skip_memory_check=true";
}

}  // namespace dtk::core
