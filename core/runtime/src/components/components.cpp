#include "dtk/core/components/components.hpp"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
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
    [](dtk_model* m, const dtk_param_visitor* v) {
      if (!blaming(m)->api->init_parameters) return make_status(DTK_ERR_UNSUPPORTED, "model has no init_parameters");
      return blame(blaming(m)->api->init_parameters(blaming(m)->model, v), blaming(m), "init_parameters");
    },
    [](dtk_model* m) -> dtk_status* {
      if (!blaming(m)->api->end_iteration) return nullptr;
      return blame(blaming(m)->api->end_iteration(blaming(m)->model), blaming(m), "end_iteration");
    },
};
}  // namespace

// ---------------------------------------------------------------------------------------------
// The table behind ModelInstance::ref() when it holds several chunks (the interleaved pipeline
// schedule): names gain the chunk's "model<k>." prefix, forwards go to the selected chunk, and
// every call goes through the chunk's blaming entry, so errors still name the model plugin.
namespace {
ModelInstance* composite(dtk_model* m) { return reinterpret_cast<ModelInstance*>(m); }

struct PrefixedParams {
  const dtk_param_visitor* inner;
  std::string prefix;
  int32_t module_offset;
};
dtk_status* prefixed_param(void* ctx, const char* name, dtk_tensor* t, const dtk_param_info* info) {
  auto* p = static_cast<PrefixedParams*>(ctx);
  const std::string full = p->prefix + (name ? name : "");
  if (!info || info->module_index < 0 || p->module_offset == 0)
    return p->inner->visit(p->inner->ctx, full.c_str(), t, info);
  dtk_param_info shifted{};
  std::memcpy(&shifted, info, std::min(info->struct_size, sizeof shifted));
  shifted.struct_size = std::min(info->struct_size, sizeof shifted);
  shifted.module_index += p->module_offset;
  return p->inner->visit(p->inner->ctx, full.c_str(), t, &shifted);
}
struct PrefixedModules {
  const dtk_module_visitor* inner;
  std::string prefix;
  int32_t module_offset;
};
dtk_status* prefixed_module(void* ctx, const dtk_module_info* m) {
  auto* p = static_cast<PrefixedModules*>(ctx);
  if (!m) return p->inner->visit(p->inner->ctx, m);
  dtk_module_info shifted{};
  std::memcpy(&shifted, m, std::min(m->struct_size, sizeof shifted));
  shifted.struct_size = std::min(m->struct_size, sizeof shifted);
  const std::string name = p->prefix + (m->name ? m->name : "");
  std::vector<std::string> params;
  std::vector<const char*> pointers;
  for (size_t i = 0; i < m->num_params; ++i) params.push_back(p->prefix + (m->param_names[i] ? m->param_names[i] : ""));
  for (const std::string& n : params) pointers.push_back(n.c_str());
  shifted.index += p->module_offset;
  shifted.name = name.c_str();
  shifted.param_names = pointers.data();
  return p->inner->visit(p->inner->ctx, &shifted);
}
// A chunk's hooks: the caller's (copied), with the chunk's module indices shifted to the
// composite's; an entry the caller left NULL is skipped, as the model would skip it.
template <dtk_status* (*dtk_module_hooks::*Entry)(void*, int32_t)>
dtk_status* shifted_hook(void* ctx, int32_t i) {
  const auto* c = static_cast<const ModelInstance::Chunk*>(ctx);
  const auto entry = c->outer_hooks.*Entry;
  return entry ? entry(c->outer_hooks.ctx, i + c->module_offset) : nullptr;
}
// Installs `hooks` (null: none) on chunk `c` through `install`, shifted unless `shift` is false.
dtk_status* install_hooks(ModelInstance::Chunk& c, const dtk_module_hooks* hooks, bool shift,
                          const std::function<dtk_status*(const dtk_module_hooks*)>& install) {
  if (!hooks || !shift) return install(hooks);
  c.outer_hooks = dtk_module_hooks{};
  std::memcpy(&c.outer_hooks, hooks, std::min(hooks->struct_size, sizeof c.outer_hooks));
  c.shifted_hooks = {dtk_module_hooks_STRUCT_SIZE,
                     &c,
                     &shifted_hook<&dtk_module_hooks::pre_forward>,
                     &shifted_hook<&dtk_module_hooks::post_forward>,
                     &shifted_hook<&dtk_module_hooks::pre_backward>,
                     &shifted_hook<&dtk_module_hooks::post_backward>};
  return install(&c.shifted_hooks);
}
struct PrefixedSink {
  const dtk_tensor_sink* inner;
  std::string prefix;
};
dtk_status* prefixed_put(void* ctx, const char* name, dtk_tensor* t) {
  auto* p = static_cast<PrefixedSink*>(ctx);
  const std::string full = p->prefix + (name ? name : "");
  return p->inner->put(p->inner->ctx, full.c_str(), t);
}

// Splits "model<k>.<name>" entries by chunk (names without a chunk's prefix: none of them).
std::vector<TensorList> split_by_chunk(const ModelInstance& m, const TensorList& state,
                                       std::vector<std::string>* stray) {
  std::vector<TensorList> out(static_cast<size_t>(m.num_chunks()));
  for (const auto& [name, t] : state) {
    bool placed = false;
    for (int k = 0; k < m.num_chunks() && !placed; ++k) {
      const std::string prefix = m.chunk_prefix(k);
      if (name.compare(0, prefix.size(), prefix) == 0)
        out[static_cast<size_t>(k)].emplace_back(name.substr(prefix.size()), t), placed = true;
    }
    if (!placed && stray) stray->push_back(name);
  }
  return out;
}

// Calls `call(k, chunk k's reference)` for every chunk in order, stopping at the first error.
template <class F>
dtk_status* each_chunk(dtk_model* m, F&& call) {
  for (int k = 0; k < composite(m)->num_chunks(); ++k)
    if (dtk_status* s = call(k, composite(m)->chunk_ref(k))) return s;
  return nullptr;
}
// visit_parameters or visit_buffers of every chunk, names prefixed and module indices shifted.
dtk_status* visit_prefixed(dtk_model* m, const dtk_param_visitor* v,
                           dtk_status* (*const dtk_model_api::*visit)(dtk_model*, const dtk_param_visitor*)) {
  return each_chunk(m, [&](int k, const dtk_model_ref* chunk) {
    PrefixedParams p{v, composite(m)->chunk_prefix(k), composite(m)->chunk(k).module_offset};
    const dtk_param_visitor wrapped{dtk_param_visitor_STRUCT_SIZE, &p, &prefixed_param};
    return (chunk->api->*visit)(chunk->model, &wrapped);
  });
}

const dtk_model_api kCompositeApi = {
    dtk_model_api_STRUCT_SIZE,
    [](const dtk_build_context*, dtk_model**) -> dtk_status* {
      return make_status(DTK_ERR_UNSUPPORTED, "create through a model reference");
    },
    [](dtk_model*) {},  // the ModelInstance owns the chunks
    [](dtk_model* m, const dtk_model_forward_args* args) -> dtk_status* {
      const dtk_model_ref* chunk = composite(m)->chunk_ref();
      return chunk->api->forward(chunk->model, args);
    },
    [](dtk_model* m, const dtk_param_visitor* v) { return visit_prefixed(m, v, &dtk_model_api::visit_parameters); },
    [](dtk_model* m, const dtk_param_visitor* v) { return visit_prefixed(m, v, &dtk_model_api::visit_buffers); },
    [](dtk_model* m, int32_t training) {
      return each_chunk(m, [&](int, const dtk_model_ref* c) { return c->api->set_training(c->model, training); });
    },
    [](dtk_model* m, const dtk_model_to_args* args) {
      return each_chunk(m, [&](int, const dtk_model_ref* c) { return c->api->to(c->model, args); });
    },
    [](dtk_model* m, const dtk_tensor_sink* out) {
      return each_chunk(m, [&](int k, const dtk_model_ref* c) {
        PrefixedSink p{out, composite(m)->chunk_prefix(k)};
        const dtk_tensor_sink wrapped{dtk_tensor_sink_STRUCT_SIZE, &p, &prefixed_put};
        return c->api->state_save(c->model, &wrapped);
      });
    },
    [](dtk_model* m, const dtk_tensor_map* state, int32_t strict) -> dtk_status* {
      return guard([&] {
        TensorList all;
        for (size_t i = 0; state && i < state->count; ++i)
          if (state->items[i].name && state->items[i].tensor)
            all.emplace_back(state->items[i].name, unwrap(state->items[i].tensor));
        composite(m)->state_load(all, strict != 0);
      });
    },
    [](dtk_model* m, dtk_model_info* info) -> dtk_status* {
      const dtk_model_ref* chunk = composite(m)->chunk_ref(0);
      return chunk->api->get_info(chunk->model, info);
    },
    [](dtk_model* m, const dtk_module_visitor* v) {
      return each_chunk(m, [&](int k, const dtk_model_ref* c) {
        PrefixedModules p{v, composite(m)->chunk_prefix(k), composite(m)->chunk(k).module_offset};
        const dtk_module_visitor wrapped{dtk_module_visitor_STRUCT_SIZE, &p, &prefixed_module};
        return c->api->visit_modules(c->model, &wrapped);
      });
    },
    [](dtk_model* m, const dtk_module_hooks* hooks) {
      return each_chunk(m, [&](int k, const dtk_model_ref* c) {
        return install_hooks(composite(m)->chunk(k), hooks, true,
                             [&](const dtk_module_hooks* h) { return c->api->set_module_hooks(c->model, h); });
      });
    },
    [](dtk_model* m, const dtk_param_visitor* v) { return visit_prefixed(m, v, &dtk_model_api::init_parameters); },
    [](dtk_model* m) {
      return each_chunk(m, [&](int, const dtk_model_ref* c) -> dtk_status* {
        if (!DTK_STRUCT_COVERS(dtk_model_api, c->api, 2_11) || !c->api->end_iteration) return nullptr;
        return c->api->end_iteration(c->model);
      });
    },
};
}  // namespace

