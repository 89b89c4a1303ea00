// The `dtk` binary end to end: what a user types, what they see, the exit code.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "../common/run_dtk.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

namespace {

using dtk_test::Result;
Result run(const std::string& args, int timeout_s = 300) { return dtk_test::run_dtk(args, timeout_s); }

std::vector<double> losses(const std::string& log) {
  std::vector<double> out;
  std::regex re("lm loss: ([0-9.E+-]+) \\|");
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it) out.push_back(std::stod((*it)[1]));
  return out;
}

// The one-line error contract with the whole message: exit 1 and the line "dtk: error: <message>".
void expect_error_line(const Result& r, const std::string& message) {
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("dtk: error: " + message + "\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

const std::string kTiny =
    std::string("train --config ") + DTK_SOURCE_DIR + "/configs/gpt-tiny.pbtxt --dataset synthetic ";

}  // namespace

TEST(Cli, VersionAndHelp) {
  Result v = run("--version");
  EXPECT_EQ(v.code, 0);
  EXPECT_NE(v.out.find("(ABI 2."), std::string::npos) << v.out;
  Result h = run("--help");
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("dtk train"), std::string::npos);
  EXPECT_EQ(run("").code, 2);
  // A command's help lists the flags it reads, and only those (the rule that refuses the others).
  auto flags_of = [](const std::string& command) {
    const Result r = run(command + " --help");
    EXPECT_EQ(r.code, 0) << r.out;
    const size_t at = r.out.find("flags of `dtk " + command + "`:");
    return at == std::string::npos ? std::string() : r.out.substr(at);
  };
  const std::string e = flags_of("export"), g = flags_of("generate");
  for (const char* flag : {"--use_checkpoint_args", "--vocab_file", "--tokenizer_type"})
    EXPECT_NE(e.find(flag), std::string::npos) << flag << "\n" << e;
  EXPECT_EQ(e.find("--seed"), std::string::npos) << e;
  EXPECT_NE(g.find("--seed"), std::string::npos) << g;
  EXPECT_EQ(g.find("--bench_out"), std::string::npos) << g;
}

TEST(Cli, PluginsListAndDescribe) {
  Result l = run("plugins list");
  ASSERT_EQ(l.code, 0) << l.out;
  for (const char* name : {"gpt", "causal_lm", "adamw", "sgd", "ddp", "synthetic"})
    EXPECT_NE(l.out.find(std::string(name) + " "), std::string::npos) << name << "\n" << l.out;
  Result d = run("plugins describe gpt");
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("num_layers"), std::string::npos);
  expect_error_line(run("plugins describe gtp"), "unknown plugin 'gtp'; did you mean 'gpt'?");
  // A plugin file that could not be loaded is named where a plugin is missing, as train names it.
  const std::string dir = dtk_test::fresh_dir(std::filesystem::temp_directory_path().string(), "dtk-cli-broken-plugin");
  std::ofstream(dir + "/libmine.so") << "not an ELF file";
  expect_error_line(run("plugins describe mine --plugin_path " + dir),
                    "unknown plugin 'mine'; 1 plugin file could not be loaded, the first: plugin '" + dir +
                        "/libmine.so': not a loadable plugin file (only 15 bytes, too short for an ELF header) (see "
                        "`dtk plugins list`)");
  std::filesystem::remove_all(dir);
}

