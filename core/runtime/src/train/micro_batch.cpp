#include "dtk/core/train/micro_batch.hpp"

#include <glog/logging.h>

#include <algorithm>
#include <utility>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/memory/memory.hpp"
#include "dtk/core/optim/aux_loss.hpp"
#include "dtk/core/timeline/trace.hpp"
#include "dtk/core/train/graph_check.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

TensorList MicroBatchRunner::next_batch(int64_t iteration, bool on_host) {
  TensorList batch;
  {
    auto t = p_.timers->scope(Phase::kBatchGenerator);
    batch = p_.train_loader->next(on_host);
  }
  if (on_host || p_.cfg->train().check_every_batch() || iteration <= p_.resumed_iteration + kCheckedIterations)
    check_batch(batch, iteration);
  if (const int64_t length = p_.plan->seq_length_of(iteration); length < p_.plan->seq_length())
    batch = cut_to_length(std::move(batch), p_.plan->seq_length(), length);
  return batch;
}

// A curriculum's iteration trains on the first `length` tokens of each sample, as
// Megatron-DeepSpeed's get_batch truncates tokens, labels, loss mask and position ids: every
// buffer of [batch, seq + 1] ("text") or [batch, seq] (a loss mask) keeps its first length + 1 or
// length columns; other buffers pass as they are.
TensorList MicroBatchRunner::cut_to_length(TensorList batch, int64_t seq, int64_t length) {
  for (auto& [name, t] : batch) {
    if (!t.defined() || t.dim() < 2) continue;
    if (t.size(1) == seq + 1)
      t = t.narrow(1, 0, length + 1).contiguous();
    else if (t.size(1) == seq)
      t = t.narrow(1, 0, length).contiguous();
  }
  return batch;
}

// The dataset contract on the first batches (cheap: a max over a few micro-batches). Token ids
// are below the vocabulary: the tokenizer's when the run names its files, else the dataset's
// declared one, else the model's. A larger id would otherwise surface as an index error deep in
// the model. "text" (what the shipped steps read) holds seq_length + 1 tokens per sample: with
// one fewer, the step would train on shorter sequences without a word.
void MicroBatchRunner::check_batch(const TensorList& batch, int64_t iteration) const {
  const auto& tokenizer = p_.cfg->tokenizer();
  int64_t limit = tokenizer.vocab_size();
  std::string what = "the tokenizer's vocabulary (" + tokenizer.vocab_file() + ")";
  if (limit <= 0 && p_.data->vocab_size() > 0)
    limit = p_.data->vocab_size(), what = "the vocabulary the dataset declares";
  if (limit <= 0) limit = p_.model->info().vocab_size, what = "the model's vocabulary";
  const std::string plugin = "dataset plugin '" + p_.dataset_name + "': ";
  const int64_t seq = p_.plan->seq_length();
  std::string error;
  if (const at::Tensor* text = find(batch, "text"); text && text->dim() == 2 && text->size(1) != seq + 1)
    error = plugin + "samples of 'text' hold " + std::to_string(text->size(1)) +
            " tokens, the run needs seq_length + 1 = " + std::to_string(seq + 1) +
            " (the step shifts them into seq_length tokens and their labels)";
  for (const auto& [name, t] : batch) {
    if (!error.empty()) break;
    // The buffers that hold token ids (the shipped steps read "text"; others may pass tokens and
    // labels themselves).
    if ((name != "text" && name != "tokens" && name != "labels") || !t.defined() || t.numel() == 0 ||
        at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kBool)
      continue;
    const int64_t hi = t.max().item<int64_t>(), lo = t.min().item<int64_t>();
    const std::string batch_of = " in '" + name + "' of a training batch of iteration " + std::to_string(iteration);
    if (lo < 0) error = plugin + "token id " + std::to_string(lo) + batch_of + " is negative";
    if (hi >= limit)
      error = plugin + "token id " + std::to_string(hi) + batch_of + " is not below " + what + " of " +
              std::to_string(limit) + " tokens";
  }
  // Data-parallel ranks read other samples: all decide together, before any collective of the
  // step, so a rank with good data does not wait for one that left.
  agree(error, *p_.topo, "checking the token ids of the first batches");
}

at::Tensor MicroBatchRunner::forward(int64_t iteration, int64_t m, Metrics* metrics,
                                     const std::function<void()>& before_forward, const TensorList* fetched) {
  int64_t forward_start = trace::now_ns();
  TensorList own;
  if (!fetched) own = next_batch(iteration);
  const TensorList& batch = fetched ? *fetched : own;
  if (before_forward) {
    before_forward();
    forward_start = trace::now_ns();  // the timeline shows the wait in it on its own
  }
  at::Tensor out;
  {
    auto t = p_.timers->scope(Phase::kForwardCompute);
    p_.model->reset_forward_watch();
    const int64_t before = memory::stats().device.bytes;
    out = step_forward(batch, metrics, /*training=*/true);
    // What the forward left allocated: the activations autograd keeps for this micro-batch's
    // backward (and its output), the memory report's measured activations.
    activation_bytes_ = std::max(activation_bytes_, memory::stats().device.bytes - before);
  }
  trace_span("forward ", m, forward_start);
  return out;
}