ModelInstance::ModelInstance(const Plugin& plugin, const dtk_build_context& ctx)
    : ModelInstance(plugin, std::vector<dtk_build_context>{ctx}) {}

ModelInstance::ModelInstance(const Plugin& plugin, const std::vector<dtk_build_context>& chunks)
    : plugin_(plugin), api_(plugin.api_as<dtk_model_api>()) {
  if (chunks.empty()) throw HostError("model plugin '" + plugin_.name() + "': no model chunk to create");
  split_ = pipeline_split(chunks[0]);
  // The forwarding table claims no more than the plugin's own table holds (abi.h rule 2): a
  // caller that checks for a newer entry sees what the plugin has.
  blaming_api_ = kBlamingApi;
  blaming_api_.struct_size = std::min(api_->struct_size, kBlamingApi.struct_size);
  composite_api_ = kCompositeApi;
  composite_api_.struct_size = blaming_api_.struct_size;
  composite_ref_ = {dtk_model_ref_STRUCT_SIZE, &composite_api_, reinterpret_cast<dtk_model*>(this)};
  for (const dtk_build_context& ctx : chunks) create_chunk(ctx);
  // Module indices run on over the chunks (a model that lists no modules: offsets stay 0, and
  // visiting its modules reports its own error).
  int32_t offset = 0;
  for (auto& c : chunks_) {
    c->module_offset = offset;
    int32_t count = 0;
    const dtk_module_visitor counter{dtk_module_visitor_STRUCT_SIZE, &count, [](void* ctx, const dtk_module_info*) {
                                       ++*static_cast<int32_t*>(ctx);
                                       return static_cast<dtk_status*>(nullptr);
                                     }};
    if (chunks_.size() == 1) break;
    if (dtk_status* s = api_->visit_modules(c->model, &counter)) {
      dtk_status_release(s);
      for (auto& d : chunks_) d->module_offset = 0;
      break;
    }
    offset += count;
  }
  check_each_parameter_once();
}

