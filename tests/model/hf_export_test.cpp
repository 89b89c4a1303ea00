// `dtk export hf`: the folder is read back here with an independent safetensors reader and run
// through an independent GPT-2 forward written with Hugging Face's parameter names (plain ATen ops,
// GPT2LMHeadModel's math: Conv1D weights [in, out], c_attn columns [q | k | v]); its logits must
// equal the gpt plugin's own on the checkpoint's weights. A tensor-parallel checkpoint exports the
// same tensors as a single-rank one.
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <string>

#include "../common/run_dtk.hpp"
#include "gpt_harness.hpp"
#include "hf_reader.hpp"

namespace fs = std::filesystem;

namespace {

using dtk_test_gpt::GPT;
using namespace dtk_test_hf;

// GPT2LMHeadModel's forward (eval), from Hugging Face's parameter names and config.json.
at::Tensor hf_gpt2_logits(std::map<std::string, at::Tensor>& P, const std::string& config, const at::Tensor& tokens) {
  const int64_t layers = std::stoll(json_value(config, "n_layer")), heads = std::stoll(json_value(config, "n_head"));
  const int64_t h = std::stoll(json_value(config, "n_embd")), hn = h / heads;
  const double eps = std::stod(json_value(config, "layer_norm_epsilon"));
  const std::string act = json_value(config, "activation_function");
  const int64_t b = tokens.size(0), s = tokens.size(1);
  auto ln = [&](const at::Tensor& x, const std::string& n) {
    return at::layer_norm(x, {h}, P.at(n + ".weight"), P.at(n + ".bias"), eps);
  };
  auto conv1d = [&](const at::Tensor& x, const std::string& n) { return at::matmul(x, P.at(n + ".weight")) + P.at(n + ".bias"); };
  auto split_heads = [&](const at::Tensor& x) { return x.view({b, s, heads, hn}).permute({0, 2, 1, 3}); };
  at::Tensor x = at::embedding(P.at("transformer.wte.weight"), tokens) +
                 at::embedding(P.at("transformer.wpe.weight"), at::arange(s, at::kLong).unsqueeze(0));
  const at::Tensor future = at::ones({s, s}, at::kBool).triu(1);
  for (int64_t l = 0; l < layers; ++l) {
    const std::string L = "transformer.h." + std::to_string(l) + ".";
    const auto qkv = conv1d(ln(x, L + "ln_1"), L + "attn.c_attn").split(h, 2);
    at::Tensor scores = at::matmul(split_heads(qkv[0]), split_heads(qkv[1]).transpose(-1, -2)) / std::sqrt(double(hn));
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    const at::Tensor ctx = at::matmul(at::softmax(scores, -1), split_heads(qkv[2])).permute({0, 2, 1, 3}).reshape({b, s, h});
    x = x + conv1d(ctx, L + "attn.c_proj");
    at::Tensor m = conv1d(ln(x, L + "ln_2"), L + "mlp.c_fc");
    m = act == "gelu" ? at::gelu(m) : at::gelu(m, "tanh");
    x = x + conv1d(m, L + "mlp.c_proj");
  }
  x = ln(x, "transformer.ln_f");
  const bool tied = json_value(config, "tie_word_embeddings") != "false";
  return at::matmul(x, (tied ? P.at("transformer.wte.weight") : P.at("lm_head.weight")).t());
}

const std::string kVocab = std::string(DTK_VOCAB_DIR) + "/encoder.json", kMerges = std::string(DTK_VOCAB_DIR) + "/vocab.bpe";
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --set train.train_iters=3 "
                           "--set lr.lr_warmup_iters=1 --set model.hidden_dropout=0 --set model.attention_dropout=0 "
                           "--set checkpoint.save_interval=3 --threads 1 ";

// gpt-tiny's shape (configs/gpt-tiny.pbtxt), dropout off, at seq 64.
const dtk_test_gpt::Opts kTiny = {{"num_layers", "2"}, {"hidden_size", "64"}, {"num_attention_heads", "4"},
                                  {"hidden_dropout", "0"}, {"attention_dropout", "0"}};
const dtk_test_gpt::Ctx kSeq64 = [] {
  dtk_test_gpt::Ctx c;
  c.seq_length = 64;
  return c;
}();

std::string export_cmd(const std::string& ck, const std::string& out) {
  return "export hf " + ck + " " + out + " --vocab_file " + kVocab + " --merge_file " + kMerges;
}

}  // namespace