at::Tensor MicroBatchRunner::forward_only(const TensorList& batch, Metrics* metrics) {
  return step_forward(batch, metrics, /*training=*/false);
}

// The step plugin's forward; under train.calculate_per_token_loss it is asked for its summed loss
// (evaluation too, so that its metrics are token-weighted alike) and a training micro-batch's
// token count is added to the iteration's.
at::Tensor MicroBatchRunner::step_forward(const TensorList& batch, Metrics* metrics, bool training) {
  const bool summed_evaluation = !training && summed_evaluation_;
  if (!p_.per_token_loss && !summed_evaluation) return step().forward_step(*p_.model, batch, metrics);
  at::Tensor tokens;
  at::Tensor out = step().forward_step(*p_.model, batch, metrics, &tokens);
  // Only the loss counts (Megatron reads num_tokens on the last stage alone): what a step returns
  // on a stage or model chunk before it is not added.
  const bool loss_chunk =
      p_.topo->pp_rank == p_.topo->pp_size - 1 && p_.model->selected_chunk() == p_.model->num_chunks() - 1;
  const std::string step = "step plugin '" + p_.step_name + "'";
  if (summed_evaluation && loss_chunk && !tokens.defined() && evaluation_error_.empty())
    evaluation_error_ = step +
                        " returned no token count with its loss: eval.full_validation averages the loss over every "
                        "token of the split, which needs a step that sums it (ABI 2.8 num_tokens; the SDK's "
                        "Step::forward_step_summed)";
  if (!training || !loss_chunk) return out;
  if (!tokens.defined())
    tokens_error_ = step +
                    " returned no token count with its loss: it cannot sum its loss over tokens (ABI 2.8 num_tokens; "
                    "the SDK's Step::forward_step_summed), which train.calculate_per_token_loss needs";
  else if (tokens.numel() != 1)
    tokens_error_ =
        step + ": forward_step returned num_tokens of shape " + Model::shape_str(tokens) + ", expected one element";
  else if (const at::Tensor t = tokens.detach().reshape({}).to(training_device(), at::kDouble); tokens_.defined())
    tokens_ = tokens_ + t;
  else
    tokens_ = t;
  return out;
}

at::Tensor MicroBatchRunner::take_tokens() {
  at::Tensor t = std::exchange(tokens_, at::Tensor());
  return t.defined() ? t : at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(training_device()));
}

void MicroBatchRunner::check_loss_output(const at::Tensor& out, const at::Tensor& stage_input) {
  if (out.dim() != 0 && out.numel() != 1)
    throw HostError("step plugin '" + p_.step_name + "': forward_step returned a loss of shape " +
                    Model::shape_str(out) + ", expected a scalar");
  check_graph(out, stage_input, std::exchange(tokens_error_, std::string()));
}

void MicroBatchRunner::check_graph(const at::Tensor& loss, const at::Tensor& stage_input, std::string error) {
  const std::string step = "step plugin '" + p_.step_name + "'";
  const std::string model = "model plugin '" + p_.model_name + "'";
  const int chunk = p_.model->selected_chunk();
  const bool first = !graph_checked_.count(chunk);
  if (error.empty() && !loss.requires_grad()) {
    if (!p_.model->outputs_attached())
      error = model +
              ": forward returned outputs that do not require grad (detached from the parameters, or "
              "computed under no_grad), so the loss of " +
              step + " cannot train anything";
    else
      error = step + ": forward_step returned a loss that does not require grad (detached from the outputs of " +
              model + "): nothing would train";
  } else if (error.empty() && first) {
    std::vector<Param> listed = p_.model->parameters();
    if (stage_input.defined()) {  // a pipeline stage's input: its gradient goes to the previous stage
      Param in;
      in.name = "(the previous pipeline stage's output)";
      in.tensor = stage_input;
      listed.push_back(std::move(in));
    }
    error = unlisted_trained_tensors(loss, listed);
    if (!error.empty()) error = model + ": " + error;
  }
  // The first micro-batch decides on every rank together (a rank that left would make the others
  // wait at their next collective); later ones throw at once (the others' next collective then
  // fails within the collective timeout).
  if (!first) {
    if (!error.empty()) throw HostError(error);
    return;
  }
  graph_checked_.insert(chunk);
  agree(error, *p_.topo, "checking the loss of the first micro-batch");
}

void MicroBatchRunner::backward(int64_t iteration, int64_t m, int64_t num_micro, double scale, const at::Tensor& out,
                                const at::Tensor& out_grad, int64_t pass, int64_t passes) {
  before_backward(pass < 0 ? m : pass, passes < 0 ? num_micro : passes);
  const int64_t backward_start = trace::now_ns();
  {
    auto t = p_.timers->scope(Phase::kBackwardCompute);
    run_backward(iteration, m, num_micro, scale, out, out_grad);
  }
  trace_span("backward ", m, backward_start);
}