TEST(Cli, TrainGptTinyLossFalls) {
  Result r = run(kTiny +
                 "--set train.train_iters=30 --set logging.log_interval=5 --set eval.eval_iters=2 "
                 "--set dataset.vocab_size=64 --set model.vocab_size=64 --set lr.lr=3e-3 --threads 2");
  ASSERT_EQ(r.code, 0) << r.out;
  auto l = losses(r.out);
  ASSERT_GE(l.size(), 4u) << r.out;
  // Uniform random tokens from a 64-word vocabulary (padded to 128 logits): the model must learn
  // the unigram distribution, from about ln(128) = 4.85 down to ln(64) = 4.16.
  EXPECT_LT(l.back(), l.front() - 0.3) << r.out;
  EXPECT_LT(l.back(), 4.5) << r.out;
  // Megatron's labels for the evaluation after training.
  EXPECT_NE(r.out.find(" validation loss at iteration 30 on validation set | lm loss value: "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(" validation loss at iteration 30 on test set | lm loss value: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("number of parameters"), std::string::npos);
}

TEST(Cli, BadInputsAreOneLineErrors) {
  expect_error_line(run(kTiny + "--model gtp"), "unknown model plugin 'gtp'; did you mean 'gpt'?");
  expect_error_line(run(kTiny + "--set model.num_layer=2"),
                        "model plugin 'gpt' has no option 'num_layer'; did you mean 'num_layers'?");
  expect_error_line(run(kTiny + "--set model.num_layers=two"),
                        "model plugin 'gpt': option 'num_layers' expects an integer, got 'two'");
  expect_error_line(run("train --config /nonexistent.pbtxt"), "config '/nonexistent.pbtxt': no such file");
  expect_error_line(run(kTiny + "--plugin_path /nonexistent/dir"),
                        "--plugin_path entry '/nonexistent/dir' does not exist");
  expect_error_line(run(kTiny + "--plugin_path " DTK_TEST_PLUGIN_DIR "/broken/tp_major.so"),
                        "plugin '" DTK_TEST_PLUGIN_DIR
                        "/broken/tp_major.so': built for DTK ABI 3.0, this host speaks ABI 2.x (major version "
                        "mismatch; rebuild the plugin)");
  expect_error_line(run(kTiny + "--set train.global_batch_size=3 --set train.micro_batch_size=2"),
                        "config: global_batch_size 3 is not divisible by micro_batch_size x data-parallel size = 2");
  // A plugin throwing inside a call: the SDK turns it into a status, the host into one line.
  expect_error_line(
      run("train --dataset exploding --set model.num_layers=1 --set model.hidden_size=32 "
          "--set model.num_attention_heads=2 --set model.vocab_size=64 --plugin_path " DTK_TEST_PLUGIN_DIR
          "/broken/tp_throwing.so"),
      "dataset plugin 'exploding': num_samples: num_samples exploded");
  expect_error_line(
      run("frobnicate"),
      "unknown command 'frobnicate' (commands: train, plugins, config, preprocess, checkpoint, export, import, generate, version; see --help)");
}

// Issue 4's promise end to end: text -> `dtk preprocess` -> Megatron .bin/.idx -> `dtk train` on a
// weighted blend of two such prefixes -> `dtk preprocess --decode` gives the text back.
TEST(Cli, PreprocessBlendTrainDecode) {
  // The GPT-2 vocab that `tools/setup.sh --vocab` puts in <repo>/data/gpt2 ($DTK_GPT2_VOCAB_DIR overrides).
  const char* env = std::getenv("DTK_GPT2_VOCAB_DIR");
  const std::string gpt2 = env != nullptr && *env ? env : DTK_SOURCE_DIR "/data/gpt2";
  for (const char* f : {"encoder.json", "vocab.bpe"}) {
    ASSERT_TRUE(std::filesystem::exists(gpt2 + "/" + f))
        << "GPT-2 vocab file " << gpt2 << "/" << f
        << " is missing: run tools/setup.sh --vocab (or set DTK_GPT2_VOCAB_DIR)";
  }
  const std::string dir = ::testing::TempDir() + "dtk_cli_blend";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const char* name : {"a", "b"}) {
    std::ofstream out(dir + "/" + name + ".jsonl");
    for (int i = 0; i < 300; ++i)
      out << "{\"text\": \"Document " << i << " of corpus " << name
          << ": the quick brown fox jumps over the lazy dog, again and again.\"}\n";
  }
  const std::string vocab = "--vocab_file " + gpt2 + "/encoder.json --merge_file " + gpt2 + "/vocab.bpe";
  for (const char* name : {"a", "b"}) {
    Result r = run("preprocess --input " + dir + "/" + name + ".jsonl --output_prefix " + dir + "/" + name + " " +
                   vocab + " --append_eod --workers 2");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + name + "_text_document.idx"));
  }
  Result t =
      run(kTiny + "--dataset gpt_indexed --data_path '0.3 " + dir + "/a_text_document 0.7 " + dir +
          "/b_text_document' --set dataset.vocab_size=50257 --set train.train_iters=6 "
          "--set logging.log_interval=3 --set eval.eval_iters=1 --set model.num_layers=1 --set lr.lr_warmup_iters=2 "
          "--threads 2");
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_EQ(losses(t.out).size(), 2u) << t.out;
  Result d = run("preprocess --decode --input " + dir + "/a_text_document 0:1 " + vocab);
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("Document 0 of corpus a: the quick brown fox"), std::string::npos) << d.out;
  Result nv = run("preprocess --decode --input " + dir + "/a_text_document");
  EXPECT_EQ(nv.code, 1);
  EXPECT_NE(nv.out.find("dtk: error: preprocess: no tokenizer: give --vocab_file and --merge_file"), std::string::npos)
      << nv.out;
  // A prefix that does not exist is one line naming it.
  Result bad = run(kTiny + "--dataset gpt_indexed --data_path " + dir +
                   "/missing --set train.train_iters=2 --set lr.lr_warmup_iters=0");
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("dtk: error: dataset plugin 'gpt_indexed': create: "), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find(dir + "/missing"), std::string::npos) << bad.out;
}