TEST(HfExport, LogitsOfTheExportedGpt2EqualTheModelsOwn) {
  if (!fs::exists(kVocab)) GTEST_SKIP() << "no GPT-2 vocabulary at " << kVocab << " (tools/setup.sh --vocab)";
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_export");
  const dtk_test::Result trained = dtk_test::run_dtk(kTrain + "--set checkpoint.save=" + dir + "/ck");
  ASSERT_EQ(trained.code, 0) << trained.out;
  const dtk_test::Result exported = dtk_test::run_dtk(export_cmd(dir + "/ck", dir + "/hf"));
  ASSERT_EQ(exported.code, 0) << exported.out;
  EXPECT_NE(exported.out.find("exported iteration 3 of " + dir + "/ck to " + dir + "/hf: GPT2LMHeadModel, 2 layers"),
            std::string::npos)
      << exported.out;
  for (const char* f : {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
                        "special_tokens_map.json", "generation_config.json"})
    EXPECT_TRUE(fs::is_regular_file(dir + "/hf/" + f)) << f;
  EXPECT_EQ(read(dir + "/hf/vocab.json"), read(kVocab));
  EXPECT_EQ(read(dir + "/hf/merges.txt"), read(kMerges));
  const std::string config = read(dir + "/hf/config.json");
  EXPECT_EQ(json_value(config, "model_type"), "gpt2");
  EXPECT_EQ(json_value(config, "activation_function"), "gelu");  // the gpt model's exact GELU
  EXPECT_EQ(json_value(config, "vocab_size"), "50257");         // unpadded
  EXPECT_EQ(json_value(config, "n_positions"), "64");
  EXPECT_EQ(json_value(config, "n_inner"), "256");

  std::map<std::string, at::Tensor> hf = read_safetensors(dir + "/hf/model.safetensors");
  EXPECT_EQ(hf.size(), 2u + 2 * 12 + 2);  // wte, wpe, 12 per layer, ln_f; the head is tied
  EXPECT_EQ(hf.at("transformer.wte.weight").sizes(), (std::vector<int64_t>{50257, 64}));
  EXPECT_EQ(hf.at("transformer.h.0.attn.c_attn.weight").sizes(), (std::vector<int64_t>{64, 192}));

  // The gpt plugin on the checkpoint's weights (eval, no dropout) against GPT-2's math on the export.
  GPT model(kTiny, kSeq64);
  const auto saved = checkpoint_model(dir + "/ck/iter_0000003/mp_rank_00/model_optim_rng.pt");
  model.state_load(dtk::TensorList(saved.begin(), saved.end()));
  model.train(false);
  const at::Tensor tokens = at::randint(0, 50257, {2, 64}, at::kLong);
  const at::Tensor ours = dtk::get(model.forward({{"tokens", tokens}}), "logits").narrow(-1, 0, 50257);
  const at::Tensor theirs = hf_gpt2_logits(hf, config, tokens);
  ASSERT_EQ(ours.sizes(), theirs.sizes());
  const double diff = (ours - theirs).abs().max().item<double>();
  std::printf("max |logit difference| %.3g over %lld logits\n", diff, static_cast<long long>(ours.numel()));
  EXPECT_LT(diff, 1e-5);
  // And a wrong layout would not pass: swapping q and k columns changes the logits.
  auto swapped = hf;
  for (int64_t l = 0; l < 2; ++l) {
    auto& w = swapped["transformer.h." + std::to_string(l) + ".attn.c_attn.weight"];
    w = at::cat({w.narrow(1, 64, 64), w.narrow(1, 0, 64), w.narrow(1, 128, 64)}, 1);
  }
  EXPECT_GT((hf_gpt2_logits(swapped, config, tokens) - theirs).abs().max().item<double>(), 1e-3);

  // Round trip: import the folder back, then the model's logits are the original's, bit for bit
  // (the same fp32 values, only re-laid out), and training fine-tunes from it.
  const dtk_test::Result imported = dtk_test::run_dtk("import hf " + dir + "/hf " + dir + "/imp");
  ASSERT_EQ(imported.code, 0) << imported.out;
  EXPECT_NE(imported.out.find("--set checkpoint.finetune=true --set model."), std::string::npos) << imported.out;
  const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + dir + "/imp");
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  GPT back(kTiny, kSeq64);
  const auto reloaded = checkpoint_model(dir + "/imp/iter_0000000/mp_rank_00/model_optim_rng.pt");
  back.state_load(dtk::TensorList(reloaded.begin(), reloaded.end()));
  back.train(false);
  const at::Tensor again = dtk::get(back.forward({{"tokens", tokens}}), "logits").narrow(-1, 0, 50257);
  EXPECT_TRUE(at::equal(again, ours)) << (again - ours).abs().max().item<double>();
  const dtk_test::Result tuned = dtk_test::run_dtk(kTrain + "--set checkpoint.load=" + dir +
                                                   "/imp --set checkpoint.finetune=true --set train.train_iters=2 --set checkpoint.save=" + dir + "/tuned");
  EXPECT_EQ(tuned.code, 0) << tuned.out;
  EXPECT_NE(tuned.out.find(" finetuning from the model of " + dir + "/imp at iteration 0"), std::string::npos) << tuned.out;

  // A byte flipped in the checkpoint: export refuses it, naming its way around, --noverify.
  fs::copy(dir + "/ck", dir + "/damaged", fs::copy_options::recursive);
  for (const auto& f : fs::recursive_directory_iterator(dir + "/damaged"))
    if (f.path().filename() == "model_optim_rng.pt") {
      std::fstream file(f.path(), std::ios::in | std::ios::out | std::ios::binary);
      const std::streamoff middle = static_cast<std::streamoff>(fs::file_size(f.path()) / 2);
      char byte = 0;
      file.seekg(middle).read(&byte, 1);
      byte = static_cast<char>(byte ^ 1);
      file.seekp(middle).write(&byte, 1);
    }
  dtk_test::expect_one_line_error(dtk_test::run_dtk(export_cmd(dir + "/damaged", dir + "/hf-damaged")),
                                  " bytes now; --noverify loads it anyway)");
  const dtk_test::Result unverified =
      dtk_test::run_dtk(export_cmd(dir + "/damaged", dir + "/hf-damaged") + " --noverify");
  EXPECT_EQ(unverified.code, 0) << unverified.out;

  // Refusals: one line each, nothing written.
  dtk_test::expect_one_line_error(dtk_test::run_dtk(export_cmd(dir + "/ck", dir + "/hf")),
                                  dir + "/hf exists and is not an empty directory");
  std::ofstream(dir + "/afile") << "x";
  dtk_test::expect_one_line_error(dtk_test::run_dtk(export_cmd(dir + "/ck", dir + "/afile")),
                                  "export hf: " + dir + "/afile is a file, not a folder");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("export hf " + dir + "/ck " + dir + "/x"),
                                  "--vocab_file and --merge_file name the GPT-2 tokenizer files");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("export onnx " + dir + "/ck " + dir + "/x"), "(formats: hf)");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(export_cmd(dir + "/nothing", dir + "/x")), "is not a directory");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + dir + "/ck " + dir + "/y"),
                                  "import hf: cannot read " + dir + "/ck/config.json");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + dir + "/hf " + dir + "/imp"),
                                  dir + "/imp exists and is not an empty directory");
  EXPECT_FALSE(fs::exists(dir + "/x"));
  EXPECT_FALSE(fs::exists(dir + "/y"));
  // A config.json that describes fewer layers than the weights hold: refused, not imported short.
  fs::copy(dir + "/hf", dir + "/hf-short");
  {
    std::ifstream in(dir + "/hf/config.json");
    std::string config((std::istreambuf_iterator<char>(in)), {});
    const size_t at = config.find("\"n_layer\": 2");
    ASSERT_NE(at, std::string::npos) << config;
    config.replace(at, 12, "\"n_layer\": 1");
    std::ofstream(dir + "/hf-short/config.json", std::ios::trunc) << config;
  }
  dtk_test::expect_one_line_error(dtk_test::run_dtk("import hf " + dir + "/hf-short " + dir + "/short"),
                                  "import hf: " + dir + "/hf-short/model.safetensors holds 12 tensors config.json does not "
                                  "describe (first 'transformer.h.1.attn.c_attn.bias')");
  EXPECT_FALSE(fs::exists(dir + "/short"));
}

