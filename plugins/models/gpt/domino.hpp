// domino.hpp — DeepSpeed-Domino's schedule for the GPT layers (arXiv 2409.15241): tensor-parallel
// all-reduces hidden behind computation by splitting the micro-batch into independent chunks.
//
// Under Megatron tensor parallelism each layer's two stages (attention, MLP; layer.hpp) end in a
// row-parallel all-reduce in forward, and their column-parallel projections all-reduce the input
// gradient in backward. Plain TP waits for each at once. Domino splits the micro-batch along the
// batch dimension into N chunks that do not depend on each other and runs them staggered:
//
//   forward, for each stage of each layer, for each chunk c:
//       wait chunk c's all-reduce of the previous stage, finish it (bias, dropout, residual),
//       LayerNorm, column projection, ..., row projection (partial sum), issue its all-reduce
//   so chunk c's all-reduce is in flight while chunks c+1..N-1 compute, and the last chunk's
//   while chunk 0 computes the next stage, across layer boundaries too.
//
//   backward, the mirror image, stages and layers in reverse, for each chunk c:
//       wait chunk c's input-gradient all-reduce of the later stage, finish it (LayerNorm and
//       residual backward), then the stage's backward down to the column projection, which
//       computes the input gradient, issues its all-reduce and only then computes the weight
//       gradient (Megatron's async_tensor_model_parallel_allreduce)
//   so each input-gradient all-reduce overlaps the weight gradient and the next chunks' backward.
//
// Autograd cannot express "wait later" in its own order, so the whole stack is one autograd
// function whose forward keeps each (layer, stage, chunk) piece's graph and whose backward runs
// the pieces in the order above (with recompute_activations=full it keeps only each layer's
// chunk inputs and generator states, and rebuilds a layer's pieces just before its backward).
// The arithmetic is plain TP's on row slices: dropout masks are drawn for the whole micro-batch
// in plain TP's order and sliced (layer.hpp LayerMasks), so losses and gradients equal plain TP's
// up to the rounding of smaller matrix products; N = 1 is plain TP itself (not this schedule).
//
// Module hooks (ZeRO-3) fire per layer: pre_forward before a layer's first chunk, post_forward
// after its last chunk was finished (the next layer may have started: two layers live at once),
// and likewise pre_backward / post_backward.
#pragma once

#include <dtk/module_hooks.hpp>

#include <functional>
#include <memory>
#include <vector>

#include "layer.hpp"

namespace dtk::gpt {

// The output layer (final LayerNorm, vocab-parallel logits, cross entropy) run per chunk inside
// the schedule, like a third stage: chunk c's logits are computed while the next chunk's last
// all-reduce is in flight; the cross entropy's two all-reduces of every chunk are issued before
// any is waited for; in backward chunk c's input-gradient all-reduce overlaps the next chunk's
// output-layer backward and the last layer's.
struct DominoHead {
  std::function<at::Tensor(const at::Tensor&)> norm;                             // final LayerNorm
  std::function<const at::Tensor&()> weight;                                     // [vocab / tp, hidden]
  TPGroup tp;                                                                    // vocab-parallel cross entropy
  int32_t module = -1;                                                           // hooks
};

// The embedding (word + position, dropout) run per chunk inside the schedule, as a first stage:
// chunk c's word-embedding all-reduce is in flight while the next chunks are looked up and until
// the first layer needs chunk c.
struct DominoEmbedding {
  std::function<at::Tensor(const at::Tensor&)> word_partial;  // ids -> this rank's share (VocabParallelEmbedding)
  std::function<at::Tensor(const at::Tensor&)> position;      // position ids -> position embedding
  std::function<const at::Tensor&()> anchor;                  // a parameter it reads (records the function)
  double dropout = 0;                                         // hidden_dropout
  int32_t module = -1;                                        // hooks
};

struct DominoStack {
  const Config* config = nullptr;
  const std::vector<std::unique_ptr<Layer>>* layers = nullptr;
  const ModuleHooks* hooks = nullptr;
  std::function<int32_t(size_t)> module_of;  // layer index -> module index (hooks)
  const DominoHead* head = nullptr;          // with labels: the output layer joins the schedule
  const DominoEmbedding* embedding = nullptr;  // with tokens: the embedding joins the schedule
};

// What the stack runs on: the hidden states [b, s, h], or (with stack.embedding) token and
// position ids [b, s]; optional attention mask and labels.
struct DominoInputs {
  at::Tensor hidden, tokens, positions, mask, labels;
};

// The layers with N = config->domino_chunks chunks (2 <= N <= b). Training with grad mode on
// builds the graph described above; otherwise the forward schedule alone runs. With tokens the
// embedding runs per chunk first; with labels ([b, s] int64) and stack.head the output layer runs
// per chunk last and the result is the per-token loss [b, s] (fp32); otherwise the hidden states
// [b, s, h].
at::Tensor domino_forward(const DominoStack& stack, const DominoInputs& in, DropoutRng& rng, bool training);

}  // namespace dtk::gpt
