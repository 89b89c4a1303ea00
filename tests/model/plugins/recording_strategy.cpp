// Test strategy: asks for per-module hooks (as ZeRO-3 will) and records them. The test reads the
// record through a plugin extension, "dtk.ext.test_hook_log.v1" (abi.h rule 8).
#include <dtk/strategy.hpp>

#include <cstring>
#include <string>
#include <vector>

namespace {

std::string g_log;  // outlives the strategy: the test checks nothing fires after it is gone

struct HookLogExtension {
  size_t struct_size;
  const char* (*log)(void);
  void (*clear)(void);
};
const HookLogExtension kHookLog = {sizeof(HookLogExtension), [] { return g_log.c_str(); }, [] { g_log.clear(); }};

const void* get_extension(const char* id) {
  return id && std::strcmp(id, "dtk.ext.test_hook_log.v1") == 0 ? &kHookLog : nullptr;
}

dtk_status* record(const char* what, int32_t module) {
  g_log += (g_log.empty() ? "" : " ") + std::string(what) + std::to_string(module);
  return nullptr;
}

class Recording : public dtk::Strategy {
 public:
  explicit Recording(const dtk::BuildContext&) {
    hooks_.struct_size = dtk_module_hooks_STRUCT_SIZE;
    hooks_.ctx = this;
    hooks_.pre_forward = [](void*, int32_t i) { return record("F+", i); };
    hooks_.post_forward = [](void*, int32_t i) { return record("F-", i); };
    hooks_.pre_backward = [](void*, int32_t i) { return record("B+", i); };
    hooks_.post_backward = [](void*, int32_t i) { return record("B-", i); };
  }
  void setup(const dtk::ModelHandle& model) override {
    params_ = model.parameters();
    g_log = "modules " + std::to_string(model.modules().size());
  }
  std::vector<dtk::Param> optimizer_params() override { return params_; }
  void reduce_gradients() override {}
  double clip_and_norm(double) override { return 0.0; }
  void zero_grad() override {}
  const dtk_module_hooks* module_hooks() override { return &hooks_; }

 private:
  std::vector<dtk::Param> params_;
  dtk_module_hooks hooks_{};
};

}  // namespace

DTK_PLUGIN_WITH_EXTENSIONS("recording", DTK_KIND_STRATEGY, "0.0.1", "Test: records per-module hooks", DTK_TORCH_VERSION,
                           dtk::strategy_api<Recording>(), DTK_NO_OPTIONS, &get_extension)
