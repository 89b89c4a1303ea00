// synthetic — random token samples for benchmarks and smoke tests. Sample i of a split is a
// pure function of (seed, split, i), so any rank or worker thread can produce it.
#include <dtk/dataset.hpp>

#include <cstdint>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_int("vocab_size", "50257", "Tokens are drawn uniformly from [0, vocab_size)."),
    dtk::opt_int("num_samples", "0",
                 "Samples per split (0 = exactly what the run requests; a split read whole needs it)."),
};

// SplitMix64: tiny, fast, good enough for random tokens, identical on every platform.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class Synthetic : public dtk::Dataset {
 public:
  explicit Synthetic(const dtk::DatasetContext& ctx)
      : vocab_(ctx.options.get_int("vocab_size")), seq_(ctx.seq_length), seed_(ctx.seed) {
    if (vocab_ <= 0) throw dtk::Error("option 'vocab_size' must be positive");
    if (seq_ <= 0) throw dtk::Error("seq_length must be positive");
    const int64_t fixed = ctx.options.get_int("num_samples");
    if (fixed < 0) throw dtk::Error("option 'num_samples' must be >= 0");
    for (int s = 0; s < 3; ++s) {
      // Random tokens have no end: a split read whole (eval.full_validation) is num_samples long.
      if (ctx.whole(s) && fixed == 0)
        throw dtk::Error(std::string("the run reads the ") +
                             (s == 1   ? "validation"
                              : s == 2 ? "test"
                                       : "training") +
                             " split whole (eval.full_validation): random data has no end; set the option "
                             "num_samples, which sizes every split, training's too (e.g. --set "
                             "dataset.num_samples=1000)",
                         DTK_ERR_INVALID_ARGUMENT);
      n_[s] = fixed > 0 ? fixed : ctx.num_samples[s];
    }
  }
  int64_t num_samples(int32_t split) override {
    if (split < 0 || split > 2) throw dtk::Error("unknown split " + std::to_string(split), DTK_ERR_OUT_OF_RANGE);
    return n_[split];
  }
  void get_sample(int32_t split, int64_t index, const dtk_buffer_sink* out) override {
    if (index < 0 || index >= num_samples(split))
      throw dtk::Error("sample " + std::to_string(index) + " out of range", DTK_ERR_OUT_OF_RANGE);
    std::vector<int64_t> tokens(static_cast<size_t>(seq_ + 1));
    uint64_t state = mix(seed_ ^ mix(static_cast<uint64_t>(split) << 56 ^ static_cast<uint64_t>(index)));
    for (auto& t : tokens) t = static_cast<int64_t>((state = mix(state)) % static_cast<uint64_t>(vocab_));
    dtk::put(out, "text", dtk::make_buffer(std::move(tokens)));
  }
  int64_t vocab_size() override { return vocab_; }

 private:
  int64_t vocab_, seq_;
  uint64_t seed_;
  int64_t n_[3] = {0, 0, 0};
};

}  // namespace

DTK_PLUGIN("synthetic", DTK_KIND_DATASET, "1.0.0", "Random tokens, seeded (benchmarks, smoke tests)", DTK_NO_TORCH,
           dtk::dataset_api<Synthetic>(), kOptions)
