#include "dtk/core/components.hpp"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>

namespace dtk::core {

using host::HostError;
using host::Plugin;

void check_plugin(dtk_status* s, const Plugin& plugin, const char* call) {
  if (!s) return;
  host::check_status(s, std::string(host::kind_name(plugin.kind())) + " plugin '" + plugin.name() + "': " + call);
}

// ---------------------------------------------------------------------------------------------
// The table behind ModelInstance::ref(): each entry calls the plugin's own and, on failure,
// returns a status whose message names the model plugin and the call. `model` is the Blaming
// context. Functions only (the state is the context): each ModelInstance copies it, claiming no
// more struct_size than the plugin's own table.
namespace {
using Blaming = ModelInstance::Blaming;
Blaming* blaming(dtk_model* m) { return reinterpret_cast<Blaming*>(m); }

dtk_status* blame(dtk_status* s, const Blaming* b, const char* call) {
  if (!s) return nullptr;
  const std::string message = "model plugin '" + b->name + "': " + call + ": " + dtk_status_get_message(s);
  const int32_t code = dtk_status_get_code(s);
  dtk_status_release(s);
  return make_status(code, message);
}

// Forwards a forward's outputs to the caller's sink, noting whether any floating-point output
// is attached to the autograd graph.
struct OutputWatch {
  const dtk_tensor_sink* inner;
  bool any_float = false, attached = false;
};
dtk_status* watch_put(void* ctx, const char* name, dtk_tensor* t) {
  auto* w = static_cast<OutputWatch*>(ctx);
  if (t && t->value.defined() && t->value.is_floating_point()) {
    w->any_float = true;
    w->attached = w->attached || t->value.requires_grad();
  }
  return w->inner->put(w->inner->ctx, name, t);
}

const dtk_model_api kBlamingApi = {
    dtk_model_api_STRUCT_SIZE,
    [](const dtk_build_context*, dtk_model**) -> dtk_status* {
      return make_status(DTK_ERR_UNSUPPORTED, "create through a model reference");
    },
    [](dtk_model*) {},  // the ModelInstance owns the model
    [](dtk_model* m, const dtk_model_forward_args* args) -> dtk_status* {
      Blaming* b = blaming(m);
      if (!args || args->struct_size < dtk_model_forward_args_STRUCT_SIZE_2_0 || !args->outputs)
        return b->api->forward(b->model, args);  // the plugin refuses it in its own words
      OutputWatch w{args->outputs};
      const dtk_tensor_sink sink{dtk_tensor_sink_STRUCT_SIZE, &w, &watch_put};
      // The caller's arguments as it wrote them (its struct_size, fields a newer caller appends
      // included), only the output sink replaced.
      dtk_model_forward_args a{};
      std::memcpy(&a, args, std::min(args->struct_size, sizeof a));
      a.struct_size = std::min(args->struct_size, sizeof a);
      a.outputs = &sink;
      // A pipeline stage after the first: the previous stage's output is the "hidden_states".
      std::optional<TensorList> staged;
      std::optional<MapView> staged_view;
      if (b->pipeline_input.defined() && args->inputs) {
        staged.emplace();
        for (size_t i = 0; i < args->inputs->count; ++i) {
          const dtk_named_tensor& item = args->inputs->items[i];
          if (item.name && std::string(item.name) != "hidden_states" && item.tensor)
            staged->emplace_back(item.name, unwrap(item.tensor));
        }
        staged->emplace_back("hidden_states", b->pipeline_input);
        staged_view.emplace(*staged);
        a.inputs = staged_view->get();
      }
      dtk_status* s = b->api->forward(b->model, &a);
      ++b->forwards;
      b->outputs_attached = b->outputs_attached || !w.any_float || w.attached;
      return blame(s, b, "forward");
    },
    [](dtk_model* m, const dtk_param_visitor* v) {
      return blame(blaming(m)->api->visit_parameters(blaming(m)->model, v), blaming(m), "visit_parameters");
    },
    [](dtk_model* m, const dtk_param_visitor* v) {
      return blame(blaming(m)->api->visit_buffers(blaming(m)->model, v), blaming(m), "visit_buffers");
    },
    [](dtk_model* m, int32_t training) {
      return blame(blaming(m)->api->set_training(blaming(m)->model, training), blaming(m), "set_training");
    },
    [](dtk_model* m, const dtk_model_to_args* args) {
      return blame(blaming(m)->api->to(blaming(m)->model, args), blaming(m), "to");
    },
    [](dtk_model* m, const dtk_tensor_sink* out) {
      return blame(blaming(m)->api->state_save(blaming(m)->model, out), blaming(m), "state_save");
    },
    [](dtk_model* m, const dtk_tensor_map* state, int32_t strict) {
      return blame(blaming(m)->api->state_load(blaming(m)->model, state, strict), blaming(m), "state_load");
    },
    [](dtk_model* m, dtk_model_info* info) {
      return blame(blaming(m)->api->get_info(blaming(m)->model, info), blaming(m), "get_info");
    },
    [](dtk_model* m, const dtk_module_visitor* v) {
      return blame(blaming(m)->api->visit_modules(blaming(m)->model, v), blaming(m), "visit_modules");
    },
    [](dtk_model* m, const dtk_module_hooks* hooks) {
      return blame(blaming(m)->api->set_module_hooks(blaming(m)->model, hooks), blaming(m), "set_module_hooks");
    },
};
}  // namespace

ModelInstance::ModelInstance(const Plugin& plugin, const dtk_build_context& ctx)
    : plugin_(plugin), api_(plugin.api_as<dtk_model_api>()) {
  dtk_model* m = nullptr;
  check_plugin(api_->create(&ctx, &m), plugin_, "create");
  if (!m) throw HostError("model plugin '" + plugin_.name() + "': create returned no model");
  ref_ = {dtk_model_ref_STRUCT_SIZE, api_, m};
  blaming_ = {api_, m, plugin_.name(), true, 0};
  // The forwarding table claims no more than the plugin's own table holds (abi.h rule 2): a
  // caller that checks for a newer entry sees what the plugin has.
  blaming_api_ = kBlamingApi;
  blaming_api_.struct_size = std::min(api_->struct_size, kBlamingApi.struct_size);
  blaming_ref_ = {dtk_model_ref_STRUCT_SIZE, &blaming_api_, reinterpret_cast<dtk_model*>(&blaming_)};
  // A model that did not honour the context's device or dtype is moved (abi.h: `to`).
  const at::Device device = to_device(ctx.device);
  const at::ScalarType dtype = to_scalar_type(ctx.params_dtype);
  for (const Param& p : parameters()) {
    if (p.tensor.device() != device || (p.tensor.is_floating_point() && p.tensor.scalar_type() != dtype)) {
      to(device, dtype);
      break;
    }
  }
}
ModelInstance::~ModelInstance() {
  if (ref_.model) api_->destroy(ref_.model);
}
std::vector<Param> ModelInstance::parameters() const {
  std::vector<Param> out;
  dtk_param_visitor v = collecting_visitor(&out);
  check_plugin(api_->visit_parameters(ref_.model, &v), plugin_, "visit_parameters");
  return out;
}
void ModelInstance::set_training(bool training) {
  check_plugin(api_->set_training(ref_.model, training ? 1 : 0), plugin_, "set_training");
}
dtk_model_info ModelInstance::info() const {
  dtk_model_info info{};
  info.struct_size = dtk_model_info_STRUCT_SIZE;
  check_plugin(api_->get_info(ref_.model, &info), plugin_, "get_info");
  if (!DTK_STRUCT_COVERS(dtk_model_info, &info, 2_0))
    throw HostError("model plugin '" + plugin_.name() + "': get_info filled " + std::to_string(info.struct_size) +
                    " bytes, fewer than ABI 2.0's " + std::to_string(dtk_model_info_STRUCT_SIZE_2_0));
  return info;
}
void ModelInstance::to(at::Device device, std::optional<at::ScalarType> dtype) {
  const dtk_model_to_args args{dtk_model_to_args_STRUCT_SIZE, from_device(device),
                               dtype ? from_scalar_type(*dtype) : DTK_DTYPE_INVALID};
  check_plugin(api_->to(ref_.model, &args), plugin_, "to");
}
std::vector<Module> ModelInstance::modules() const {
  std::vector<Module> out;
  const dtk_module_visitor v = collecting_module_visitor(&out);
  check_plugin(api_->visit_modules(ref_.model, &v), plugin_, "visit_modules");
  return out;
}
void ModelInstance::set_module_hooks(const dtk_module_hooks* hooks) {
  check_plugin(api_->set_module_hooks(ref_.model, hooks), plugin_, "set_module_hooks");
}
TensorList ModelInstance::state_save() const {
  SinkCollector out;
  check_plugin(api_->state_save(ref_.model, out.sink()), plugin_, "state_save");
  return std::move(out.items());
}
void ModelInstance::state_load(const TensorList& state, bool strict) {
  MapView view(state);
  check_plugin(api_->state_load(ref_.model, view.get(), strict ? 1 : 0), plugin_, "state_load");
}

// ---------------------------------------------------------------------------------------------
StepInstance::StepInstance(const Plugin& plugin, const dtk_build_context& ctx)
    : plugin_(plugin), api_(plugin.api_as<dtk_step_api>()) {
  check_plugin(api_->create(&ctx, &step_), plugin_, "create");
  if (!step_) throw HostError("step plugin '" + plugin_.name() + "': create returned no step");
}
StepInstance::~StepInstance() {
  if (step_) api_->destroy(step_);
}
at::Tensor StepInstance::forward_step(const ModelInstance& model, const TensorList& batch,
                                      std::vector<std::pair<std::string, double>>* metrics) {
  MapView view(batch);
  // Host callbacks run inside plugin frames: nothing may throw out of them.
  dtk_metric_sink sink{dtk_metric_sink_STRUCT_SIZE, metrics, [](void* ctx, const char* name, double v) {
                         if (!name) return;
                         try {
                           static_cast<std::vector<std::pair<std::string, double>>*>(ctx)->emplace_back(name, v);
                         } catch (...) {
                         }
                       }};
  dtk_step_forward_args args{dtk_step_forward_args_STRUCT_SIZE, model.ref(), view.get(), &sink, nullptr};
  check_plugin(api_->forward_step(step_, &args), plugin_, "forward_step");
  if (!args.loss) throw HostError("step plugin '" + plugin_.name() + "': forward_step returned no loss");
  TensorHandle owned(args.loss);
  return unwrap(args.loss);
}

// ---------------------------------------------------------------------------------------------
OptimizerInstance::OptimizerInstance(const Plugin& plugin, const dtk_build_context& ctx, std::vector<Param> params,
                                     const ParamGroups& groups)
    : plugin_(plugin), api_(plugin.api_as<dtk_optimizer_api>()), params_(std::move(params)) {
  const size_t n = groups.specs().size();
  std::vector<dtk_tensor> handles;
  handles.reserve(params_.size());
  for (const auto& p : params_) handles.push_back(dtk_tensor{p.tensor});
  std::vector<std::vector<dtk_tensor*>> tensors(n);
  std::vector<std::vector<const char*>> names(n);
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t g = groups.group_of(params_[i].name, params_[i].info.no_weight_decay != 0);
    tensors[g].push_back(&handles[i]);
    names[g].push_back(params_[i].name.c_str());
  }
  std::vector<dtk_param_group> group_args;
  for (size_t g = 0; g < n; ++g)
    group_args.push_back({dtk_param_group_STRUCT_SIZE, tensors[g].size(), tensors[g].data(), names[g].data(),
                          groups.specs()[g].weight_decay, groups.specs()[g].lr_scale});
  dtk_optimizer* o = nullptr;
  const dtk_optimizer_create_args args{dtk_optimizer_create_args_STRUCT_SIZE, &ctx, group_args.data(), n};
  check_plugin(api_->create(&args, &o), plugin_, "create");
  if (!o) throw HostError("optimizer plugin '" + plugin_.name() + "': create returned no optimizer");
  ref_ = {dtk_optimizer_ref_STRUCT_SIZE, api_, o};
}
OptimizerInstance::~OptimizerInstance() {
  if (ref_.optimizer) api_->destroy(ref_.optimizer);
}
TensorList OptimizerInstance::state_save() const {
  SinkCollector out;
  check_plugin(api_->state_save(ref_.optimizer, out.sink()), plugin_, "state_save");
  return std::move(out.items());
}
void OptimizerInstance::state_load(const TensorList& state) {
  MapView view(state);
  check_plugin(api_->state_load(ref_.optimizer, view.get()), plugin_, "state_load");
}

