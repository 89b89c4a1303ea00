// Generation with the gpt plugin's key/value cache (dtk/core/export/generate.hpp, docs/models.md
// "Generation"): the cached forward's logits equal the full forward's at the same position, with
// a left-padded batch; greedy generation picks the argmax of the full forward over the whole
// sequence at every step; sampling honours top-k, top-p and the seed.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <fstream>
#include <sstream>

#include "../common/run_dtk.hpp"
#include "dtk/core/export/generate.hpp"
#include "gpt_harness.hpp"

namespace {

using dtk_test_gpt::GPT;
using dtk_test_gpt::Opts;

const Opts kTiny = {{"num_layers", "2"},        {"hidden_size", "64"},       {"num_attention_heads", "4"},
                    {"vocab_size", "100"},      {"max_position_embeddings", "32"}, {"hidden_dropout", "0"},
                    {"attention_dropout", "0"}, {"make_vocab_size_divisible_by", "64"}};

// The full forward's logits [vocab] at the last position of `ids` (one unpadded sequence).
at::Tensor full_last_logits(GPT& m, const std::vector<int64_t>& ids) {
  const at::Tensor tokens = at::tensor(ids, at::kLong).view({1, -1});
  for (auto& [name, t] : m.forward({{"tokens", tokens}}))
    if (name == "logits") return t[0][-1].clone();
  throw std::runtime_error("no logits");
}

}  // namespace

TEST(Generate, CachedLogitsEqualTheFullForwardWithALeftPaddedBatch) {
  GPT m(kTiny);
  m.train(false);
  at::NoGradGuard no_grad;
  // Two prompts (5 and 3 tokens) in one batch: row 1 is left-padded by 2.
  const std::vector<std::vector<int64_t>> prompts = {{5, 17, 42, 8, 99}, {3, 64, 21}};
  const at::Tensor tokens = at::tensor(std::vector<int64_t>{5, 17, 42, 8, 99, 0, 0, 3, 64, 21}, at::kLong).view({2, 5});
  const at::Tensor pos = at::tensor(std::vector<int64_t>{0, 1, 2, 3, 4, 0, 0, 0, 1, 2}, at::kLong).view({2, 5});
  at::Tensor mask = at::ones({5, 5}, at::kBool).triu(1).view({1, 1, 5, 5}).repeat({2, 1, 1, 1});
  mask[1].narrow(-1, 0, 2).fill_(true);  // row 1's padding is never a key
  dtk::TensorList out = m.forward({{"tokens", tokens},
                                   {"position_ids", pos},
                                   {"attention_mask", mask},
                                   {"kv_cache_length", at::scalar_tensor(0, at::kLong)},
                                   {"kv_cache_capacity", at::scalar_tensor(8, at::kLong)}});
  at::Tensor logits;
  dtk::TensorList caches;
  for (auto& [name, t] : out) {
    if (name == "logits")
      logits = t;
    else
      caches.emplace_back(name, t);
  }
  ASSERT_EQ(logits.sizes(), at::IntArrayRef({2, 1, 128}));  // the padded vocabulary, last position
  ASSERT_EQ(caches.size(), 2u);
  EXPECT_EQ(caches[0].second.sizes(), at::IntArrayRef({2, 2, 4, 8, 16}));  // [k|v, b, heads, capacity, head_dim]
  for (size_t i = 0; i < 2; ++i)
    EXPECT_TRUE(at::allclose(logits[static_cast<int64_t>(i)][0], full_last_logits(m, prompts[i]), 1e-5, 1e-5)) << i;

  // One more token each, through the cache.
  const at::Tensor next = at::tensor(std::vector<int64_t>{7, 11}, at::kLong).view({2, 1});
  at::Tensor step_mask = at::zeros({2, 1, 1, 6}, at::kBool);
  step_mask[1].narrow(-1, 0, 2).fill_(true);
  dtk::TensorList in{{"tokens", next},
                     {"position_ids", at::tensor(std::vector<int64_t>{5, 3}, at::kLong).view({2, 1})},
                     {"attention_mask", step_mask},
                     {"kv_cache_length", at::scalar_tensor(5, at::kLong)}};
  for (auto& c : caches) in.push_back(c);
  for (auto& [name, t] : m.forward(in))
    if (name == "logits") logits = t;
  EXPECT_TRUE(at::allclose(logits[0][0], full_last_logits(m, {5, 17, 42, 8, 99, 7}), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(logits[1][0], full_last_logits(m, {3, 64, 21, 11}), 1e-5, 1e-5));
}

TEST(Generate, GreedyPicksTheArgmaxOfTheFullForwardAtEveryStep) {
  GPT m(kTiny);
  m.train(false);
  dtk::core::SamplingOptions o;
  o.temperature = 0;
  o.max_new_tokens = 10;
  o.vocab_size = 100;
  const std::vector<std::vector<int64_t>> prompts = {{5, 17, 42, 8, 99}, {3, 64, 21}, {1}};
  std::vector<std::vector<int64_t>> streamed(prompts.size());
  const auto got = dtk::core::generate(m.ref(), prompts, o, 32,
                                       [&](size_t i, int64_t id) { streamed[i].push_back(id); });
  ASSERT_EQ(got.size(), prompts.size());
  EXPECT_EQ(streamed, got) << "every token is streamed as it is chosen";
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i].size(), 10u);
    std::vector<int64_t> seq = prompts[i];
    for (int64_t id : got[i]) {
      const at::Tensor full = full_last_logits(m, seq).narrow(0, 0, 100);
      EXPECT_EQ(id, full.argmax().item<int64_t>()) << "sequence " << i << " after " << seq.size() << " tokens";
      seq.push_back(id);
    }
  }
  // The last new token is never fed back: 30 + 3 tokens need 32 positions, which fit.
  dtk::core::SamplingOptions three = o;
  three.max_new_tokens = 3;
  EXPECT_EQ(dtk::core::generate(m.ref(), {std::vector<int64_t>(30, 1)}, three, 32).at(0).size(), 3u);
  // A prompt too long for the positions is one line naming both numbers.
  try {
    dtk::core::generate(m.ref(), {std::vector<int64_t>(30, 1)}, o, 32);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_STREQ(e.what(), "generate: the longest prompt (30 tokens) plus 10 new tokens exceeds the model's 32 positions");
  }
}

