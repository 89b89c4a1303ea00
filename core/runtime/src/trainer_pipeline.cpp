// trainer_pipeline.cpp — pipeline parallelism in the Trainer (distributed.pipeline_model_parallel_size
// > 1): Megatron's forward_backward_pipelining_without_interleaving (PipeDream-flush, "1F1B"),
// and with several model chunks per rank its _with_interleaving (below, "The interleaved schedule").
//
// Each stage's model holds its layers (the model plugin builds them from pre_process /
// post_process and pp_rank); the step plugin runs on every stage with the same batch. Between
// neighbouring stages the host sends the activations [micro_batch, seq, hidden] forward and their
// gradients back over the pipeline group (point to point, every wait bounded by the collective
// timeout). The shape is agreed from the configuration, not sent per micro-batch.
//
//   stage s of p, m micro-batches:  warm-up  min(p - s - 1, m) forwards
//                                   steady   m - warm-up times: forward, then backward of the oldest
//                                   cool-down the remaining backwards
// so stage s holds at most p - s activations at once, and the bubble is (p - 1) / (m + p - 1) of
// an iteration. Sends are asynchronous (each waited once the schedule knows it arrived),
// receives block, so no two stages wait on each other.
//
// Tied embeddings (the first stage's word embedding and the last stage's output weight, both
// listed with dtk_param_info.shared): their gradients are summed over the pipeline group after
// the strategy reduced them (Megatron's embedding-group all-reduce; stages in between add zeros),
// and norms count them on the first stage only.
#include <deque>
#include <exception>
#include <limits>
#include <list>
#include <map>

#include "dtk/core/comm.hpp"
#include "dtk/core/cuda_support.hpp"
#include "dtk/core/trace.hpp"
#include "dtk/core/trainer.hpp"

namespace dtk::core {

using host::HostError;

std::vector<int64_t> Trainer::stage_activation_shape() const {
  return {plan_.micro_batch_size(), plan_.seq_length(), model_->info().hidden_size};
}

at::Tensor Trainer::receive_stage_tensor(int32_t peer, int32_t tag, Phase phase, const char* what) {
  // Megatron's pipeline timers (logging.timing_log_level=2): min and max over the ranks show the
  // most and the least waiting stage.
  auto timer = timers_.scope(phase);
  at::Tensor t =
      at::empty(stage_activation_shape(), at::TensorOptions().dtype(stage_dtype()).device(training_device()));
  const int64_t start = trace::now_ns();
  recv(t, DTK_GROUP_PIPELINE_PARALLEL, peer, tag).wait();
  if (trace::active()) trace::span(what, "wait", start, trace::now_ns());
  return t;
}

at::ScalarType Trainer::stage_dtype() const { return to_scalar_type(build_context(model_slot_).params_dtype); }

void Trainer::check_stage_output(const at::Tensor& out) const {
  const std::vector<int64_t> shape = stage_activation_shape();
  if (out.sizes() == at::IntArrayRef(shape) && out.scalar_type() == stage_dtype()) return;
  throw HostError("step plugin '" + step_slot_.plugin.name() + "' with model plugin '" + model_slot_.plugin.name() +
                  "': pipeline stage " + std::to_string(topo_.pp_rank) + " produced " + Model::shape_str(out) + " " +
                  std::string(c10::toString(out.scalar_type())) + ", the stages agreed on " +
                  Model::shape_str(at::empty(shape)) + " " + c10::toString(stage_dtype()) +
                  " [micro_batch_size, seq_length, hidden_size] hidden states in the parameters' dtype (is the step "
                  "pipeline-aware? docs/plugin-guide.md)");
}

namespace {

// The previous stage's output as the model's "hidden_states" for one forward, taken back after
// it however it ends.
class StageInput {
 public:
  explicit StageInput(ModelInstance& model) : model_(model) {}
  ~StageInput() { model_.set_pipeline_input(at::Tensor()); }
  void set(const at::Tensor& input) { model_.set_pipeline_input(input); }
  StageInput(const StageInput&) = delete;
  StageInput& operator=(const StageInput&) = delete;

