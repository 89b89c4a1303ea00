// dtk::data — Megatron-LM's GPT dataset: train/valid/test split of the documents, the
// document / sample / shuffle indices (megatron/core/datasets/gpt_dataset.py + helpers.cpp),
// their on-disk caches in Megatron's names and formats, and the weighted BlendedDataset with
// Megatron's greedy blending and its cache.
//
// Two Megatrons, chosen by MegatronOrder: Megatron-core's GPTDataset/BlendedDataset (today's
// Megatron-LM, megatron/core/datasets, add_extra_token_to_sequence on) and the legacy
// megatron/data/gpt_dataset.py + blendable_dataset.py DeepSpeed-Domino ships. Their document,
// sample and shuffle indices are the same for the same documents, seq_length, num_samples and
// seed (numpy's legacy RandomState(seed).shuffle, NumpyRandomState below, drawn in Megatron's
// order: the document index, its epochs then a separate last epoch, then the shuffle index);
// they differ in the split's rounding, the blend's sizes, the blend index's dtype and the cache
// files' names, descriptions and places, each of which follows the order chosen.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dtk/data/indexed_dataset.hpp"
#include "dtk/data/megatron_cache.hpp"
#include "dtk/data/npy.hpp"

namespace dtk::data {

enum class MegatronOrder {
  kCore,    // Megatron-core (megatron/core/datasets), today's Megatron-LM: "megatron_core"
  kLegacy,  // megatron/data/gpt_dataset.py (DeepSpeed-Domino, Megatron-LM before core): "megatron_legacy"
};
// "megatron_core" | "megatron_legacy"; anything else throws DataError naming it.
MegatronOrder parse_order(const std::string& name);
const char* order_name(MegatronOrder order);

// Legacy Megatron's get_train_valid_test_split_: "969,30,1" (or "a/b/c", or "1") normalized to the
// document boundaries [0, b1, b2, size]. Throws DataError for unparsable/negative/zero weights.
std::array<size_t, 4> split_boundaries(const std::string& split, size_t num_documents);
// Megatron-core's: the split's numbers (re.findall("[.0-9]+")) normalized with numpy, their
// running sums the book-ends b_k, and split k the documents [round(b_k * n), round(b_k+1 * n)).
// Contiguous boundaries: a split Megatron-core leaves out (weight 0) is empty.
std::array<size_t, 4> split_boundaries(const std::string& split, size_t num_documents, MegatronOrder order);
// Megatron-core's split_matrix as its description holds it ([[0, 0.969], [0.969, 0.999], ...]).
PyJson core_split_matrix(const std::string& split);
// os.path.dirname / basename / join, as Megatron composes its cache paths.
std::string python_dirname(const std::string& path);
std::string python_basename(const std::string& path);
std::string python_join(const std::string& a, const std::string& b);

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

// extra_token below is Megatron-core's add_extra_token_to_sequence: 1 (Megatron-LM's setting,
// and legacy Megatron's only one) draws samples of seq_length + 1 tokens, consecutive samples
// sharing one; 0 draws samples of exactly seq_length tokens.
//
// Megatron's _num_epochs: smallest E with E * tokens_per_epoch >= samples * seq_length + extra_token.
int64_t num_epochs(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples, int64_t extra_token = 1);
// Whether the last epoch is shuffled separately (it supplies < 80% of an epoch's samples).
bool separate_last_epoch(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples, int64_t num_epochs,
                         int64_t extra_token = 1);
// The samples a sample index over `tokens` tokens holds (helpers.cpp): (tokens - extra_token) /
// seq_length, or with drop_last false (Megatron-core's drop_last_partial_validation_sequence=False,
// the valid split only) ceil(float(tokens - extra_token) / seq_length) in 32-bit float arithmetic,
// as helpers.cpp computes it: the last sample may be partial (padded when read).
int64_t sample_index_samples(int64_t tokens, int64_t seq_length, int64_t extra_token, bool drop_last);
// _build_doc_idx: documents repeated num_epochs times and shuffled (all epochs together, or
// the first E-1 together and the last one separately).
std::vector<int32_t> build_doc_idx(const std::vector<int32_t>& documents, int64_t num_epochs, NumpyRandomState* rng,
                                   bool separate_last_epoch);
// helpers.cpp build_sample_idx: rows of (position in doc_idx, token offset), flattened,
// (num_samples + 1) rows, num_samples = sample_index_samples(num_epochs * tokens_per_epoch, ...).
std::vector<int64_t> build_sample_idx(const std::vector<int32_t>& sizes, const std::vector<int32_t>& doc_idx,
                                      int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                      int64_t extra_token = 1, bool drop_last = true);
// _build_shuffle_idx: [0, num_samples) shuffled, then [num_samples, total_size) shuffled.
std::vector<int64_t> build_shuffle_idx(int64_t num_samples, int64_t total_size, NumpyRandomState* rng);

// Megatron's _PAD_TOKEN_ID: what a sample shorter than sample_length() is padded with (the last,
// partial validation sample with drop_last_partial_validation off). Never a token id.
constexpr int64_t kPadTokenId = -1;

// A source of fixed-length token samples (what a dataset plugin hands out).
class TokenDataset {
 public:
  virtual ~TokenDataset() = default;
  virtual size_t size() const = 0;
  // Every sample has sample_length() = seq_length + extra_token tokens (seq_length + 1 unless
  // add_extra_token is off); padded with kPadTokenId where the data ends first.
  virtual size_t sample_length() const = 0;
  // Writes sample i (i < size()) to out[0 .. sample_length()). Throws DataError.
  virtual void get(size_t i, int64_t* out) const = 0;
  std::vector<int64_t> get(size_t i) const {
    std::vector<int64_t> v(sample_length());
    get(i, v.data());
    return v;
  }
};

// Megatron-core GPTDataset.__getitem__'s tokens and labels for a sample get() wrote (seq_length +
// 1 or, without the extra token, seq_length ids), in the form the causal_lm step reads: `text`
// of seq_length + 1 ids whose first seq_length are the tokens and last seq_length the labels
// (with the extra token: the sample; without: the sample and a padding label), padding written
// as 0 as Megatron writes it; `loss_mask` seq_length values, 0 where the label is padding.
void megatron_step_inputs(const int64_t* sample, size_t sample_length, int64_t seq_length, std::vector<int64_t>* text,
                          std::vector<float>* loss_mask);

struct GptDatasetOptions {
  MegatronOrder order = MegatronOrder::kCore;
  std::string name = "train";  // split name, part of the cache file names
  // The split string as the user gave it (Megatron's --split, default "969, 30, 1"): part of the
  // cache descriptions Megatron names its files by, so it is kept verbatim. Megatron-core with
  // per-split data paths has none: "" ("split": null, "split_matrix": null).
  std::string split = "969, 30, 1";
  // Megatron-core only: the "tokenizer" entry of the description (the tokenizer's
  // unique_identifiers), as JSON; "null" when unknown. It names the files DTK writes (Megatron
  // finds them when it is the same); DTK reads Megatron's caches whatever theirs holds.
  std::string tokenizer_json = "null";
  int64_t num_samples = 0;  // requested samples (the dataset may hold more: whole epochs)
  // Megatron-core's num_samples=None (a blend whose weights come from the datasets' sizes): one
  // epoch exactly, "num_samples": null in the description; num_samples is ignored.
  bool whole_epoch = false;
  // Megatron-core's add_extra_token_to_sequence (default on, as Megatron-LM runs it): samples of
  // seq_length + 1 tokens; off: seq_length tokens (the step's last label is then padding).
  bool add_extra_token = true;
  // Megatron-core's drop_last_partial_validation_sequence (default on): off, the "valid" split
  // keeps its last partial sample, padded with kPadTokenId. Other splits always drop it.
  bool drop_last_partial_validation = true;
  int64_t seq_length = 1024;
  uint64_t seed = 1234;
  // Megatron's --data-cache-path. Empty: Megatron's default place, PREFIX/cache/GPTDataset_indices
  // (core) or DIR_OF_PREFIX/index-cache (legacy).
  std::string cache_dir;
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
  size_t sample_length() const override { return static_cast<size_t>(options_.seq_length + extra_); }
  void get(size_t i, int64_t* out) const override;
  using TokenDataset::get;