// ---------------------------------------------------------------------------------------------
StrategyInstance::StrategyInstance(const Plugin& plugin, const dtk_build_context& ctx)
    : plugin_(plugin), api_(plugin.api_as<dtk_strategy_api>()) {
  check_plugin(api_->create(&ctx, &strategy_), plugin_, "create");
  if (!strategy_) throw HostError("strategy plugin '" + plugin_.name() + "': create returned no strategy");
}
StrategyInstance::~StrategyInstance() {
  if (hooked_) {
    try {
      hooked_->set_module_hooks(nullptr);
    } catch (const std::exception& e) {
      LOG(ERROR) << e.what();
    }
  }
  if (strategy_) api_->destroy(strategy_);
}
void StrategyInstance::setup(ModelInstance& model) {
  check_plugin(api_->setup(strategy_, model.ref()), plugin_, "setup");
  info_ = dtk_strategy_info{};
  info_.struct_size = dtk_strategy_info_STRUCT_SIZE;
  if (DTK_HAS_FIELD(dtk_strategy_api, api_, get_info) && api_->get_info) {
    check_plugin(api_->get_info(strategy_, &info_), plugin_, "get_info");
    if (info_.struct_size > dtk_strategy_info_STRUCT_SIZE) info_.struct_size = dtk_strategy_info_STRUCT_SIZE;
  } else {
    info_ = dtk_strategy_info{};  // a 2.0 strategy: replicated state, whole parameters
  }
  if (info_.partitions_parameters &&
      !(DTK_HAS_FIELD(dtk_strategy_api, api_, gather_parameters) && api_->gather_parameters))
    throw HostError("strategy plugin '" + plugin_.name() + "' partitions parameters but has no gather_parameters");
  const dtk_module_hooks* hooks = nullptr;
  check_plugin(api_->module_hooks(strategy_, &hooks), plugin_, "module_hooks");
  if (!hooks) return;
  try {
    model.set_module_hooks(hooks);
  } catch (const HostError& e) {
    throw HostError("strategy plugin '" + plugin_.name() + "' needs per-module hooks, but " + e.what());
  }
  hooked_ = &model;
}
std::vector<Param> StrategyInstance::optimizer_params() {
  std::vector<Param> out;
  dtk_param_visitor v = collecting_visitor(&out);
  check_plugin(api_->optimizer_params(strategy_, &v), plugin_, "optimizer_params");
  return out;
}
void StrategyInstance::before_backward(int64_t micro_batch, int64_t num_micro_batches) {
  const dtk_backward_args args{dtk_backward_args_STRUCT_SIZE, static_cast<int32_t>(micro_batch),
                               static_cast<int32_t>(num_micro_batches), micro_batch + 1 == num_micro_batches ? 1 : 0};
  check_plugin(api_->before_backward(strategy_, &args), plugin_, "before_backward");
}
void StrategyInstance::reduce_gradients() {
  check_plugin(api_->reduce_gradients(strategy_), plugin_, "reduce_gradients");
}
double StrategyInstance::clip_and_norm(double max_norm) {
  dtk_clip_args args{dtk_clip_args_STRUCT_SIZE, max_norm, 0.0};
  check_plugin(api_->clip_and_norm(strategy_, &args), plugin_, "clip_and_norm");
  return args.norm;
}
void StrategyInstance::optimizer_step(const OptimizerInstance& opt, const dtk_optimizer_step_args& args) {
  const dtk_strategy_step_args step{dtk_strategy_step_args_STRUCT_SIZE, opt.ref(), &args};
  check_plugin(api_->optimizer_step(strategy_, &step), plugin_, "optimizer_step");
}
void StrategyInstance::zero_grad() { check_plugin(api_->zero_grad(strategy_), plugin_, "zero_grad"); }
TensorList StrategyInstance::state_save() const {
  SinkCollector out;
  if (!api_->state_save) return {};
  check_plugin(api_->state_save(strategy_, out.sink()), plugin_, "state_save");
  return std::move(out.items());
}
void StrategyInstance::state_load(const TensorList& state) {
  if (!api_->state_load) return;
  MapView view(state);
  check_plugin(api_->state_load(strategy_, view.get()), plugin_, "state_load");
}

