// template_scaled_sgd — an example optimizer plugin built out of tree against the installed
// DTK SDK: plain SGD whose step size is scaled per parameter group. It shows everything a
// plugin author writes: options, a class deriving from an SDK base, and one DTK_PLUGIN line.
#include <dtk/optimizer.hpp>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_float("scale", "1.0", "Multiplies the learning rate of every step."),
    dtk::opt_bool("verbose", "false", "Log each step through the host's log."),
};

class ScaledSgd : public dtk::Optimizer {
 public:
  ScaledSgd(const dtk::BuildContext& ctx, std::vector<dtk::ParamGroup> groups)
      : groups_(std::move(groups)), scale_(ctx.options.get_float("scale")), verbose_(ctx.options.get_bool("verbose")) {
    if (scale_ <= 0) throw dtk::Error("option 'scale' must be positive");  // becomes a status
    DTK_LOG(INFO) << "template_scaled_sgd: " << groups_.size() << " parameter groups, scale " << scale_;
  }

  void step(const dtk_optimizer_step_args& args) override {
    at::NoGradGuard no_grad;
    // Under loss scaling the gradients arrive multiplied by args.grad_scale (1 otherwise).
    for (auto& g : groups_)
      for (auto& p : g.params)
        if (p.grad().defined()) p.add_(p.grad(), -g.lr_at(args) * scale_ / args.grad_scale);
    if (verbose_) DTK_LOG(INFO) << "step " << args.iteration << " lr " << args.lr * scale_;
  }

  dtk::TensorList state_save() override { return {}; }  // stateless
  void state_load(const dtk::TensorList&) override {}

 private:
  std::vector<dtk::ParamGroup> groups_;
  double scale_;
  bool verbose_;
};

}  // namespace

DTK_PLUGIN("template_scaled_sgd", DTK_KIND_OPTIMIZER, "0.1.0", "Out-of-tree example: SGD with a scaled step",
           DTK_TORCH_VERSION, dtk::optimizer_api<ScaledSgd>(), kOptions)
