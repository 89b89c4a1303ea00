// dtk/step.hpp — a forward-step (+ loss) plugin as an ordinary C++ class.
//
//   class MyStep : public dtk::Step { ... };          // constructor: (const dtk::BuildContext&)
//   DTK_PLUGIN("my_step", DTK_KIND_STEP, "1.0.0", "What it is", DTK_TORCH_VERSION,
//              dtk::step_api<MyStep>(), kOptions)
#pragma once

#include <dtk/model.hpp>

#include <string>
#include <utility>

namespace dtk {

class Metrics {
 public:
  explicit Metrics(const dtk_metric_sink* sink) : sink_(sink) {}
  void put(const std::string& name, double value) const {
    if (sink_ && sink_->put) sink_->put(sink_->ctx, name.c_str(), value);
  }
  // A one-element tensor, read by the host when it needs the number (ABI 2.5: no wait for the
  // device, and capturable into a CUDA graph); from an older host, read here.
  void put(const std::string& name, const at::Tensor& value) const {
    if (!sink_) return;
    if (sink_->struct_size >= dtk_metric_sink_STRUCT_SIZE_2_5 && sink_->put_tensor) {
      sink_->put_tensor(sink_->ctx, name.c_str(), wrap(value.detach().reshape({})));
      return;
    }
    if (sink_->put) sink_->put(sink_->ctx, name.c_str(), value.item<double>());
  }
  // ABI 2.8: a value the host reports as sum(numerator) / sum(denominator) over the iteration's
  // micro-batches (or an evaluation's batches): Megatron-LM's token-weighted "lm loss". Both are
  // one-element tensors already summed over the data-parallel group. An older host gets their
  // ratio for this micro-batch alone.
  void put_ratio(const std::string& name, const at::Tensor& numerator, const at::Tensor& denominator) const {
    if (!sink_) return;
    const dtk_host_services* host = host_services();
    if (host && host->abi_minor >= 8 && sink_->struct_size >= dtk_metric_sink_STRUCT_SIZE_2_5 && sink_->put_tensor) {
      const at::Tensor pair =
          at::cat({numerator.detach().reshape({1}), denominator.detach().reshape({1}).to(numerator.scalar_type())});
      sink_->put_tensor(sink_->ctx, name.c_str(), wrap(pair));
      return;
    }
    put(name, numerator.detach().reshape({}) / denominator.detach().reshape({}).to(numerator.scalar_type()));
  }

 private:
  const dtk_metric_sink* sink_;
};

// Base class of a C++ step plugin. [main-thread]
class Step {
 public:
  virtual ~Step() = default;
  // `batch`: every buffer the dataset put, by name, collated to [micro_batch_size, ...] (under
  // tensor parallelism the TP group must use one batch: broadcast TP rank 0's, as causal_lm does).
  // Returns the scalar loss to differentiate, attached to the model's outputs (the host runs
  // backward on it: a detached loss is refused naming the plugin at fault); reports metrics
  // (DP-averaged) into `metrics`. Errors from model.forward arrive already naming the model.
  // Pipeline parallelism (ctx.pp_size > 1): forward_step runs on every stage with the same batch.
  // The host passes the previous stage's output to the model as its "hidden_states" input (the
  // step need not), and on a stage that is not the last (ctx.post_process false) the model
  // returns "hidden_states" instead of a loss: forward_step then returns that tensor as it is,
  // and the host sends it on to the next stage (metrics come from the last stage only). With the
  // interleaved schedule each model chunk has its own step, built with the chunk's context.
  virtual at::Tensor forward_step(const ModelHandle& model, const TensorList& batch, const Metrics& metrics) = 0;
  // ABI 2.8, train.calculate_per_token_loss (Megatron-LM's --calculate-per-token-loss): the same
  // step, returning the loss summed over the tokens forward_step averages (not their mean), their
  // number in *num_tokens (one element), and ratio metrics (Metrics::put_ratio) summed over the
  // data-parallel group. The host divides the gradients by the global batch's token count. A
  // stage before the last returns its output as forward_step does. Not overridden: num_tokens
  // stays undefined and the host refuses the run, naming the step.
  virtual at::Tensor forward_step_summed(const ModelHandle& model, const TensorList& batch, const Metrics& metrics,
                                         at::Tensor* num_tokens) {
    (void)num_tokens;
    return forward_step(model, batch, metrics);
  }
};

template <class T>
const dtk_step_api* step_api() {
  static const dtk_step_api api = {
      dtk_step_api_STRUCT_SIZE,
      [](const dtk_build_context* ctx, dtk_step** out) {
        return guard([&] { *out = reinterpret_cast<dtk_step*>(new T(BuildContext(ctx))); });
      },
      [](dtk_step* s) { delete reinterpret_cast<T*>(s); },
      [](dtk_step* s, dtk_step_forward_args* args) {
        return guard([&] {
          const auto a = read_struct(args, dtk_step_forward_args_STRUCT_SIZE_2_0, "forward_step args");
          Step* step = reinterpret_cast<T*>(s);
          if (DTK_HAS_FIELD(dtk_step_forward_args, args, num_tokens) && a.sum_loss) {
            at::Tensor tokens;
            at::Tensor l =
                step->forward_step_summed(ModelHandle(a.model), from_map(a.batch), Metrics(a.metrics), &tokens);
            args->loss = wrap(std::move(l));
            if (tokens.defined()) args->num_tokens = wrap(std::move(tokens));
            return;
          }
          at::Tensor l = step->forward_step(ModelHandle(a.model), from_map(a.batch), Metrics(a.metrics));
          args->loss = wrap(std::move(l));
        });
      },
  };
  return &api;
}

}  // namespace dtk