void StrategyInstance::gather_parameters(bool whole) {
  if (!info_.partitions_parameters) return;
  check_plugin(api_->gather_parameters(strategy_, whole ? 1 : 0), plugin_, "gather_parameters");
}
dtk_memory_usage StrategyInstance::memory_usage() const {
  dtk_memory_usage u{};
  u.struct_size = dtk_memory_usage_STRUCT_SIZE;
  if (!(DTK_HAS_FIELD(dtk_strategy_api, api_, memory_usage) && api_->memory_usage)) {
    u = dtk_memory_usage{};
    return u;
  }
  check_plugin(api_->memory_usage(strategy_, &u), plugin_, "memory_usage");
  return u;
}

// ---------------------------------------------------------------------------------------------
DatasetInstance::DatasetInstance(const Plugin& plugin, const dtk_dataset_context& ctx)
    : plugin_(plugin), api_(plugin.api_as<dtk_dataset_api>()) {
  check_plugin(api_->create(&ctx, &dataset_), plugin_, "create");
  if (!dataset_) throw HostError("dataset plugin '" + plugin_.name() + "': create returned no dataset");
}
DatasetInstance::~DatasetInstance() {
  if (dataset_) api_->destroy(dataset_);
}
int64_t DatasetInstance::num_samples(int32_t split) const {
  int64_t n = 0;
  check_plugin(api_->num_samples(dataset_, split, &n), plugin_, "num_samples");
  return n;
}
int64_t DatasetInstance::vocab_size() const {
  int64_t n = 0;
  check_plugin(api_->vocab_size(dataset_, &n), plugin_, "vocab_size");
  return n;
}

}  // namespace dtk::core
