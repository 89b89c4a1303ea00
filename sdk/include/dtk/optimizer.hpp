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
  double weight_decay = 0.0;
  double lr_scale = 1.0;
};

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
  }
  return out;
}

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
