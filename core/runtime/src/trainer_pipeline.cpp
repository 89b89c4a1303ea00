// trainer_pipeline.cpp — pipeline parallelism in the Trainer (distributed.pipeline_model_parallel_size
// > 1): Megatron's forward_backward_pipelining_without_interleaving (PipeDream-flush, "1F1B").
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
// an iteration. Sends are asynchronous (waited at the end of the iteration), receives block, so
// no two stages wait on each other.
//
// Tied embeddings (the first stage's word embedding and the last stage's output weight, both
// listed with dtk_param_info.shared): their gradients are summed over the pipeline group after
// the strategy reduced them (Megatron's embedding-group all-reduce; stages in between add zeros),
// and norms count them on the first stage only.
#include <deque>

#include "dtk/core/comm.hpp"
#include "dtk/core/trace.hpp"
#include "dtk/core/trainer.hpp"

namespace dtk::core {

using host::HostError;

std::vector<int64_t> Trainer::stage_activation_shape() const {
  return {plan_.micro_batch_size(), plan_.seq_length(), model_->info().hidden_size};
}

void Trainer::pipeline_forward_backward(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) {
  const int stage = topo_.pp_rank, stages = topo_.pp_size;
  const bool first = stage == 0, last = stage == stages - 1;
  const std::vector<int64_t> shape = stage_activation_shape();
  const auto options = at::TensorOptions().dtype(to_scalar_type(build_context(model_slot_).params_dtype));
  // Sends are waited when they are known to be done, or at the end: a send never blocks the
  // schedule. An activation's send is done once its gradient came back.
  std::deque<Work> activation_sends;
  std::vector<Work> gradient_sends;
  auto receive = [&](int32_t peer, const char* what) {
    at::Tensor t = at::empty(shape, options);
    const int64_t start = trace::now_ns();
    recv(t, DTK_GROUP_PIPELINE_PARALLEL, peer).wait();
    if (trace::active()) trace::span(what, "wait", start, trace::now_ns());
    return t;
  };

  struct Pending {
    at::Tensor input, output;  // this stage's input (a leaf) and output of one micro-batch
  };
  std::deque<Pending> pending;
  int64_t forwards = 0, backwards = 0;
  auto forward = [&] {
    at::Tensor input;
    std::vector<std::pair<std::string, double>> metrics;
    at::Tensor output;
    try {
      // Received after the batch check (it waits for every rank, the previous stage included).
      output = forward_micro_batch(iteration, forwards, &metrics, [&] {
        if (!first) input = receive(stage - 1, "receive activations").requires_grad_(true);
        model_->set_pipeline_input(input);
      });
    } catch (...) {
      model_->set_pipeline_input(at::Tensor());
      throw;
    }
    model_->set_pipeline_input(at::Tensor());
    // Sent before any check that waits for the other ranks (check_loss agrees world-wide).
    if (!last && output.sizes() == at::IntArrayRef(shape))
      activation_sends.push_back(send(output.detach(), DTK_GROUP_PIPELINE_PARALLEL, stage + 1));
    check_forward_output(output, input);
    r.metrics.add(metrics);
    pending.push_back({input, output});
    ++forwards;
  };
  auto backward = [&] {
    at::Tensor grad;
    if (!last) {
      grad = receive(stage + 1, "receive gradients");
      activation_sends.front().wait();  // its activations were received: a no-op wait
      activation_sends.pop_front();
    }
    Pending p = std::move(pending.front());
    pending.pop_front();
    backward_micro_batch(iteration, backwards, num_micro, scale, p.output, grad);
    if (!first) {
      at::Tensor g = p.input.grad();
      if (!g.defined()) g = at::zeros(shape, options);  // the stage's output did not depend on it
      gradient_sends.push_back(send(g, DTK_GROUP_PIPELINE_PARALLEL, stage - 1));
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
  for (Work& w : gradient_sends) w.wait();
  // The loss and the step's metrics exist on the last stage: every stage logs the same.
  r.metrics.broadcast(DTK_GROUP_PIPELINE_PARALLEL, stages - 1);
}

void Trainer::pipeline_evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) {
  const int stage = topo_.pp_rank, stages = topo_.pp_size;
  const std::vector<int64_t> shape = stage_activation_shape();
  const auto options = at::TensorOptions().dtype(to_scalar_type(build_context(model_slot_).params_dtype));
  std::vector<Work> sends;
  for (int64_t k = 0; k < num_batches; ++k) {
    at::Tensor input;
    if (stage > 0) {
      input = at::empty(shape, options);
      recv(input, DTK_GROUP_PIPELINE_PARALLEL, stage - 1).wait();
    }
    model_->set_pipeline_input(input);
    std::vector<std::pair<std::string, double>> m;
    at::Tensor out;
    try {
      out = step_->forward_step(*model_, loader.next(), &m);
    } catch (...) {
      model_->set_pipeline_input(at::Tensor());
      throw;
    }
    model_->set_pipeline_input(at::Tensor());
    if (stage < stages - 1) {
      if (out.sizes() != at::IntArrayRef(shape))
        throw HostError("step plugin '" + step_slot_.plugin.name() + "': pipeline stage " + std::to_string(stage) +
                        " produced " + Model::shape_str(out) + " in evaluation, the stages agreed on " +
                        Model::shape_str(at::empty(shape)));
      sends.push_back(send(out, DTK_GROUP_PIPELINE_PARALLEL, stage + 1));
    }
    metrics.add(m);
  }
  for (Work& w : sends) w.wait();
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
  for (const Param& p : model_->parameters())
    if (p.info.shared) mine += p.tensor.numel(), name = p.name;
  for (const Param& p : optimizer_->params())
    if (p.info.shared && (p.info.full_numel == 0 || p.info.full_numel == p.tensor.numel())) whole += p.tensor.numel();
  // Decided by every rank together: a data-parallel rank may hold all of a shard list or none.
  if (world_max(mine != whole ? 1 : 0, topo_, "pipeline: checking the tied weights") != 0)
    throw HostError("pipeline parallelism with tied embeddings: strategy plugin '" + strategy_slot_.plugin.name() +
                    "' shards the tied weight" + (name.empty() ? "" : " '" + name + "'") +
                    " over data-parallel ranks, and the first and last stage must sum whole gradients; use "
                    "--strategy ddp, data-parallel size 1, or model.untie_embeddings_and_output_weights=true");
  // Every stage learns the size; the first and the last must agree on it.
  const bool ends = topo_.pp_rank == 0 || topo_.pp_rank == topo_.pp_size - 1;
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
  at::Tensor flat = parts.empty() ? at::zeros({tied_numel_}, at::kFloat) : at::cat(parts);
  all_reduce(flat, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_SUM).wait();
  int64_t offset = 0;
  for (at::Tensor& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view(g.sizes()));
    offset += g.numel();
  }
}

}  // namespace dtk::core
