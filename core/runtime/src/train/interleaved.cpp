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
#include <deque>
#include <map>
#include <vector>

#include "dtk/host/error.hpp"
#include "schedules.hpp"

namespace dtk::core {

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

class Interleaved final : public ForwardBackwardSchedule {
 public:
  explicit Interleaved(MicroBatchRunner& runner)
      : run_(runner),
        rank_(runner.topo().pp_rank),
        stages_(runner.topo().pp_size),
        chunks_(runner.model().num_chunks()),
        order_{stages_, chunks_},
        prev_((rank_ + stages_ - 1) % stages_),
        next_((rank_ + 1) % stages_) {}

  void train(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) override;
  void evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) override;

 private:
  // One iteration's state. An activation send is done once its gradient came back (waited by key
  // c x m + j). A gradient send of backward position b reached the previous rank once that rank
  // sent the activations of a forward it runs after its backward b (plus one round of p when
  // either end wraps around).
  struct Iteration {
    int64_t iteration, num_micro;
    double scale;
    IterationResult* result;
    std::vector<TensorList> batches;
    int64_t previous_warmup;
    PendingSends activation_sends, gradient_sends;
    std::vector<std::deque<StageActivations>> pending;
  };
  bool first_stage(int c) const { return rank_ == 0 && c == 0; }                     // the embedding's chunk
  bool last_stage(int c) const { return rank_ == stages_ - 1 && c == chunks_ - 1; }  // the loss's
  void forward(Iteration& it, int64_t k);
  void backward(Iteration& it, int64_t k);

  MicroBatchRunner& run_;
  const int rank_, stages_, chunks_;
  const InterleavedOrder order_;
  const int prev_, next_;
};

void Interleaved::train(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) {
  if (const std::string refusal = interleaved_refusal(chunks_, stages_, num_micro); !refusal.empty())
    throw host::HostError(refusal);
  const FirstChunkAfter reset(run_.model());
  Iteration it{iteration, num_micro, scale, &r, {}, order_.warmup(prev_, num_micro), {}, {}, {}};
  it.pending.resize(static_cast<size_t>(chunks_));
  for (int64_t j = 0; j < num_micro; ++j) it.batches.push_back(run_.next_batch(iteration));
  const int64_t total = num_micro * chunks_, warmup = order_.warmup(rank_, num_micro);
  for (int64_t k = 0; k < warmup; ++k) forward(it, k);
  for (int64_t k = 0; k < total - warmup; ++k) {
    forward(it, k + warmup);
    backward(it, k);
  }
  for (int64_t k = total - warmup; k < total; ++k) backward(it, k);
  it.activation_sends.wait_all();
  it.gradient_sends.wait_all();
  r.pipeline_parallel_comm = comm_timing(DTK_GROUP_PIPELINE_PARALLEL);
  r.metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages_ - 1);
}

void Interleaved::forward(Iteration& it, int64_t k) {
  const int c = order_.chunk(k, true);
  const int64_t j = order_.micro_batch(k);
  run_.model().select_chunk(c);
  at::Tensor input, output;
  Metrics metrics;
  {
    StageInput staged(run_.model());
    auto receive = [&] {
      if (first_stage(c)) return;
      input = run_.receive_stage_tensor(prev_, kActivationTag, Phase::kForwardRecv, "receive activations")
                  .requires_grad_(true);
      it.gradient_sends.wait_through(k - it.previous_warmup - 1 - 2 * stages_);
      staged.set(input);
    };
    output = run_.forward(it.iteration, j, &metrics, receive, &it.batches[static_cast<size_t>(j)]);
  }
  if (last_stage(c)) {
    run_.check_loss_output(output, input);
    it.result->metrics.add(metrics);
  } else {
    run_.check_stage_output(output);  // sent before the graph check, which waits for every rank
    it.activation_sends.add(c * it.num_micro + j,
                            send(output.detach(), DTK_GROUP_PIPELINE_PARALLEL, next_, kActivationTag));
    run_.check_graph(output, input);
  }
  it.pending[static_cast<size_t>(c)].push_back({input, output});
}

void Interleaved::backward(Iteration& it, int64_t k) {
  const int c = order_.chunk(k, false);
  const int64_t j = order_.micro_batch(k);
  run_.model().select_chunk(c);
  at::Tensor grad;
  if (!last_stage(c)) {
    grad = run_.receive_stage_tensor(next_, kGradientTag, Phase::kBackwardRecv, "receive gradients");
    it.activation_sends.wait_for(c * it.num_micro + j);
  }
  auto& queue = it.pending[static_cast<size_t>(c)];
  StageActivations a = std::move(queue.front());
  queue.pop_front();
  run_.backward(it.iteration, j, it.num_micro, it.scale, a.output, grad, k, it.num_micro * chunks_);
  if (!first_stage(c)) {
    at::Tensor g = a.input.grad();
    if (!g.defined()) g = at::zeros(run_.stage_shape(), run_.stage_options());  // output did not depend on it
    it.gradient_sends.add(k, send(g, DTK_GROUP_PIPELINE_PARALLEL, prev_, kGradientTag));
  }
}

// Forward only, in the schedule's order over all the evaluation's micro-batches (their count is a
// multiple of p: eval_iters steps of the training's micro-batches). A send is waited before the
// next one: in a forward-only order its receiver depends on nothing this rank does later.
void Interleaved::evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) {
  const FirstChunkAfter reset(run_.model());
  std::map<int64_t, TensorList> batches;  // the micro-batches of the current round of p
  PendingSends sends;
  for (int64_t k = 0; k < num_batches * chunks_; ++k) {
    const int c = order_.chunk(k, true);
    const int64_t j = order_.micro_batch(k);
    if (c == 0) batches[j] = loader.next();
    run_.model().select_chunk(c);
    at::Tensor input;
    if (!first_stage(c)) {
      input = at::empty(run_.stage_shape(), run_.stage_options());
      recv(input, DTK_GROUP_PIPELINE_PARALLEL, prev_, kActivationTag).wait();
    }
    Metrics m;
    at::Tensor out;
    {
      StageInput staged(run_.model());
      staged.set(input);
      out = run_.forward_only(batches.at(j), &m);
    }
    if (last_stage(c)) {
      metrics.add(m);
    } else {
      run_.check_stage_output(out);
      sends.wait_all();
      sends.add(k, send(out, DTK_GROUP_PIPELINE_PARALLEL, next_, kActivationTag));
    }
    if (c == chunks_ - 1) batches.erase(j);
  }
  sends.wait_all();
  metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages_ - 1);
}

}  // namespace

std::string interleaved_refusal(int virtual_stages, int pp_size, int64_t num_micro) {
  if (virtual_stages <= 1 || num_micro % pp_size == 0) return "";
  return "config: the interleaved pipeline schedule (distributed.virtual_pipeline_model_parallel_size " +
         std::to_string(virtual_stages) + ") needs the micro-batches per step (" + std::to_string(num_micro) +
         ": train.global_batch_size / (train.micro_batch_size x data-parallel size)) to be a multiple of "
         "distributed.pipeline_model_parallel_size " +
         std::to_string(pp_size);
}

std::unique_ptr<ForwardBackwardSchedule> make_interleaved_schedule(MicroBatchRunner& runner) {
  return std::make_unique<Interleaved>(runner);
}

}  // namespace dtk::core
