// dtk_bench_data — data pipeline throughput (prints figures; asserts nothing).
//
//   dtk_bench_data [--text FILE] [--vocab DIR] [--mb 50] [--tokens 100000000] [--tmp /tmp]
//
// --text: the base text (default: the committed tests/data/fixtures/shakespeare_excerpt.txt);
// --vocab: the directory of encoder.json and vocab.bpe (default: data/gpt2 of the repository,
// where `tools/setup.sh --vocab` puts them).
//
// 1. GPT-2 BPE tokenizer MB/s on the base text repeated to --mb MB, on 1 thread and on all
//    hardware threads (the text is cut at safe pre-tokenizer boundaries, one cache per thread,
//    as `dtk preprocess` does). When `node` and the npm reference encoders are available
//    (NODE_PATH), it times them on the same text in the same run (tools/bench/bench_tokenizer.js).
// 2. GPT dataset index build time (doc_idx + sample_idx + shuffle_idx) for --tokens tokens of
//    synthetic documents, seq_length 1024, one and three epochs, plus cache write and reload.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dtk/text/gpt2_tokenizer.hpp"
#include "dtk/data/gpt_dataset.hpp"
#include "dtk/data/indexed_dataset.hpp"

using namespace dtk::data;
using namespace dtk::text;
using Clock = std::chrono::steady_clock;

static double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

static std::string read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Cuts `text` into about `n` chunks before a '\n' followed by printable ASCII (safe boundaries).
static std::vector<std::string_view> split_at_lines(std::string_view text, size_t n) {
  std::vector<std::string_view> out;
  const size_t target = text.size() / n + 1;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t cut = text.size();
    for (size_t k = pos + target; k + 1 < text.size(); ++k) {
      if (text[k] == '\n' && text[k + 1] >= 0x21 && text[k + 1] <= 0x7e) {
        cut = k;
        break;
      }
    }
    out.push_back(text.substr(pos, cut - pos));
    pos = cut;
  }
  return out;
}

static double encode_mbps(const Gpt2Tokenizer& tok, std::string_view text, unsigned threads, size_t* tokens) {
  const auto chunks = split_at_lines(text, threads * 16);
  std::vector<size_t> counts(threads, 0);
  const auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Gpt2Tokenizer::Cache cache;
      std::vector<int32_t> ids;
      for (size_t c = t; c < chunks.size(); c += threads) {
        ids.clear();
        tok.encode(chunks[c], &ids, &cache);
        counts[t] += ids.size();
      }
    });
  }
  for (auto& th : pool) th.join();
  const double s = since(t0);
  *tokens = 0;
  for (size_t c : counts) *tokens += c;
  return static_cast<double>(text.size()) / 1e6 / s;
}

