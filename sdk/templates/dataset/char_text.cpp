// template_char_text — an example dataset plugin built out of tree against the installed DTK SDK.
// Data tier: plain C++, no LibTorch (DTK_NO_TORCH, dtk_add_plugin(... NO_TORCH)).
//
// Any text file, read as bytes: the vocabulary is the 256 byte values, a sample is a window of
// seq_length + 1 consecutive bytes (the step shifts it into seq_length tokens and their next-token
// labels). The file is cut into train / validation / test by percent; each split's windows start
// every seq_length bytes, so neighbouring windows share one byte, as Megatron's GPT samples do.
//
// The dataset contract (docs/plugin-guide.md, "Contracts"):
//   * The host asks for samples 0, 1, 2, ... of a split, in order (each data-parallel rank its own
//     share of every global batch): shuffling is the dataset's job. Here, epoch e of a split reads
//     its windows in a seeded order of its own; a run that needs more samples than a split has
//     windows reads further epochs, each ordered differently.
//   * num_samples(split) may exceed what the run asks for (the context says how many it will ask).
//   * Sample i must be a pure function of (split, i) and the options: the host reads samples on a
//     loader thread, again after a resume, and on every rank.
//   * Token ids must be below vocab_size() (the host checks the first batches).
#include <dtk/dataset.hpp>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_string("data_path", "", "The text file to train on (read as bytes)."),
    dtk::opt_int("valid_percent", "5", "Percent of the file, from its end, held out for validation."),
    dtk::opt_int("test_percent", "5", "Percent of the file, before the validation part, held out for test."),
};

// SplitMix64: a tiny, portable mixing function (the same order on every platform).
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class CharText : public dtk::Dataset {
 public:
  explicit CharText(const dtk::DatasetContext& ctx) : seq_(ctx.seq_length), seed_(ctx.seed) {
    const std::string path = ctx.options.get_string("data_path");
    if (path.empty()) throw dtk::Error("option 'data_path' is required: the text file to train on");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw dtk::Error("cannot read data_path '" + path + "'", DTK_ERR_NOT_FOUND);
    auto text = std::make_shared<std::vector<uint8_t>>(std::istreambuf_iterator<char>(in),
                                                       std::istreambuf_iterator<char>());
    text_ = text;
    const int64_t valid = ctx.options.get_int("valid_percent"), test = ctx.options.get_int("test_percent");
    if (valid < 0 || test < 0 || valid + test >= 100)
      throw dtk::Error("valid_percent and test_percent must be >= 0 and leave some of the file for training");
    // [train | test | valid], each a run of bytes.
    const auto n = static_cast<int64_t>(text->size());
    const int64_t train_end = n * (100 - valid - test) / 100, test_end = n * (100 - valid) / 100;
    const int64_t begin[3] = {0, test_end, train_end}, end[3] = {train_end, n, test_end};
    for (int s = 0; s < 3; ++s) {
      begin_[s] = begin[s];
      windows_[s] = end[s] - begin[s] > seq_ ? (end[s] - begin[s] - 1) / seq_ : 0;
      // Ask for what the run needs: more than one epoch is fine, none at all is not. A split read
      // whole (eval.full_validation, ABI 2.17) is one epoch of its windows.
      wanted_[s] = ctx.whole(s) ? windows_[s] : ctx.num_samples[s];
      if (wanted_[s] > 0 && windows_[s] == 0)
        throw dtk::Error("data_path '" + path + "' (" + std::to_string(n) + " bytes) leaves split " +
                         std::to_string(s) + " (0 train, 1 validation, 2 test) shorter than seq_length + 1 = " +
                         std::to_string(seq_ + 1) + " bytes");
    }
  }

  int64_t num_samples(int32_t split) override {
    check_split(split);
    return wanted_[split];
  }

  void get_sample(int32_t split, int64_t index, const dtk_buffer_sink* out) override {
    check_split(split);
    if (index < 0 || index >= wanted_[split])
      throw dtk::Error("sample " + std::to_string(index) + " out of range", DTK_ERR_OUT_OF_RANGE);
    const int64_t w = windows_[split], epoch = index / w;
    const int64_t start = begin_[split] + shuffled(split, epoch, index % w) * seq_;
    std::vector<int64_t> tokens(text_->begin() + start, text_->begin() + start + seq_ + 1);
    dtk::put(out, "text", dtk::make_buffer(std::move(tokens)));  // seq_length + 1 ids in [0, 256)
  }

  int64_t vocab_size() override { return 256; }

 private:
  void check_split(int32_t split) const {
    if (split < 0 || split > 2) throw dtk::Error("unknown split " + std::to_string(split), DTK_ERR_OUT_OF_RANGE);
  }

  // Window j of an epoch -> a window of the split, a bijection on [0, w): j -> (a j + b) mod w
  // with a coprime to w, a and b drawn from (seed, split, epoch). Stateless, so it is safe on the
  // loader thread and the same after a resume.
  int64_t shuffled(int32_t split, int64_t epoch, int64_t j) const {
    const auto w = static_cast<uint64_t>(windows_[split]);
    const uint64_t r = mix(seed_ ^ mix(static_cast<uint64_t>(split) << 48 ^ static_cast<uint64_t>(epoch)));
    uint64_t a = 1 + r % w;
    while (std::gcd(a, w) != 1) a = a % w + 1;
    const uint64_t b = mix(r) % w;
    return static_cast<int64_t>((a * static_cast<uint64_t>(j) % w + b) % w);
  }

  int64_t seq_;
  uint64_t seed_;
  std::shared_ptr<const std::vector<uint8_t>> text_;
  int64_t begin_[3] = {0, 0, 0}, windows_[3] = {0, 0, 0}, wanted_[3] = {0, 0, 0};
};

}  // namespace

DTK_PLUGIN("template_char_text", DTK_KIND_DATASET, "0.1.0", "Out-of-tree example: a text file as byte tokens",
           DTK_NO_TORCH, dtk::dataset_api<CharText>(), kOptions)