  // The cache files DTK reads first and writes: which = "description", "doc_idx", "sample_idx"
  // or "shuffle_idx". Core: DIR/<md5>-GPTDataset-<name>-{description.txt,document_index.npy,
  // sample_index.npy,shuffle_index.npy}; legacy: DIR/<md5>{.dsc,_doc_idx.npy,_sample_idx.npy,
  // _shuffle_idx.npy}, the md5 of the description text Megatron builds.
  std::string cache_file(const std::string& which) const;
  bool loaded_from_cache() const { return loaded_from_cache_; }
  // The description file the indices were read from ("" when built).
  const std::string& loaded_from() const { return loaded_from_; }
  // Megatron's description of this dataset (its md5 names the files) and, for Megatron-core,
  // its unique_identifiers (what a BlendedDataset's description embeds).
  const std::string& description() const { return description_; }
  const PyJson& unique_identifiers() const { return identifiers_; }
  int64_t num_epochs() const { return num_epochs_; }
  const NpyArray& doc_idx() const { return doc_idx_; }
  const NpyArray& sample_idx() const { return sample_idx_; }
  const NpyArray& shuffle_idx() const { return shuffle_idx_; }

 private:
  void build();
  bool try_load(std::string* why);
  bool load_files(const std::string& doc, const std::string& sample, const std::string& shuffle, std::string* why);
  bool scan_core_descriptions(std::string* why);
  void write_cache();
  std::string cache_file_in(const std::string& dir, const std::string& which) const;
  std::shared_ptr<const IndexedDataset> data_;
  size_t doc_begin_, doc_end_;
  GptDatasetOptions options_;
  int64_t tokens_per_epoch_ = 0;
  int64_t extra_ = 1;      // add_extra_token
  bool drop_last_ = true;  // false: the valid split keeps its partial last sample
  int64_t num_epochs_ = 0;
  int64_t total_samples_ = 0;  // rows of sample_idx - 1
  bool loaded_from_cache_ = false;
  std::string loaded_from_;
  std::string description_, hash_;
  PyJson identifiers_;
  std::vector<std::string> cache_dirs_;  // where to look, in order; the last one is written
  NpyArray doc_idx_, sample_idx_, shuffle_idx_;
};

// Weights normalized to sum 1; throws DataError for empty, negative, NaN or all-zero weights.
// (Megatron-core's normalize: numpy's sum; legacy's: Python's sum from the left.)
std::vector<double> normalize_weights(const std::vector<double>& weights, MegatronOrder order = MegatronOrder::kCore);
// The samples a blend of num_samples draws from each dataset (what each GPT dataset is built
// for), and the blend's own size. Core: ceil(ceil(w * N) * 1.005) per dataset, the blend
// sum(ceil(w * N)); legacy: ceil(w * N * 1.005) per dataset, the blend their sum.
std::vector<int64_t> blend_samples_per_dataset(const std::vector<double>& normalized_weights, int64_t num_samples,
                                               MegatronOrder order = MegatronOrder::kCore);
int64_t blend_size(const std::vector<double>& normalized_weights, int64_t num_samples, MegatronOrder order);
// helpers.cpp build_blending_indices: at sample i pick the dataset with the largest
// w * max(i, 1) - count (first on ties). Returns (dataset index, sample within it) per sample.
void build_blending_indices(const std::vector<double>& normalized_weights, int64_t size,
                            std::vector<int16_t>* dataset_index, std::vector<int64_t>* dataset_sample_index);
// helpers.cpp build_exhaustive_blending_indices: every sample of every dataset once, sum(sizes)
// long. At sample i pick, among the datasets with samples left, the largest
// (size / total) * max(i, 1) - count (first on ties).
void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>* dataset_index,
                                       std::vector<int64_t>* dataset_sample_index);