 private:
  ModelInstance& model_;
};

// Sends in flight, each waited once it is known to be done. On an error the ones left are handed
// over unwaited (the process is ending): a send whose receiver will never come would otherwise
// hold the error back for a whole collective timeout each.
class PendingSends {
 public:
  ~PendingSends() {
    if (!std::uncaught_exceptions()) return;
    for (auto& [index, work] : sends_) (void)work.release();
  }
  void add(int64_t index, Work w) { sends_.emplace_back(index, std::move(w)); }
  // Waits every send of an index <= `index`, in the order added (done: their receiver has moved on).
  void wait_through(int64_t index) {
    while (!sends_.empty() && sends_.front().first <= index) {
      sends_.front().second.wait();
      sends_.pop_front();
    }
  }
  // Waits the send of index `index`, wherever it is (the interleaved schedule learns them done out
  // of order).
  void wait_for(int64_t index) {
    for (auto it = sends_.begin(); it != sends_.end(); ++it)
      if (it->first == index) {
        it->second.wait();
        sends_.erase(it);
        return;
      }
  }
  void wait_all() { wait_through(std::numeric_limits<int64_t>::max()); }

 private:
  std::list<std::pair<int64_t, Work>> sends_;
};

}  // namespace

void Trainer::pipeline_forward_backward(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) {
  const int stage = topo_.pp_rank, stages = topo_.pp_size;
  const bool first = stage == 0, last = stage == stages - 1;
  const std::vector<int64_t> shape = stage_activation_shape();
  const auto options = at::TensorOptions().dtype(stage_dtype()).device(training_device());
  auto receive = [&](int32_t peer, const char* what) {
    return receive_stage_tensor(peer, 0, peer < stage ? Phase::kForwardRecv : Phase::kBackwardRecv, what);
  };
  // A send never blocks the schedule: it is waited once known to be done. The activations of
  // micro-batch k were received once their gradient came back; the gradients of micro-batch j
  // were received once the previous stage sends the activations of j + (its warm-up) + 1 (its
  // backward of j comes before that forward in 1F1B).
  PendingSends activation_sends, gradient_sends;
  const int64_t previous_warmup = std::min<int64_t>(stages - stage, num_micro);

  struct Pending {
    at::Tensor input, output;  // this stage's input (a leaf) and output of one micro-batch
  };
  std::deque<Pending> pending;
  int64_t forwards = 0, backwards = 0;
  auto forward = [&] {
    at::Tensor input;
    std::vector<std::pair<std::string, double>> metrics;
    at::Tensor output;
    {
      StageInput staged(*model_);
      // Received after the batch check (it waits for every rank, the previous stage included).
      output = forward_micro_batch(iteration, forwards, &metrics, [&] {
        if (first) return;
        input = receive(stage - 1, "receive activations").requires_grad_(true);
        gradient_sends.wait_through(forwards - previous_warmup - 1);
        staged.set(input);
      });
    }
    if (last) {
      check_forward_output(output, input);
    } else {
      // Sent before the graph check, which waits for every rank.
      check_stage_output(output);
      activation_sends.add(forwards, send(output.detach(), DTK_GROUP_PIPELINE_PARALLEL, stage + 1));
      check_loss(output, input);
    }
    r.metrics.add(metrics);
    pending.push_back({input, output});
    ++forwards;
  };
  auto backward = [&] {
    at::Tensor grad;
    if (!last) {
      grad = receive(stage + 1, "receive gradients");
      activation_sends.wait_through(backwards);
    }
    Pending p = std::move(pending.front());
    pending.pop_front();
    backward_micro_batch(iteration, backwards, num_micro, scale, p.output, grad);
    if (!first) {
      at::Tensor g = p.input.grad();
      if (!g.defined()) g = at::zeros(shape, options);  // the stage's output did not depend on it
      gradient_sends.add(backwards, send(g, DTK_GROUP_PIPELINE_PARALLEL, stage - 1));
    }
    ++backwards;
  };

  const int64_t warmup = std::min<int64_t>(stages - stage - 1, num_micro);
  for (int64_t i = 0; i < warmup; ++i) forward();
  for (int64_t i = warmup; i < num_micro; ++i) {
    forward();
    backward();
  }
  while (backwards < num_micro) backward();
  activation_sends.wait_all();
  gradient_sends.wait_all();
  // The schedule's own waits, before the collectives below use the pipeline group too.
  r.pipeline_parallel_comm = comm_timing(DTK_GROUP_PIPELINE_PARALLEL);
  // The loss and the step's metrics exist on the last stage: every stage logs the same.
  r.metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages - 1);
}