int main(int argc, char** argv) {
  std::string text_path = std::string(DTK_DATA_FIXTURES_DIR) + "/shakespeare_excerpt.txt";
  std::string vocab = DTK_GPT2_VOCAB_DIR;
  double mb = 50;
  int64_t total_tokens = 100000000;
  std::string tmp = "/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--text")
      text_path = argv[i + 1];
    else if (a == "--vocab")
      vocab = argv[i + 1];
    else if (a == "--mb")
      mb = std::atof(argv[i + 1]);
    else if (a == "--tokens")
      total_tokens = std::atoll(argv[i + 1]);
    else if (a == "--tmp")
      tmp = argv[i + 1];
    else {
      std::fprintf(stderr,
                   "usage: dtk_bench_data [--text FILE] [--vocab DIR] [--mb 50] [--tokens 100000000] [--tmp /tmp]\n");
      return 2;
    }
  }
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  std::printf("dtk_bench_data: %u hardware threads\n", hw);

  // ---- tokenizer
  const std::string base = read_file(text_path);
  if (base.empty()) {
    std::fprintf(stderr, "dtk_bench_data: cannot read the base text '%s' (--text)\n", text_path.c_str());
    return 1;
  }
  for (const char* f : {"/encoder.json", "/vocab.bpe"}) {
    if (read_file(vocab + f).empty()) {
      std::fprintf(stderr, "dtk_bench_data: cannot read '%s%s': run tools/setup.sh --vocab (or pass --vocab DIR)\n",
                   vocab.c_str(), f);
      return 1;
    }
  }
  std::string text;
  while (text.size() < mb * 1e6) text += base;
  text.resize(static_cast<size_t>(mb * 1e6));
  text.resize(text.rfind('\n') + 1);
  auto t0 = Clock::now();
  const Gpt2Tokenizer tok(vocab + "/encoder.json", vocab + "/vocab.bpe");
  std::printf("tokenizer load (encoder.json + vocab.bpe): %.3f s\n", since(t0));
  size_t tokens = 0;
  const double one = encode_mbps(tok, text, 1, &tokens);
  std::printf("dtk GPT-2 BPE, 1 thread:   %.1f MB, %zu tokens, %.2f MB/s\n", text.size() / 1e6, tokens, one);
  const double all = encode_mbps(tok, text, hw, &tokens);
  std::printf("dtk GPT-2 BPE, %u threads: %.1f MB, %zu tokens, %.2f MB/s\n", hw, text.size() / 1e6, tokens, all);
  const std::string text_file = tmp + "/dtk_bench_text.txt";
  {
    std::ofstream f(text_file, std::ios::binary);
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
  }
  const char* node_path = std::getenv("NODE_PATH");
  const std::string script = std::string(DTK_SOURCE_DIR) + "/tools/bench/bench_tokenizer.js";
  if (std::system("node --version > /dev/null 2>&1") == 0) {
    std::printf("npm reference encoders (node, 1 thread, NODE_PATH=%s):\n", node_path ? node_path : "");
    std::fflush(stdout);
    const std::string cmd = "node '" + script + "' '" + text_file + "'";
    if (std::system(cmd.c_str()) != 0) std::printf("  (node benchmark failed)\n");
  } else {
    std::printf("node not found: npm reference encoders not timed\n");
  }
  std::remove(text_file.c_str());

  // ---- index build
  const std::string prefix = tmp + "/dtk_bench_docs";
  {
    t0 = Clock::now();
    IndexedDatasetBuilder b(bin_path(prefix), DType::kUInt16);
    std::mt19937_64 g(1);
    std::vector<int64_t> doc;
    int64_t written = 0;
    while (written < total_tokens) {
      const int64_t len = std::min<int64_t>(total_tokens - written, 1 + static_cast<int64_t>(g() % 2000));
      doc.assign(static_cast<size_t>(len), static_cast<int64_t>(g() % 50257));
      b.add_document(doc);
      written += len;
    }
    b.finalize(idx_path(prefix));
    std::printf("synthetic dataset: %lld tokens in %zu documents written in %.2f s\n", static_cast<long long>(written),
                b.num_documents(), since(t0));
  }
  auto data = std::make_shared<const IndexedDataset>(prefix);
  for (int epochs : {1, 3}) {
    GptDatasetOptions o;
    o.seq_length = 1024;
    o.num_samples = (total_tokens * epochs - 1) / 1024 - 10;
    o.seed = 1234;
    o.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
    t0 = Clock::now();
    GPTDataset ds(data, 0, data->num_sequences(), o);
    const double build = since(t0);
    std::printf("index build, %d epoch(s): %lld tokens/epoch, %zu samples of 1025 tokens: %.3f s\n", epochs,
                static_cast<long long>(total_tokens), ds.size(), build);
    o.cache_mode = GptDatasetOptions::CacheMode::kBuild;
    o.cache_dir = tmp;
    t0 = Clock::now();
    GPTDataset built(data, 0, data->num_sequences(), o);
    const double save = since(t0);
    t0 = Clock::now();
    GPTDataset loaded(data, 0, data->num_sequences(), o);
    std::printf("  build + write cache: %.3f s; load + validate cache: %.3f s (from cache: %s)\n", save, since(t0),
                loaded.loaded_from_cache() ? "yes" : "no");
    std::vector<int64_t> sample(ds.sample_length());
    t0 = Clock::now();
    const size_t n = std::min<size_t>(ds.size(), 200000);
    for (size_t i = 0; i < n; ++i) loaded.get(i, sample.data());
    std::printf("  random sample reads: %.2f us/sample\n", since(t0) / static_cast<double>(n) * 1e6);
    for (const char* w : {"doc_idx", "sample_idx", "shuffle_idx"}) std::remove(built.cache_file(w).c_str());
  }
  std::remove(bin_path(prefix).c_str());
  std::remove(idx_path(prefix).c_str());
  return 0;
}
