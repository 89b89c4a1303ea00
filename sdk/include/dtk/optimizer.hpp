// dtk/optimizer.hpp — an optimizer plugin as an ordinary C++ class.
//
//   class MyOpt : public dtk::Optimizer { ... };
//       // constructor: (const dtk::BuildContext&, std::vector<dtk::ParamGroup>)
//   DTK_PLUGIN("my_opt", DTK_KIND_OPTIMIZER, "1.0.0", "What it is", DTK_TORCH_VERSION,
//              dtk::optimizer_api<MyOpt>(), kOptions)
#pragma once

#include <dtk/tensor.hpp>

#include <string>
#include <utility>
#include <vector>

namespace dtk {

struct ParamGroup {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  double weight_decay = 0.0;  // at the end of a weight-decay schedule (the whole run when constant)
  double lr_scale = 1.0;      // effective lr = step lr x lr_scale
  size_t index = 0;           // the group's place in create()'s list (from_groups sets it)

  // This step's learning rate: the host's rate for this group (ABI 2.8 group_lr: a rule with its
  // own max_lr/min_lr), else the step's lr x lr_scale.
  double lr_at(const dtk_optimizer_step_args& args) const {
    const bool has = args.struct_size >= dtk_optimizer_step_args_STRUCT_SIZE_2_8;
    if (has && args.group_lr && index < args.num_group_lr) return args.group_lr[index];
    return args.lr * lr_scale;
  }

  // This step's weight decay: weight_decay x args.weight_decay_scale (ABI 2.2; a host of an
  // earlier minor does not pass the scale, which then is 1).
  double decay_at(const dtk_optimizer_step_args& args) const {
    const bool has = args.struct_size >= dtk_optimizer_step_args_STRUCT_SIZE_2_2;
    return weight_decay * (has ? args.weight_decay_scale : 1.0);
  }
};

// This step's Adam betas: the host's (ABI 2.14 has_betas: DeepSpeed's OneCycle cycles beta1),
// else the optimizer's configured ones.
struct Betas {
  double beta1, beta2;
};
inline Betas step_betas(const dtk_optimizer_step_args& args, double beta1, double beta2) {
  if (args.struct_size >= dtk_optimizer_step_args_STRUCT_SIZE_2_14 && args.has_betas) return {args.beta1, args.beta2};
  return {beta1, beta2};
}

// Arrays of versioned structs are walked with their elements' own struct_size (abi.h rule 2):
// a host of a newer minor may pass larger elements than this plugin knows.
inline std::vector<ParamGroup> from_groups(const dtk_param_group* groups, size_t n) {
  std::vector<ParamGroup> out(n);
  for (size_t g = 0; g < n; ++g) {
    const auto group = read_struct(&element(groups, g), dtk_param_group_STRUCT_SIZE_2_0, "parameter group");
    for (size_t i = 0; i < group.count; ++i) {
      out[g].params.push_back(unwrap(group.params[i]));
      out[g].names.push_back(group.names ? group.names[i] : "p" + std::to_string(i));
    }
    out[g].weight_decay = group.weight_decay;
    out[g].lr_scale = group.lr_scale;
    out[g].index = g;
  }
  return out;
}

// Step arguments kept past the call that gave them (a strategy that applies the update later:
// ddp's overlap_param_gather, ZeRO-Offload's delayed update): owns a copy of the group rates the
// host lent for the call only.
class StepArgs {
 public:
  StepArgs() = default;
  explicit StepArgs(const dtk_optimizer_step_args& args) { assign(args); }
  StepArgs(const StepArgs& other) { assign(other.args_); }
  StepArgs& operator=(const StepArgs& other) {
    if (this != &other) assign(other.args_);
    return *this;
  }
  const dtk_optimizer_step_args& get() const { return args_; }

 private:
  void assign(const dtk_optimizer_step_args& args) {
    args_ = args;
    rates_.clear();
    if (args.struct_size >= dtk_optimizer_step_args_STRUCT_SIZE_2_8 && args.group_lr)
      rates_.assign(args.group_lr, args.group_lr + args.num_group_lr);
    args_.group_lr = rates_.empty() ? nullptr : rates_.data();
  }
  dtk_optimizer_step_args args_{};
  std::vector<double> rates_;
};

// Adam's per-parameter moments and step count, in the checkpoint layout the first-party Adam
// plugins share ("step", "g<group>.<param>.exp_avg", "g<group>.<param>.exp_avg_sq"), so a run can
// switch between them at a checkpoint. A moment stays undefined until its parameter's first step.
struct AdamMoments {
  std::vector<std::vector<at::Tensor>> exp_avg, exp_avg_sq;  // [group][param]
  int64_t step = 0;
  int64_t last_iteration = -1;  // args.iteration of the last update counted (not saved; load resets it)