// Where and how a BlendedDataset caches its indices (Megatron caches them only under a
// --data-cache-path: cache_dir empty = no cache).
struct BlendCacheOptions {
  MegatronOrder order = MegatronOrder::kCore;
  std::string name = "train";
  std::string cache_dir;
  bool write = true;  // false: only compare with / read what is there (ranks other than 0)
  // Megatron-core's blend of unweighted prefixes: the weights given are the datasets' sizes,
  // normalized once (a weighted blend's are normalized twice).
  bool weights_from_sizes = false;
};

class BlendedDataset : public TokenDataset {
 public:
  // The size of a blend that reads every sample of its datasets once (Megatron-core's size None:
  // a blend without weights read whole under --full-validation). Needs weights_from_sizes.
  static constexpr int64_t kExhaustive = -1;
  // `weights` are normalized here again, as Megatron's BlendedDataset/BlendableDataset do
  // (kExhaustive: not at all; they are the datasets' sizes, whole numbers).
  BlendedDataset(std::vector<std::shared_ptr<const TokenDataset>> datasets, const std::vector<double>& weights,
                 int64_t size, const BlendCacheOptions& cache = BlendCacheOptions());
  size_t size() const override { return dataset_index_.size(); }
  size_t sample_length() const override { return datasets_[0]->sample_length(); }
  void get(size_t i, int64_t* out) const override;
  using TokenDataset::get;
  int16_t dataset_of(size_t i) const { return dataset_index_.at(i); }
  int64_t sample_of(size_t i) const { return dataset_sample_index_.at(i); }
  const std::shared_ptr<const TokenDataset>& part(size_t k) const { return datasets_.at(k); }
  size_t num_parts() const { return datasets_.size(); }
  // The cache files ("description", "dataset_index", "dataset_sample_index"), "" without a
  // cache_dir or when the datasets are not GPTDatasets. Core: DIR/<md5>-BlendedDataset-<name>-
  // {description.txt,dataset_index.npy,dataset_sample_index.npy}; legacy: DIR/<md5>{.dsc,
  // _index.npy,_sample_index.npy}.
  std::string cache_file(const std::string& which) const;
  bool loaded_from_cache() const { return loaded_from_cache_; }
  // The description file of the cache that held these indices ("" when built and written).
  const std::string& loaded_from() const { return loaded_from_; }
  const std::string& description() const { return description_; }