// GPT-2's own activation: a model trained with model.openai_gelu exports "gelu_new", the tanh GELU,
// and the reference forward with that activation matches; importing keeps it.
TEST(HfExport, OpenaiGeluExportsGeluNew) {
  if (!fs::exists(kVocab)) GTEST_SKIP() << "no GPT-2 vocabulary at " << kVocab << " (tools/setup.sh --vocab)";
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_export_gelu_new");
  ASSERT_EQ(dtk_test::run_dtk(kTrain + "--set model.openai_gelu=true --set checkpoint.save=" + dir + "/ck").code, 0);
  ASSERT_EQ(dtk_test::run_dtk(export_cmd(dir + "/ck", dir + "/hf")).code, 0);
  const std::string config = read(dir + "/hf/config.json");
  EXPECT_EQ(json_value(config, "activation_function"), "gelu_new");
  dtk_test_gpt::Opts opts = kTiny;
  opts["openai_gelu"] = "true";
  GPT model(opts, kSeq64);
  const auto saved = checkpoint_model(dir + "/ck/iter_0000003/mp_rank_00/model_optim_rng.pt");
  model.state_load(dtk::TensorList(saved.begin(), saved.end()));
  model.train(false);
  const at::Tensor tokens = at::randint(0, 50257, {2, 64}, at::kLong);
  std::map<std::string, at::Tensor> hf = read_safetensors(dir + "/hf/model.safetensors");
  const at::Tensor ours = dtk::get(model.forward({{"tokens", tokens}}), "logits").narrow(-1, 0, 50257);
  EXPECT_LT((ours - hf_gpt2_logits(hf, config, tokens)).abs().max().item<double>(), 1e-5);
  const dtk_test::Result imported = dtk_test::run_dtk("import hf " + dir + "/hf " + dir + "/imp");
  ASSERT_EQ(imported.code, 0) << imported.out;
  EXPECT_NE(imported.out.find("activation gelu_new (model.openai_gelu=true)"), std::string::npos) << imported.out;
}