// The contract every consumer relies on (model.hpp, `parameters`): a tensor listed twice would be
// stepped and counted twice, and two under one name would meet in a checkpoint.
void ModelInstance::check_each_parameter_once() const {
  std::map<const void*, std::string> name_of;
  std::set<std::string> names;
  for (const Param& p : parameters()) {
    const auto [it, fresh] = name_of.emplace(p.tensor.unsafeGetTensorImpl(), p.name);
    if (!fresh)
      throw HostError("model plugin '" + plugin_.name() + "': visit_parameters lists one tensor twice, as '" +
                      it->second + "' and '" + p.name + "': list each parameter once (a tied weight once, shared=1 " +
                      "on the stage that owns it)");
    if (!names.insert(p.name).second)
      throw HostError("model plugin '" + plugin_.name() + "': visit_parameters lists two parameters named '" + p.name +
                      "'");
  }
}

void ModelInstance::create_chunk(const dtk_build_context& asked) {
  // Deferred parameters only for a model that can hand their values out afterwards (abi.h).
  dtk_build_context ctx = asked;
  if (!DTK_HAS_FIELD(dtk_model_api, api_, init_parameters) || !api_->init_parameters) ctx.deferred_parameters = 0;
  dtk_model* m = nullptr;
  check_plugin(api_->create(&ctx, &m), plugin_, "create");
  if (!m) throw HostError("model plugin '" + plugin_.name() + "': create returned no model");
  auto chunk = std::make_unique<Chunk>(api_, m);
  chunk->blaming = {api_, m, plugin_.name(), true, 0, at::Tensor()};
  chunk->blaming_ref = {dtk_model_ref_STRUCT_SIZE, &blaming_api_, reinterpret_cast<dtk_model*>(&chunk->blaming)};
  chunks_.push_back(std::move(chunk));
  // A model that did not honour the context's device or dtype is moved (abi.h: `to`).
  const at::Device device = to_device(ctx.device);
  const at::ScalarType dtype = to_scalar_type(ctx.params_dtype);
  std::vector<Param> params;
  dtk_param_visitor v = collecting_visitor(&params);
  check_plugin(api_->visit_parameters(m, &v), plugin_, "visit_parameters");
  for (const Param& p : params) {
    if (p.tensor.device() != device || (p.tensor.is_floating_point() && p.tensor.scalar_type() != dtype)) {
      const dtk_model_to_args args{dtk_model_to_args_STRUCT_SIZE, from_device(device), from_scalar_type(dtype)};
      check_plugin(api_->to(m, &args), plugin_, "to");
      break;
    }
  }
}
ModelInstance::~ModelInstance() = default;

