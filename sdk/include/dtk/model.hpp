// dtk/model.hpp — a model plugin as an ordinary C++ class, and calling another plugin's model.
//
//   class MyModel : public dtk::Model { ... };        // constructor: (const dtk::BuildContext&)
//   DTK_PLUGIN("my_model", DTK_KIND_MODEL, "1.0.0", "What it is", DTK_TORCH_VERSION,
//              dtk::model_api<MyModel>(), kOptions)
//
// A model that fires per-module hooks (ZeRO-3) also includes dtk/module_hooks.hpp.
#pragma once

#include <dtk/tensor.hpp>

#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtk {

struct Param {
  std::string name;
  at::Tensor tensor;
  dtk_param_info info{dtk_param_info_STRUCT_SIZE, 0, -1, 0, 0, -1, 0, 0, 0, 0, 0};
};

// One module of a model (abi.h dtk_module_info): index in forward order, name, and the names of
// every parameter it reads in forward.
struct Module {
  int32_t index = 0;
  std::string name;
  std::vector<std::string> params;
};

// Base class of a C++ model plugin. Every method is [main-thread]. Contracts the host relies on
// (docs/plugin-guide.md, "Contracts"; the host checks them and names this plugin when broken):
//   forward     The step decides the inputs; the shipped causal_lm step passes "tokens" and
//               "position_ids" [b, s] int64, "labels" [b, s] int64, and "attention_mask"
//               [b, 1, s, s] bool (true = masked) only when it resets the mask. With "labels" it
//               expects "loss" [b, s]: the per-token loss, still attached to the parameters (it
//               masks and averages it, then the host runs backward); without, "logits" [b, s, V]
//               (this rank's vocabulary slice under TP). Exceptions thrown here reach the user
//               as "model plugin '<name>': forward: <what()>".
//   parameters  EVERY trainable tensor, each once under its own name (a tensor the loss reaches
//               that is missing here is never updated: the host refuses it on the first step; one
//               listed twice, or two names alike, when the model is created). Fill dtk_param_info:
//               tensor_parallel/partition_dim for TP shards, no_weight_decay for biases and norms,
//               shared=1 on a tied tensor's owning stage, module_index for ZeRO-3's hooks.
//   info        num_layers, hidden_size, num_attention_heads, seq_length (FLOPs, memory
//               estimate, the start-up line), vocab_size (padded: generation, and the token-id
//               check when neither tokenizer nor dataset declares one), recompute (FLOPs).
//   Seeded initialisation: draw weights from dtk::layers::seeded_generator(ctx.seed) on the CPU
//   (dtk::layers::ParamFactory does it), then move them to ctx.device and ctx.params_dtype.
class Model {
 public:
  virtual ~Model() = default;
  virtual TensorList forward(const TensorList& inputs) = 0;
  virtual std::vector<Param> parameters() = 0;
  virtual std::vector<Param> buffers() { return {}; }
  virtual void set_training(bool training) = 0;
  virtual dtk_model_info info() = 0;

  // The model's modules (empty: none).
  virtual std::vector<Module> modules() { return {}; }
  // Installs per-module hooks (nullptr removes them). A model that does not fire hooks refuses
  // them; see dtk/module_hooks.hpp for the helper that fires them.
  virtual void set_module_hooks(const dtk_module_hooks* hooks) {
    if (hooks) throw Error("this model does not support per-module hooks", DTK_ERR_UNSUPPORTED);
  }

  // Partitioned construction (ABI 2.4): true when this model was created under
  // ctx.deferred_parameters and its parameters are placeholders; init_parameters then hands out
  // every parameter's initial value, one at a time (dtk::layers::DeferredInit records and replays
  // them; DecoderLM wires it). A model that ignores the flag keeps these defaults.
  using ParamValueFn = std::function<void(const std::string& name, const at::Tensor& value)>;
  virtual bool defers_parameters() { return false; }
  virtual void init_parameters(const ParamValueFn& take) {
    (void)take;
    throw Error("this model did not defer its parameters", DTK_ERR_UNSUPPORTED);
  }

  // Once per training iteration, after the optimizer step (ABI 2.11, dtk_model_api.end_iteration):
  // state the training forwards gathered and no optimizer owns (the MoE expert bias). Every rank
  // calls it; collectives are allowed.
  virtual void end_iteration() {}

  // Moves/casts every parameter and buffer in place (keeping tensor identity for optimizers).
  virtual void to(at::Device device, std::optional<at::ScalarType> dtype) {
    auto move = [&](const at::Tensor& t) {
      at::Tensor moved = dtype && t.is_floating_point() ? t.to(device, *dtype) : t.to(device);
      t.set_data(moved);
    };
    for (auto& p : parameters()) move(p.tensor);
    for (auto& b : buffers()) move(b.tensor);
  }

  // Checkpoint state: parameters and buffers under their names, tied duplicates once.
  virtual TensorList state_save() {
    TensorList out;
    for (auto& p : parameters())
      if (!find(out, p.name)) out.emplace_back(p.name, p.tensor.detach());
    for (auto& b : buffers())
      if (!find(out, b.name)) out.emplace_back(b.name, b.tensor.detach());
    return out;
  }

