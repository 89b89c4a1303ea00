// contract_data — random tokens (vocab 64) whose options break the dataset contract, for
// tests/contracts: `short_samples` gives seq_length tokens instead of seq_length + 1;
// `bad_id_from` puts id `vocab_size` into every sample from that index on.
#include <dtk/dataset.hpp>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_bool("short_samples", "false", "seq_length tokens per sample instead of seq_length + 1."),
    dtk::opt_int("bad_id_from", "-1", "From this sample index on, each sample holds an id out of the vocabulary."),
};

class ContractData : public dtk::Dataset {
 public:
  explicit ContractData(const dtk::DatasetContext& ctx)
      : seq_(ctx.seq_length),
        short_(ctx.options.get_bool("short_samples")),
        bad_from_(ctx.options.get_int("bad_id_from")) {
    for (int s = 0; s < 3; ++s) n_[s] = ctx.num_samples[s];
  }
  int64_t num_samples(int32_t split) override { return n_[split]; }
  void get_sample(int32_t, int64_t index, const dtk_buffer_sink* out) override {
    std::vector<int64_t> tokens(static_cast<size_t>(short_ ? seq_ : seq_ + 1));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((index * 31 + i * 7) % 64);
    if (bad_from_ >= 0 && index >= bad_from_) tokens[1] = 64;
    dtk::put(out, "text", dtk::make_buffer(std::move(tokens)));
  }
  int64_t vocab_size() override { return 64; }

 private:
  int64_t seq_;
  bool short_;
  int64_t bad_from_;
  int64_t n_[3] = {0, 0, 0};
};

}  // namespace

DTK_PLUGIN("contract_data", DTK_KIND_DATASET, "1.0.0", "Test dataset that breaks a contract on request", DTK_NO_TORCH,
           dtk::dataset_api<ContractData>(), kOptions)
