// sgd — stochastic gradient descent with momentum and (L2-coupled) weight decay, as
// torch.optim.SGD, which is what Megatron uses for --optimizer sgd.
#include <dtk/optimizer.hpp>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_float("momentum", "0.9", "Momentum factor (Megatron's --sgd_momentum)."),
    dtk::opt_bool("nesterov", "false", "Use Nesterov momentum."),
};

class Sgd : public dtk::Optimizer {
 public:
  Sgd(const dtk::BuildContext& ctx, std::vector<dtk::ParamGroup> groups)
      : groups_(std::move(groups)),
        momentum_(ctx.options.get_float("momentum")),
        nesterov_(ctx.options.get_bool("nesterov")) {
    if (momentum_ < 0) throw dtk::Error("option 'momentum' must be >= 0");
    if (nesterov_ && momentum_ == 0) throw dtk::Error("option 'nesterov' needs a non-zero 'momentum'");
    for (auto& g : groups_) buf_.emplace_back(g.params.size());
  }

  void step(const dtk_optimizer_step_args& args) override {
    at::NoGradGuard no_grad;
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      auto& g = groups_[gi];
      const double lr = g.lr_at(args);
      const double weight_decay = g.decay_at(args);
      for (size_t i = 0; i < g.params.size(); ++i) {
        at::Tensor& p = g.params[i];
        if (!p.grad().defined()) continue;
        at::Tensor d = p.grad();
        if (args.grad_scale != 1.0) d = d / args.grad_scale;
        if (weight_decay != 0) d = d.add(p, weight_decay);
        if (momentum_ != 0) {
          at::Tensor& b = buf_[gi][i];
          if (!b.defined())
            b = d.clone();
          else
            b.mul_(momentum_).add_(d);
          d = nesterov_ ? d.add(b, momentum_) : b;
        }
        p.add_(d, -lr);
      }
    }
  }

  dtk::TensorList state_save() override {
    dtk::TensorList out;
    for (size_t gi = 0; gi < groups_.size(); ++gi)
      for (size_t i = 0; i < groups_[gi].params.size(); ++i)
        if (buf_[gi][i].defined())
          out.emplace_back("g" + std::to_string(gi) + "." + groups_[gi].names[i] + ".momentum_buffer", buf_[gi][i]);
    return out;
  }

  void state_load(const dtk::TensorList& state) override {
    for (size_t gi = 0; gi < groups_.size(); ++gi)
      for (size_t i = 0; i < groups_[gi].params.size(); ++i)
        if (const at::Tensor* t =
                dtk::find(state, "g" + std::to_string(gi) + "." + groups_[gi].names[i] + ".momentum_buffer")) {
          const at::Tensor& p = groups_[gi].params[i];
          if (t->sizes() != p.sizes())
            throw dtk::Error("sgd: momentum buffer of '" + groups_[gi].names[i] + "' has shape " + dtk::shape_str(*t) +
                             ", the parameter " + dtk::shape_str(p));
          buf_[gi][i] = t->to(p.options()).clone();  // a checkpoint's host tensor onto the parameter's device
        }
  }

 private:
  std::vector<dtk::ParamGroup> groups_;
  std::vector<std::vector<at::Tensor>> buf_;
  double momentum_;
  bool nesterov_;
};

}  // namespace

DTK_PLUGIN("sgd", DTK_KIND_OPTIMIZER, "1.0.0", "SGD with momentum and L2 weight decay (torch.optim.SGD)",
           DTK_TORCH_VERSION, dtk::optimizer_api<Sgd>(), kOptions)