  virtual void state_load(const TensorList& state, bool strict) {
    TensorList mine = state_save();
    for (auto& kv : mine) {
      const at::Tensor* src = find(state, kv.first);
      if (!src) {
        if (strict) throw Error("checkpoint state has no tensor '" + kv.first + "'", DTK_ERR_NOT_FOUND);
        continue;
      }
      if (src->sizes() != kv.second.sizes())
        throw Error("tensor '" + kv.first + "': checkpoint shape " + shape_str(*src) + " does not match the model's " +
                    shape_str(kv.second));
      at::NoGradGuard no_grad;
      kv.second.copy_(*src);
    }
    if (strict)
      for (auto& kv : state)
        if (!find(mine, kv.first))
          throw Error("checkpoint has unexpected tensor '" + kv.first + "'", DTK_ERR_INVALID_ARGUMENT);
  }

  // Kept for source compatibility: dtk::shape_str.
  static std::string shape_str(const at::Tensor& t) { return dtk::shape_str(t); }
};

namespace detail {
inline dtk_status* visit_all(const std::vector<Param>& params, const dtk_param_visitor* v) {
  for (const auto& p : params) {
    dtk_tensor h{p.tensor};
    if (dtk_status* s = v->visit(v->ctx, p.name.c_str(), &h, &p.info)) return s;
  }
  return nullptr;
}

inline dtk_status* visit_modules(const std::vector<Module>& modules, const dtk_module_visitor* v) {
  for (const auto& m : modules) {
    std::vector<const char*> names;
    for (const auto& n : m.params) names.push_back(n.c_str());
    const dtk_module_info info{dtk_module_info_STRUCT_SIZE, m.index, m.name.c_str(), names.data(), names.size()};
    if (dtk_status* s = v->visit(v->ctx, &info)) return s;
  }
  return nullptr;
}

// guard() for a body that itself returns a status (a visitor's).
template <class F>
dtk_status* guard_status(F&& body) noexcept {
  dtk_status* s = nullptr;
  dtk_status* g = guard([&] { s = body(); });
  return g ? g : s;
}
}  // namespace detail

template <class T>
const dtk_model_api* model_api() {
  static const dtk_model_api api = {
      dtk_model_api_STRUCT_SIZE,
      [](const dtk_build_context* ctx, dtk_model** out) {
        return guard([&] { *out = reinterpret_cast<dtk_model*>(new T(BuildContext(ctx))); });
      },
      [](dtk_model* m) { delete reinterpret_cast<T*>(m); },
      [](dtk_model* m, const dtk_model_forward_args* args) {
        return guard([&] {
          const auto a = read_struct(args, dtk_model_forward_args_STRUCT_SIZE_2_0, "forward args");
          put_all(a.outputs, reinterpret_cast<T*>(m)->forward(from_map(a.inputs)));
        });
      },
      [](dtk_model* m, const dtk_param_visitor* v) {
        return detail::guard_status([&] { return detail::visit_all(reinterpret_cast<T*>(m)->parameters(), v); });
      },
      [](dtk_model* m, const dtk_param_visitor* v) {
        return detail::guard_status([&] { return detail::visit_all(reinterpret_cast<T*>(m)->buffers(), v); });
      },
      [](dtk_model* m, int32_t training) {
        return guard([&] { reinterpret_cast<T*>(m)->set_training(training != 0); });
      },
      [](dtk_model* m, const dtk_model_to_args* args) {
        return guard([&] {
          const auto a = read_struct(args, dtk_model_to_args_STRUCT_SIZE_2_0, "to args");
          std::optional<at::ScalarType> st;
          if (a.dtype != DTK_DTYPE_INVALID) st = to_scalar_type(a.dtype);
          reinterpret_cast<T*>(m)->to(to_device(a.device), st);
        });
      },
      [](dtk_model* m, const dtk_tensor_sink* out) {
        return guard([&] { put_all(out, reinterpret_cast<T*>(m)->state_save()); });
      },
      [](dtk_model* m, const dtk_tensor_map* state, int32_t strict) {
        return guard([&] { reinterpret_cast<T*>(m)->state_load(from_map(state), strict != 0); });
      },
      [](dtk_model* m, dtk_model_info* info) {
        return guard([&] {
          dtk_model_info mine = reinterpret_cast<T*>(m)->info();
          mine.struct_size = dtk_model_info_STRUCT_SIZE;
          mine.deferred_parameters = reinterpret_cast<T*>(m)->defers_parameters() ? 1 : 0;
          write_struct(info, mine);
        });
      },
      [](dtk_model* m, const dtk_module_visitor* v) {
        return detail::guard_status([&] { return detail::visit_modules(reinterpret_cast<T*>(m)->modules(), v); });
      },
      [](dtk_model* m, const dtk_module_hooks* hooks) {
        return guard([&] { reinterpret_cast<T*>(m)->set_module_hooks(hooks); });
      },
      [](dtk_model* m, const dtk_param_visitor* v) {
        struct VisitorFailed {};  // stops the replay: drawing the rest would only delay the error
        dtk_status* visited = nullptr;
        dtk_status* s = guard([&] {
          try {
            reinterpret_cast<T*>(m)->init_parameters([&](const std::string& name, const at::Tensor& value) {
              dtk_tensor h{value};
              if ((visited = v->visit(v->ctx, name.c_str(), &h, nullptr))) throw VisitorFailed{};
            });
          } catch (const VisitorFailed&) {
          }
        });
        return visited ? visited : s;
      },
      [](dtk_model* m) { return guard([&] { reinterpret_cast<T*>(m)->end_iteration(); }); },
  };
  return &api;
}

