// A checkpoint carries its model (dtk/core/checkpoint/checkpoint_model.hpp), through real dtk runs
// of a tiny llama: a run whose model computes another function than the checkpoint's is refused in
// one line naming the option and both values; --use_checkpoint_args evaluates with the
// checkpoint's options (the loss of the run that gives them by hand), whatever model the command
// line names; an option that does not change the function (fused_lm_head, dropout) may differ;
// `dtk generate` needs no model flag and checks the ones it is given (the prompt "A" is GPT-2 id 32,
// inside the tiny vocabulary).
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "../common/run_dtk.hpp"
#include "dtk/core/checkpoint/checkpoint_model.hpp"
#include "dtk/core/components/services.hpp"

namespace {

using dtk_test::expect_one_line_error;
using dtk_test::Result;
using dtk_test::run_dtk;

// A 2-layer llama on 64 random token ids: 2 iterations, then the final evaluation.
const std::string kRun = std::string("--dataset synthetic --threads 2 --set dataset.vocab_size=64 ") +
                         "--set train.seq_length=32 --set train.train_iters=2 --set train.micro_batch_size=4 " +
                         "--set train.global_batch_size=4 --set lr.lr_warmup_iters=1 --set eval.eval_interval=0 " +
                         "--set eval.eval_iters=2 --set logging.log_interval=1 ";
const std::string kLlama = std::string("train --config ") + DTK_SOURCE_DIR + "/configs/llama-tiny.pbtxt " + kRun +
                           "--set model.vocab_size=64 ";

// The final evaluation's line ("validation loss at iteration 2 ... | lm loss value: ..."), as printed.
std::string validation(const std::string& log) {
  std::smatch m;
  static const std::regex re(R"(validation loss at iteration 2 on validation set \| [^\n]*)");
  return std::regex_search(log, m, re) ? m[0].str() : "";
}

// Trained once with rotary_base 500000 (the default is 10000) and full recomputation in one group
// of both layers (which does not change the function), saved at iteration 2.
const std::string& checkpoint() {
  static const std::string dir = [] {
    const std::string d = dtk_test::fresh_dir(DTK_TEST_TMP, "rotary-500000");
    const Result r = run_dtk(kLlama +
                             "--set model.rotary_base=500000 --set model.recompute_activations=full "
                             "--set model.recompute_num_layers=2 --set checkpoint.save=" +
                             d + " --set checkpoint.save_interval=2");
    EXPECT_EQ(r.code, 0) << r.out;
    return d;
  }();
  return dir;
}

}  // namespace

TEST(CheckpointModel, AnotherRotaryBaseIsRefusedInOneLine) {
  const std::string& ck = checkpoint();
  expect_one_line_error(run_dtk(kLlama + "--set checkpoint.load=" + ck),
                        "checkpoint " + ck + " was trained with model.rotary_base=500000 but this run has 10000; "
                        "pass --set model.rotary_base=500000 or --use_checkpoint_args");
  // Fine-tuning loads the same weights into the same function: the same check.
  expect_one_line_error(run_dtk(kLlama + "--set checkpoint.finetune=true --set checkpoint.load=" + ck),
                        "was trained with model.rotary_base=500000 but this run has 10000");
  // Another model plugin altogether.
  expect_one_line_error(run_dtk(kLlama + "--model gpt --set checkpoint.load=" + ck),
                        "checkpoint " + ck + " was trained with model plugin 'llama' but this run has 'gpt'");
}

TEST(CheckpointModel, UseCheckpointArgsEvaluatesWithTheCheckpointsOptions) {
  const std::string& ck = checkpoint();
  const Result matching = run_dtk(kLlama + "--set model.rotary_base=500000 --set checkpoint.load=" + ck);
  ASSERT_EQ(matching.code, 0) << matching.out;
  const std::string want = validation(matching.out);
  ASSERT_FALSE(want.empty()) << matching.out;
  const Result adopted = run_dtk(kLlama + "--use_checkpoint_args --set checkpoint.load=" + ck);
  ASSERT_EQ(adopted.code, 0) << adopted.out;
  EXPECT_NE(adopted.out.find("checkpoint.use_checkpoint_args: the model is the one " + ck + " records: 'llama'"),
            std::string::npos)
      << adopted.out;
  EXPECT_EQ(validation(adopted.out), want) << adopted.out;
  // The run's recompute setting replaces the recorded one with the options that go with it: the
  // recorded recompute_num_layers=2 is not kept beside recompute_activations=none (it would do
  // nothing, and be refused).
  const Result no_recompute =
      run_dtk(kLlama + "--use_checkpoint_args --set model.recompute_activations=none --set checkpoint.load=" + ck);
  ASSERT_EQ(no_recompute.code, 0) << no_recompute.out;
  EXPECT_NE(no_recompute.out.find("this run's recompute_activations=none"), std::string::npos) << no_recompute.out;
  EXPECT_EQ(validation(no_recompute.out), want) << no_recompute.out;
  // No model flags at all (DTK's default config names gpt): the checkpoint's model, the same loss
  // (the default config's learning-rate schedule is not the checkpoint's: the checkpoint's wins).
  const Result bare = run_dtk("train " + kRun + "--set checkpoint.use_checkpoint_args=true --set checkpoint.load=" + ck +
                              " --set checkpoint.use_checkpoint_opt_param_scheduler=true");
  ASSERT_EQ(bare.code, 0) << bare.out;
  EXPECT_EQ(validation(bare.out), want) << bare.out;
}