void Trainer::pipeline_evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) {
  const int stage = topo_.pp_rank, stages = topo_.pp_size;
  const std::vector<int64_t> shape = stage_activation_shape();
  const auto options = at::TensorOptions().dtype(stage_dtype()).device(training_device());
  PendingSends sends;  // at most one: the next stage takes them in order and waits for nothing else
  for (int64_t k = 0; k < num_batches; ++k) {
    at::Tensor input;
    if (stage > 0) {
      input = at::empty(shape, options);
      recv(input, DTK_GROUP_PIPELINE_PARALLEL, stage - 1).wait();
    }
    std::vector<std::pair<std::string, double>> m;
    at::Tensor out;
    {
      StageInput staged(*model_);
      staged.set(input);
      out = step().forward_step(*model_, loader.next(), &m);
    }
    if (stage < stages - 1) {
      check_stage_output(out);
      sends.wait_all();
      sends.add(k, send(out, DTK_GROUP_PIPELINE_PARALLEL, stage + 1));
    }
    metrics.add(m);
  }
  sends.wait_all();
  metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages - 1);
}

// ---------------------------------------------------------------------------------------------
// The interleaved schedule (Megatron's forward_backward_pipelining_with_interleaving; Narayanan
// et al. 2021). Each rank holds v model chunks: chunk c of rank r is virtual stage c x p + r of a
// v x p stage pipeline, so activations go round the ranks v times (the last rank's chunk c feeds
// the first rank's chunk c + 1). The m x v chunk-forwards run in the order
//   position k: chunk (k mod p v) / p, micro-batch (k / p v) x p + k mod p
// (p micro-batches through chunk 0, the same p through chunk 1, ... then the next p), backwards
// in the same order with the chunks reversed. Warm-up: 2 (p - r - 1) + (v - 1) p forwards (all
// of them when m == p), then steady one forward and one backward, then the cool-down backwards.
// The bubble shrinks v times: (p - 1) / v / (m + (p - 1) / v) of an iteration.
//
// Communication: with p == 2 the next and the previous rank are the same one, so activations and
// gradients travel with their own tags; every rank sends and receives each kind in the schedule's
// order. The micro-batches of the iteration are fetched and checked first: the checks wait for
// every rank, and inside the schedule the ranks are at different micro-batches.
namespace {
constexpr int32_t kActivationTag = 0, kGradientTag = 1;

// Chunk 0 selected again when a schedule ends, however it ends (what the rest of the Trainer uses).
class FirstChunkAfter {
 public:
  explicit FirstChunkAfter(ModelInstance& model) : model_(model) {}
  ~FirstChunkAfter() { model_.select_chunk(0); }
  FirstChunkAfter(const FirstChunkAfter&) = delete;
  FirstChunkAfter& operator=(const FirstChunkAfter&) = delete;

 private:
  ModelInstance& model_;
};

// Where a position of the schedule is (Megatron's get_model_chunk_id and its micro-batch).
struct InterleavedOrder {
  int64_t p, v;
  int chunk(int64_t k, bool forward) const {
    const auto c = static_cast<int>((k % (p * v)) / p);
    return forward ? c : static_cast<int>(v) - 1 - c;
  }
  int64_t micro_batch(int64_t k) const { return (k / (p * v)) * p + k % p; }
  // Forwards before the first backward on pipeline rank `rank` (Megatron's num_warmup_microbatches).
  int64_t warmup(int64_t rank, int64_t num_micro) const {
    if (num_micro == p) return num_micro * v;
    return std::min(num_micro * v, 2 * (p - rank - 1) + (v - 1) * p);
  }
};
}  // namespace

std::string Trainer::interleaving_refusal(int64_t num_micro) const {
  if (virtual_stages() <= 1 || num_micro % topo_.pp_size == 0) return "";
  return "config: the interleaved pipeline schedule (distributed.virtual_pipeline_model_parallel_size " +
         std::to_string(virtual_stages()) + ") needs the micro-batches per step (" + std::to_string(num_micro) +
         ": train.global_batch_size / (train.micro_batch_size x data-parallel size)) to be a multiple of "
         "distributed.pipeline_model_parallel_size " +
         std::to_string(topo_.pp_size);
}