TEST(Generate, SamplingHonoursTopKTopPTheSeedAndThePadding) {
  at::Tensor logits = at::tensor(std::vector<float>{0.f, 1.f, 2.f, 3.f, 10.f}, at::kFloat).view({1, 5}).repeat({400, 1});
  dtk::core::SamplingOptions o;
  o.seed = 7;
  at::Generator g1 = at::make_generator<at::CPUGeneratorImpl>(7), g2 = at::make_generator<at::CPUGeneratorImpl>(7);
  o.vocab_size = 4;  // id 4 (the largest logit) is padding: never chosen
  const at::Tensor a = dtk::core::sample_next(logits, o, &g1), b = dtk::core::sample_next(logits, o, &g2);
  EXPECT_TRUE(at::equal(a, b)) << "same seed, same tokens";
  EXPECT_EQ(a.max().item<int64_t>(), 3);
  EXPECT_GT(a.eq(2).sum().item<int64_t>(), 0) << "temperature 1 samples more than the top token";
  o.top_k = 2;
  const at::Tensor k = dtk::core::sample_next(logits, o, &g1);
  EXPECT_EQ(k.lt(2).sum().item<int64_t>(), 0) << "top-k 2 keeps ids 2 and 3 only";
  o.top_k = 0;
  o.top_p = 0.5;  // id 3 alone holds ~0.67 of the probability among 0..3
  EXPECT_EQ(dtk::core::sample_next(logits, o, &g1).ne(3).sum().item<int64_t>(), 0);
  o.temperature = 0;
  EXPECT_EQ(dtk::core::sample_next(logits, o, &g1).ne(3).sum().item<int64_t>(), 0) << "greedy";
  // A temperature or top_p that rounds to 0 in float is greedy, not a NaN the sampler refuses.
  o.top_p = 1e-300;
  o.temperature = 1e-300;
  EXPECT_EQ(dtk::core::sample_next(logits, o, &g1).ne(3).sum().item<int64_t>(), 0) << "temperature 1e-300";
  o.temperature = 1;
  EXPECT_EQ(dtk::core::sample_next(logits, o, &g1).ne(3).sum().item<int64_t>(), 0) << "top_p 1e-300";
}

