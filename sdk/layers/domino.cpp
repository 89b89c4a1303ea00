// domino.cpp — see dtk/layers/domino.hpp.
#include <dtk/layers/domino.hpp>

#include <dtk/trace.hpp>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <array>
#include <optional>

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Comm::Work moves but has no move assignment: completes what `into` held (Work's destructor
// waits) and takes `from`'s collective.
void replace_work(std::optional<Comm::Work>& into, std::optional<Comm::Work>& from) {
  into.reset();
  into.emplace(std::move(*from));
}

// An input gradient whose all-reduce is in flight: the column projection's backward fills it.
// Under sequence parallelism (tp.splits_sequence()) the gradient is reduce-scattered into this
// rank's rows of the sequence instead (`send`: the reordered input, alive until the wait), and
// `output_grad` receives the gradient of the stage's reduce-scattered output (OutputGradPort).
struct GradSlot {
  at::Tensor buffer, send, output_grad;
  std::optional<Comm::Work> work;
  TPGroup tp;
};

// Under sequence parallelism a stage's backward starts with the all-gather of its output
// gradient, which the row-parallel backward needs whole. To put that gather in flight while other
// chunks compute, each piece's graph is cut at the reduce-scattered output: this identity hands
// the output gradient to the slot instead of passing it on, and the backward of the rest (from
// the partial sum on) runs separately once the gather is back. `anchor` is any input that needs a
// gradient (the piece's input), so that the function is recorded; it gets none from here.
struct OutputGradPort : public torch::autograd::Function<OutputGradPort> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& /*anchor*/, GradSlot* slot) {
    ctx->saved_data["slot"] = reinterpret_cast<int64_t>(slot);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    reinterpret_cast<GradSlot*>(ctx->saved_data["slot"].toInt())->output_grad = grad[0];
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Column-parallel linear projections of one input (replicated on the TP ranks, so forward needs
// no communication), outputs concatenated along the last dimension, whose backward computes the
// common input gradient, issues its all-reduce into `slot`, and then computes the weight and bias
// gradients while it is in flight. The input gradient reaches the caller through the slot, not
// through autograd: the caller waits for it when it needs it.
// `params`: the n_weights weights, then their biases (all or none: an undefined tensor cannot be
// an input of a custom autograd function). The weights themselves are saved (not views), as
// dtk::linear does, so ZeRO-3 may release them.
struct ColumnsAsyncGrad : public torch::autograd::Function<ColumnsAsyncGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params, int64_t n_weights,
                            GradSlot* slot) {
    const auto n = static_cast<size_t>(n_weights);
    const bool bias = params.size() == 2 * n;
    std::vector<at::Tensor> saved{x};
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < n; ++i) {
      saved.push_back(params[i]);
      out.push_back(dtk::linear_product(x, params[i], bias ? params[n + i] : at::Tensor()));
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["slot"] = reinterpret_cast<int64_t>(slot);
    ctx->saved_data["bias"] = bias;
    return n == 1 ? out[0] : at::cat(out, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const size_t n = saved.size() - 1;
    const bool bias = ctx->saved_data["bias"].toBool();
    auto* slot = reinterpret_cast<GradSlot*>(ctx->saved_data["slot"].toInt());
    const at::Tensor g = grad[0].reshape({-1, grad[0].size(-1)});
    std::vector<at::Tensor> gs;  // each projection's output gradient
    for (size_t i = 0, at_col = 0; i < n; ++i) {
      const int64_t cols = saved[1 + i].size(0);
      gs.push_back(n == 1 ? g : g.narrow(1, static_cast<int64_t>(at_col), cols));
      at_col += static_cast<size_t>(cols);
    }
    at::Tensor gx = dtk::mm(gs[0], saved[1]);
    for (size_t i = 1; i < n; ++i) dtk::addmm_(gx, gs[i], saved[1 + i]);
    if (slot->tp.splits_sequence()) {
      PendingShard shard = sequence_reduce_scatter_async(gx.view(x.sizes()), slot->tp);
      slot->buffer = std::move(shard.shard);
      slot->send = std::move(shard.send);
      replace_work(slot->work, shard.work);
    } else {
      slot->buffer = gx.view(x.sizes());
      slot->work.emplace(Comm::all_reduce_async(slot->buffer, DTK_GROUP_TENSOR_PARALLEL));
    }
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    variable_list out{at::Tensor()};
    for (size_t i = 0; i < n; ++i) out.push_back(dtk::mm(gs[i].t(), x2));
    if (bias)
      for (size_t i = 0; i < n; ++i) out.push_back(gs[i].sum(0));
    out.push_back(at::Tensor());  // n_weights
    out.push_back(at::Tensor());  // slot
    return out;
  }
};

// The projections of `columns` on x through ColumnsAsyncGrad.
at::Tensor project_async(const at::Tensor& x, const std::vector<const ColumnParallelLinear*>& columns, GradSlot* slot) {
  std::vector<at::Tensor> params;
  for (const ColumnParallelLinear* c : columns) params.push_back(c->weight);
  const bool bias = columns.front()->bias.defined();
  for (const ColumnParallelLinear* c : columns) {
    if (c->bias.defined() != bias)
      throw Error("Domino: a stage's column-parallel projections must all have biases or none");
    if (bias) params.push_back(c->bias);
  }
  return ColumnsAsyncGrad::apply(x, at::TensorList(params), static_cast<int64_t>(columns.size()), slot);
}

// The same projections without a graph (evaluation, recompute's first pass).
at::Tensor project(const at::Tensor& x, const std::vector<const ColumnParallelLinear*>& columns) {
  if (columns.size() == 1) return dtk::linear_product(x, columns[0]->weight, columns[0]->bias);
  std::vector<at::Tensor> out;
  for (const ColumnParallelLinear* c : columns) out.push_back(dtk::linear_product(x, c->weight, c->bias));
  return at::cat(out, -1);
}

// The row-parallel partial sum's all-reduce, issued in forward and waited by the caller before
// the result is read (identity in backward: Megatron's reduce_from_tensor_model_parallel_region).
struct ReduceAsync : public torch::autograd::Function<ReduceAsync> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& partial, std::optional<Comm::Work>* work) {
    at::Tensor buffer = partial.contiguous().clone();
    work->emplace(Comm::all_reduce_async(buffer, DTK_GROUP_TENSOR_PARALLEL));
    return buffer;
  }
  static variable_list backward(AutogradContext*, variable_list grad) { return {grad[0], at::Tensor()}; }
};

