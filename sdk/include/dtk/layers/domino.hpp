// dtk/layers/domino.hpp — DeepSpeed-Domino's schedule (arXiv 2409.15241) for any transformer
// whose layers follow Megatron's tensor-parallel pattern: tensor-parallel all-reduces hidden
// behind computation by splitting the micro-batch into independent chunks. The gpt and llama
// plugins run their layers with it (option domino_chunks); a third-party model gets it by
// implementing DominoLayer.
//
// Under Megatron tensor parallelism each layer is two stages (attention, MLP), each
//   out = in + dropout(RowParallel(f(ColumnParallel(Norm(in)))) + row bias)
// The row-parallel projection ends in an all-reduce in forward, and the column-parallel
// projections all-reduce the input gradient in backward. Plain TP waits for each at once. Domino
// splits the micro-batch along the batch dimension into N chunks that do not depend on each other
// and runs them staggered:
//
//   forward, for each stage of each layer, for each chunk c:
//       wait chunk c's all-reduce of the previous stage, finish it (bias, dropout, residual),
//       norm, column projection(s), ..., row projection (partial sum), issue its all-reduce
//   so chunk c's all-reduce is in flight while chunks c+1..N-1 compute, and the last chunk's
//   while chunk 0 computes the next stage, across layer boundaries too.
//
//   backward, the mirror image, stages and layers in reverse, for each chunk c:
//       wait chunk c's input-gradient all-reduce of the later stage, finish it (norm and
//       residual backward), then the stage's backward down to the column projection, which
//       computes the input gradient, issues its all-reduce and only then computes the weight
//       gradient (Megatron's async_tensor_model_parallel_allreduce)
//   so each input-gradient all-reduce overlaps the weight gradient and the next chunks' backward.
//
// Autograd cannot express "wait later" in its own order, so the whole stack is one autograd
// function whose forward keeps each (layer, stage, chunk) piece's graph and whose backward runs
// the pieces in the order above (with recompute it keeps only each layer's chunk inputs and
// generator states, and rebuilds a layer's pieces just before its backward).
// The arithmetic is plain TP's on row slices: dropout masks are drawn for the whole micro-batch
// in plain TP's order and sliced (LayerMasks), so losses and gradients equal plain TP's up to the
// rounding of smaller matrix products; N = 1 is plain TP itself (not this schedule).
//
// Module hooks (ZeRO-3) fire per layer: pre_forward before a layer's first chunk, post_forward
// after its last chunk was finished (the next layer may have started: two layers live at once),
// and likewise pre_backward / post_backward.
#pragma once

#include <dtk/layers/context_parallel.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/tensor_parallel.hpp>
#include <dtk/module_hooks.hpp>

#include <functional>
#include <string>
#include <vector>

