#include "dtk/core/components.hpp"

#include <cmath>
#include <set>

namespace dtk::core {

using host::HostError;
using host::Plugin;

void check_plugin(dtk_status* s, const Plugin& plugin, const char* call) {
  if (!s) return;
  host::check_status(s, std::string(host::kind_name(plugin.kind())) + " plugin '" + plugin.name() + "': " + call);
}

// ---------------------------------------------------------------------------------------------
ModelInstance::ModelInstance(const Plugin& plugin, const dtk_build_context& ctx)
    : plugin_(plugin), api_(plugin.api_as<dtk_model_api>()) {
  dtk_model* m = nullptr;
  check_plugin(api_->create(&ctx, &m), plugin_, "create");
  if (!m) throw HostError("model plugin '" + plugin_.name() + "': create returned no model");
  ref_ = {sizeof(dtk_model_ref), api_, m};
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
  info.struct_size = sizeof(info);
  check_plugin(api_->get_info(ref_.model, &info), plugin_, "get_info");
  return info;
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
  dtk_metric_sink sink{sizeof(dtk_metric_sink), metrics, [](void* ctx, const char* name, double v) {
                         if (!name) return;
                         try {
                           static_cast<std::vector<std::pair<std::string, double>>*>(ctx)->emplace_back(name, v);
                         } catch (...) {
                         }
                       }};
  dtk_tensor* loss = nullptr;
  check_plugin(api_->forward_step(step_, model.ref(), view.get(), &loss, &sink), plugin_, "forward_step");
  if (!loss) throw HostError("step plugin '" + plugin_.name() + "': forward_step returned no loss");
  TensorHandle owned(loss);
  return unwrap(loss);
}

// ---------------------------------------------------------------------------------------------
OptimizerInstance::OptimizerInstance(const Plugin& plugin, const dtk_build_context& ctx,
                                     const std::vector<Param>& params, double weight_decay)
    : plugin_(plugin), api_(plugin.api_as<dtk_optimizer_api>()) {
  // Two groups as Megatron: weights decay; biases and norm parameters do not.
  std::vector<dtk_tensor> handles;
  handles.reserve(params.size());
  for (const auto& p : params) handles.push_back(dtk_tensor{p.tensor});
  std::vector<dtk_tensor*> decay, no_decay;
  std::vector<const char*> decay_names, no_decay_names;
  for (size_t i = 0; i < params.size(); ++i) {
    (params[i].info.no_weight_decay ? no_decay : decay).push_back(&handles[i]);
    (params[i].info.no_weight_decay ? no_decay_names : decay_names).push_back(params[i].name.c_str());
  }
  std::vector<dtk_param_group> groups;
  if (!decay.empty())
    groups.push_back({sizeof(dtk_param_group), decay.size(), decay.data(), decay_names.data(), weight_decay, 1.0});
  if (!no_decay.empty())
    groups.push_back({sizeof(dtk_param_group), no_decay.size(), no_decay.data(), no_decay_names.data(), 0.0, 1.0});
  num_groups_ = groups.size();
  dtk_optimizer* o = nullptr;
  check_plugin(api_->create(&ctx, groups.data(), groups.size(), &o), plugin_, "create");
  if (!o) throw HostError("optimizer plugin '" + plugin_.name() + "': create returned no optimizer");
  ref_ = {sizeof(dtk_optimizer_ref), api_, o};
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
  if (strategy_) api_->destroy(strategy_);
}
void StrategyInstance::setup(const ModelInstance& model) {
  check_plugin(api_->setup(strategy_, model.ref()), plugin_, "setup");
}
std::vector<Param> StrategyInstance::optimizer_params() {
  std::vector<Param> out;
  dtk_param_visitor v = collecting_visitor(&out);
  check_plugin(api_->optimizer_params(strategy_, &v), plugin_, "optimizer_params");
  return out;
}
void StrategyInstance::before_backward(bool is_last) {
  check_plugin(api_->before_backward(strategy_, is_last ? 1 : 0), plugin_, "before_backward");
}
void StrategyInstance::reduce_gradients() {
  check_plugin(api_->reduce_gradients(strategy_), plugin_, "reduce_gradients");
}
double StrategyInstance::clip_and_norm(double max_norm) {
  double norm = 0;
  check_plugin(api_->clip_and_norm(strategy_, max_norm, &norm), plugin_, "clip_and_norm");
  return norm;
}
void StrategyInstance::optimizer_step(const OptimizerInstance& opt, const dtk_optimizer_step_args& args) {
  check_plugin(api_->optimizer_step(strategy_, opt.ref(), &args), plugin_, "optimizer_step");
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