// With stdout piped (block-buffered), what a command printed before failing still comes out
// before its error line.
TEST(Cli, ErrorLineComesAfterEarlierOutput) {
  Result r = run(kTiny + "--dataset gpt_indexed --set dataset.data_path=/nonexistent/corpus");
  EXPECT_EQ(r.code, 1) << r.out;
  const size_t params = r.out.find("number of parameters");
  const size_t error = r.out.find("dtk: error: ");
  ASSERT_NE(params, std::string::npos) << r.out;
  ASSERT_NE(error, std::string::npos) << r.out;
  EXPECT_LT(params, error) << r.out;
}

// fp32 products on the CPU go to oneDNN's sgemm when LibTorch loaded it (dtk/gemm.hpp), and the run
// says which engine it uses; DTK_CPU_GEMM=aten keeps LibTorch's BLAS. Both train the same model:
// the losses agree to fp32 rounding. A bad value is one line and exit 2, before any work.
TEST(Cli, SaysWhichCpuGemmEngineItUsesAndBothTrainTheSame) {
  const std::string args = kTiny + "--set train.train_iters=6 --set lr.lr_warmup_iters=0 --set eval.eval_iters=0 "
                                   "--set logging.log_interval=1 ";
  const Result def = run(args);
  ::setenv("DTK_CPU_GEMM", "aten", 1);
  const Result aten = run(args);
  ::setenv("DTK_CPU_GEMM", "onednn", 1);
  const Result onednn = run(args);
  ::setenv("DTK_CPU_GEMM", "fast", 1);
  const Result bad = run(args);
  ::unsetenv("DTK_CPU_GEMM");
  ASSERT_EQ(def.code, 0) << def.out;
  ASSERT_EQ(aten.code, 0) << aten.out;
  EXPECT_NE(def.out.find(" > CPU matrix products: "), std::string::npos) << def.out;
  EXPECT_NE(aten.out.find(" > CPU matrix products: LibTorch's BLAS (at::mm)"), std::string::npos) << aten.out;
  if (onednn.code == 0) {
    EXPECT_NE(onednn.out.find(" > CPU matrix products: oneDNN "), std::string::npos) << onednn.out;
    EXPECT_NE(def.out.find(" > CPU matrix products: oneDNN "), std::string::npos) << "auto picks oneDNN when it can";
  } else {  // a LibTorch without a shared oneDNN: refused naming why
    EXPECT_EQ(onednn.code, 2) << onednn.out;
    EXPECT_EQ(onednn.out.rfind("dtk: error: DTK_CPU_GEMM=onednn: ", 0), 0u) << onednn.out;
  }
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_EQ(bad.out, "dtk: error: DTK_CPU_GEMM='fast' is not one of auto, onednn, aten\n");
  const std::regex loss_re(R"(iteration +(\d+)/ +6 \|.*?lm loss: (\S+) \|)");
  auto losses = [&](const std::string& out) {
    std::vector<double> l;
    for (std::sregex_iterator it(out.begin(), out.end(), loss_re), end; it != end; ++it) l.push_back(std::stod((*it)[2]));
    return l;
  };
  const std::vector<double> a = losses(def.out), b = losses(aten.out);
  ASSERT_EQ(a.size(), 6u) << def.out;
  ASSERT_EQ(b.size(), 6u) << aten.out;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * b[i]) << "iteration " << i + 1;
}