// A gpt with a sliding window (model.window_size) has no GPT2LMHeadModel form: one line, no folder.
TEST(HfExport, SlidingWindowIsRefused) {
  if (!fs::exists(kVocab)) GTEST_SKIP() << "no GPT-2 vocabulary at " << kVocab << " (tools/setup.sh --vocab)";
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_export_window");
  ASSERT_EQ(dtk_test::run_dtk(kTrain + "--set model.window_size=7,0 --set checkpoint.save=" + dir + "/ck").code, 0);
  dtk_test::expect_one_line_error(dtk_test::run_dtk(export_cmd(dir + "/ck", dir + "/hf")),
                                  "option 'window_size' is 7,0: Hugging Face's GPT2LMHeadModel attends to every "
                                  "earlier token (no sliding window)");
  EXPECT_FALSE(fs::exists(dir + "/hf"));
}

// Zero-centred norm weights (model.apply_layernorm_1p, Megatron's --apply-layernorm-1p): the
// checkpoint holds w (near 0), the export Hugging Face's 1 + w, and the exported model's logits are
// the plugin's.
TEST(HfExport, ZeroCentredNormsExportOnePlusW) {
  if (!fs::exists(kVocab)) GTEST_SKIP() << "no GPT-2 vocabulary at " << kVocab << " (tools/setup.sh --vocab)";
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_export_1p");
  const dtk_test::Result trained =
      dtk_test::run_dtk(kTrain + "--set model.apply_layernorm_1p=true --set checkpoint.save=" + dir + "/ck");
  ASSERT_EQ(trained.code, 0) << trained.out;
  ASSERT_EQ(dtk_test::run_dtk(export_cmd(dir + "/ck", dir + "/hf")).code, 0);
  const auto saved = checkpoint_model(dir + "/ck/iter_0000003/mp_rank_00/model_optim_rng.pt");
  std::map<std::string, at::Tensor> hf = read_safetensors(dir + "/hf/model.safetensors");
  const at::Tensor w = saved.at("language_model.encoder.layers.0.input_layernorm.weight");
  EXPECT_LT(w.abs().max().item<double>(), 0.1) << "saved zero-centred";
  EXPECT_GT(w.abs().max().item<double>(), 0.0) << "trained";
  EXPECT_TRUE(at::allclose(hf.at("transformer.h.0.ln_1.weight"), w + 1));
  EXPECT_TRUE(
      at::allclose(hf.at("transformer.ln_f.weight"), saved.at("language_model.encoder.final_layernorm.weight") + 1));
  dtk_test_gpt::Opts opts = kTiny;
  opts["apply_layernorm_1p"] = "true";
  GPT model(opts, kSeq64);
  model.state_load(dtk::TensorList(saved.begin(), saved.end()));
  model.train(false);
  const at::Tensor tokens = at::randint(0, 50257, {2, 64}, at::kLong);
  const at::Tensor ours = dtk::get(model.forward({{"tokens", tokens}}), "logits").narrow(-1, 0, 50257);
  EXPECT_LT((ours - hf_gpt2_logits(hf, read(dir + "/hf/config.json"), tokens)).abs().max().item<double>(), 1e-5);
}