void ModelInstance::select_chunk(int k) {
  if (k < 0 || k >= num_chunks()) throw HostError("model chunk " + std::to_string(k) + " does not exist");
  selected_ = k;
}
std::string ModelInstance::chunk_prefix(int64_t k, int64_t chunks) {
  return chunks > 1 ? "model" + std::to_string(k) + "." : std::string();
}
const dtk_model_ref* ModelInstance::chunk_ref(int k) const {
  return &chunks_[static_cast<size_t>(k < 0 ? selected_ : k)]->blaming_ref;
}

std::vector<Param> ModelInstance::parameters() const {
  std::vector<Param> out;
  for (int k = 0; k < num_chunks(); ++k) {
    const size_t first = out.size();
    dtk_param_visitor v = collecting_visitor(&out);
    check_plugin(api_->visit_parameters(chunks_[k]->model, &v), plugin_, "visit_parameters");
    for (size_t i = first; i < out.size(); ++i) {
      out[i].name = chunk_prefix(k) + out[i].name;
      if (out[i].info.module_index >= 0) out[i].info.module_index += chunks_[k]->module_offset;
    }
  }
  return out;
}
void ModelInstance::set_training(bool training) {
  for (const auto& c : chunks_) check_plugin(api_->set_training(c->model, training ? 1 : 0), plugin_, "set_training");
}
dtk_model_info ModelInstance::info() const {
  dtk_model_info info{};
  info.struct_size = dtk_model_info_STRUCT_SIZE;
  check_plugin(api_->get_info(chunks_[0]->model, &info), plugin_, "get_info");
  if (!DTK_STRUCT_COVERS(dtk_model_info, &info, 2_0))
    throw HostError("model plugin '" + plugin_.name() + "': get_info filled " + std::to_string(info.struct_size) +
                    " bytes, fewer than ABI 2.0's " + std::to_string(dtk_model_info_STRUCT_SIZE_2_0));
  return info;
}
void ModelInstance::to(at::Device device, std::optional<at::ScalarType> dtype) {
  const dtk_model_to_args args{dtk_model_to_args_STRUCT_SIZE, from_device(device),
                               dtype ? from_scalar_type(*dtype) : DTK_DTYPE_INVALID};
  for (const auto& c : chunks_) check_plugin(api_->to(c->model, &args), plugin_, "to");
}
std::vector<Module> ModelInstance::modules() const {
  std::vector<Module> out;
  for (int k = 0; k < num_chunks(); ++k) {
    const size_t first = out.size();
    const dtk_module_visitor v = collecting_module_visitor(&out);
    check_plugin(api_->visit_modules(chunks_[k]->model, &v), plugin_, "visit_modules");
    for (size_t i = first; i < out.size(); ++i) {
      out[i].index += chunks_[k]->module_offset;
      out[i].name = chunk_prefix(k) + out[i].name;
      for (std::string& p : out[i].params) p = chunk_prefix(k) + p;
    }
  }
  return out;
}
void ModelInstance::set_module_hooks(const dtk_module_hooks* hooks) {
  for (const auto& c : chunks_)
    check_plugin(install_hooks(*c, hooks, chunks_.size() > 1,
                               [&](const dtk_module_hooks* h) { return api_->set_module_hooks(c->model, h); }),
                 plugin_, "set_module_hooks");
}
TensorList ModelInstance::state_save() const {
  TensorList all;
  for (int k = 0; k < num_chunks(); ++k) {
    SinkCollector out;
    check_plugin(api_->state_save(chunks_[k]->model, out.sink()), plugin_, "state_save");
    for (auto& [name, t] : out.items()) all.emplace_back(chunk_prefix(k) + name, std::move(t));
  }
  return all;
}
void ModelInstance::state_load(const TensorList& state, bool strict) {
  if (num_chunks() == 1) {
    MapView view(state);
    check_plugin(api_->state_load(chunks_[0]->model, view.get(), strict ? 1 : 0), plugin_, "state_load");
    return;
  }
  std::vector<std::string> stray;
  const std::vector<TensorList> parts = split_by_chunk(*this, state, &stray);
  if (strict && !stray.empty())
    throw HostError("model plugin '" + plugin_.name() + "': state_load: '" + stray[0] + "' belongs to none of the " +
                    std::to_string(num_chunks()) +
                    " model chunks (model<k>.<name>): was it saved without the interleaved pipeline schedule?");
  for (int k = 0; k < num_chunks(); ++k) {
    MapView view(parts[static_cast<size_t>(k)]);
    check_plugin(api_->state_load(chunks_[k]->model, view.get(), strict ? 1 : 0), plugin_, "state_load");
  }
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
at::Tensor StepInstance::forward_step(const ModelInstance& model, const TensorList& batch, StepMetrics* metrics,
                                      at::Tensor* num_tokens) {
  MapView view(batch);
  // Host callbacks run inside plugin frames: nothing may throw out of them.
  dtk_metric_sink sink{dtk_metric_sink_STRUCT_SIZE, metrics,
                       [](void* ctx, const char* name, double v) {
                         if (!name) return;
                         try {
                           static_cast<StepMetrics*>(ctx)->values.emplace_back(name, v);
                         } catch (...) {
                         }
                       },
                       [](void* ctx, const char* name, dtk_tensor* t) {
                         TensorHandle owned(t);
                         if (!name || !t) return;
                         try {
                           static_cast<StepMetrics*>(ctx)->tensors.emplace_back(name, unwrap(t));
                         } catch (...) {
                         }
                       }};
  dtk_step_forward_args args{
      dtk_step_forward_args_STRUCT_SIZE, model.ref(), view.get(), &sink, nullptr, num_tokens ? 1 : 0, nullptr};
  check_plugin(api_->forward_step(step_, &args), plugin_, "forward_step");
  TensorHandle owned_tokens(args.num_tokens);
  if (!args.loss) throw HostError("step plugin '" + plugin_.name() + "': forward_step returned no loss");
  TensorHandle owned(args.loss);
  if (num_tokens) *num_tokens = args.num_tokens ? unwrap(args.num_tokens) : at::Tensor();
  return unwrap(args.loss);
}

// ---------------------------------------------------------------------------------------------
OptimizerInstance::OptimizerInstance(const Plugin& plugin, const dtk_build_context& ctx, std::vector<Param> params,
                                     const ParamGroups& groups)
    : plugin_(plugin), api_(plugin.api_as<dtk_optimizer_api>()), params_(std::move(params)), specs_(groups.specs()) {
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
bool StrategyInstance::defers_parameters() const {
  if (!DTK_HAS_FIELD(dtk_strategy_api, api_, defers_parameters) || !api_->defers_parameters) return false;
  int32_t deferred = 0;
  check_plugin(api_->defers_parameters(strategy_, &deferred), plugin_, "defers_parameters");
  return deferred != 0;
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