// dtk runs on tcmalloc by default (dtk/core/memory/allocator.hpp: bin/dtk executes the host
// with it preloaded) and says which allocator it runs on; DTK_ALLOCATOR=system keeps glibc malloc, and the
// process really has no tcmalloc mapped then; a bad DTK_ALLOCATOR or DTK_TCMALLOC_PATH is one line.
TEST(Cli, RunsOnACachingAllocatorUnlessToldOtherwise) {
  const std::string args = kTiny + "--set train.train_iters=1 --set lr.lr_warmup_iters=0 --set eval.eval_iters=0 "
                                   "--set logging.log_interval=1 ";
  const Result def = run(args);
  ASSERT_EQ(def.code, 0) << def.out;
#ifdef DTK_TEST_HAVE_TCMALLOC
  EXPECT_NE(def.out.find(" > memory allocator: tcmalloc (DTK_ALLOCATOR=system selects glibc malloc)"),
            std::string::npos)
      << def.out;
#endif
  ::setenv("DTK_ALLOCATOR", "system", 1);
  const Result sys = run(args);
  ::setenv("DTK_ALLOCATOR", "jemalloc", 1);
  const Result bad = run(args);
  ::unsetenv("DTK_ALLOCATOR");
  ASSERT_EQ(sys.code, 0) << sys.out;
  EXPECT_NE(sys.out.find(" > memory allocator: glibc malloc"), std::string::npos) << sys.out;
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_EQ(bad.out, "dtk: error: DTK_ALLOCATOR='jemalloc': expected 'tcmalloc' (the default) or 'system'\n");
  // DTK_TCMALLOC_PATH names another tcmalloc: a file that is not a shared library (nothing there,
  // text, a directory, a program) is refused (else training would run on glibc malloc, after the
  // loader's own message).
  for (const char* path : {"/nonexistent/libtcmalloc.so", "/etc/passwd", "/tmp", "/bin/ls"}) {
    ::setenv("DTK_TCMALLOC_PATH", path, 1);
    const Result wrong = run(args);
    ::unsetenv("DTK_TCMALLOC_PATH");
    EXPECT_EQ(wrong.code, 2) << wrong.out;
    EXPECT_EQ(wrong.out, std::string("dtk: error: DTK_TCMALLOC_PATH='") + path +
                             "': not a readable shared library (unset it for the default)\n");
  }
}

// Debian's LibTorch links libraries it never calls; dtk starts on empty stand-ins for them
// (dtk/host/torch_standins.hpp) and says so; DTK_TORCH_STANDINS=off loads the real ones; a bad
// value is one line; a plugin calling one of them is refused with the way out, and loads with it.
TEST(Cli, StartsOnLibTorchStandInsUnlessToldOtherwise) {
#ifndef DTK_TEST_TORCH_STANDINS
  GTEST_SKIP() << "this LibTorch links nothing it does not call: no stand-ins";
#else
  const std::string said = "LibTorch: " + std::to_string(DTK_TEST_TORCH_STANDINS) +
                           " of its dependencies that it never calls stood in by empty libraries";
  ::unsetenv("DTK_TORCH_STANDINS");  // the caller's choice is not this test's
  const Result on = run("version");
  ASSERT_EQ(on.code, 0) << on.out;
  EXPECT_NE(on.out.find(said), std::string::npos) << on.out;
  EXPECT_EQ(run("--version").out, on.out);  // the flag and the command say the same
  ::setenv("DTK_TORCH_STANDINS", "off", 1);
  const Result off = run("version");
  ::setenv("DTK_TORCH_STANDINS", "no", 1);
  const Result bad = run("version");
  ::unsetenv("DTK_TORCH_STANDINS");
  ASSERT_EQ(off.code, 0) << off.out;
  EXPECT_EQ(off.out.find("stood in"), std::string::npos) << off.out;
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_EQ(bad.out, "dtk: error: DTK_TORCH_STANDINS='no': expected 'on' (the default) or 'off'\n");
  ::setenv("DTK_TORCH_STANDINS", "no", 1);
  const Result bad_launch = run("launch --nproc_per_node 2 version");
  ::unsetenv("DTK_TORCH_STANDINS");
  EXPECT_EQ(bad_launch.code, 2) << bad_launch.out;
  EXPECT_EQ(bad_launch.out, bad.out);
#ifdef DTK_TEST_CALLS_ZSTD_DIR
  const std::string describe = "plugins describe calls_zstd --plugin_path " DTK_TEST_CALLS_ZSTD_DIR;
  const Result refused = run(describe);
  expect_one_line_error(refused, "undefined symbol: ZSTD_versionNumber");
  EXPECT_NE(refused.out.find("run with DTK_TORCH_STANDINS=off"), std::string::npos) << refused.out;
  ::setenv("DTK_TORCH_STANDINS", "off", 1);
  const Result loaded = run(describe);
  ::unsetenv("DTK_TORCH_STANDINS");
  EXPECT_NE(loaded.out.find("not a DTK plugin"), std::string::npos) << loaded.out;
  EXPECT_EQ(loaded.out.find("undefined symbol"), std::string::npos) << loaded.out;
#endif
#endif
}