// Two tensor-parallel ranks' partitions are merged into the same tensors a single-rank run of the
// same model exports. With lr 0 the weights are the initial ones, which Megatron's initialisation
// makes equal at every tensor-parallel size (training then stays equal only to float accuracy,
// which Adam amplifies to ~1e-3 in a few steps).
TEST(HfExport, TensorParallelCheckpointExportsTheSameModel) {
  if (!fs::exists(kVocab)) GTEST_SKIP() << "no GPT-2 vocabulary at " << kVocab << " (tools/setup.sh --vocab)";
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "hf_export_tp");
  const std::string frozen = kTrain + "--set lr.lr=0 --set lr.min_lr=0 ";
  ASSERT_EQ(dtk_test::run_dtk(frozen + "--set checkpoint.save=" + dir + "/tp1").code, 0);
  const dtk_test::Result tp2 = dtk_test::run_dtk("launch --nproc_per_node 2 " + frozen +
                                                 "--set distributed.tensor_model_parallel_size=2 --set checkpoint.save=" +
                                                 dir + "/tp2");
  ASSERT_EQ(tp2.code, 0) << tp2.out;
  for (const char* tp : {"tp1", "tp2"}) {
    const dtk_test::Result r = dtk_test::run_dtk(export_cmd(dir + "/" + tp, dir + "/hf_" + tp));
    ASSERT_EQ(r.code, 0) << r.out;
  }
  const auto a = read_safetensors(dir + "/hf_tp1/model.safetensors");
  const auto b = read_safetensors(dir + "/hf_tp2/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    ASSERT_EQ(t.sizes(), b.at(name).sizes()) << name;
    EXPECT_TRUE(at::equal(t, b.at(name))) << name << ": " << (t - b.at(name)).abs().max().item<double>();
  }
}