void Trainer::interleaved_forward_backward(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) {
  if (const std::string refusal = interleaving_refusal(num_micro); !refusal.empty()) throw HostError(refusal);
  const int rank = topo_.pp_rank, stages = topo_.pp_size, chunks = model_->num_chunks();
  const InterleavedOrder order{stages, chunks};
  const int prev = (rank + stages - 1) % stages, next = (rank + 1) % stages;
  const FirstChunkAfter reset(*model_);
  auto first_stage = [&](int c) { return rank == 0 && c == 0; };                   // the embedding's chunk
  auto last_stage = [&](int c) { return rank == stages - 1 && c == chunks - 1; };  // the loss's
  const std::vector<int64_t> shape = stage_activation_shape();
  const auto options = at::TensorOptions().dtype(stage_dtype()).device(training_device());
  std::vector<TensorList> batches;
  for (int64_t j = 0; j < num_micro; ++j) batches.push_back(next_batch(iteration));

  // An activation send is done once its gradient came back (waited by key c x m + j). A gradient
  // send of backward position b reached the previous rank once that rank sent the activations of
  // a forward it runs after its backward b (plus one round of p when either end wraps around).
  PendingSends activation_sends, gradient_sends;
  const int64_t total = num_micro * chunks, warmup = order.warmup(rank, num_micro);
  const int64_t previous_warmup = order.warmup(prev, num_micro);
  struct Pending {
    at::Tensor input, output;
  };
  std::vector<std::deque<Pending>> pending(static_cast<size_t>(chunks));

  auto forward = [&](int64_t k) {
    const int c = order.chunk(k, true);
    const int64_t j = order.micro_batch(k);
    model_->select_chunk(c);
    at::Tensor input, output;
    std::vector<std::pair<std::string, double>> metrics;
    {
      StageInput staged(*model_);
      output = forward_micro_batch(
          iteration, j, &metrics,
          [&] {
            if (first_stage(c)) return;
            input = receive_stage_tensor(prev, kActivationTag, Phase::kForwardRecv, "receive activations").requires_grad_(true);
            gradient_sends.wait_through(k - previous_warmup - 1 - 2 * stages);
            staged.set(input);
          },
          &batches[static_cast<size_t>(j)]);
    }
    if (last_stage(c)) {
      check_forward_output(output, input);
      r.metrics.add(metrics);
    } else {
      check_stage_output(output);  // sent before the graph check, which waits for every rank
      activation_sends.add(c * num_micro + j, send(output.detach(), DTK_GROUP_PIPELINE_PARALLEL, next, kActivationTag));
      check_loss(output, input);
    }
    pending[static_cast<size_t>(c)].push_back({input, output});
  };
  auto backward = [&](int64_t k) {
    const int c = order.chunk(k, false);
    const int64_t j = order.micro_batch(k);
    model_->select_chunk(c);
    at::Tensor grad;
    if (!last_stage(c)) {
      grad = receive_stage_tensor(next, kGradientTag, Phase::kBackwardRecv, "receive gradients");
      activation_sends.wait_for(c * num_micro + j);
    }
    Pending p = std::move(pending[static_cast<size_t>(c)].front());
    pending[static_cast<size_t>(c)].pop_front();
    backward_micro_batch(iteration, j, num_micro, scale, p.output, grad, k, total);
    if (!first_stage(c)) {
      at::Tensor g = p.input.grad();
      if (!g.defined()) g = at::zeros(shape, options);  // the chunk's output did not depend on it
      gradient_sends.add(k, send(g, DTK_GROUP_PIPELINE_PARALLEL, prev, kGradientTag));
    }
  };

  for (int64_t k = 0; k < warmup; ++k) forward(k);
  for (int64_t k = 0; k < total - warmup; ++k) {
    forward(k + warmup);
    backward(k);
  }
  for (int64_t k = total - warmup; k < total; ++k) backward(k);
  activation_sends.wait_all();
  gradient_sends.wait_all();
  r.pipeline_parallel_comm = comm_timing(DTK_GROUP_PIPELINE_PARALLEL);
  r.metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages - 1);
}

// Forward only, in the schedule's order over all the evaluation's micro-batches (their count is a
// multiple of p: eval_iters steps of the training's micro-batches). A send is waited before the
// next one: in a forward-only order its receiver depends on nothing this rank does later.
void Trainer::interleaved_evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) {
  const int rank = topo_.pp_rank, stages = topo_.pp_size, chunks = model_->num_chunks();
  const InterleavedOrder order{stages, chunks};
  const int prev = (rank + stages - 1) % stages, next = (rank + 1) % stages;
  const FirstChunkAfter reset(*model_);
  const std::vector<int64_t> shape = stage_activation_shape();
  const auto options = at::TensorOptions().dtype(stage_dtype()).device(training_device());
  std::map<int64_t, TensorList> batches;  // the micro-batches of the current round of p
  PendingSends sends;
  for (int64_t k = 0; k < num_batches * chunks; ++k) {
    const int c = order.chunk(k, true);
    const int64_t j = order.micro_batch(k);
    if (c == 0) batches[j] = loader.next();
    model_->select_chunk(c);
    at::Tensor input;
    if (rank > 0 || c > 0) {
      input = at::empty(shape, options);
      recv(input, DTK_GROUP_PIPELINE_PARALLEL, prev, kActivationTag).wait();
    }
    std::vector<std::pair<std::string, double>> m;
    at::Tensor out;
    {
      StageInput staged(*model_);
      staged.set(input);
      out = step().forward_step(*model_, batches.at(j), &m);
    }
    if (rank == stages - 1 && c == chunks - 1) {
      metrics.add(m);
    } else {
      check_stage_output(out);
      sends.wait_all();
      sends.add(k, send(out, DTK_GROUP_PIPELINE_PARALLEL, next, kActivationTag));
    }
    if (c == chunks - 1) batches.erase(j);
  }
  sends.wait_all();
  metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages - 1);
}