// Sequence parallelism's counterpart (the embedding's; the layers' stages cut their graph there,
// see OutputGradPort): the row-parallel partial sum reduce-scattered along the sequence in forward
// (waited by the caller), its gradient all-gathered in backward.
struct ReduceScatterAsync : public torch::autograd::Function<ReduceScatterAsync> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& partial, std::optional<Comm::Work>* work,
                            at::Tensor* send, TPGroup tp) {
    ctx->saved_data["tp_rank"] = static_cast<int64_t>(tp.rank);
    ctx->saved_data["tp_size"] = static_cast<int64_t>(tp.size);
    PendingShard p = sequence_reduce_scatter_async(partial, tp);
    replace_work(*work, p.work);
    *send = std::move(p.send);
    return p.shard;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    TPGroup tp{static_cast<int>(ctx->saved_data["tp_rank"].toInt()),
               static_cast<int>(ctx->saved_data["tp_size"].toInt()), true};
    return {sequence_all_gather(grad[0], tp), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// One (layer, stage, chunk) of a training forward: the stage input (a leaf), its LayerNorm output
// (graph from the input), the stage output (graph from the input and the LayerNorm output, cut at
// the column projection's input), and the slot of the input-gradient all-reduce.
// Under sequence parallelism the stage output's graph is cut again at the reduce-scattered output
// (OutputGradPort): `partial` is where the rest of the graph starts, the row-parallel partial
// sum's gradient edge (the edge, not the tensor: the whole-sequence sum is not kept).
struct Piece {
  at::Tensor in, ln_out, out;
  torch::autograd::Edge partial;
  std::unique_ptr<GradSlot> slot;

  // Starts the piece's graph (grad mode on) at `input`: the leaf `in`, its LayerNorm output, and
  // the cut after it, which is returned: the column projection's input.
  // Under sequence parallelism the cut is this rank's rows of the LayerNorm output, without a
  // graph: the column projections read its all-gather and send its gradient back through the
  // slot, reduce-scattered.
  template <class Norm>
  at::Tensor begin(const at::Tensor& input, Norm&& norm, const TPGroup& tp) {
    slot = std::make_unique<GradSlot>();
    slot->tp = tp;
    in = input.detach().requires_grad_(true);
    ln_out = norm(in);
    if (tp.splits_sequence()) return ln_out.detach();
    return ln_out.detach().requires_grad_(true);
  }
};

// A stage of one chunk whose forward all-reduce is in flight.
struct InFlight {
  size_t layer = 0;
  int stage = 0;  // -1: the embedding
  at::Tensor in, reduced, send;
  torch::autograd::Edge partial;  // a layer stage's partial sum under sequence parallelism, with `graph`
  std::optional<Comm::Work> work;
  bool active = false;

  // Issues the all-reduce of this rank's partial sum (the reduce-scatter of its rows of the
  // sequence under sequence parallelism); `reduced` holds the result after the wait. With `graph`
  // through ReduceAsync (the embedding's reduce-scatter through ReduceScatterAsync; a layer
  // stage's keeps the partial sum's edge for the piece, see Piece), else on the partial sum itself.
  void issue(const at::Tensor& partial, bool graph, const TPGroup& tp) {
    if (tp.splits_sequence()) {
      if (graph && stage < 0) {
        reduced = ReduceScatterAsync::apply(partial, &work, &send, tp);
        return;
      }
      if (graph) this->partial = torch::autograd::impl::gradient_edge(partial);
      PendingShard p = sequence_reduce_scatter_async(partial.detach(), tp);
      reduced = std::move(p.shard), send = std::move(p.send);
      replace_work(work, p.work);
      return;
    }
    if (graph) {
      reduced = ReduceAsync::apply(partial, &work);
      return;
    }
    reduced = partial.contiguous();
    work.emplace(Comm::all_reduce_async(reduced, DTK_GROUP_TENSOR_PARALLEL));
  }
};

const char* const kStageName[2] = {"attention", "mlp"};

struct State : torch::CustomClassHolder {
  DominoStack stack;
  at::Tensor mask;  // the micro-batch's attention mask or undefined
  bool training = true, recompute = false;
  // seq: the whole sequence; local_seq: this rank's rows of it (seq / tp under sequence
  // parallelism), the length of the hidden states between the layers' blocks.
  int64_t batch = 0, seq = 0, local_seq = 0, chunks = 1;
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> start, rows;                       // chunk c = rows [start[c], start[c] + rows[c])
  std::vector<LayerMasks> masks;                          // per layer, whole micro-batch
  std::vector<std::array<std::vector<Piece>, 2>> pieces;  // [layer][stage][chunk]
  std::vector<std::vector<at::Tensor>> layer_inputs;      // recompute: [layer][chunk]
  std::vector<DropoutRng> layer_rng;                      // recompute: generators before the layer
  at::Tensor labels;                                      // with the output layer in the schedule
  bool embedding_graph = false;                           // the embedding's pieces keep their graph
  std::vector<Piece> head_pieces;                         // [chunk]
  std::vector<at::Tensor> head_inputs;                    // recompute: [chunk]

  bool with_head() const { return stack.head && labels.defined(); }
  at::Tensor tokens;                    // with the embedding in the schedule
  at::Tensor positions;                 // [b or 1, s] or undefined
  at::Tensor layer_positions;           // the layers' (the whole sequence's under CP) or undefined
  DropoutMask embedding_keep;           // its dropout mask, whole micro-batch
  std::vector<Piece> embedding_pieces;  // [chunk]: only `out` (no input gradient)
  bool with_embedding() const { return stack.embedding && tokens.defined(); }

  const DominoLayer& layer(size_t l) const { return *stack.layers[l]; }

  void fire(ModuleHooks::HookFn fn, size_t l, const char* what) const { fire_module(fn, stack.module_of(l), what); }
  void fire_module(ModuleHooks::HookFn fn, int32_t module, const char* what) const {
    if (const dtk_module_hooks* t = stack.hooks ? stack.hooks->table() : nullptr)
      ModuleHooks::fire(t, fn, module, what);
  }

  // The output layer's logits on chunk c's finished hidden states, with its cross entropy begun
  // (the row maxima's all-reduce in flight).
  VocabParallelCrossEntropy head_begin(size_t c, const at::Tensor& in, bool graph, bool save_inputs) {
    TraceSpan span("compute", [&] { return "output layer, chunk " + std::to_string(c); });
    if (save_inputs) head_inputs[c] = in;
    const DominoHead& head = *stack.head;
    const at::Tensor labels_c = labels.narrow(0, start[c], rows[c]);
    at::Tensor logits;
    if (!graph) {
      at::NoGradGuard no_grad;
      logits = dtk::linear_product(sequence_all_gather(head.norm(in), stack.tp), head.weight());
    } else {
      at::AutoGradMode enable(true);
      Piece& p = head_pieces[c];
      const at::Tensor ln_leaf = sequence_all_gather(p.begin(in, head.norm, stack.tp), stack.tp);
      logits = ColumnsAsyncGrad::apply(ln_leaf, at::TensorList(head.weight()), int64_t{1}, p.slot.get());
    }
    VocabParallelCrossEntropy ce(logits, labels_c, head.tp);
    ce.reduce_max();
    return ce;
  }

  // The output layer on every chunk, between its forward hooks; `input(c)` gives chunk c's hidden
  // states just before its turn (after the last layer: finishing that chunk, so chunk c's logits
  // are computed while the later chunks' last all-reduces are in flight). The cross entropy runs
  // in phases across the chunks: every chunk's maxima all-reduce is issued before the first is
  // waited for, then every chunk's sums all-reduce, so each overlaps the other chunks' work.
  template <class Input>
  std::vector<at::Tensor> run_head(Input&& input, bool graph, bool save_inputs) {
    const size_t n = static_cast<size_t>(chunks);
    std::vector<at::Tensor> out(n);
    {
      at::AutoGradMode mode(graph);
      fire_module(&dtk_module_hooks::pre_forward, stack.head->module, "pre_forward");
    }
    std::vector<std::optional<VocabParallelCrossEntropy>> ce(n);
    for (size_t c = 0; c < n; ++c) ce[c].emplace(head_begin(c, input(c), graph, save_inputs));
    for (size_t c = 0; c < n; ++c) {
      TraceSpan span("compute", [&] { return "cross entropy, chunk " + std::to_string(c); });
      ce[c]->reduce_sums();
    }
    for (size_t c = 0; c < n; ++c) {
      TraceSpan span("compute", [&] { return "loss, chunk " + std::to_string(c); });
      at::AutoGradMode mode(graph);
      if (!graph) {
        out[c] = ce[c]->loss();
        continue;
      }
      Piece& p = head_pieces[c];
      p.out = ce[c]->loss();
      out[c] = p.out.detach();
    }
    at::AutoGradMode mode(graph);
    fire_module(&dtk_module_hooks::post_forward, stack.head->module, "post_forward");
    return out;
  }

  // Chunk c's rows of position ids (one row [1, s] serves every sequence, as plain TP's broadcast):
  // the embedding's (`positions`), or the layers'.
  at::Tensor chunk_positions(size_t c, const at::Tensor& of) const {
    if (!of.defined() || of.size(0) == 1) return of;
    return of.narrow(0, start[c], rows[c]);
  }
  at::Tensor chunk_positions(size_t c) const { return chunk_positions(c, positions); }

  at::Tensor chunk_mask(size_t c) const {
    if (!mask.defined() || mask.size(0) == 1) return mask;
    return mask.narrow(0, start[c], rows[c]);
  }

  // A mask of the whole micro-batch's [batch, seq, hidden], for chunk c's rows (and this rank's
  // rows of the sequence under sequence parallelism).
  DropoutMask hidden_mask(const DropoutMask& m, size_t c) const {
    const DropoutMask rows_c = m.rows(start[c], rows[c]);
    return stack.tp.splits_sequence() ? rows_c.sequence_rows(seq, stack.tp.rank * local_seq, local_seq) : rows_c;
  }

  // Finishes chunk c's in-flight stage: waits for its all-reduce, adds bias, dropout, residual.
  at::Tensor finish(InFlight& f, size_t c, bool graph) {
    f.work->wait();
    f.work.reset();
    f.send = at::Tensor();
    f.active = false;
    if (f.stage < 0) return finish_embedding(f, c);
    const LayerMasks& m = masks[f.layer];
    at::Tensor out;
    {
      at::AutoGradMode mode(graph);
      at::Tensor reduced = f.reduced;
      if (graph && stack.tp.splits_sequence()) {
        Piece& p = pieces[f.layer][static_cast<size_t>(f.stage)][c];
        p.partial = std::move(f.partial);
        reduced = OutputGradPort::apply(reduced, f.in, p.slot.get());
      }
      // in + dropout(reduced + bias): the rest of the row-parallel projection, then the residual.
      const at::Tensor& bias = layer(f.layer).stage_row(f.stage).bias;
      out = f.in + apply_dropout(bias.defined() ? reduced + bias : reduced,
                                 hidden_mask(f.stage == 0 ? m.attention_out : m.mlp_out, c));
    }
    if (graph) pieces[f.layer][static_cast<size_t>(f.stage)][c].out = out;
    f.in = f.reduced = at::Tensor();
    if (f.stage == 1 && c + 1 == static_cast<size_t>(chunks)) {
      masks[f.layer] = LayerMasks();  // the layer is done (a graph keeps the slices it saved)
      at::AutoGradMode mode(graph);   // hooks see the grad mode of the work they surround
      fire(&dtk_module_hooks::post_forward, f.layer, "post_forward");
    }
    return graph ? out.detach() : out;
  }

  // Chunk c's embedding after its all-reduce: + position embedding, dropout (plain TP's order).
  // Its graph is kept whenever the function records one (recompute does not rerun it).
  at::Tensor finish_embedding(InFlight& f, size_t c) {
    const DominoEmbedding& e = *stack.embedding;
    at::Tensor out;
    {
      at::AutoGradMode mode(embedding_graph);
      // Position ids of one row ([1, s]) serve every sequence, as in plain TP's broadcast add.
      out = e.position ? f.reduced + e.position(sequence_shard(chunk_positions(c), stack.tp)) : f.reduced;
      out = apply_dropout(out, hidden_mask(embedding_keep, c));
    }
    f.reduced = at::Tensor();
    if (embedding_graph) embedding_pieces[c].out = out;
    if (c + 1 == static_cast<size_t>(chunks)) {
      embedding_keep = DropoutMask();
      at::AutoGradMode mode(embedding_graph);
      fire_module(&dtk_module_hooks::post_forward, e.module, "post_forward");
    }
    return embedding_graph ? out.detach() : out;
  }

  // Looks every chunk's tokens up and issues their all-reduces (stage -1 of `flight`).
  void start_embedding(std::vector<InFlight>& flight, DropoutRng& rng) {
    const DominoEmbedding& e = *stack.embedding;
    at::AutoGradMode mode(embedding_graph);
    fire_module(&dtk_module_hooks::pre_forward, e.module, "pre_forward");
    // Plain TP draws the embedding's mask before the first layer's: so does this.
    if (training && e.dropout > 0.0) embedding_keep = draw_keep_mask({batch, seq, stack.hidden}, e.dropout, rng.hidden);
    for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) {
      TraceSpan span("compute", [&] { return "embedding, chunk " + std::to_string(c); });
      InFlight& f = flight[c];
      f.stage = -1;
      f.layer = 0;
      f.active = true;
      f.issue(e.word_partial(tokens.narrow(0, start[c], rows[c])), embedding_graph, stack.tp);
    }
  }

  // Layers [first, last) on the finished chunk inputs `h`; returns the finished outputs. With
  // `graph` each piece's graph is kept in `pieces`; with `save_inputs` (recompute) the layers'
  // chunk inputs and generator states are kept instead.
  std::vector<at::Tensor> run_forward(size_t first, size_t last, std::vector<at::Tensor> h, DropoutRng& rng, bool graph,
                                      bool save_inputs, bool head = false, bool embed = false) {
    std::vector<InFlight> flight(static_cast<size_t>(chunks));
    if (embed) start_embedding(flight, rng);  // h is then filled by the first layer's finishes
    for (size_t l = first; l < last; ++l) {
      {
        at::AutoGradMode mode(graph);
        fire(&dtk_module_hooks::pre_forward, l, "pre_forward");
      }
      if (save_inputs) layer_rng[l] = rng.clone();
      masks[l] = layer(l).draw_masks(batch, seq, rng, training);
      if (graph) {
        for (auto& stage : pieces[l]) {
          stage.clear();
          stage.resize(static_cast<size_t>(chunks));
        }
      }
      for (int s = 0; s < 2; ++s) {
        const DominoLayer& ly = layer(l);
        const std::vector<const ColumnParallelLinear*> columns = ly.stage_columns(s);
        // Chunk c up to the column projections' input: its previous stage finished, normalised.
        // Under sequence parallelism that input's all-gather is then issued, and every chunk is
        // prepared before the first is projected, so chunk c's gather is in flight while the other
        // chunks are normalised and projected; otherwise each chunk is projected at once.
        std::vector<std::optional<PendingGather>> gathers(static_cast<size_t>(chunks));
        auto prepare = [&](size_t c) -> at::Tensor {
          TraceSpan span("compute", [&] { return piece_name(l, s, c) + ", norm"; });
          at::Tensor in = flight[c].active ? finish(flight[c], c, graph) : h[c];
          if (s == 0 && save_inputs) layer_inputs[l][c] = in;
          auto norm = [&](const at::Tensor& x) { return ly.stage_norm(s, x); };
          at::Tensor cut;
          if (graph) {
            at::AutoGradMode enable(true);
            Piece& p = pieces[l][static_cast<size_t>(s)][c];
            cut = p.begin(in, norm, stack.tp);
            flight[c].in = p.in;
          } else {
            at::NoGradGuard no_grad;
            cut = norm(in);
            flight[c].in = in;
          }
          if (stack.tp.splits_sequence()) gathers[c].emplace(sequence_all_gather_async(cut, stack.tp));
          return cut;
        };
        // Chunk c from the projections' input to its partial sum, whose reduction it issues.
        auto project_chunk = [&](size_t c, at::Tensor cut) {
          TraceSpan span("compute",
                         [&] { return piece_name(l, s, c) + (graph || !save_inputs ? "" : " (keeps input)"); });
          if (stack.tp.splits_sequence()) cut = gathers[c]->wait();
          DominoChunk chunk;
          chunk.mask = chunk_mask(c);
          chunk.positions = chunk_positions(c, layer_positions);
          if (s == 0) chunk.attention_probs = masks[l].rows(start[c], rows[c]).attention_probs;
          InFlight& f = flight[c];
          f.layer = l;
          f.stage = s;
          f.active = true;
          if (graph) {
            at::AutoGradMode enable(true);
            Piece& p = pieces[l][static_cast<size_t>(s)][c];
            f.issue(ly.stage_partial(s, project_async(cut, columns, p.slot.get()), chunk), graph, stack.tp);
          } else {
            at::NoGradGuard no_grad;
            f.issue(ly.stage_partial(s, project(cut, columns), chunk), /*graph=*/false, stack.tp);
          }
        };
        if (stack.tp.splits_sequence()) {
          std::vector<at::Tensor> cuts;
          for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) cuts.push_back(prepare(c));
          for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) project_chunk(c, cuts[c]);
        } else {
          for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) project_chunk(c, prepare(c));
        }
      }
    }
    auto finished = [&](size_t c) {
      TraceSpan span("compute", [&] { return "finish chunk " + std::to_string(c); });
      return finish(flight[c], c, graph);
    };
    if (head) return run_head(finished, graph, save_inputs);
    for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) h[c] = finished(c);
    return h;
  }

  // Waits for piece p's input-gradient all-reduce and runs its LayerNorm backward: the gradient
  // of the stage input (the residual part arrived with the stage's backward).
  // `module_done`: the module whose post_backward fires after the last chunk (-1: none).
  at::Tensor finish_backward(Piece& p, size_t c, int32_t module_done) {
    p.slot->work->wait();
    p.slot->work.reset();
    p.slot->send = at::Tensor();
    torch::autograd::backward({p.ln_out}, {p.slot->buffer});
    at::Tensor g = p.in.grad();
    p = Piece();
    if (module_done >= 0 && c + 1 == static_cast<size_t>(chunks))
      fire_module(&dtk_module_hooks::post_backward, module_done, "post_backward");
    return g;
  }

  struct Pending {
    Piece* piece = nullptr;  // its input-gradient all-reduce is in flight
    int32_t module_done = -1;
  };

  // Stage s of layer l backward under sequence parallelism, in two halves per chunk: the upper
  // one (from the stage output to the reduce-scattered output: residual, dropout, bias) ends by
  // issuing the all-gather of the output gradient; the lower one (from the partial sum: the
  // row-parallel product, attention or MLP, the column products) waits for it. Chunk c + 1's upper
  // half and gather are issued before chunk c's lower half, so each gather but the first is in
  // flight while the previous chunk's lower half computes.
  template <class Take>
  void stage_backward_gathering(size_t l, int s, std::vector<at::Tensor>& g, std::vector<Pending>& pending,
                                Take&& take) {
    const size_t n = static_cast<size_t>(chunks);
    std::vector<std::optional<PendingGather>> gathers(n);
    auto upper = [&](size_t c) {
      TraceSpan span("compute", [&] { return piece_name(l, s, c) + " backward, output"; });
      if (pending[c].piece) g[c] = take(c);
      Piece& p = pieces[l][static_cast<size_t>(s)][c];
      torch::autograd::backward({p.out}, {g[c]});
      p.out = at::Tensor();
      gathers[c].emplace(sequence_all_gather_async(p.slot->output_grad, stack.tp));
      p.slot->output_grad = at::Tensor();
    };
    auto lower = [&](size_t c) {
      TraceSpan span("compute", [&] { return piece_name(l, s, c) + " backward"; });
      Piece& p = pieces[l][static_cast<size_t>(s)][c];
      const at::Tensor whole = gathers[c]->wait();
      gathers[c].reset();
      torch::autograd::Engine::get_default_engine().execute({p.partial}, {whole}, /*keep_graph=*/false,
                                                            /*create_graph=*/false, /*accumulate_grad=*/true);
      p.partial = torch::autograd::Edge();
      pending[c] = {&p, s == 0 ? stack.module_of(l) : -1};
    };
    upper(0);
    for (size_t c = 1; c < n; ++c) {
      upper(c);
      lower(c - 1);
    }
    lower(n - 1);
  }

  std::vector<at::Tensor> run_backward(std::vector<at::Tensor> g) {
    const size_t n = layer_count();
    std::vector<Pending> pending(static_cast<size_t>(chunks));
    auto take = [&](size_t c) {
      Pending p = pending[c];
      pending[c] = Pending();
      return finish_backward(*p.piece, c, p.module_done);
    };
    if (with_head()) {
      if (recompute) {
        run_head([&](size_t c) { return head_inputs[c]; }, /*graph=*/true, /*save_inputs=*/false);
        head_inputs.clear();
      }
      fire_module(&dtk_module_hooks::pre_backward, stack.head->module, "pre_backward");
      for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) {
        TraceSpan span("compute", [&] { return "output layer, chunk " + std::to_string(c) + " backward"; });
        Piece& p = head_pieces[c];
        torch::autograd::backward({p.out}, {g[c]});
        p.out = at::Tensor();
        pending[c] = {&p, stack.head->module};
      }
    }
    for (size_t l = n; l-- > 0;) {
      if (recompute) {
        DropoutRng rng = layer_rng[l].clone();
        run_forward(l, l + 1, layer_inputs[l], rng, /*graph=*/true, /*save_inputs=*/false);
        layer_inputs[l].clear();
      }
      fire(&dtk_module_hooks::pre_backward, l, "pre_backward");
      for (int s = 1; s >= 0; --s) {
        if (stack.tp.splits_sequence()) {
          stage_backward_gathering(l, s, g, pending, take);
          continue;
        }
        for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) {
          TraceSpan span("compute", [&] { return piece_name(l, s, c) + " backward"; });
          if (pending[c].piece) g[c] = take(c);
          Piece& p = pieces[l][static_cast<size_t>(s)][c];
          torch::autograd::backward({p.out}, {g[c]});
          p.out = at::Tensor();
          pending[c] = {&p, s == 0 ? stack.module_of(l) : -1};
        }
      }
    }
    for (size_t c = 0; c < static_cast<size_t>(chunks); ++c) {
      TraceSpan span("compute", [&] { return "finish chunk " + std::to_string(c) + " backward"; });
      g[c] = take(c);
      if (!with_embedding()) continue;
      // The embedding's backward (word and position gradients), chunk by chunk.
      if (c == 0) fire_module(&dtk_module_hooks::pre_backward, stack.embedding->module, "pre_backward");
      torch::autograd::backward({embedding_pieces[c].out}, {g[c]});
      embedding_pieces[c] = Piece();
      if (c + 1 == static_cast<size_t>(chunks))
        fire_module(&dtk_module_hooks::post_backward, stack.embedding->module, "post_backward");
    }
    return g;
  }

  size_t layer_count() const { return stack.layers.size(); }

  // "layer 3 attention, chunk 1" (timeline spans).
  static std::string piece_name(size_t l, int s, size_t c) {
    return "layer " + std::to_string(l) + " " + kStageName[s] + ", chunk " + std::to_string(c);
  }

  void init(const DominoStack& s, const DominoInputs& in, bool train, bool graph) {
    stack = s;
    mask = in.mask;
    labels = in.labels;
    tokens = stack.embedding ? in.tokens : at::Tensor();
    positions = in.positions;
    layer_positions = in.layer_positions.defined() ? in.layer_positions : in.positions;
    embedding_graph = graph;
    const at::Tensor& x = with_embedding() ? tokens : in.hidden;
    if (labels.defined() &&
        (labels.dim() != 2 || labels.size(0) != x.size(0) ||
         labels.size(1) != x.size(1) * (with_embedding() || !stack.tp.splits_sequence() ? 1 : stack.tp.size)))
      throw Error(stack.model + ": 'labels' must be [batch, seq] like the tokens, got " + Model::shape_str(labels));
    head_pieces.resize(static_cast<size_t>(s.chunks));
    embedding_pieces.resize(static_cast<size_t>(s.chunks));
    training = train;
    batch = x.size(0);
    const int sp = stack.tp.splits_sequence() ? stack.tp.size : 1;
    // Token ids hold the whole sequence; hidden states this rank's rows of it.
    seq = with_embedding() ? x.size(1) : x.size(1) * sp;
    local_seq = seq / sp;
    device = x.device();
    dtype = with_embedding() ? stack.embedding->anchor().scalar_type() : x.scalar_type();
    chunks = s.chunks;
    if (chunks > batch)
      throw Error(stack.model + ": domino_chunks (" + std::to_string(chunks) + ") exceeds the micro-batch size (" +
                  std::to_string(batch) + "): each chunk needs at least one sequence");
    // Chunks as equal as possible; the first batch % chunks get one row more.
    for (int64_t c = 0, at_row = 0; c < chunks; ++c) {
      const int64_t r = batch / chunks + (c < batch % chunks ? 1 : 0);
      start.push_back(at_row);
      rows.push_back(r);
      at_row += r;
    }
    masks.resize(layer_count());
    pieces.resize(layer_count());
  }

  std::vector<at::Tensor> split(const at::Tensor& t) const {
    std::vector<at::Tensor> out;
    for (int64_t c = 0; c < chunks; ++c)
      out.push_back(t.narrow(0, start[static_cast<size_t>(c)], rows[static_cast<size_t>(c)]));
    return out;
  }
};

