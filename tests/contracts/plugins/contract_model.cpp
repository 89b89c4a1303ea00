// contract_model — a tiny causal LM (embedding, linear head, per-token loss) whose option `fault`
// breaks one rule of the model contract, for tests/contracts.
#include <dtk/model.hpp>
#include <dtk/module_hooks.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_int("vocab_size", "64", "Vocabulary."),
    dtk::opt_enum("fault", "none",
                  "none|detached|unlisted|listed_twice|same_name|throw_forward|throw_backward|late_gradient",
                  "The rule to break (late_gradient: with modules, hidden_bias is listed under the head, not the "
                  "embedding that reads it)."),
    dtk::opt_int("context_parallel", "0", "What it reports in dtk_model_info.context_parallel (no attention: any)."),
    dtk::opt_bool("modules", "false",
                  "Report two modules (the embedding with hidden_bias, the head) and fire the strategy's hooks "
                  "around them."),
    dtk::opt_bool("spare_parameter", "false",
                  "Also list a parameter `spare` [vocab, 16] that the forward never reads (no gradient reaches it)."),
};

// Identity forward; its backward throws (a model's custom autograd function failing).
struct ThrowingBackward : public torch::autograd::Function<ThrowingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("boom in backward");
  }
};

class ContractModel : public dtk::Model {
 public:
  explicit ContractModel(const dtk::BuildContext& ctx)
      : vocab_(ctx.options.get_int("vocab_size")),
        fault_(ctx.options.get_string("fault")),
        seq_(ctx.seq_length),
        context_parallel_(static_cast<int32_t>(ctx.options.get_int("context_parallel"))),
        modules_(ctx.options.get_bool("modules")),
        spare_parameter_(ctx.options.get_bool("spare_parameter")) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(ctx.seed);
    auto opts = at::TensorOptions().dtype(ctx.params_dtype).device(ctx.device);
    embedding_ = at::empty({vocab_, 16}).normal_(0, 0.02, gen).to(opts).set_requires_grad(true);
    head_ = at::empty({vocab_, 16}).normal_(0, 0.02, gen).to(opts).set_requires_grad(true);
    hidden_bias_ = at::zeros({16}, opts).set_requires_grad(true);  // listed unless fault == unlisted
    if (spare_parameter_) spare_ = at::empty({vocab_, 16}).normal_(0, 0.02, gen).to(opts).set_requires_grad(true);
  }
  dtk::TensorList forward(const dtk::TensorList& inputs) override {
    if (fault_ == "throw_forward") throw dtk::Error("boom in forward");
    at::Tensor h = hooks_.run(0, dtk::get(inputs, "tokens"),
                              [&](const at::Tensor& t) { return at::embedding(embedding_, t) + hidden_bias_; });
    if (fault_ == "throw_backward") h = ThrowingBackward::apply(h);
    at::Tensor logits = hooks_.run(1, h, [&](const at::Tensor& x) { return dtk::linear(x, head_); });
    const at::Tensor& labels = dtk::get(inputs, "labels");
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, vocab_}), labels.reshape({-1}), {}, at::Reduction::None)
                          .view(labels.sizes());
    if (fault_ == "detached") loss = loss.detach();
    return {{"loss", loss}};
  }
  std::vector<dtk::Param> parameters() override {
    std::vector<dtk::Param> out(2);
    out[0].name = "embedding";
    out[0].tensor = embedding_;
    out[1].name = "head";
    out[1].tensor = head_;
    if (fault_ != "unlisted") {
      out.emplace_back();
      out.back().name = "hidden_bias";
      out.back().tensor = hidden_bias_;
    }
    if (spare_parameter_) out.push_back({"spare", spare_, out[1].info});
    if (fault_ == "listed_twice") out.push_back({"head_again", head_, out[1].info});
    if (fault_ == "same_name") out[1].name = "embedding";
    return out;
  }
  std::vector<dtk::Module> modules() override {
    if (!modules_) return {};
    const bool late = fault_ == "late_gradient";
    std::vector<std::string> first{"embedding"}, second{"head"};
    (late ? second : first).push_back("hidden_bias");
    return {{0, "embedding", first}, {1, "head", second}};
  }
  void set_module_hooks(const dtk_module_hooks* hooks) override { hooks_.set(modules_ ? hooks : nullptr); }
  void set_training(bool) override {}
  dtk_model_info info() override {
    dtk_model_info i{};
    i.num_layers = 1;
    i.hidden_size = 16;
    i.num_attention_heads = 1;
    i.seq_length = seq_;
    i.vocab_size = vocab_;
    i.context_parallel = context_parallel_;
    return i;
  }

 private:
  int64_t vocab_;
  std::string fault_;
  int64_t seq_;
  int32_t context_parallel_;
  bool modules_, spare_parameter_;
  dtk::ModuleHooks hooks_;  // fired only where set_module_hooks gave a table (modules)
  at::Tensor embedding_, head_, hidden_bias_, spare_;
};

}  // namespace

DTK_PLUGIN("contract_model", DTK_KIND_MODEL, "1.0.0", "Test model that breaks a contract on request", DTK_TORCH_VERSION,
           dtk::model_api<ContractModel>(), kOptions)