void MicroBatchRunner::forward_backward(int64_t iteration, int64_t m, int64_t num_micro, double scale,
                                        Metrics* metrics, const TensorList* fetched) {
  const at::Tensor loss = forward(iteration, m, metrics, {}, fetched);
  check_loss_output(loss);
  backward(iteration, m, num_micro, scale, loss, at::Tensor());
}

void MicroBatchRunner::before_backward(int64_t m, int64_t num_micro) { p_.strategy->before_backward(m, num_micro); }

void MicroBatchRunner::bare_forward_backward(int64_t iteration, const TensorList& batch, int64_t num_micro,
                                             double scale, Metrics* metrics) {
  const at::Tensor loss = step_forward(batch, metrics, /*training=*/true);
  check_loss_output(loss);
  run_backward(iteration, 0, num_micro, scale, loss, at::Tensor());
}

void MicroBatchRunner::run_backward(int64_t iteration, int64_t m, int64_t num_micro, double scale,
                                    const at::Tensor& out, const at::Tensor& out_grad) {
  // A layer's own losses (an MoE router's) get the factor the step's loss gets below, on every
  // stage (dtk.ext.aux_loss.v1).
  aux_loss::set_backward_scale(p_.per_token_loss ? scale : scale / static_cast<double>(num_micro), p_.per_token_loss);
  try {
    if (out_grad.defined()) {
      out.backward(out_grad);  // a stage before the last: the gradient the next stage sent
    } else {
      // Megatron scales each micro-batch loss by 1/num_microbatches so gradients average (not a
      // summed loss: the host divides by the global batch's tokens after the reduction).
      at::Tensor scaled = p_.per_token_loss ? out.reshape({}) : out.reshape({}) / static_cast<double>(num_micro);
      if (scale != 1.0) scaled = scaled * scale;  // loss scaling
      if (p_.hooks.scaled_loss) scaled = p_.hooks.scaled_loss(iteration, m, scaled);
      scaled.backward();
    }
  } catch (const HostError&) {
    throw;
  } catch (const std::exception& e) {
    // Autograd runs the model's and the step's backward functions, and the strategy's module
    // hooks where it installed them (ZeRO-3): name them all.
    VLOG(1) << "backward failed: " << e.what();
    const std::string hooks =
        p_.strategy->hooks_model() ? " and the module hooks of strategy plugin '" + p_.strategy_name + "'" : "";
    throw HostError("backward of the loss of step plugin '" + p_.step_name + "' through model plugin '" +
                    p_.model_name + "'" + hooks + " failed: " + one_line(e.what()));
  }
}

void MicroBatchRunner::trace_span(const char* what, int64_t m, int64_t start) const {
  if (!trace::active()) return;
  const std::string chunk =
      p_.model->num_chunks() > 1 ? " chunk " + std::to_string(p_.model->selected_chunk()) : std::string();
  trace::span((what + std::to_string(m) + chunk).c_str(), "step", start, trace::now_ns());
}

std::vector<int64_t> MicroBatchRunner::stage_shape() const {
  // Under sequence parallelism a stage sends its rows of the sequence (Megatron's p2p shape), of
  // its share of the sequence under context parallelism.
  const dtk_model_info info = p_.model->info();
  const int64_t length = (seq_length_ > 0 ? seq_length_ : p_.plan->seq_length()) / std::max(1, p_.topo->cp_size);
  const int64_t seq = length / (info.sequence_parallel ? std::max(1, p_.topo->tp_size) : 1);
  return {p_.plan->micro_batch_size(), seq, info.hidden_size};
}

at::TensorOptions MicroBatchRunner::stage_options() const {
  return at::TensorOptions().dtype(p_.stage_dtype).device(training_device());
}

at::Tensor MicroBatchRunner::receive_stage_tensor(int32_t peer, int32_t tag, Phase phase, const char* what) {
  // Megatron's pipeline timers (logging.timing_log_level=2): min and max over the ranks show the
  // most and the least waiting stage.
  auto timer = p_.timers->scope(phase);
  at::Tensor t = at::empty(stage_shape(), stage_options());
  const int64_t start = trace::now_ns();
  recv(t, DTK_GROUP_PIPELINE_PARALLEL, peer, tag).wait();
  if (trace::active()) trace::span(what, "wait", start, trace::now_ns());
  return t;
}

void MicroBatchRunner::check_stage_output(const at::Tensor& out) const {
  const std::vector<int64_t> shape = stage_shape();
  if (out.sizes() == at::IntArrayRef(shape) && out.scalar_type() == p_.stage_dtype) return;
  throw HostError("step plugin '" + p_.step_name + "' with model plugin '" + p_.model_name + "': pipeline stage " +
                  std::to_string(p_.topo->pp_rank) + " produced " + Model::shape_str(out) + " " +
                  std::string(c10::toString(out.scalar_type())) + ", the stages agreed on " +
                  Model::shape_str(at::empty(shape)) + " " + c10::toString(p_.stage_dtype) +
                  " [micro_batch_size, seq_length (/ tensor-parallel size under sequence parallelism), hidden_size] "
                  "hidden states in the parameters' dtype (is the step "
                  "pipeline-aware? docs/plugin-guide.md)");
}

}  // namespace dtk::core
