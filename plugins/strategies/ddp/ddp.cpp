// ddp — plain data parallelism, Megatron's DistributedDataParallel without buckets:
// gradients are averaged over the data-parallel group after the last micro-batch's backward;
// the global gradient norm follows Megatron's clip_grad_norm_fp32 (TP-sharded parameters on
// every TP rank, replicated ones once, summed over the model-parallel group).
// With one process every collective is the identity, so this is also the single-device path.
//
// Mixed precision as Megatron's Float16OptimizerWithFloat16Params: for bf16/fp16 parameters the
// optimizer works on fp32 master copies (gradients converted to fp32 before the reduction, the
// norm and the update), and the updated masters are copied back into the model's parameters.
// Without masters a bf16 weight near 1.0 cannot move by less than 2^-8: small updates vanish.
// Gradients of such parameters accumulate across micro-batches in fp32 (Megatron's
// accumulate_allreduce_grads_in_fp32): before each further micro-batch's backward, and before the
// reduction, the parameter's gradient is added into the master's fp32 gradient and cleared.
#include <dtk/strategy.hpp>

#include <cmath>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_bool("average_gradients", "true", "Average (not sum) gradients over data-parallel ranks."),
    dtk::opt_bool("fp32_master_weights", "true",
                  "For bf16/fp16 parameters, let the optimizer update fp32 master copies (Megatron)."),
};

class Ddp : public dtk::Strategy {
 public:
  explicit Ddp(const dtk::BuildContext& ctx)
      : average_(ctx.options.get_bool("average_gradients")),
        masters_enabled_(ctx.options.get_bool("fp32_master_weights")),
        tp_rank_(ctx.tp_rank),
        pp_rank_(ctx.pp_rank) {}

  void setup(const dtk::ModelHandle& model) override {
    params_ = model.parameters();
    at::NoGradGuard no_grad;
    for (const auto& p : params_) {
      const bool low =
          p.tensor.is_floating_point() && p.tensor.scalar_type() != at::kFloat && p.tensor.scalar_type() != at::kDouble;
      // The master is the parameter itself for fp32 (no copy), a fp32 clone otherwise.
      masters_.push_back(masters_enabled_ && low ? p.tensor.detach().to(at::kFloat).clone() : p.tensor);
    }
  }

  // The optimizer sees the masters: fp32 copies for low-precision parameters, else the params.
  std::vector<dtk::Param> optimizer_params() override {
    std::vector<dtk::Param> out = params_;
    for (size_t i = 0; i < out.size(); ++i) out[i].tensor = masters_[i];
    return out;
  }

  void before_backward(const dtk_backward_args& args) override {
    if (args.micro_batch > 0) accumulate_into_masters();
  }

  void reduce_gradients() override {
    at::NoGradGuard no_grad;
    accumulate_into_masters();
    if (dtk::Comm::size(DTK_GROUP_DATA_PARALLEL) <= 1) return;
    for (auto& m : masters_)
      if (m.grad().defined())
        dtk::Comm::all_reduce(m.grad(), DTK_GROUP_DATA_PARALLEL, average_ ? DTK_REDUCE_AVG : DTK_REDUCE_SUM);
  }

  dtk_memory_usage memory_usage() override {
    dtk_memory_usage u{};
    u.struct_size = dtk_memory_usage_STRUCT_SIZE;
    for (size_t i = 0; i < params_.size(); ++i) {
      u.parameter_bytes += bytes(params_[i].tensor);
      u.gradient_bytes += bytes(params_[i].tensor.grad());
      if (is_self(i)) continue;
      u.master_bytes += bytes(masters_[i]);
      u.gradient_bytes += bytes(masters_[i].grad());
    }
    return u;
  }

  double clip_and_norm(double max_norm) override {
    at::NoGradGuard no_grad;
    // Accumulate on the gradients' device (one host sync at the end, not one per parameter): one
    // multi-tensor pass on a GPU (dtk/grad_norm.hpp).
    std::vector<at::Tensor> counted;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = masters_[i].grad();
      if (!g.defined()) continue;
      // Replicated parameters are counted on TP rank 0 only, so the sum is not duplicated.
      if (!params_[i].info.tensor_parallel && tp_rank_ != 0) continue;
      // A tied weight (pipeline parallelism: the first stage's embedding and the last stage's
      // output weight, their gradients summed by the host) is counted on the first stage.
      if (params_[i].info.shared && pp_rank_ != 0) continue;
      counted.push_back(g);
    }
    // On the parameters' device even without gradients: every rank of the group must pick the same
    // backend (NCCL for CUDA tensors, Gloo for host ones).
    at::Tensor total =
        dtk::sum_of_squares(counted, masters_.empty() ? at::Device(at::kCPU) : masters_.front().device());
    dtk::Comm::all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM);
    const double norm = std::sqrt(total.item<double>());
    if (max_norm > 0 && std::isfinite(norm)) {
      const double coeff = max_norm / (norm + 1e-6);
      if (coeff < 1.0) {
        std::vector<at::Tensor> grads;
        for (auto& m : masters_)
          if (m.grad().defined()) grads.push_back(m.grad());
        dtk::scale_all(grads, coeff);
      }
    }
    return norm;
  }

  void optimizer_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) override {
    dtk::optimizer_step(optimizer, args);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!is_self(i)) params_[i].tensor.copy_(masters_[i]);  // round the fp32 master into the param
  }

  void zero_grad() override {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].tensor.grad().defined()) params_[i].tensor.mutable_grad() = at::Tensor();
      if (!is_self(i) && masters_[i].grad().defined()) masters_[i].mutable_grad() = at::Tensor();
    }
  }

  // Checkpoints carry the fp32 masters: the low-precision params alone would lose their bits.
  dtk::TensorList state_save() override {
    dtk::TensorList out;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!is_self(i)) out.emplace_back("master." + params_[i].name, masters_[i]);
    return out;
  }

  void state_load(const dtk::TensorList& state) override {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (is_self(i)) continue;
      const at::Tensor* t = dtk::find(state, "master." + params_[i].name);
      if (!t) throw dtk::Error("ddp: checkpoint has no fp32 master for '" + params_[i].name + "'", DTK_ERR_NOT_FOUND);
      if (t->sizes() != masters_[i].sizes())
        throw dtk::Error("ddp: master '" + params_[i].name + "' has shape " + dtk::shape_str(*t) + ", expected " +
                         dtk::shape_str(masters_[i]));
      masters_[i].copy_(*t);
    }
  }

 private:
  bool is_self(size_t i) const { return masters_[i].unsafeGetTensorImpl() == params_[i].tensor.unsafeGetTensorImpl(); }

  // Moves the low-precision parameters' gradients (one micro-batch's) into the fp32 masters'.
  void accumulate_into_masters() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].tensor.mutable_grad();
      if (is_self(i) || !g.defined()) continue;
      at::Tensor& main = masters_[i].mutable_grad();
      if (main.defined())
        main.add_(g);
      else
        main = g.to(at::kFloat);
      g = at::Tensor();
    }
  }

  static int64_t bytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

  bool average_, masters_enabled_;
  int32_t tp_rank_, pp_rank_;
  std::vector<dtk::Param> params_;
  std::vector<at::Tensor> masters_;  // masters_[i] is params_[i] itself, or its fp32 copy
};

}  // namespace

DTK_PLUGIN("ddp", DTK_KIND_STRATEGY, "1.0.0", "Data parallel gradient averaging with Megatron's global-norm clipping",
           DTK_TORCH_VERSION, dtk::strategy_api<Ddp>(), kOptions)