// The whole stack as one autograd function (see domino.hpp for why).
struct DominoFunction : public torch::autograd::Function<DominoFunction> {
  // `anchor`: the hidden input, or (embedding in the schedule) a parameter the embedding reads,
  // so the function is recorded; its gradient comes from the pieces' own backward.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& anchor, const DominoStack* stack,
                            const DominoInputs* in, DropoutRng* rng, bool training) {
    auto st = c10::make_intrusive<State>();
    st->init(*stack, *in, training, /*graph=*/true);
    const bool embed = st->with_embedding();
    std::vector<at::Tensor> first =
        embed ? std::vector<at::Tensor>(static_cast<size_t>(st->chunks)) : st->split(anchor);
    st->recompute = stack->recompute;
    const size_t n = st->layer_count();
    std::vector<at::Tensor> out;
    if (st->recompute) {
      st->layer_inputs.assign(n, std::vector<at::Tensor>(static_cast<size_t>(st->chunks)));
      st->layer_rng.resize(n);
      st->head_inputs.resize(static_cast<size_t>(st->chunks));
      at::NoGradGuard no_grad;
      out = st->run_forward(0, n, first, *rng, /*graph=*/false, /*save_inputs=*/true, st->with_head(), embed);
    } else {
      out = st->run_forward(0, n, first, *rng, /*graph=*/true, /*save_inputs=*/false, st->with_head(), embed);
    }
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    ctx->saved_data["model"] = stack->model;
    at::NoGradGuard no_grad;
    return at::cat(out, 0);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto it = ctx->saved_data.find("state");
    if (it == ctx->saved_data.end())
      throw Error(ctx->saved_data["model"].toStringRef() +
                  ": the Domino schedule (domino_chunks > 1) runs backward once per forward (no retain_graph)");
    auto st = c10::static_intrusive_pointer_cast<State>(it->second.toCapsule());
    ctx->saved_data.erase(it);
    at::Tensor g = grad[0];
    if (!g.defined())
      g = st->with_head() ? at::zeros({st->batch, st->seq}, at::TensorOptions().device(st->device))
                          : at::zeros({st->batch, st->local_seq, st->stack.hidden},
                                      at::TensorOptions().device(st->device).dtype(st->dtype));
    std::vector<at::Tensor> gx = st->run_backward(st->split(g));
    at::Tensor g_anchor = st->with_embedding() ? at::Tensor() : at::cat(gx, 0);
    return {g_anchor, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

LayerMasks LayerMasks::rows(int64_t start, int64_t length) const {
  return {attention_probs.rows(start, length), attention_out.rows(start, length), mlp_out.rows(start, length)};
}

LayerMasks draw_layer_masks(int64_t batch, int64_t seq, int64_t heads_local, int64_t hidden, double attention_dropout,
                            double hidden_dropout, DropoutRng& rng, bool training, const ContextParallel& cp) {
  LayerMasks m;
  if (!training) return m;
  // The plain layer's draws, per generator in the same order: attention probabilities from the
  // TENSOR_PARALLEL stream; the attention and MLP outputs from the DEFAULT stream.
  if (attention_dropout > 0.0) {
    const int64_t whole = seq * cp.size;
    m.attention_probs = draw_keep_mask(cp.gathers_keys() ? cp.gathered_probs_shape(batch, heads_local, seq)
                                                         : std::vector<int64_t>{batch, heads_local, whole, whole},
                                       attention_dropout, rng.attention);
  }
  if (hidden_dropout > 0.0) {
    m.attention_out = draw_keep_mask({batch, seq, hidden}, hidden_dropout, rng.hidden);
    m.mlp_out = draw_keep_mask({batch, seq, hidden}, hidden_dropout, rng.hidden);
  }
  return m;
}

at::Tensor domino_forward(const DominoStack& stack, const DominoInputs& in, DropoutRng& rng, bool training) {
  const bool embed = stack.embedding && in.tokens.defined();
  if (at::GradMode::is_enabled() && !stack.layers.empty()) {
    // An input must need a gradient for the function to be recorded: the hidden input (made a
    // leaf if it is not), or a parameter of the embedding.
    at::Tensor anchor = embed ? stack.embedding->anchor()
                              : (in.hidden.requires_grad() ? in.hidden : in.hidden.detach().requires_grad_(true));
    return DominoFunction::apply(anchor, &stack, &in, &rng, training);
  }
  State st;
  st.init(stack, in, training, /*graph=*/false);
  std::vector<at::Tensor> first = embed ? std::vector<at::Tensor>(static_cast<size_t>(st.chunks)) : st.split(in.hidden);
  return at::cat(
      st.run_forward(0, st.layer_count(), first, rng, /*graph=*/false, /*save_inputs=*/false, st.with_head(), embed),
      0);
}

}  // namespace dtk::layers
