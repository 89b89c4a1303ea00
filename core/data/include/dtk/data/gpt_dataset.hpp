// dtk::data — Megatron-LM's GPT dataset: train/valid/test split of the documents, the
// document / sample / shuffle indices (megatron/data/gpt_dataset.py + helpers.cpp), their
// on-disk cache, and the weighted BlendedDataset with Megatron's greedy blending.
//
// All of it is Megatron's, element for element (megatron/core/datasets/gpt_dataset.py, and the
// legacy megatron/data/gpt_dataset.py DeepSpeed-Domino ships, whose orders are the same): split
// parsing, number of epochs, separate last epoch (< 80% of an epoch), the sample index
// (seq_length+1 tokens per sample, consecutive samples share one token), the blending algorithm
// and the ceil(w * N * 1.005) per-dataset sample counts, and the shuffles, which are numpy's
// legacy numpy.random.RandomState(seed).shuffle (NumpyRandomState below), drawn in Megatron's
// order: the document index (its epochs, then a separate last epoch), then the shuffle index.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dtk/data/indexed_dataset.hpp"
#include "dtk/data/npy.hpp"

namespace dtk::data {

// Megatron's get_train_valid_test_split_: "969,30,1" (or "a/b/c", or "1") normalized to the
// document boundaries [0, b1, b2, size]. Throws DataError for unparsable/negative/zero weights.
std::array<size_t, 4> split_boundaries(const std::string& split, size_t num_documents);

// numpy's legacy numpy.random.RandomState(seed), the part Megatron's indices use: MT19937 seeded
// from an integer as numpy seeds it (mt19937_seed: Matsumoto and Nishimura's init_genrand, which
// is std::mt19937's seeding too), and RandomState.shuffle of a 1-D array: for i = n-1 down to 1,
// swap a[i] with a[j], j = random_interval(i) (a uniform integer in [0, i] by masked rejection:
// the smallest all-ones mask >= i over 32-bit draws, or over 64-bit draws, high word first, when
// i >= 2^32). The same seed gives the same permutation as numpy, on every machine.
class NumpyRandomState {
 public:
  // seed in [0, 2^32 - 1], numpy's range; anything else throws DataError.
  explicit NumpyRandomState(uint64_t seed);
  uint32_t next32() { return static_cast<uint32_t>(gen_()); }
  uint64_t next64() {
    const uint64_t high = next32();
    return (high << 32) | next32();
  }
  // numpy's random_interval(max): uniform in [0, max].
  uint64_t interval(uint64_t max);
  template <typename T>
  void shuffle(T* a, size_t n) {
    for (size_t i = n; i > 1; --i) {
      const size_t j = static_cast<size_t>(interval(i - 1));
      std::swap(a[i - 1], a[j]);
    }
  }

 private:
  std::mt19937 gen_;
};

// Megatron's _num_epochs: smallest E with (E * tokens_per_epoch - 1) / seq_length >= samples.
int64_t num_epochs(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples);
// Whether the last epoch is shuffled separately (it supplies < 80% of an epoch's samples).
bool separate_last_epoch(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples, int64_t num_epochs);
// _build_doc_idx: documents repeated num_epochs times and shuffled (all epochs together, or
// the first E-1 together and the last one separately).
std::vector<int32_t> build_doc_idx(const std::vector<int32_t>& documents, int64_t num_epochs, NumpyRandomState* rng,
                                   bool separate_last_epoch);
// helpers.cpp build_sample_idx: rows of (position in doc_idx, token offset), flattened,
// (num_samples + 1) rows where num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length.
std::vector<int64_t> build_sample_idx(const std::vector<int32_t>& sizes, const std::vector<int32_t>& doc_idx,
                                      int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch);
// _build_shuffle_idx: [0, num_samples) shuffled, then [num_samples, total_size) shuffled.
std::vector<int64_t> build_shuffle_idx(int64_t num_samples, int64_t total_size, NumpyRandomState* rng);

// A source of fixed-length token samples (what a dataset plugin hands out).
class TokenDataset {
 public:
  virtual ~TokenDataset() = default;
  virtual size_t size() const = 0;
  // Every sample has sample_length() = seq_length + 1 tokens.
  virtual size_t sample_length() const = 0;
  // Writes sample i (i < size()) to out[0 .. sample_length()). Throws DataError.
  virtual void get(size_t i, int64_t* out) const = 0;
  std::vector<int64_t> get(size_t i) const {
    std::vector<int64_t> v(sample_length());
    get(i, v.data());
    return v;
  }
};

struct GptDatasetOptions {
  std::string name = "train";  // split name, part of the cache file names
  int64_t num_samples = 0;     // requested samples (the dataset may hold more: whole epochs)
  int64_t seq_length = 1024;
  uint64_t seed = 1234;
  std::string cache_dir;  // empty: next to the data files
  enum class CacheMode {
    kBuild,     // load the cached indices when valid, otherwise build and save them
    kWaitOnly,  // only wait (up to wait_timeout_s) for another process to write them
    kNoCache,   // build in memory, never touch the disk
  };
  CacheMode cache_mode = CacheMode::kBuild;
  double wait_timeout_s = 600;
};

class GPTDataset : public TokenDataset {
 public:
  // Documents [doc_begin, doc_end) of `data` (a document is one sequence of the .idx, as
  // Megatron's preprocess writes them). Throws DataError when the range holds fewer tokens
  // than one sample, when the cache is unusable, or when waiting times out.
  GPTDataset(std::shared_ptr<const IndexedDataset> data, size_t doc_begin, size_t doc_end,
             const GptDatasetOptions& options);