  // The step number of this update, for the bias corrections. Calls with the same args.iteration
  // are parts of one update (a strategy that applies an update bucket by bucket, each call with
  // only that bucket's gradients: ddp's overlap_param_gather), so the count advances once.
  int64_t begin_update(const dtk_optimizer_step_args& args) {
    if (args.iteration != last_iteration) ++step;
    last_iteration = args.iteration;
    return step;
  }

  explicit AdamMoments(const std::vector<ParamGroup>& groups) {
    for (const auto& g : groups) {
      exp_avg.emplace_back(g.params.size());
      exp_avg_sq.emplace_back(g.params.size());
    }
  }

  TensorList save(const std::vector<ParamGroup>& groups) const {
    TensorList out;
    out.emplace_back("step", at::scalar_tensor(static_cast<int64_t>(step), at::kLong));
    for (size_t gi = 0; gi < groups.size(); ++gi)
      for (size_t i = 0; i < groups[gi].params.size(); ++i) {
        if (!exp_avg[gi][i].defined()) continue;
        const std::string key = "g" + std::to_string(gi) + "." + groups[gi].names[i];
        out.emplace_back(key + ".exp_avg", exp_avg[gi][i]);
        out.emplace_back(key + ".exp_avg_sq", exp_avg_sq[gi][i]);
      }
    return out;
  }

  // Copies each moment into the parameter's dtype and device; `contiguous` for optimizers that
  // index raw arrays, else the parameter's own (dense) layout is kept.
  void load(const TensorList& state, const std::vector<ParamGroup>& groups, bool contiguous) {
    if (const at::Tensor* s = find(state, "step")) step = s->item<int64_t>();
    last_iteration = -1;  // the next call counts a step (ZeRO's disk swap sets the count back per slice)
    for (size_t gi = 0; gi < groups.size(); ++gi)
      for (size_t i = 0; i < groups[gi].params.size(); ++i) {
        const std::string key = "g" + std::to_string(gi) + "." + groups[gi].names[i];
        const at::Tensor* m = find(state, key + ".exp_avg");
        const at::Tensor* v = find(state, key + ".exp_avg_sq");
        if (!m || !v) continue;
        const at::Tensor& p = groups[gi].params[i];
        if (m->sizes() != p.sizes() || v->sizes() != p.sizes())
          throw Error("optimizer state '" + key + "': exp_avg " + shape_str(*m) + " / exp_avg_sq " + shape_str(*v) +
                      " do not match the parameter's " + shape_str(p));
        const auto format = contiguous ? at::MemoryFormat::Contiguous : at::MemoryFormat::Preserve;
        exp_avg[gi][i] = m->to(p.options()).clone(format);
        exp_avg_sq[gi][i] = v->to(p.options()).clone(format);
      }
  }
};

// Base class of a C++ optimizer plugin. [main-thread]
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step(const dtk_optimizer_step_args& args) = 0;
  virtual TensorList state_save() = 0;
  virtual void state_load(const TensorList& state) = 0;
};

// Steps another plugin's optimizer through its vtable (strategies).
inline void optimizer_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) {
  if (!optimizer || !optimizer->api || !optimizer->optimizer) throw Error("invalid optimizer reference");
  check(optimizer->api->step(optimizer->optimizer, &args));
}

// Another plugin's optimizer state through its vtable (strategies that look at the moments or the
// step count): what its state_save puts, the tensors as it holds them.
inline TensorList optimizer_state(const dtk_optimizer_ref* optimizer) {
  if (!optimizer || !optimizer->api || !optimizer->optimizer) throw Error("invalid optimizer reference");
  SinkCollector sink;
  check(optimizer->api->state_save(optimizer->optimizer, sink.sink()));
  return std::move(sink.items());
}

template <class T>
const dtk_optimizer_api* optimizer_api() {
  static const dtk_optimizer_api api = {
      dtk_optimizer_api_STRUCT_SIZE,
      [](const dtk_optimizer_create_args* args, dtk_optimizer** out) {
        return guard([&] {
          const auto a = read_struct(args, dtk_optimizer_create_args_STRUCT_SIZE_2_0, "optimizer create args");
          *out = reinterpret_cast<dtk_optimizer*>(new T(BuildContext(a.context), from_groups(a.groups, a.num_groups)));
        });
      },
      [](dtk_optimizer* o) { delete reinterpret_cast<T*>(o); },
      [](dtk_optimizer* o, const dtk_optimizer_step_args* args) {
        return guard([&] {
          reinterpret_cast<T*>(o)->step(read_struct(args, dtk_optimizer_step_args_STRUCT_SIZE_2_0, "step args"));
        });
      },
      [](dtk_optimizer* o, const dtk_tensor_sink* out) {
        return guard([&] { put_all(out, reinterpret_cast<T*>(o)->state_save()); });
      },
      [](dtk_optimizer* o, const dtk_tensor_map* state) {
        return guard([&] { reinterpret_cast<T*>(o)->state_load(from_map(state)); });
      },
  };
  return &api;
}

}  // namespace dtk