namespace dtk::layers {

// One layer's dropout masks for a whole micro-batch (undefined where that dropout is off), drawn
// in the plain layer's order and sliced per chunk.
struct LayerMasks {
  DropoutMask attention_probs;  // [batch, heads / (tp x cp), seq x cp, seq x cp] (a2a; draw_layer_masks), TP stream
  DropoutMask attention_out;    // [batch, seq, hidden], DEFAULT stream
  DropoutMask mlp_out;          // [batch, seq, hidden], DEFAULT stream
  LayerMasks rows(int64_t start, int64_t length) const;
};

// The masks of a Megatron layer that drops attention probabilities, the attention output and the
// MLP output, in that order (each generator's draws in its plain forward's order); none when not
// training. Under context parallelism `seq` is this rank's share and `heads_local` the heads whose
// core attention it runs: under a2a the probabilities cover the whole sequence's seq x C positions,
// under all_gather they are drawn for cp.gathered_probs_shape.
LayerMasks draw_layer_masks(int64_t batch, int64_t seq, int64_t heads_local, int64_t hidden, double attention_dropout,
                            double hidden_dropout, DropoutRng& rng, bool training, const ContextParallel& cp = {});

// What one chunk's stage reads besides its input: its rows of the attention mask (undefined:
// causal) and of the layers' position ids (undefined when the model has none for its layers; the
// whole sequence's under context parallelism's a2a where the model gives them as DecoderLM does:
// DominoInputs::layer_positions, for layers that read positions), and its slice of the probabilities
// dropout mask.
struct DominoChunk {
  at::Tensor mask, positions;
  DropoutMask attention_probs;
};

// A transformer layer Domino can schedule: stage 0 (attention) and stage 1 (MLP), each
//   out = in + dropout(all_reduce(stage_partial(columns(stage_norm(in)))) + stage_row.bias).
class DominoLayer {
 public:
  virtual ~DominoLayer() = default;
  // The normalisation that starts the stage (LayerNorm, RMSNorm).
  virtual at::Tensor stage_norm(int stage, const at::Tensor& in) const = 0;
  // The stage's column-parallel projections of the normalised input (all with biases or none);
  // stage_partial receives their outputs concatenated along the last dimension. Their common input
  // gradient is all-reduced once, asynchronously.
  virtual std::vector<const ColumnParallelLinear*> stage_columns(int stage) const = 0;
  // The stage's row-parallel projection: its bias is added after the all-reduce.
  virtual const RowParallelLinear& stage_row(int stage) const = 0;
  // From the projections' output to this rank's partial sum of the row projection (its weight,
  // no bias, not reduced).
  virtual at::Tensor stage_partial(int stage, const at::Tensor& projected, const DominoChunk& chunk) const = 0;
  // The layer's masks for a whole micro-batch of `batch` sequences of `seq` tokens.
  virtual LayerMasks draw_masks(int64_t batch, int64_t seq, DropoutRng& rng, bool training) const = 0;
};

// The output layer (final LayerNorm, vocab-parallel logits, cross entropy) run per chunk inside
// the schedule, like a third stage: chunk c's logits are computed while the next chunk's last
// all-reduce is in flight; the cross entropy's two all-reduces of every chunk are issued before
// any is waited for; in backward chunk c's input-gradient all-reduce overlaps the next chunk's
// output-layer backward and the last layer's.
struct DominoHead {
  std::function<at::Tensor(const at::Tensor&)> norm;  // final norm
  std::function<const at::Tensor&()> weight;          // [vocab / tp, hidden]
  TPGroup tp;                                         // vocab-parallel cross entropy
  int32_t module = -1;                                // hooks
};

// The embedding (word [+ position], dropout) run per chunk inside the schedule, as a first stage:
// chunk c's word-embedding all-reduce is in flight while the next chunks are looked up and until
// the first layer needs chunk c.
struct DominoEmbedding {
  std::function<at::Tensor(const at::Tensor&)> word_partial;  // ids -> this rank's share (VocabParallelEmbedding)
  std::function<at::Tensor(const at::Tensor&)> position;      // position ids -> position embedding (empty: none)
  std::function<const at::Tensor&()> anchor;                  // a parameter it reads (records the function)
  double dropout = 0;                                         // hidden_dropout
  int32_t module = -1;                                        // hooks
};

struct DominoStack {
  std::string model;       // names the plugin in errors
  int64_t chunks = 2;      // N
  int64_t hidden = 0;      // hidden size
  bool recompute = false;  // full activation recomputation, one layer at a time
  std::vector<const DominoLayer*> layers;
  const ModuleHooks* hooks = nullptr;
  std::function<int32_t(size_t)> module_of;    // layer index -> module index (hooks)
  const DominoHead* head = nullptr;            // with labels: the output layer joins the schedule
  const DominoEmbedding* embedding = nullptr;  // with tokens: the embedding joins the schedule
  // The tensor-parallel group; under sequence parallelism the hidden states between the blocks
  // are this rank's rows of the sequence: each stage all-gathers its normalised input (issued for
  // every chunk before the first is projected) and reduce-scatters its partial sum (in flight
  // like the all-reduce it replaces); backward all-gathers the output gradient (blocking) and
  // reduce-scatters the input gradient (in flight).
  TPGroup tp;
};

// What the stack runs on: the hidden states [b, s, h], or (with stack.embedding) token ids
// [b, s]; position ids [b or 1, s] (for the embedding, and for the layers' DominoChunk unless
// `layer_positions` is given: under context parallelism's a2a the layers' attention runs on the
// whole sequence, whose positions rotary reads); optional attention mask [b or 1, 1, s, s] and labels
// [b, s].
struct DominoInputs {
  at::Tensor hidden, tokens, positions, mask, labels, layer_positions;
};

// The layers with N = stack.chunks chunks (2 <= N <= b). Training with grad mode on
// builds the graph described above; otherwise the forward schedule alone runs. With tokens the
// embedding runs per chunk first; with labels ([b, s] int64) and stack.head the output layer runs
// per chunk last and the result is the per-token loss [b, s] (fp32); otherwise the hidden states
// [b, s, h].
at::Tensor domino_forward(const DominoStack& stack, const DominoInputs& in, DropoutRng& rng, bool training);

}  // namespace dtk::layers