 private:
  std::vector<std::shared_ptr<const TokenDataset>> datasets_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
  BlendCacheOptions cache_;
  std::string description_, hash_, loaded_from_;
  bool loaded_from_cache_ = false;
};

// "--data_path" as Megatron's get_blend_from_list reads it: "w1 p1 w2 p2 ..." (an even count of
// words whose odd ones are all numbers), or prefixes without weights "p1 p2 ..." (one prefix, an
// odd count, or pairs whose first words are not numbers). Whitespace separated.
struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;  // as given; all 1 when not weighted
  bool weighted = false;        // given as weight/prefix pairs (a blend, even of one prefix, as in Megatron)
};
DataBlend parse_data_path(const std::string& data_path);

// Megatron's build_train_valid_test_datasets: per prefix, split the documents, build the
// three GPT datasets (a blend's datasets for blend_samples_per_dataset samples each), blend.
// num_samples = {train, valid, test}; a split with no documents or 0 requested samples
// yields nullptr; kWholeSplit asks for the split whole (Megatron's num_samples None under
// --full-validation): one epoch of a single prefix, every sample once; a blend without weights
// reads one epoch of each prefix, every sample once (Megatron-core's exhaustive blending). A
// weighted blend has no whole split (Megatron: "Using client-specified weights requires
// client-specified size"). base_options.order
// chooses the Megatron; base_options.split is the split.
constexpr int64_t kWholeSplit = -1;
struct TrainValidTest {
  std::shared_ptr<const TokenDataset> train, valid, test;
};
TrainValidTest build_train_valid_test_datasets(const std::string& data_path, const std::array<int64_t, 3>& num_samples,
                                               const GptDatasetOptions& base_options);
// Several prefixes without weights (Megatron-core only; legacy Megatron refuses them): each
// prefix's split is one whole epoch (num_samples null), and the blend draws min(N, their samples
// together) samples with the datasets' sizes as weights, or, read whole, each of them once.
//
// Megatron's per-split data paths (--train-data-path, --valid-data-path, --test-data-path): split
// k comes from data_paths[k] ("" = none), each prefix's documents all of it. Megatron-core: no
// split in the descriptions ("split": null), a single prefix a plain dataset even with a weight;
// legacy: the split string still in them. Otherwise as above.
TrainValidTest build_per_split_datasets(const std::array<std::string, 3>& data_paths,
                                        const std::array<int64_t, 3>& num_samples, const GptDatasetOptions& base_options);

}  // namespace dtk::data
