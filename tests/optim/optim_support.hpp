// Drives optimizer and strategy plugins through the C ABI (shared by the test and the benchmark).
#pragma once

#include <dtk/core/components/services.hpp>
#include <dtk/host/plugin_host.hpp>
#include <dtk/model.hpp>
#include <dtk/optimizer.hpp>

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtk_optim_support {

inline dtk::host::PluginHost& host() {
  static auto* h = new dtk::host::PluginHost(dtk::core::host_torch_version(), dtk::core::host_services());
  return *h;
}

inline const dtk::host::Plugin& plugin(const std::string& dir, const std::string& file) {
  const std::string path = dir + "/" + file;
  for (const auto* p : host().list())
    if (p->path == path) return *p;
  return host().load_file(path);
}

inline void check(dtk_status* s) {
  if (!s) return;
  std::string m = dtk_status_get_message(s);
  dtk_status_release(s);
  throw std::runtime_error(m);
}

inline dtk_build_context context(const dtk_option_values* options) {
  dtk_build_context b{};
  b.struct_size = sizeof(b);
  b.options = options;
  b.device = {DTK_DEVICE_CPU, -1};
  b.params_dtype = DTK_DTYPE_FLOAT32;
  b.tp_size = b.pp_size = b.dp_size = 1;
  b.pre_process = b.post_process = 1;
  return b;
}

// An optimizer plugin instance over parameter groups (params, weight decay).
class PluginOptimizer {
 public:
  // lr_scales: one per group (default 1).
  PluginOptimizer(const dtk::host::Plugin& p, const std::map<std::string, std::string>& opts,
                  const std::vector<std::pair<std::vector<at::Tensor>, double>>& groups,
                  const std::vector<double>& lr_scales = {})
      : options_(dtk::host::resolve_options(p, opts)), api_(p.api_as<dtk_optimizer_api>()) {
    std::vector<std::vector<dtk_tensor>> handles(groups.size());
    std::vector<std::vector<dtk_tensor*>> ptrs(groups.size());
    std::vector<dtk_param_group> gs;
    for (size_t g = 0; g < groups.size(); ++g) {
      for (const auto& t : groups[g].first) handles[g].push_back(dtk_tensor{t});
      for (auto& h : handles[g]) ptrs[g].push_back(&h);
      gs.push_back({sizeof(dtk_param_group), ptrs[g].size(), ptrs[g].data(), nullptr, groups[g].second,
                    g < lr_scales.size() ? lr_scales[g] : 1.0});
    }
    dtk_build_context b = context(options_.get());
    const dtk_optimizer_create_args args{dtk_optimizer_create_args_STRUCT_SIZE, &b, gs.data(), gs.size()};
    check(api_->create(&args, &opt_));
  }
  ~PluginOptimizer() { api_->destroy(opt_); }
  dtk_optimizer_ref ref() const { return {sizeof(dtk_optimizer_ref), api_, opt_}; }
  void step(double lr, int64_t it, double weight_decay_scale = 1.0) {
    dtk_optimizer_step_args a{dtk_optimizer_step_args_STRUCT_SIZE, lr, it, 1.0, weight_decay_scale};
    check(api_->step(opt_, &a));
  }
  // A step with the host's Adam betas (ABI 2.14 has_betas: OneCycle's momentum cycling).
  void step_with_betas(double lr, int64_t it, double beta1, double beta2) {
    dtk_optimizer_step_args a{dtk_optimizer_step_args_STRUCT_SIZE, lr, it, 1.0, 1.0};
    a.has_betas = 1, a.beta1 = beta1, a.beta2 = beta2;
    check(api_->step(opt_, &a));
  }
  dtk::TensorList state_save() {
    dtk::SinkCollector out;
    check(api_->state_save(opt_, out.sink()));
    return std::move(out.items());
  }
  void state_load(const dtk::TensorList& state) {
    dtk::MapView view(state);
    check(api_->state_load(opt_, view.get()));
  }

 private:
  dtk::host::OptionValues options_;
  const dtk_optimizer_api* api_;
  dtk_optimizer* opt_ = nullptr;
};

}  // namespace dtk_optim_support