  size_t size() const override { return shuffle_idx_.size(); }
  size_t sample_length() const override { return static_cast<size_t>(options_.seq_length) + 1; }
  void get(size_t i, int64_t* out) const override;
  using TokenDataset::get;

  // The cache files: PREFIX_{name}_indexmap_{N}ns_{L}sl_{S}s_{doc,sample,shuffle}_idx.npy.
  std::string cache_file(const std::string& which) const;
  bool loaded_from_cache() const { return loaded_from_cache_; }
  int64_t num_epochs() const { return num_epochs_; }
  const NpyArray& doc_idx() const { return doc_idx_; }
  const NpyArray& sample_idx() const { return sample_idx_; }
  const NpyArray& shuffle_idx() const { return shuffle_idx_; }

 private:
  void build();
  bool try_load(std::string* why);
  std::shared_ptr<const IndexedDataset> data_;
  size_t doc_begin_, doc_end_;
  GptDatasetOptions options_;
  int64_t tokens_per_epoch_ = 0;
  int64_t num_epochs_ = 0;
  int64_t total_samples_ = 0;  // rows of sample_idx - 1
  bool loaded_from_cache_ = false;
  NpyArray doc_idx_, sample_idx_, shuffle_idx_;
};

// Weights normalized to sum 1; throws DataError for empty, negative, NaN or all-zero weights.
std::vector<double> normalize_weights(const std::vector<double>& weights);
// Megatron: samples to draw from each dataset of a blend, ceil(w * num_samples * 1.005).
std::vector<int64_t> blend_samples_per_dataset(const std::vector<double>& normalized_weights, int64_t num_samples);
// helpers.cpp build_blending_indices: at sample i pick the dataset with the largest
// w * max(i, 1) - count (first on ties). Returns (dataset index, sample within it) per sample.
void build_blending_indices(const std::vector<double>& normalized_weights, int64_t size,
                            std::vector<int16_t>* dataset_index, std::vector<int64_t>* dataset_sample_index);

class BlendedDataset : public TokenDataset {
 public:
  BlendedDataset(std::vector<std::shared_ptr<const TokenDataset>> datasets, const std::vector<double>& weights,
                 int64_t size);
  size_t size() const override { return dataset_index_.size(); }
  size_t sample_length() const override { return datasets_[0]->sample_length(); }
  void get(size_t i, int64_t* out) const override;
  using TokenDataset::get;
  int16_t dataset_of(size_t i) const { return dataset_index_.at(i); }

 private:
  std::vector<std::shared_ptr<const TokenDataset>> datasets_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

// "--data_path": either one prefix, or "w1 p1 w2 p2 ..." (whitespace separated).
struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;  // normalized; {1} for a single prefix
};
DataBlend parse_data_path(const std::string& data_path);

// Megatron's build_train_valid_test_datasets: per prefix, split the documents, build the
// three GPT datasets (each blended dataset draws ceil(w*N*1.005) samples per prefix), blend.
// num_samples = {train, valid, test}; a split with no documents or 0 requested samples
// yields nullptr.
struct TrainValidTest {
  std::shared_ptr<const TokenDataset> train, valid, test;
};
TrainValidTest build_train_valid_test_datasets(const std::string& data_path, const std::string& split,
                                               const std::array<int64_t, 3>& num_samples,
                                               const GptDatasetOptions& base_options);

}  // namespace dtk::data