// `dtk generate` end to end: a checkpoint continued greedily in one process and, converted to
// TP=2, under `dtk launch` print the same text; sampling with one seed is repeatable and equal at
// both sizes; a prompts file is continued in batches; bad inputs are one line.
TEST(GenerateCli, OneProcessAndTensorParallelPrintTheSameText) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "generate");
  const std::string train = std::string("train --config ") + DTK_SOURCE_DIR +
                            "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set train.train_iters=3 "
                            "--set lr.lr_warmup_iters=1 --set eval.eval_iters=0 --set eval.eval_interval=0 "
                            "--set checkpoint.save=" + dir + "/tp1";  // padded to 50304 at TP1, 50432 at TP2
  ASSERT_EQ(dtk_test::run_dtk(train).code, 0);
  ASSERT_EQ(dtk_test::run_dtk("checkpoint convert " + dir + "/tp1 " + dir + "/tp2 --tensor_model_parallel_size 2").code, 0);
  const std::string bpe = " --vocab_file " + std::string(DTK_VOCAB_DIR) + "/encoder.json --merge_file " +
                          std::string(DTK_VOCAB_DIR) + "/vocab.bpe ";
  auto gen = [&](const std::string& load, const std::string& args, bool tp2) {
    return dtk_test::run_dtk((tp2 ? "launch --nproc_per_node 2 generate --load " : "generate --load ") + load + bpe + args);
  };
  // stdout alone: the prompt and its continuation (the header line and, under launch, each rank's
  // network line go to stderr).
  auto text = [](const dtk_test::Result& r) {
    std::string out;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);)
      if (line.rfind("generate: ", 0) != 0 && line.find("] > distributed: Gloo listens on ") == std::string::npos)
        out += line + "\n";
    return out;
  };
  const std::string greedy = "--prompt 'First Citizen:' --max_new_tokens 12 --temperature 0";
  const dtk_test::Result a = gen(dir + "/tp1", greedy, false), b = gen(dir + "/tp2", greedy, true);
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(a.out.find("generate: iteration 3 of " + dir + "/tp1, tensor-parallel size 1, greedy"), std::string::npos)
      << a.out;
  EXPECT_EQ(text(a).rfind("First Citizen:", 0), 0u) << a.out;
  EXPECT_GT(text(a).size(), std::string("First Citizen:\n").size()) << a.out;
  EXPECT_EQ(text(a), text(b)) << "TP1 and TP2 greedy text";
  const std::string sampled = "--prompt 'First Citizen:' --max_new_tokens 12 --temperature 0.8 --top_k 50 --top_p 0.95 --seed 5";
  const dtk_test::Result c = gen(dir + "/tp1", sampled, false), d = gen(dir + "/tp1", sampled, false),
                         e = gen(dir + "/tp2", sampled, true);
  EXPECT_EQ(text(c), text(d)) << "the same seed, the same text";
  EXPECT_EQ(text(c), text(e)) << "and at TP=2";

  const std::string prompts = dir + "/prompts.txt";
  std::ofstream(prompts) << "Hello there\nTo be or not\nThe king\n";
  const dtk_test::Result f = gen(dir + "/tp1", "--prompts_file " + prompts + " --batch_size 2 --max_new_tokens 5", false);
  ASSERT_EQ(f.code, 0) << f.out;
  for (const char* p : {"=== prompt 1\nHello there", "=== prompt 2\nTo be or not", "=== prompt 3\nThe king"})
    EXPECT_NE(f.out.find(p), std::string::npos) << p << "\n" << f.out;

  dtk_test::expect_one_line_error(gen(dir + "/tp2", greedy, false),
                                  "was saved at tensor-parallel size 2: run `dtk launch --nproc_per_node 2 generate");
  dtk_test::expect_one_line_error(dtk_test::run_dtk("generate" + bpe + greedy), "generate: --load DIR (a checkpoint) is required");
  dtk_test::expect_one_line_error(gen(dir + "/tp1", "--prompt x --prompts_file " + prompts, false),
                                  "give --prompt or --prompts_file, not both");
  // Text the tokenizer cannot read: the prompt that holds it is named.
  const std::string latin1 = dir + "/latin1.txt";
  std::ofstream(latin1) << "Hello\nCaf\xe9 au lait\n";
  dtk_test::expect_one_line_error(gen(dir + "/tp1", "--prompts_file " + latin1, false),
                                  "generate: --prompts_file " + latin1 + " line 2: invalid UTF-8 at byte 3");
  dtk_test::expect_one_line_error(gen(dir + "/tp1", "--prompt x --top_p 0", false), "--top_p must be in (0, 1]");
  dtk_test::expect_one_line_error(gen(dir + "/tp1", "--prompt ''", false), "generate: --prompt is empty");
  // A checkpoint that records its tokenizer (GPT-2's, here on random tokens of its range): another
  // tokenizer's flags are refused; the same tokenizer's (files anywhere) are taken.
  ASSERT_EQ(dtk_test::run_dtk(train + "/../tok" + bpe).code, 0);
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk("generate --load " + dir + "/tok --prompt 1 --tokenizer_type NullTokenizer --vocab_size 100"),
      "generate: the tokenizer flags give a NullTokenizer of 101 tokens, but " + dir +
          "/tok/iter_0000003 was trained with a GPT2BPETokenizer of 50257 tokens: drop the tokenizer flags");
  const dtk_test::Result same = gen(dir + "/tok", "--prompt Hello --max_new_tokens 2", false);
  EXPECT_EQ(same.code, 0) << same.out;
  dtk_test::expect_one_line_error(gen(dir + "/tp1", "--prompt x --max_new_tokens 5000", false),
                                  "generate: --prompt: 1 prompt token plus 5000 new ones (--max_new_tokens) exceed the "
                                  "model's ");
  // A prompt too long anywhere in a file is named by its line before any batch is generated.
  const std::string long_prompts = dir + "/long.txt";
  std::ofstream(long_prompts) << "Hello there\n\nThe king\n"
                              << std::string(200, 'a')
                              << " b c d e f g h i j k l m n o p q r s t u v w x y z 1 2 3 4 5 6 7 8 9\n";
  const dtk_test::Result g =
      gen(dir + "/tp1", "--prompts_file " + long_prompts + " --batch_size 1 --max_new_tokens 5", false);
  dtk_test::expect_one_line_error(g, "generate: --prompts_file " + long_prompts + " line 4: ");
  EXPECT_EQ(g.out.find("=== prompt"), std::string::npos) << g.out;
}
