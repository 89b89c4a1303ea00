// Pipeline parallelism with one model chunk per rank (distributed.pipeline_model_parallel_size
// > 1): Megatron's forward_backward_pipelining_without_interleaving (PipeDream-flush, "1F1B").
//
// Each stage's model holds its layers (the model plugin builds them from pre_process /
// post_process and pp_rank); the step plugin runs on every stage with the same batch. Between
// neighbouring stages the activations [micro_batch, seq, hidden] go forward and their gradients
// back over the pipeline group (point to point, every wait bounded by the collective timeout).
// The shape is agreed from the configuration, not sent per micro-batch.
//
//   stage s of p, m micro-batches:  warm-up  min(p - s - 1, m) forwards
//                                   steady   m - warm-up times: forward, then backward of the oldest
//                                   cool-down the remaining backwards
// so stage s holds at most p - s activations at once, and the bubble is (p - 1) / (m + p - 1) of
// an iteration. Sends are asynchronous (each waited once the schedule knows it arrived),
// receives block, so no two stages wait on each other.
#include <deque>

#include "schedules.hpp"

namespace dtk::core {

namespace {

class OneFOneB final : public ForwardBackwardSchedule {
 public:
  explicit OneFOneB(MicroBatchRunner& runner)
      : run_(runner), stage_(runner.topo().pp_rank), stages_(runner.topo().pp_size) {}

  void train(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) override {
    Iteration it{iteration, num_micro, scale, &r, {}, {}, {}};
    const int64_t warmup = std::min<int64_t>(stages_ - stage_ - 1, num_micro);
    for (int64_t i = 0; i < warmup; ++i) forward(it);
    for (int64_t i = warmup; i < num_micro; ++i) {
      forward(it);
      backward(it);
    }
    while (it.backwards < num_micro) backward(it);
    it.activation_sends.wait_all();
    it.gradient_sends.wait_all();
    // The schedule's own waits, before the collectives below use the pipeline group too.
    r.pipeline_parallel_comm = comm_timing(DTK_GROUP_PIPELINE_PARALLEL);
    // The loss and the step's metrics exist on the last stage: every stage logs the same.
    r.metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages_ - 1);
  }

  void evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) override {
    PendingSends sends;  // at most one: the next stage takes them in order and waits for nothing else
    for (int64_t k = 0; k < num_batches; ++k) {
      at::Tensor input;
      if (stage_ > 0) {
        input = at::empty(run_.stage_shape(), run_.stage_options());
        recv(input, DTK_GROUP_PIPELINE_PARALLEL, stage_ - 1).wait();
      }
      Metrics m;
      at::Tensor out;
      {
        StageInput staged(run_.model());
        staged.set(input);
        out = run_.forward_only(loader.next(), &m);
      }
      if (stage_ < stages_ - 1) {
        run_.check_stage_output(out);
        sends.wait_all();
        sends.add(k, send(out, DTK_GROUP_PIPELINE_PARALLEL, stage_ + 1));
      }
      metrics.add(m);
    }
    sends.wait_all();
    metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages_ - 1);
  }

 private:
  // One iteration's state. A send never blocks the schedule: it is waited once known to be
  // done. The activations of micro-batch k were received once their gradient came back; the
  // gradients of micro-batch j were received once the previous stage sends the activations of
  // j + (its warm-up) + 1 (its backward of j comes before that forward in 1F1B).
  struct Iteration {
    int64_t iteration, num_micro;
    double scale;
    IterationResult* result;
    PendingSends activation_sends, gradient_sends;
    std::deque<StageActivations> pending;
    int64_t forwards = 0, backwards = 0;
  };

  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }

  void forward(Iteration& it) {
    const int64_t previous_warmup = std::min<int64_t>(stages_ - stage_, it.num_micro);
    at::Tensor input, output;
    Metrics metrics;
    {
      StageInput staged(run_.model());
      // Received after the batch check (it waits for every rank, the previous stage included).
      output = run_.forward(it.iteration, it.forwards, &metrics, [&] {
        if (first()) return;
        input =
            run_.receive_stage_tensor(stage_ - 1, 0, Phase::kForwardRecv, "receive activations").requires_grad_(true);
        it.gradient_sends.wait_through(it.forwards - previous_warmup - 1);
        staged.set(input);
      });
    }
    if (last()) {
      run_.check_loss_output(output, input);
    } else {
      // Sent before the graph check, which waits for every rank.
      run_.check_stage_output(output);
      it.activation_sends.add(it.forwards, send(output.detach(), DTK_GROUP_PIPELINE_PARALLEL, stage_ + 1));
      run_.check_graph(output, input);
    }
    it.result->metrics.add(metrics);
    it.pending.push_back({input, output});
    ++it.forwards;
  }

  void backward(Iteration& it) {
    at::Tensor grad;
    if (!last()) {
      grad = run_.receive_stage_tensor(stage_ + 1, 0, Phase::kBackwardRecv, "receive gradients");
      it.activation_sends.wait_through(it.backwards);
    }
    StageActivations a = std::move(it.pending.front());
    it.pending.pop_front();
    run_.backward(it.iteration, it.backwards, it.num_micro, it.scale, a.output, grad);
    if (!first()) {
      at::Tensor g = a.input.grad();
      if (!g.defined()) g = at::zeros(run_.stage_shape(), run_.stage_options());  // output did not depend on it
      it.gradient_sends.add(it.backwards, send(g, DTK_GROUP_PIPELINE_PARALLEL, stage_ - 1));
    }
    ++it.backwards;
  }

  MicroBatchRunner& run_;
  const int stage_, stages_;
};

}  // namespace

std::unique_ptr<ForwardBackwardSchedule> make_one_f_one_b_schedule(MicroBatchRunner& runner) {
  return std::make_unique<OneFOneB>(runner);
}

}  // namespace dtk::core