// A dtk_param_visitor that appends every visited parameter (name, tensor, info) to `out`,
// reading the info through its own struct_size (it may come from an older or newer plugin).
inline dtk_param_visitor collecting_visitor(std::vector<Param>* out) {
  return {dtk_param_visitor_STRUCT_SIZE, out,
          [](void* ctx, const char* name, dtk_tensor* t, const dtk_param_info* info) {
            return guard([&] {
              Param p;
              p.name = name ? name : "";
              p.tensor = unwrap(t);
              if (info) p.info = read_struct(info, dtk_param_info_STRUCT_SIZE_2_0, "parameter info");
              static_cast<std::vector<Param>*>(ctx)->push_back(std::move(p));
            });
          }};
}

// A dtk_module_visitor that appends every visited module to `out`.
inline dtk_module_visitor collecting_module_visitor(std::vector<Module>* out) {
  return {dtk_module_visitor_STRUCT_SIZE, out, [](void* ctx, const dtk_module_info* info) {
            return guard([&] {
              const auto m = read_struct(info, dtk_module_info_STRUCT_SIZE_2_0, "module info");
              Module mod;
              mod.index = m.index;
              mod.name = m.name ? m.name : "";
              for (size_t i = 0; i < m.num_params; ++i) mod.params.emplace_back(m.param_names[i]);
              static_cast<std::vector<Module>*>(ctx)->push_back(std::move(mod));
            });
          }};
}

// Calls another plugin's model through its vtable (used by step and strategy plugins).
class ModelHandle {
 public:
  explicit ModelHandle(const dtk_model_ref* ref) : ref_(ref) {
    if (!ref || !ref->api || !ref->model) throw Error("invalid model reference");
  }
  TensorList forward(const TensorList& inputs) const {
    MapView view(inputs);
    SinkCollector out;
    const dtk_model_forward_args args{dtk_model_forward_args_STRUCT_SIZE, view.get(), out.sink()};
    check(ref_->api->forward(ref_->model, &args));
    return std::move(out.items());
  }
  std::vector<Param> parameters() const { return visit(ref_->api->visit_parameters); }
  std::vector<Param> buffers() const { return visit(ref_->api->visit_buffers); }
  std::vector<Module> modules() const {
    std::vector<Module> out;
    const dtk_module_visitor v = collecting_module_visitor(&out);
    check(ref_->api->visit_modules(ref_->model, &v));
    return out;
  }
  const dtk_model_ref* ref() const { return ref_; }
  // Partitioned construction (ABI 2.4): whether the model's parameters are placeholders, and
  // their initial values one at a time (abi.h dtk_model_api.init_parameters).
  bool defers_parameters() const {
    dtk_model_info info{};
    info.struct_size = dtk_model_info_STRUCT_SIZE;
    check(ref_->api->get_info(ref_->model, &info));
    return info.struct_size >= dtk_model_info_STRUCT_SIZE_2_4 && info.deferred_parameters != 0;
  }
  // ABI 2.11's end_iteration where the model has it.
  void end_iteration() const {
    if (DTK_STRUCT_COVERS(dtk_model_api, ref_->api, 2_11) && ref_->api->end_iteration)
      check(ref_->api->end_iteration(ref_->model));
  }
  void init_parameters(const Model::ParamValueFn& take) const {
    if (!DTK_STRUCT_COVERS(dtk_model_api, ref_->api, 2_4) || !ref_->api->init_parameters)
      throw Error("the model has no init_parameters (a model plugin before ABI 2.4)", DTK_ERR_UNSUPPORTED);
    const dtk_param_visitor v{dtk_param_visitor_STRUCT_SIZE, const_cast<Model::ParamValueFn*>(&take),
                              [](void* ctx, const char* name, dtk_tensor* t, const dtk_param_info*) {
                                return guard([&] { (*static_cast<Model::ParamValueFn*>(ctx))(name ? name : "", unwrap(t)); });
                              }};
    check(ref_->api->init_parameters(ref_->model, &v));
  }

 private:
  using VisitFn = dtk_status* (*)(dtk_model*, const dtk_param_visitor*);
  std::vector<Param> visit(VisitFn fn) const {
    std::vector<Param> out;
    dtk_param_visitor v = collecting_visitor(&out);
    check(fn(ref_->model, &v));
    return out;
  }
  const dtk_model_ref* ref_;
};

}  // namespace dtk
