// recording_sgd — plain SGD with decoupled weight decay that writes what the host hands it to a
// file (option `record`), so tests can check the optimizer groups (names, weight decay, lr
// scale) and, per step, the learning rate and weight_decay_scale against Megatron's schedules:
//   group <g> wd <weight_decay> lr_scale <lr_scale> <name> <name> ...
//   step <iteration> lr <lr> wd_scale <weight_decay_scale or "none"> g0 <group 0's lr> g1 ...
// Built as sgd_v2_1 too (DTK_TEST_ABI_MINOR=1): an entry that says ABI 2.1, which predates
// weight_decay_scale, so the host must refuse a weight-decay schedule with it.
// It declares a beta1 option (not used by its update), so the host hands it Adam's betas under
// OneCycle's momentum cycling (ABI 2.14), written as "betas <iteration> <beta1> <beta2>".
// count_calls=true saves a "step" that counts calls, not updates (what abi.md asks an optimizer
// driven bucket by bucket not to do): ddp's overlap_param_gather must refuse it.
#include <dtk/optimizer.hpp>

#include <fstream>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_string("record", "", "File the groups and every step's arguments are written to."),
    dtk::opt_bool("count_calls", "false", "Save a 'step' entry counting the calls of step()."),
    dtk::opt_float("beta1", "0.9", "Not used by the update: the host hands an optimizer with it Adam's betas."),
};

class RecordingSgd : public dtk::Optimizer {
 public:
  RecordingSgd(const dtk::BuildContext& ctx, std::vector<dtk::ParamGroup> groups)
      : groups_(std::move(groups)),
        path_(ctx.options.get_string("record")),
        count_calls_(ctx.options.get_bool("count_calls")) {
    if (path_.empty()) return;
    std::ofstream out(path_, std::ios::trunc);
    for (size_t g = 0; g < groups_.size(); ++g) {
      out << "group " << g << " wd " << groups_[g].weight_decay << " lr_scale " << groups_[g].lr_scale;
      for (const auto& n : groups_[g].names) out << " " << n;
      out << "\n";
    }
  }

  void step(const dtk_optimizer_step_args& args) override {
    at::NoGradGuard no_grad;
    ++calls_;
    if (!path_.empty()) {
      std::ofstream out(path_, std::ios::app);
      out.precision(17);
      out << "step " << args.iteration << " lr " << args.lr << " wd_scale ";
      if (args.struct_size >= dtk_optimizer_step_args_STRUCT_SIZE_2_2)
        out << args.weight_decay_scale;
      else
        out << "none";
      for (const auto& g : groups_) out << " g" << g.index << " " << g.lr_at(args);
      out << "\n";
      if (args.struct_size >= dtk_optimizer_step_args_STRUCT_SIZE_2_14 && args.has_betas)
        out << "betas " << args.iteration << " " << args.beta1 << " " << args.beta2 << "\n";
    }
    for (auto& g : groups_) {
      const double lr = g.lr_at(args), wd = g.decay_at(args);
      for (auto& p : g.params) {
        if (!p.grad().defined()) continue;
        if (wd != 0) p.mul_(1.0 - lr * wd);
        p.add_(p.grad(), -lr / args.grad_scale);
      }
    }
  }

  dtk::TensorList state_save() override {
    if (!count_calls_) return {};
    return {{"step", at::scalar_tensor(calls_, at::kLong)}};
  }
  void state_load(const dtk::TensorList& state) override {
    if (const at::Tensor* t = dtk::find(state, "step")) calls_ = t->item<int64_t>();
  }

 private:
  std::vector<dtk::ParamGroup> groups_;
  std::string path_;
  bool count_calls_;
  int64_t calls_ = 0;
};

}  // namespace

#ifdef DTK_TEST_ABI_MINOR
#undef DTK_ABI_MINOR
#define DTK_ABI_MINOR DTK_TEST_ABI_MINOR
DTK_PLUGIN("sgd_v2_1", DTK_KIND_OPTIMIZER, "1.0.0", "recording_sgd whose entry says ABI 2.1", DTK_TORCH_VERSION,
           dtk::optimizer_api<RecordingSgd>(), kOptions)
#else
DTK_PLUGIN("recording_sgd", DTK_KIND_OPTIMIZER, "1.0.0", "SGD that records its groups and step arguments",
           DTK_TORCH_VERSION, dtk::optimizer_api<RecordingSgd>(), kOptions)
#endif