// A checkpoint recorded before idle values were refused may hold one (it did nothing then): it
// reads as the plugin's default, dropped, unless the command line gives it (the host refuses
// that); a setting that acts keeps its options. What is idle is the plugin's declaration
// (only_with), so the shipped llama's own table decides.
TEST(CheckpointModel, RecordedIdleOptionsReadAsTheDefault) {
  static dtk::host::PluginHost* plugins = [] {
    auto* host = new dtk::host::PluginHost(dtk::core::host_torch_version(), dtk::core::host_services());
    host->load_file(std::string(DTK_PLUGIN_DIR) + "/dtk_plugin_llama.so");
    return host;  // plugins are never unloaded
  }();
  dtk::config::PluginChoice m;
  m.set_name("llama");
  auto& o = *m.mutable_options();
  o["fused_lm_head"] = "0", o["lm_head_chunk_tokens"] = "256", o["cross_entropy_impl"] = "ops";
  o["recompute_activations"] = "selective", o["recompute_method"] = "block", o["recompute_num_layers"] = "2";
  o["rope_scaling"] = "llama3", o["rope_scaling_factor"] = "16";
  dtk::core::drop_idle_model_options(&m, *plugins, {"recompute_num_layers"});
  EXPECT_EQ(o.count("lm_head_chunk_tokens") + o.count("cross_entropy_impl") + o.count("recompute_method"), 0u);
  EXPECT_EQ(o.at("recompute_num_layers"), "2");  // given: kept, for the host to refuse
  EXPECT_EQ(o.at("rope_scaling_factor"), "16");  // rope_scaling=llama3 acts
  EXPECT_EQ(o.size(), 5u);
  o["fused_lm_head"] = "True", o["lm_head_chunk_tokens"] = "256";
  dtk::core::drop_idle_model_options(&m, *plugins);
  EXPECT_EQ(o.at("lm_head_chunk_tokens"), "256");
  // A model plugin not installed here is left as recorded.
  m.set_name("not_installed");
  o["fused_lm_head"] = "false";
  dtk::core::drop_idle_model_options(&m, *plugins);
  EXPECT_EQ(o.at("lm_head_chunk_tokens"), "256");
}

TEST(CheckpointModel, OptionsThatKeepTheFunctionMayDiffer) {
  const std::string& ck = checkpoint();
  const Result r = run_dtk(kLlama + "--set model.rotary_base=5e5 --set model.fused_lm_head=false "
                                    "--set model.hidden_dropout=0.1 --set model.recompute_activations=full "
                                    "--set model.unfused_kernels=all --set checkpoint.load=" + ck);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("loaded checkpoint from " + ck + " at iteration 2"), std::string::npos) << r.out;
}

TEST(CheckpointModel, GenerateNeedsNoModelFlagsAndChecksTheOnesGiven) {
  const std::string& ck = checkpoint();
  // A tokenizer no larger than the model's 64 tokens (GPT-2's 50257 is refused up front: BadInputs).
  const std::string gen = "generate --load " + ck +
                          " --tokenizer_type NullTokenizer --vocab_size 63 --prompt '5 7' --max_new_tokens 3 "
                          "--temperature 0 ";
  const Result plain = run_dtk(gen);
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_NE(plain.out.find("generate: iteration 2 of " + ck), std::string::npos) << plain.out;
  expect_one_line_error(run_dtk(gen + "--set model.rotary_base=10000"),
                        "checkpoint " + ck + " was trained with model.rotary_base=500000 but this run has 10000");
  EXPECT_EQ(run_dtk(gen + "--set model.rotary_base=500000 --set model.fused_lm_head=false").code, 0);
  const Result adopted = run_dtk(gen + "--set model.rotary_base=10000 --use_checkpoint_args");
  EXPECT_EQ(adopted.code, 0) << adopted.out;
  EXPECT_NE(adopted.out.find("generate: checkpoint.use_checkpoint_args: the model is the one"), std::string::npos)
      << adopted.out;
  // A setting the command line changes takes the recorded options that go with it (the recorded
  // recompute_num_layers=2 does nothing beside recompute_activations=none); an idle one the line
  // gives itself is refused, naming it.
  const Result changed = run_dtk(gen + "--set model.recompute_activations=none");
  EXPECT_EQ(changed.code, 0) << changed.out;
  const Result adopted_changed = run_dtk(gen + "--use_checkpoint_args --set model.recompute_activations=none");
  EXPECT_EQ(adopted_changed.code, 0) << adopted_changed.out;
  EXPECT_NE(adopted_changed.out.find("this run's recompute_activations=none"), std::string::npos)
      << adopted_changed.out;
  EXPECT_EQ(adopted_changed.out.find("this run's recompute_activations=none, "), std::string::npos)
      << "only the command line's options are the run's: " << adopted_changed.out;
  expect_one_line_error(run_dtk(gen + "--set model.recompute_activations=none --set model.recompute_num_layers=2"),
                        "option recompute_num_layers=2 does nothing without recompute_activations=full");
  expect_one_line_error(run_dtk(gen + "--set train.seq_length=16"),
                        "generate runs the model the checkpoint records: --set train.seq_length=16 is not read");
}