// The tied weights' gradients, as the optimizer steps them (after the strategy's reduction), summed
// over the pipeline group: the first and the last stage contribute theirs, stages in between
// zeros of the agreed size. A strategy that shards them (ZeRO over data-parallel ranks) hands the
// optimizer pieces that do not line up between the stages: refused at setup.
void Trainer::setup_tied_gradients() {
  tied_numel_ = 0;
  if (topo_.pp_size <= 1) return;
  int64_t mine = 0, whole = 0;  // elements of the model's tied weights; of those the optimizer holds whole
  std::string name;
  int tied = 0;
  for (const Param& p : model_->parameters())
    if (p.info.shared) mine += p.tensor.numel(), name = p.name, ++tied;
  // The first stage's tied weight and the last stage's copy are summed element by element: one
  // on each, none in between (what the shipped models list; convert assumes it too).
  const bool ends = topo_.pp_rank == 0 || topo_.pp_rank == topo_.pp_size - 1;
  std::string layout;
  if (tied > 1 || (tied > 0 && !ends))
    layout = "model plugin '" + model_slot_.plugin.name() + "': pipeline stage " + std::to_string(topo_.pp_rank) +
             " lists " + std::to_string(tied) +
             " tied weights (dtk_param_info.shared); with pipeline stages the first and the last stage list one each "
             "(the word embedding and its copy), the stages between none";
  agree(layout, topo_, "pipeline: checking the tied weights");
  for (const Param& p : optimizer_->params())
    if (p.info.shared && (p.info.full_numel == 0 || p.info.full_numel == p.tensor.numel())) whole += p.tensor.numel();
  // Decided by every rank together: a data-parallel rank may hold all of a shard list or none.
  if (world_max(mine != whole ? 1 : 0, topo_, "pipeline: checking the tied weights") != 0)
    throw HostError("pipeline parallelism with tied embeddings: strategy plugin '" + strategy_slot_.plugin.name() +
                    "' shards the tied weight" + (name.empty() ? "" : " '" + name + "'") +
                    " over data-parallel ranks, and the first and last stage must sum whole gradients; use "
                    "--strategy ddp, data-parallel size 1, or model.untie_embeddings_and_output_weights=true");
  // Every stage learns the size; the first and the last must agree on it.
  at::Tensor sizes = at::tensor({static_cast<double>(mine), ends ? -static_cast<double>(mine) : -1e300},
                                at::TensorOptions().dtype(at::kDouble));
  all_reduce(sizes, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_MAX).wait();
  const auto most = static_cast<int64_t>(sizes[0].item<double>()), least = static_cast<int64_t>(-sizes[1].item<double>());
  if (most != least)
    throw HostError("model plugin '" + model_slot_.plugin.name() +
                    "': the tied weights (dtk_param_info.shared) of the first and the last pipeline stage differ in "
                    "size (" + std::to_string(least) + " and " + std::to_string(most) + " elements)");
  tied_numel_ = most;
}

void Trainer::sync_tied_gradients() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const Param& p : optimizer_->params())
    if (p.info.shared) {
      at::Tensor& g = p.tensor.mutable_grad();
      if (!g.defined()) g = at::zeros_like(p.tensor);
      grads.push_back(g);
    }
  std::vector<at::Tensor> parts;  // fp32 for the sum (Gloo has no bf16)
  for (const at::Tensor& g : grads) parts.push_back(g.reshape({-1}).to(at::kFloat));
  // On the training device even without a tied tensor here: every stage must pick the same backend.
  at::Tensor flat = parts.empty()
                        ? at::zeros({tied_numel_}, at::TensorOptions().dtype(at::kFloat).device(training_device()))
                        : at::cat(parts).to(training_device());  // ZeRO-Offload's host partitions too
  all_reduce(flat, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_SUM).wait();
  int64_t offset = 0;
  for (at::Tensor& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view(g.sizes()));
    offset += g.numel();
  }
}

}  // namespace dtk::core