// A Llama user's path with a real tokenizer.json: preprocess (BOS from the file's template, EOD
// </s>), decode back, train a llama that records the tokenizer, generate and export with no
// tokenizer flags (the checkpoint's), and Megatron's tokenizer flags selecting the same.
TEST(Cli, LlamaTokenizerFromTextToExport) {
  const std::string tok = DTK_SOURCE_DIR "/data/tokenizers/sp-bpe";
  ASSERT_TRUE(std::filesystem::exists(tok + "/tokenizer.json")) << "run tools/setup.sh --vocab";
  const std::string dir = ::testing::TempDir() + "dtk_cli_llama_tok";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir + "/c.jsonl");
    for (int i = 0; i < 200; ++i)
      out << "{\"text\": \"Fortune " << i << ": a journey of a thousand miles begins with a single step.\"}\n";
  }
  const std::string flags = "--tokenizer_type HuggingFaceTokenizer --tokenizer_model " + tok;
  Result p = run("preprocess --input " + dir + "/c.jsonl --output_prefix " + dir + "/c " + flags + " --append_eod");
  ASSERT_EQ(p.code, 0) << p.out;
  Result d = run("preprocess --decode --input " + dir + "/c_text_document 3:4 " + flags);
  ASSERT_EQ(d.code, 0) << d.out;
  // The template's <s> first, the text, the appended </s> (spelled by the decoder as they are).
  EXPECT_NE(d.out.find("<s> Fortune 3: a journey of a thousand miles begins with a single step.</s>"),
            std::string::npos)
      << d.out;
  const std::string train = "train --config " DTK_SOURCE_DIR "/configs/llama-main.pbtxt --data_path " + dir +
                            "/c_text_document --set tokenizer.model_file=" + tok +
                            " --set train.train_iters=3 --set logging.log_interval=1 --set eval.eval_iters=1 "
                            "--set model.num_layers=1 --set model.hidden_size=32 --set model.ffn_hidden_size=64 "
                            "--set lr.lr_warmup_iters=1 --set checkpoint.save=" + dir + "/ckpt --threads 2";
  Result c = run("config " + train.substr(6));
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("key: \"eod_token\"\n    value: \"2\""), std::string::npos) << c.out;  // the tokenizer's </s>
  EXPECT_NE(c.out.find("vocab_size: 32000"), std::string::npos) << c.out;
  Result t = run(train);
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_EQ(losses(t.out).size(), 3u) << t.out;
  Result g = run("generate --load " + dir + "/ckpt --prompt 'A journey of' --max_new_tokens 5");
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_NE(g.out.find("A journey of"), std::string::npos) << g.out;
  Result e = run("export hf " + dir + "/ckpt " + dir + "/hf");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/hf/tokenizer.json"));
  std::ifstream config(dir + "/hf/tokenizer_config.json");
  const std::string text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"eos_token\": \"</s>\""), std::string::npos) << text;
  // Megatron's spelling selects the same tokenizer.
  Result m = run("config --config " DTK_SOURCE_DIR "/configs/llama-main.pbtxt --megatron_args '--tokenizer-type "
                 "HuggingFaceTokenizer --tokenizer-model " + tok + "'");
  ASSERT_EQ(m.code, 0) << m.out;
  EXPECT_NE(m.out.find("type: \"HuggingFaceTokenizer\""), std::string::npos) << m.out;
  // SentencePiece inside dtk, which also links protobuf for its configs (the two must not meet).
  const std::string sp = "--tokenizer_type Llama2Tokenizer --tokenizer_model " DTK_SOURCE_DIR
                         "/tests/data/fixtures/tokenizers/gpl3_bpe.model";
  Result s = run("preprocess --input " + dir + "/c.jsonl --output_prefix " + dir + "/s " + sp + " --append_eod");
  ASSERT_EQ(s.code, 0) << s.out;
  Result sd = run("preprocess --decode --input " + dir + "/s_text_document 3:4 " + sp);
  ASSERT_EQ(sd.code, 0) << sd.out;
  EXPECT_NE(sd.out.find("Fortune 3: a journey of a thousand miles begins with a single step."), std::string::npos)
      << sd.out;
  expect_error_line(run("preprocess --input " + dir + "/c.jsonl --output_prefix " + dir +
                        "/x --tokenizer_type Llama3Tokenizer --tokenizer_model " + tok),
                    "preprocess: unknown --tokenizer-type 'Llama3Tokenizer' (DTK has GPT2BPETokenizer, "
                    "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer, "
                    "TikTokenizer, NullTokenizer; the names are case-sensitive)");
}

