// recording_data — random-token samples (a pure function of split and index, as synthetic's) of
// splits with a fixed number of samples, that write every sample the host reads to a file per
// rank (option `record`: "<record>.<rank>", one "<split> <index>" line per read), so tests can
// check the order the samplers read the splits in.
#include <dtk/dataset.hpp>

#include <cstdint>
#include <fstream>
#include <mutex>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_string("record", "", "Prefix of the per-rank files the reads are written to."),
    dtk::opt_int("train_samples", "24", "Samples of the train split."),
    dtk::opt_int("valid_samples", "12", "Samples of the validation split."),
    dtk::opt_int("test_samples", "8", "Samples of the test split."),
};

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class RecordingData : public dtk::Dataset {
 public:
  explicit RecordingData(const dtk::DatasetContext& ctx)
      : seq_(ctx.seq_length),
        n_{ctx.options.get_int("train_samples"), ctx.options.get_int("valid_samples"),
           ctx.options.get_int("test_samples")} {
    const std::string record = ctx.options.get_string("record");
    if (!record.empty()) out_.open(record + "." + std::to_string(ctx.rank), std::ios::trunc);
  }
  int64_t num_samples(int32_t split) override {
    if (split < 0 || split > 2) throw dtk::Error("unknown split " + std::to_string(split), DTK_ERR_OUT_OF_RANGE);
    return n_[split];
  }
  void get_sample(int32_t split, int64_t index, const dtk_buffer_sink* out) override {
    if (index < 0 || index >= num_samples(split))
      throw dtk::Error("sample " + std::to_string(index) + " out of range", DTK_ERR_OUT_OF_RANGE);
    if (out_.is_open()) {
      const std::lock_guard<std::mutex> lock(mutex_);
      out_ << split << " " << index << "\n" << std::flush;
    }
    std::vector<int64_t> tokens(static_cast<size_t>(seq_ + 1));
    uint64_t state = mix(static_cast<uint64_t>(split) << 56 ^ static_cast<uint64_t>(index));
    for (auto& t : tokens) t = static_cast<int64_t>((state = mix(state)) % 1000);
    dtk::put(out, "text", dtk::make_buffer(std::move(tokens)));
  }
  int64_t vocab_size() override { return 1000; }

 private:
  int64_t seq_;
  int64_t n_[3];
  std::mutex mutex_;
  std::ofstream out_;
};

}  // namespace

DTK_PLUGIN("recording_data", DTK_KIND_DATASET, "1.0.0", "Random tokens; writes each read sample's index (tests)",
           DTK_NO_TORCH, dtk::dataset_api<RecordingData>(), kOptions)
