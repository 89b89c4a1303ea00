// The gpt and causal_lm plugins as shipped, loaded by the host's PluginHost and driven only
// through the C ABI: shared by the model tests (test_gpt.cpp) and the Hugging Face export test.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <dtk/core/components/components.hpp>
#include <dtk/core/components/services.hpp>
#include <dtk/host/plugin_host.hpp>
#include <dtk/model.hpp>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtk_test_gpt {

using dtk::TensorList;
using Opts = std::map<std::string, std::string>;

struct Plugins {
  dtk::host::PluginHost host{dtk::core::host_torch_version(), dtk::core::host_services()};
  const dtk::host::Plugin* gpt = nullptr;
  const dtk::host::Plugin* step = nullptr;
  const dtk::host::Plugin* llama = nullptr;
  Plugins() {
    gpt = &host.load_file(std::string(DTK_TEST_PLUGIN_DIR) + "/dtk_plugin_gpt.so");
    llama = &host.load_file(std::string(DTK_TEST_PLUGIN_DIR) + "/dtk_plugin_llama.so");
    step = &host.load_file(std::string(DTK_TEST_PLUGIN_DIR) + "/dtk_plugin_causal_lm.so");
  }
};

inline Plugins& plugins() {
  static Plugins* p = new Plugins();  // plugins are never unloaded
  return *p;
}

struct Ctx {
  int32_t dtype = DTK_DTYPE_FLOAT32;
  int32_t tp_rank = 0, tp_size = 1;
  int64_t seq_length = 16;
  uint64_t seed = 1234;
  int32_t pp_rank = 0, pp_size = 1;
  int64_t micro_batch = 2;
  bool deferred = false;  // ABI 2.4: parameters without values (partitioned construction)
};

inline dtk_build_context make_ctx(const dtk_option_values* options, const Ctx& c) {
  dtk_build_context b{};
  b.struct_size = sizeof(b);
  b.options = options;
  b.device = {DTK_DEVICE_CPU, -1};
  b.params_dtype = c.dtype;
  b.tp_rank = c.tp_rank, b.tp_size = c.tp_size;
  b.pp_rank = c.pp_rank, b.pp_size = c.pp_size;
  b.dp_rank = 0, b.dp_size = 1;
  b.pre_process = c.pp_rank == 0, b.post_process = c.pp_rank == c.pp_size - 1;
  b.seq_length = c.seq_length;
  b.micro_batch_size = c.micro_batch;
  b.seed = c.seed;
  b.deferred_parameters = c.deferred ? 1 : 0;
  return b;
}

inline void check(dtk_status* s) {
  if (!s) return;
  std::string m = dtk_status_get_message(s);
  dtk_status_release(s);
  throw std::runtime_error(m);
}

// A model plugin's model (the gpt plugin's unless `plugin` names another).
class GPT {
 public:
  explicit GPT(const Opts& user, const Ctx& c = {}, const dtk::host::Plugin* plugin = nullptr)
      : opts_(dtk::host::resolve_options(plugin ? *plugin : *plugins().gpt, user)),
        api_((plugin ? plugin : plugins().gpt)->api_as<dtk_model_api>()) {
    // The run's sequence length is the model's seq_length option where the test gives one (a
    // learned position table must cover the run's samples).
    Ctx run = c;
    const auto seq = user.find("seq_length");
    if (seq != user.end() && std::stoll(seq->second) > 0) run.seq_length = std::stoll(seq->second);
    dtk_build_context b = make_ctx(opts_.get(), run);
    check(api_->create(&b, &model_));
    ref_ = {sizeof(dtk_model_ref), api_, model_};
  }
  ~GPT() { api_->destroy(model_); }
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  TensorList forward(const TensorList& in) {
    dtk::MapView view(in);
    dtk::SinkCollector out;
    const dtk_model_forward_args args{dtk_model_forward_args_STRUCT_SIZE, view.get(), out.sink()};
    check(api_->forward(model_, &args));
    return std::move(out.items());
  }
  std::vector<dtk::Param> params() { return dtk::ModelHandle(&ref_).parameters(); }
  std::map<std::string, at::Tensor> param_map() {
    std::map<std::string, at::Tensor> m;
    for (auto& p : params()) m[p.name] = p.tensor;
    return m;
  }
  void train(bool t) { check(api_->set_training(model_, t ? 1 : 0)); }
  TensorList state_save() {
    dtk::SinkCollector out;
    check(api_->state_save(model_, out.sink()));
    return std::move(out.items());
  }
  void state_load(const TensorList& s, bool strict = true) {
    dtk::MapView view(s);
    check(api_->state_load(model_, view.get(), strict ? 1 : 0));
  }
  dtk_model_info info() {
    dtk_model_info i{};
    i.struct_size = sizeof(i);
    check(api_->get_info(model_, &i));
    return i;
  }
  void zero_grad() {
    for (auto& p : params())
      if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
  }
  const dtk_model_ref* ref() const { return &ref_; }
  void set_hooks(const dtk_module_hooks* hooks) { check(api_->set_module_hooks(model_, hooks)); }
  std::vector<dtk::Module> modules() { return dtk::ModelHandle(&ref_).modules(); }

 private:
  dtk::host::OptionValues opts_;
  const dtk_model_api* api_;
  dtk_model* model_ = nullptr;
  dtk_model_ref ref_{};
};

// How many nodes of t's autograd graph have `name` in their name.
inline int64_t graph_has(const at::Tensor& t, const std::string& name) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  int64_t n = 0;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (node->name().find(name) != std::string::npos) ++n;
    for (const auto& e : node->next_edges()) todo.push_back(e.function.get());
  }
  return n;
}

}  // namespace dtk_test_gpt