// Megatron's TikTokenizer through every command: preprocess, decode, train, generate, export. The
// exported tokenizer.json, read as a HuggingFaceTokenizer, preprocesses the corpus to the same
// bytes. (A 2048-id cut of o200k_base, 16 of them special, keeps the model small.)
TEST(Cli, TikTokenizerFromTextToExport) {
  const std::string vocab = DTK_SOURCE_DIR "/data/tokenizers/tiktoken/o200k_base.json";
  ASSERT_TRUE(std::filesystem::exists(vocab)) << "run tools/setup.sh --vocab";
  const std::string dir = ::testing::TempDir() + "dtk_cli_tiktoken";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir + "/c.jsonl");
    for (int i = 0; i < 200; ++i)
      out << "{\"text\": \"Fortune " << i << ": camelCase journeys of a thousand miles<s>begin with one step.\"}\n";
  }
  const std::string flags = "--tokenizer_type TikTokenizer --tokenizer_model " + vocab +
                            " --vocab_size 2048 --tiktoken_num_special_tokens 16";
  Result p = run("preprocess --input " + dir + "/c.jsonl --output_prefix " + dir + "/c " + flags + " --append_eod");
  ASSERT_EQ(p.code, 0) << p.out;
  Result d = run("preprocess --decode --input " + dir + "/c_text_document 3:4 " + flags);
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("Fortune 3: camelCase journeys of a thousand miles<s>begin with one step.</s>"),
            std::string::npos)
      << d.out;
  const std::string train = "train --config " DTK_SOURCE_DIR "/configs/llama-main.pbtxt --data_path " + dir +
                            "/c_text_document " + flags +
                            " --set train.train_iters=3 --set logging.log_interval=1 --set eval.eval_iters=1 "
                            "--set model.num_layers=1 --set model.hidden_size=32 --set model.ffn_hidden_size=64 "
                            "--set lr.lr_warmup_iters=1 --set checkpoint.save=" +
                            dir + "/ckpt --threads 2";
  Result c = run("config " + train.substr(6));
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("key: \"eod_token\"\n    value: \"2\""), std::string::npos) << c.out;  // </s>
  EXPECT_NE(c.out.find("vocab_size: 2048"), std::string::npos) << c.out;
  Result t = run(train);
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_EQ(losses(t.out).size(), 3u) << t.out;
  Result g = run("generate --load " + dir + "/ckpt --prompt 'A journey of' --max_new_tokens 5");
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_NE(g.out.find("A journey of"), std::string::npos) << g.out;
  Result e = run("export hf " + dir + "/ckpt " + dir + "/hf");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("tokenizer.json (made from the TikTokenizer vocabulary)"), std::string::npos) << e.out;
  Result h = run("preprocess --input " + dir + "/c.jsonl --output_prefix " + dir +
                 "/h --tokenizer_type HuggingFaceTokenizer --tokenizer_model " + dir + "/hf --append_eod");
  ASSERT_EQ(h.code, 0) << h.out;
  const auto bytes = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(bytes(dir + "/h_text_document.bin"), bytes(dir + "/c_text_document.bin"));
  EXPECT_EQ(bytes(dir + "/h_text_document.idx"), bytes(dir + "/c_text_document.idx"));
  expect_error_line(
      run("preprocess --input " + dir + "/c.jsonl --output_prefix " + dir + "/x " + flags + " --tiktoken_pattern v3"),
      "preprocess: TikTokenizer: --tiktoken-pattern must be v1 or v2, got 'v3'");
}
