#include "dtk/data/gpt_dataset.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include "dtk/data/error.hpp"
#include "dtk/data/megatron_cache.hpp"

namespace dtk::data {

// ------------------------------------------------------------------ split

std::array<size_t, 4> split_boundaries(const std::string& split, size_t size) {
  std::vector<double> w;
  const char sep = split.find(',') != std::string::npos ? ',' : (split.find('/') != std::string::npos ? '/' : '\0');
  size_t pos = 0;
  while (true) {
    const size_t end = sep ? split.find(sep, pos) : std::string::npos;
    std::string item = split.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (...) {
      used = 0;
    }
    if (item.empty() || used != item.size() || !std::isfinite(v) || v < 0) {
      throw DataError("invalid split '" + split + "': '" + item +
                      "' is not a non-negative number (expected e.g. \"969,30,1\")");
    }
    w.push_back(v);
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  while (w.size() < 3) w.push_back(0.0);
  w.resize(3);
  const double sum = w[0] + w[1] + w[2];
  if (!(sum > 0)) throw DataError("invalid split '" + split + "': the weights sum to 0");
  if (!std::isfinite(sum)) throw DataError("invalid split '" + split + "': the weights' sum overflows a double");
  // Megatron: index[i+1] = index[i] + int(round(w_i / sum * size)), then shift so the last is size.
  std::array<int64_t, 4> idx{0, 0, 0, 0};
  for (int k = 0; k < 3; ++k) {
    idx[k + 1] = idx[k] + static_cast<int64_t>(std::nearbyint(w[k] / sum * static_cast<double>(size)));
  }
  const int64_t diff = idx[3] - static_cast<int64_t>(size);
  std::array<size_t, 4> out{0, 0, 0, 0};
  for (int k = 1; k < 4; ++k) {
    const int64_t v = idx[k] - diff;
    out[k] = static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(v, static_cast<int64_t>(size))));
  }
  out[1] = std::min(out[1], out[2]);
  return out;
}

MegatronOrder parse_order(const std::string& name) {
  if (name == "megatron_core") return MegatronOrder::kCore;
  if (name == "megatron_legacy") return MegatronOrder::kLegacy;
  throw DataError("unknown dataset order '" + name + "': expected megatron_core or megatron_legacy");
}

const char* order_name(MegatronOrder order) {
  return order == MegatronOrder::kCore ? "megatron_core" : "megatron_legacy";
}

namespace {

// blended_megatron_dataset_config.py: parse_and_normalize_split, then the running sums
// (book-ends) of convert_split_vector_to_split_matrix; the first book-end is Python's int 0.
std::array<double, 4> core_bookends(const std::string& split) {
  // Megatron's regex ([.0-9]+) reads "-1,2,0" as 1, 2, 0 and "nan,1,1" as 1, 1: a sign or a letter
  // is refused here instead of read past.
  for (const char c : split)
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '-' || c == '+')
      throw DataError("invalid split '" + split + "': '" + std::string(1, c) +
                      "' in it (the weights are non-negative numbers, e.g. \"969, 30, 1\")");
  // Megatron's regex reads "1,,1" as 1, 1 (train 1, valid 1, test 0), where "train 1, valid 0,
  // test 1" was meant: a field left empty is refused too.
  size_t field_start = 0;
  for (size_t k = 0; k <= split.size(); ++k) {
    if (k < split.size() && split[k] != ',' && split[k] != '/') continue;
    if (split.find_first_not_of(' ', field_start) >= k)
      throw DataError("invalid split '" + split +
                      "': a field is empty (give each weight, 0 included, e.g. \"1, 0, 1\")");
    field_start = k + 1;
  }
  std::vector<double> v;
  size_t i = 0;
  while (i < split.size()) {
    if (!(std::isdigit(static_cast<unsigned char>(split[i])) || split[i] == '.')) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < split.size() && (std::isdigit(static_cast<unsigned char>(split[j])) || split[j] == '.')) ++j;
    const std::string item = split.substr(i, j - i);
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used != item.size() || !std::isfinite(x)) {
      throw DataError("invalid split '" + split + "': '" + item + "' is not a number (expected e.g. \"969, 30, 1\")");
    }
    v.push_back(x);
    i = j;
  }
  if (v.size() > 3 || v.empty()) {
    throw DataError("invalid split '" + split + "': expected 1 to 3 numbers (train, valid, test), e.g. \"969, 30, 1\"");
  }
  while (v.size() < 3) v.push_back(0.0);
  const double sum = numpy_sum(v);
  if (!(sum > 0)) throw DataError("invalid split '" + split + "': the weights sum to 0");
  if (!std::isfinite(sum)) throw DataError("invalid split '" + split + "': the weights' sum overflows a double");
  const std::vector<double> w = numpy_normalize(v);
  return {0.0, w[0], w[0] + w[1], (w[0] + w[1]) + w[2]};
}

}  // namespace

PyJson core_split_matrix(const std::string& split) {
  const auto b = core_bookends(split);
  PyJson m = PyJson::array();
  for (size_t k = 0; k < 3; ++k) {
    if (b[k + 1] <= b[k]) {
      m.items.push_back(PyJson::null());
      continue;
    }
    m.items.push_back(PyJson::array({k == 0 ? PyJson::integer(0) : PyJson::real(b[k]), PyJson::real(b[k + 1])}));
  }
  return m;
}

std::array<size_t, 4> split_boundaries(const std::string& split, size_t size, MegatronOrder order) {
  if (order == MegatronOrder::kLegacy) return split_boundaries(split, size);
  const auto b = core_bookends(split);
  std::array<size_t, 4> out{0, 0, 0, 0};
  size_t prev_end = 0;
  for (size_t k = 0; k < 3; ++k) {
    // None (an empty split) or [round(b_k * n), round(b_k+1 * n)); the out array keeps them
    // contiguous: an empty split is [end of the previous, same).
    if (b[k + 1] <= b[k]) {
      out[k + 1] = std::max(out[k], prev_end);
      continue;
    }
    const auto beg = static_cast<size_t>(std::nearbyint(b[k] * static_cast<double>(size)));
    const auto end = static_cast<size_t>(std::nearbyint(b[k + 1] * static_cast<double>(size)));
    out[k] = std::min(beg, size);
    out[k + 1] = std::min(end, size);
    prev_end = out[k + 1];
  }
  return out;
}

std::string python_dirname(const std::string& p) {
  const size_t i = p.rfind('/') == std::string::npos ? 0 : p.rfind('/') + 1;
  std::string head = p.substr(0, i);
  if (!head.empty() && head.find_first_not_of('/') != std::string::npos) {
    while (!head.empty() && head.back() == '/') head.pop_back();
  }
  return head;
}

std::string python_basename(const std::string& p) {
  const size_t i = p.rfind('/');
  return i == std::string::npos ? p : p.substr(i + 1);
}

std::string python_join(const std::string& a, const std::string& b) {
  if (!b.empty() && b[0] == '/') return b;
  if (a.empty() || a.back() == '/') return a + b;
  return a + "/" + b;
}

// ------------------------------------------------------------------ index construction

NumpyRandomState::NumpyRandomState(uint64_t seed) : gen_(static_cast<uint32_t>(seed)) {
  if (seed > std::numeric_limits<uint32_t>::max())
    throw DataError("seed " + std::to_string(seed) +
                    " is outside [0, 4294967295], the range of numpy's RandomState that Megatron's sample order uses");
}

uint64_t NumpyRandomState::interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  for (int shift = 1; shift <= 32; shift *= 2) mask |= mask >> shift;  // smallest 2^k - 1 >= max
  uint64_t value;
  if (max <= std::numeric_limits<uint32_t>::max()) {
    do value = next32() & mask;
    while (value > max);
  } else {
    do value = next64() & mask;
    while (value > max);
  }
  return value;
}

int64_t num_epochs(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples, int64_t extra_token) {
  const int64_t wanted = num_samples * seq_length + extra_token;
  int64_t epochs = 1, total = tokens_per_epoch;
  while (total < wanted) {
    ++epochs;
    total += tokens_per_epoch;
  }
  return epochs;
}

bool separate_last_epoch(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples, int64_t num_epochs,
                         int64_t extra_token) {
  if (num_epochs <= 1) return false;
  const int64_t before_last = ((num_epochs - 1) * tokens_per_epoch - extra_token) / seq_length;
  const int64_t from_last = num_samples - before_last;
  const int64_t per_epoch = (tokens_per_epoch - extra_token) / seq_length;
  return from_last < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
}

int64_t sample_index_samples(int64_t tokens, int64_t seq_length, int64_t extra_token, bool drop_last) {
  if (drop_last) return (tokens - extra_token) / seq_length;
  // helpers.cpp: ceil(float(num_epochs * tokens_per_epoch - add_extra_token_to_sequence) / seq_length),
  // a 32-bit float divided by the int32 seq_length (converted to float).
  const float q = static_cast<float>(tokens - extra_token) / static_cast<float>(seq_length);
  return static_cast<int64_t>(std::ceil(q));
}

std::vector<int32_t> build_doc_idx(const std::vector<int32_t>& documents, int64_t num_epochs, NumpyRandomState* rng,
                                   bool separate_last_epoch) {
  if (!separate_last_epoch || num_epochs == 1) {
    std::vector<int32_t> idx;
    idx.reserve(documents.size() * static_cast<size_t>(num_epochs));
    for (int64_t e = 0; e < num_epochs; ++e) idx.insert(idx.end(), documents.begin(), documents.end());
    rng->shuffle(idx.data(), idx.size());
    return idx;
  }
  std::vector<int32_t> first = build_doc_idx(documents, num_epochs - 1, rng, false);
  std::vector<int32_t> last = build_doc_idx(documents, 1, rng, false);
  first.insert(first.end(), last.begin(), last.end());
  return first;
}

std::vector<int64_t> build_sample_idx(const std::vector<int32_t>& sizes, const std::vector<int32_t>& doc_idx,
                                      int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                      int64_t extra_token, bool drop_last) {
  const int64_t num_samples = sample_index_samples(num_epochs * tokens_per_epoch, seq_length, extra_token, drop_last);
  std::vector<int64_t> out(2 * static_cast<size_t>(num_samples + 1));
  int64_t row = 0, pos = 0, offset = 0;
  out[0] = 0;
  out[1] = 0;
  ++row;
  const int64_t last_pos = static_cast<int64_t>(doc_idx.size()) - 1;
  while (row <= num_samples) {
    int64_t remaining = seq_length + extra_token;
    while (remaining != 0) {
      const int64_t doc_len = sizes[static_cast<size_t>(doc_idx[static_cast<size_t>(pos)])] - offset;
      remaining -= doc_len;
      if (remaining <= 0) {
        offset += remaining + doc_len - extra_token;
        remaining = 0;
      } else {
        if (pos == last_pos) {  // ran out of documents (only for the very last sample)
          offset = sizes[static_cast<size_t>(doc_idx[static_cast<size_t>(pos)])] - extra_token;
          break;
        }
        ++pos;
        offset = 0;
      }
    }
    out[2 * static_cast<size_t>(row)] = pos;
    out[2 * static_cast<size_t>(row) + 1] = offset;
    ++row;
  }
  return out;
}

std::vector<int64_t> build_shuffle_idx(int64_t num_samples, int64_t total_size, NumpyRandomState* rng) {
  std::vector<int64_t> idx(static_cast<size_t>(total_size));
  for (int64_t i = 0; i < total_size; ++i) idx[static_cast<size_t>(i)] = i;
  rng->shuffle(idx.data(), static_cast<size_t>(num_samples));
  if (total_size > num_samples) {
    rng->shuffle(idx.data() + num_samples, static_cast<size_t>(total_size - num_samples));
  }
  return idx;
}

// ------------------------------------------------------------------ GPTDataset

namespace {

bool is_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read '" + path + "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_file_atomically(const std::string& path, const std::string& text) {
  std::random_device rd;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rd());
  {
    std::ofstream out(tmp, std::ios::binary);
    out << text;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      throw DataError("cannot write '" + path + "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw DataError("cannot write '" + path + "': " + std::strerror(errno));
  }
}

}  // namespace

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, size_t doc_begin, size_t doc_end,
                       const GptDatasetOptions& options)
    : data_(std::move(data)), doc_begin_(doc_begin), doc_end_(doc_end), options_(options) {
  const std::string& prefix = data_->prefix();
  require_token_dtype(*data_);  // Megatron's GPT dataset would read a float one as garbage
  if (options_.seq_length < 1 || options_.seq_length > (1 << 30)) {
    throw DataError("'" + prefix + "': invalid seq_length " + std::to_string(options_.seq_length));
  }
  if (options_.num_samples < 0) {
    throw DataError("'" + prefix + "': invalid number of samples " + std::to_string(options_.num_samples));
  }
  if (doc_begin_ >= doc_end_ || doc_end_ > data_->num_sequences()) {
    throw DataError("'" + prefix + "' " + options_.name + " split: empty or invalid document range [" +
                    std::to_string(doc_begin_) + ", " + std::to_string(doc_end_) + ") of " +
                    std::to_string(data_->num_sequences()) + " documents");
  }
  for (size_t d = doc_begin_; d < doc_end_; ++d) tokens_per_epoch_ += data_->sequence_length(d);
  // Megatron repeats a split shorter than a sample over as many epochs as its samples need
  // (helpers.cpp asserts only tokens_per_epoch > 1); without samples asked for there are none.
  if (options_.order == MegatronOrder::kLegacy) {
    // Megatron-core's options: legacy megatron/data has none of them.
    const char* what = !options_.add_extra_token                ? "add_extra_token=false"
                       : !options_.drop_last_partial_validation ? "drop_last_partial_validation=false"
                       : options_.whole_epoch ? "blend without weights or split read whole (eval.full_validation)"
                                              : nullptr;
    if (what) {
      throw DataError(std::string("dataset order megatron_legacy has no ") + what +
                      " (Megatron-core's GPTDataset option; legacy megatron/data always draws seq_length+1 tokens, "
                      "drops a partial sample and needs blend weights): use order megatron_core");
    }
  }
  extra_ = options_.add_extra_token ? 1 : 0;
  drop_last_ = !(options_.name == "valid" && !options_.drop_last_partial_validation);
  if (options_.whole_epoch) options_.num_samples = 0;
  const int64_t one_epoch = tokens_per_epoch_ < 2 ? 0
                                                   : sample_index_samples(tokens_per_epoch_, options_.seq_length,
                                                                          extra_, drop_last_);
  if (tokens_per_epoch_ < 2 || ((options_.num_samples == 0 || options_.whole_epoch) && one_epoch < 1)) {
    throw DataError("'" + prefix + "' " + options_.name + " split: " + std::to_string(tokens_per_epoch_) +
                    " tokens in documents [" + std::to_string(doc_begin_) + ", " + std::to_string(doc_end_) +
                    "), too small for one sample of seq_length" + (extra_ ? "+1" : "") + " = " +
                    std::to_string(options_.seq_length + extra_) + " tokens");
  }
  num_epochs_ = data::num_epochs(tokens_per_epoch_, options_.seq_length, options_.num_samples, extra_);
  if (static_cast<double>(num_epochs_) * static_cast<double>(doc_end_ - doc_begin_) > 2e9) {
    throw DataError("'" + prefix + "' " + options_.name + " split: " + std::to_string(options_.num_samples) +
                    " samples would need " + std::to_string(num_epochs_) +
                    " epochs over the documents; the document index would exceed 2^31 entries");
  }
  total_samples_ = sample_index_samples(num_epochs_ * tokens_per_epoch_, options_.seq_length, extra_, drop_last_);

  if (options_.order == MegatronOrder::kCore) {
    // megatron_dataset.py: unique_identifiers, json.dumps(indent=4), md5.
    identifiers_ = PyJson::object();
    identifiers_.set("class", PyJson::string("GPTDataset"));
    identifiers_.set("dataset_path", PyJson::string(prefix));
    identifiers_.set("num_samples", options_.whole_epoch ? PyJson::null() : PyJson::integer(options_.num_samples));
    identifiers_.set("index_split", PyJson::string(options_.name));
    identifiers_.set("random_seed", PyJson::integer(static_cast<int64_t>(options_.seed)));
    identifiers_.set("sequence_length", PyJson::integer(options_.seq_length));
    // Per-split data paths: Megatron-core's config has no split (None) and so no split_matrix.
    identifiers_.set("split", options_.split.empty() ? PyJson::null() : PyJson::string(options_.split));
    identifiers_.set("split_matrix", options_.split.empty() ? PyJson::null() : core_split_matrix(options_.split));
    identifiers_.set("tokenizer", parse_json(options_.tokenizer_json, "megatron_tokenizer (the tokenizer's description)"));
    description_ = dumps_indent4(identifiers_);
    hash_ = md5_hex(description_);
    cache_dirs_ = {options_.cache_dir.empty() ? prefix + "/cache/GPTDataset_indices" : options_.cache_dir};
  } else {
    // gpt_dataset.py _build_index_mappings: the description text, md5; looked for in
    // DIR_OF_PREFIX/index-cache, then in --data-cache-path, written to the last.
    description_ = "GPT Dataset\n\nData prefix " + prefix + "\nDataset name " + options_.name + "\nNumber of samples " +
                   std::to_string(options_.num_samples) + "\nSequence length " + std::to_string(options_.seq_length) +
                   "\nRandom seed " + std::to_string(options_.seed) + "\nSplit " + options_.split + "\n";
    hash_ = md5_hex(description_);
    cache_dirs_ = {python_join(python_dirname(prefix), "index-cache")};
    if (!options_.cache_dir.empty()) cache_dirs_.push_back(options_.cache_dir);
  }

  using Mode = GptDatasetOptions::CacheMode;
  if (options_.cache_mode == Mode::kNoCache) {
    build();
    return;
  }
  std::string why;
  if (try_load(&why)) return;
  if (options_.cache_mode == Mode::kBuild) {
    build();
    write_cache();
    return;
  }
  // kWaitOnly: another process (rank 0) builds them.
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (try_load(&why)) return;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > options_.wait_timeout_s) {
      throw DataError("timed out after " + std::to_string(static_cast<int>(waited)) +
                      " s waiting for the index cache '" + cache_file("doc_idx") + "' (" + why + ")");
    }
  }
}

std::string GPTDataset::cache_file(const std::string& which) const {
  return cache_file_in(cache_dirs_.back(), which);
}

std::string GPTDataset::cache_file_in(const std::string& dir, const std::string& which) const {
  if (options_.order == MegatronOrder::kCore) {
    const std::string base = python_join(dir, hash_ + "-GPTDataset-" + options_.name + "-");
    if (which == "description") return base + "description.txt";
    if (which == "doc_idx") return base + "document_index.npy";
    if (which == "sample_idx") return base + "sample_index.npy";
    if (which == "shuffle_idx") return base + "shuffle_index.npy";
  } else {
    const std::string base = python_join(dir, hash_);
    if (which == "description") return base + ".dsc";
    if (which == "doc_idx" || which == "sample_idx" || which == "shuffle_idx") return base + "_" + which + ".npy";
  }
  throw DataError("unknown index cache file '" + which + "'");
}

void GPTDataset::write_cache() {
  const std::string& dir = cache_dirs_.back();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // as Megatron's os.makedirs(path, exist_ok=True)
  if (ec) throw DataError("cannot create the index cache directory '" + dir + "': " + ec.message());
  doc_idx_.save(cache_file("doc_idx"));
  sample_idx_.save(cache_file("sample_idx"));
  shuffle_idx_.save(cache_file("shuffle_idx"));
  write_file_atomically(cache_file("description"), description_);  // last: the set is complete
}

void GPTDataset::build() {
  std::vector<int32_t> documents;
  documents.reserve(doc_end_ - doc_begin_);
  for (size_t d = doc_begin_; d < doc_end_; ++d) documents.push_back(static_cast<int32_t>(d));
  const bool separate =
      separate_last_epoch(tokens_per_epoch_, options_.seq_length, options_.num_samples, num_epochs_, extra_);
  NumpyRandomState rng(options_.seed);
  std::vector<int32_t> doc_idx = build_doc_idx(documents, num_epochs_, &rng, separate);
  const std::vector<int32_t> sizes = data_->sequence_lengths();
  std::vector<int64_t> sample_idx =
      build_sample_idx(sizes, doc_idx, options_.seq_length, num_epochs_, tokens_per_epoch_, extra_, drop_last_);
  const int64_t first_part =
      separate ? ((num_epochs_ - 1) * tokens_per_epoch_ - extra_) / options_.seq_length : total_samples_;
  std::vector<int64_t> shuffle_idx = build_shuffle_idx(first_part, total_samples_, &rng);

  // Megatron's dtypes: the document index int32; the sample index int32 (legacy always; core
  // while the document index's length and the longest document fit), else int64; the shuffle
  // index uint32 below 2^32 - 2 samples, else int64.
  int64_t max_size = 0;
  for (int32_t v : sizes) max_size = std::max<int64_t>(max_size, v);
  const bool sample_i4 = options_.order == MegatronOrder::kLegacy ||
                         std::max<int64_t>(static_cast<int64_t>(doc_idx.size()), max_size) <=
                             std::numeric_limits<int32_t>::max();
  const size_t ndoc = doc_idx.size();
  doc_idx_ = NpyArray::from_int32(std::move(doc_idx), {ndoc});
  sample_idx_ = NpyArray::from_int64(sample_idx, {static_cast<size_t>(total_samples_ + 1), 2}, sample_i4 ? "<i4" : "<i8");
  shuffle_idx_ = NpyArray::from_int64(
      shuffle_idx, {static_cast<size_t>(total_samples_)},
      total_samples_ < static_cast<int64_t>(std::numeric_limits<uint32_t>::max()) - 1 ? "<u4" : "<i8");
  loaded_from_cache_ = false;
  loaded_from_.clear();
}

bool GPTDataset::try_load(std::string* why) {
  *why = "no index cache '" + cache_file("description") + "' yet";
  for (const std::string& dir : cache_dirs_) {
    const std::string fdsc = cache_file_in(dir, "description"), fd = cache_file_in(dir, "doc_idx"),
                      fs = cache_file_in(dir, "sample_idx"), fh = cache_file_in(dir, "shuffle_idx");
    if (!is_file(fdsc) || !is_file(fd) || !is_file(fs) || !is_file(fh)) continue;
    if (read_file(fdsc) != description_) {  // an md5 collision, or a file written over
      *why = "'" + fdsc + "' does not hold this dataset's description";
      continue;
    }
    if (load_files(fd, fs, fh, why)) {
      loaded_from_ = fdsc;
      return true;
    }
  }
  if (options_.order == MegatronOrder::kLegacy) {
    // Megatron-LM before mid-2023 named them after the prefix, next to the data.
    const std::string old = data_->prefix() + "_" + options_.name + "_indexmap_" +
                            std::to_string(options_.num_samples) + "ns_" + std::to_string(options_.seq_length) + "sl_" +
                            std::to_string(options_.seed) + "s_";
    if (is_file(old + "doc_idx.npy") && is_file(old + "sample_idx.npy") && is_file(old + "shuffle_idx.npy")) {
      std::string w;
      if (load_files(old + "doc_idx.npy", old + "sample_idx.npy", old + "shuffle_idx.npy", &w)) {
        loaded_from_ = old + "doc_idx.npy";
        return true;
      }
    }
    return false;
  }
  return scan_core_descriptions(why);
}

// A Megatron-core cache folder holds descriptions whose md5 DTK cannot always recompute (the
// tokenizer's identifiers are Megatron's objects): read each <md5>-GPTDataset-<name>-
// description.txt and take the one that describes this dataset in everything the indices
// depend on (path or file name, split, its documents, samples, seq_length, seed).
bool GPTDataset::scan_core_descriptions(std::string* why) {
  const std::string& dir = cache_dirs_.back();
  const std::string tail = "-GPTDataset-" + options_.name + "-description.txt";
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  if (ec) return false;
  std::vector<std::string> found;
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    if (name.size() == 32 + tail.size() && name.compare(32, std::string::npos, tail) == 0) found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  for (const std::string& name : found) {
    const std::string path = python_join(dir, name);
    try {
      const PyJson d = parse_json(read_file(path), path);
      auto str = [&](const char* k) {
        const PyJson* v = d.find(k);
        return v && v->kind == PyJson::Kind::kString ? v->s : std::string("\x01");
      };
      auto num = [&](const char* k) {
        const PyJson* v = d.find(k);
        return v && v->kind == PyJson::Kind::kInt ? v->i : std::numeric_limits<int64_t>::min();
      };
      const PyJson* ns = d.find("num_samples");
      const bool samples_match = options_.whole_epoch ? ns && ns->kind == PyJson::Kind::kNull
                                                      : num("num_samples") == options_.num_samples;
      if (str("class") != "GPTDataset" || str("index_split") != options_.name || !samples_match ||
          num("sequence_length") != options_.seq_length ||
          num("random_seed") != static_cast<int64_t>(options_.seed)) {
        continue;
      }
      // Older Megatron-core called the path "path_prefix".
      const std::string their = str("dataset_path") != "\x01" ? str("dataset_path") : str("path_prefix");
      if (their != data_->prefix() && python_basename(their) != python_basename(data_->prefix())) continue;
      const PyJson* split = d.find("split");
      if (!split) continue;
      if (split->kind == PyJson::Kind::kNull) {  // per-split data paths: all the documents
        if (!options_.split.empty() || doc_begin_ != 0 || doc_end_ != data_->num_sequences()) continue;
      } else {
        if (split->kind != PyJson::Kind::kString || options_.split.empty()) continue;
        const auto bounds = split_boundaries(split->s, data_->num_sequences(), MegatronOrder::kCore);
        const int k = options_.name == "train" ? 0 : options_.name == "valid" ? 1 : 2;
        if (bounds[static_cast<size_t>(k)] != doc_begin_ || bounds[static_cast<size_t>(k) + 1] != doc_end_) continue;
      }
      const std::string base = path.substr(0, path.size() - std::string("description.txt").size());
      if (!is_file(base + "document_index.npy") || !is_file(base + "sample_index.npy") ||
          !is_file(base + "shuffle_index.npy")) {
        continue;
      }
      if (load_files(base + "document_index.npy", base + "sample_index.npy", base + "shuffle_index.npy", why)) {
        loaded_from_ = path;
        return true;
      }
    } catch (const DataError& e) {
      *why = e.what();
    }
  }
  return false;
}

// Loads the three indices and checks them against the data: the document index holds this
// split's documents, each num_epochs times; the sample index is the one build_sample_idx makes
// from that document index and these documents' lengths; the shuffle index is a permutation.
// Anything else is not this dataset's cache and is not used.
bool GPTDataset::load_files(const std::string& fd, const std::string& fs, const std::string& fh, std::string* why) {
  try {
    NpyArray d = NpyArray::load(fd), s = NpyArray::load(fs), h = NpyArray::load(fh);
    const size_t ndocs = doc_end_ - doc_begin_;
    const size_t ndoc = static_cast<size_t>(num_epochs_) * ndocs;
    if (d.shape().size() != 1 || d.size() != ndoc) throw DataError("'" + fd + "' has the wrong shape");
    std::vector<int32_t> doc_idx(ndoc);
    std::vector<int64_t> seen(ndocs, 0);
    for (size_t k = 0; k < ndoc; ++k) {
      const int64_t v = d[k];
      if (v < static_cast<int64_t>(doc_begin_) || v >= static_cast<int64_t>(doc_end_)) {
        throw DataError("'" + fd + "' holds document " + std::to_string(v) + " outside this split");
      }
      if (++seen[static_cast<size_t>(v) - doc_begin_] > num_epochs_) {
        throw DataError("'" + fd + "' holds document " + std::to_string(v) + " more than once per epoch");
      }
      doc_idx[k] = static_cast<int32_t>(v);
    }
    const size_t rows = static_cast<size_t>(total_samples_) + 1;
    if (s.shape().size() != 2 || s.shape()[0] != rows || s.shape()[1] != 2) {
      throw DataError("'" + fs + "' has the wrong shape");
    }
    const std::vector<int64_t> want = build_sample_idx(data_->sequence_lengths(), doc_idx, options_.seq_length,
                                                       num_epochs_, tokens_per_epoch_, extra_, drop_last_);
    for (size_t r = 0; r < 2 * rows; ++r) {
      if (s[r] != want[r]) throw DataError("'" + fs + "' row " + std::to_string(r / 2) + " does not fit the data");
    }
    if (h.shape().size() != 1 || h.size() != static_cast<size_t>(total_samples_)) {
      throw DataError("'" + fh + "' has the wrong shape");
    }
    std::vector<bool> hit(h.size(), false);
    for (size_t k = 0; k < h.size(); ++k) {
      const int64_t v = h[k];
      if (v < 0 || v >= total_samples_ || hit[static_cast<size_t>(v)])
        throw DataError("'" + fh + "' is not a permutation of the samples");
      hit[static_cast<size_t>(v)] = true;
    }
    doc_idx_ = std::move(d);
    sample_idx_ = std::move(s);
    shuffle_idx_ = std::move(h);
    loaded_from_cache_ = true;
    return true;
  } catch (const DataError& e) {
    *why = e.what();
    return false;
  }
}

void GPTDataset::get(size_t i, int64_t* out) const {
  if (i >= size()) {
    throw DataError("'" + data_->prefix() + "' " + options_.name + " split: sample " + std::to_string(i) +
                    " out of range (" + std::to_string(size()) + " samples)");
  }
  const size_t idx = static_cast<size_t>(shuffle_idx_[i]);
  const size_t pos_f = static_cast<size_t>(sample_idx_[2 * idx]);
  const size_t pos_l = static_cast<size_t>(sample_idx_[2 * idx + 2]);
  const size_t off_f = static_cast<size_t>(sample_idx_[2 * idx + 1]);
  const size_t off_l = static_cast<size_t>(sample_idx_[2 * idx + 3]);
  const size_t want = sample_length();
  size_t n = 0;
  auto append = [&](size_t pos, size_t offset, size_t length) {
    if (length > want - n) length = want + 1;  // forces the error below without overflowing out
    if (length > want - n) {
      throw DataError("'" + data_->prefix() + "': corrupt sample index at sample " + std::to_string(i));
    }
    const TokenView v = data_->view(static_cast<size_t>(doc_idx_[pos]), offset, length);
    convert_tokens(v, out + n);
    n += v.count;
  };
  const size_t extra = static_cast<size_t>(extra_);
  if (pos_f == pos_l) {
    append(pos_f, off_f, off_l >= off_f ? off_l - off_f + extra : want + 1);
  } else {
    const size_t first_len = static_cast<size_t>(data_->sequence_length(static_cast<size_t>(doc_idx_[pos_f])));
    append(pos_f, off_f, first_len >= off_f ? first_len - off_f : want + 1);
    for (size_t p = pos_f + 1; p < pos_l; ++p) {
      append(p, 0, static_cast<size_t>(data_->sequence_length(static_cast<size_t>(doc_idx_[p]))));
    }
    append(pos_l, 0, off_l + extra);
  }
  // The last sample of an index that keeps its partial sample: padded, as Megatron pads it.
  if (n < want && !drop_last_ && idx + 1 == static_cast<size_t>(total_samples_)) {
    std::fill(out + n, out + want, kPadTokenId);
    n = want;
  }
  if (n != want) {
    throw DataError("'" + data_->prefix() + "': corrupt sample index at sample " + std::to_string(i) + " (" +
                    std::to_string(n) + " tokens instead of " + std::to_string(want) + ")");
  }
}

void megatron_step_inputs(const int64_t* sample, size_t n, int64_t seq_length, std::vector<int64_t>* text,
                          std::vector<float>* loss_mask) {
  const size_t L = static_cast<size_t>(seq_length);
  if (n != L && n != L + 1) {
    throw DataError("a sample of " + std::to_string(n) + " tokens for seq_length " + std::to_string(seq_length) +
                    " (expected seq_length or seq_length + 1)");
  }
  text->assign(L + 1, 0);
  loss_mask->assign(L, 0.0f);
  for (size_t k = 0; k < n; ++k) (*text)[k] = sample[k] == kPadTokenId ? 0 : sample[k];
  // The label of token k is sample[k + 1]; without the extra token the last one is padding.
  for (size_t k = 0; k < L; ++k) (*loss_mask)[k] = k + 1 < n && sample[k + 1] != kPadTokenId ? 1.0f : 0.0f;
}

// ------------------------------------------------------------------ blending

std::vector<double> normalize_weights(const std::vector<double>& weights, MegatronOrder order) {
  if (weights.empty()) throw DataError("blend weights: no datasets given");
  double sum = 0;
  for (double w : weights) {
    if (!std::isfinite(w) || w < 0)
      throw DataError("blend weights: weight " + std::to_string(w) + " is not a non-negative number");
    // (Its dataset would still be built and indexed, for no sample: a split too small for one
    // then stops the run over data it never reads.)
    if (w == 0 && weights.size() > 1)
      throw DataError("blend weights: a weight of 0 asks for no samples from its dataset: drop that entry");
    sum += w;  // legacy dataset_utils: weight_sum = 0.0; weight_sum += weight
  }
  if (!(sum > 0)) throw DataError("blend weights: the weights sum to 0");
  if (!std::isfinite(sum)) throw DataError("blend weights: the weights' sum overflows a double: scale them down");
  if (order == MegatronOrder::kCore) return numpy_normalize(weights);
  std::vector<double> out;
  for (double w : weights) out.push_back(w / sum);
  return out;
}

std::vector<int64_t> blend_samples_per_dataset(const std::vector<double>& w, int64_t n, MegatronOrder order) {
  std::vector<int64_t> out;
  for (double x : w) {
    if (order == MegatronOrder::kCore) {
      // _get_size_per_split_per_dataset: int(math.ceil(math.ceil(N * w) * (1 + surplus)))
      const double target = std::ceil(static_cast<double>(n) * x);
      out.push_back(static_cast<int64_t>(std::ceil(target * (1 + 0.005))));
    } else {
      // get_datasets_weights_and_num_samples: int(math.ceil(N * w * 1.005))
      out.push_back(static_cast<int64_t>(std::ceil(static_cast<double>(n) * x * 1.005)));
    }
  }
  return out;
}

int64_t blend_size(const std::vector<double>& w, int64_t n, MegatronOrder order) {
  int64_t size = 0;
  if (order == MegatronOrder::kLegacy) {
    for (int64_t v : blend_samples_per_dataset(w, n, order)) size += v;  // the sum of what each provides
  } else {
    for (double x : w) size += static_cast<int64_t>(std::ceil(static_cast<double>(n) * x));  // sum of targets
  }
  return size;
}

namespace {

// helpers.cpp's two blends, one loop: at sample i pick, among the datasets still open, the one
// with the largest w * max(i, 1) - count (the first on ties, open ones in ascending order as
// Megatron's std::set iterates). `limits` empty: every dataset stays open (the weighted blend);
// else dataset k closes once limits[k] of its samples are drawn (the exhaustive blend).
void greedy_blend(const std::vector<double>& w, int64_t size, const std::vector<int64_t>& limits,
                  std::vector<int16_t>* dataset_index, std::vector<int64_t>* dataset_sample_index) {
  if (w.size() >= 32767) throw DataError("blend: at most 32766 datasets");
  std::vector<int64_t> count(w.size(), 0);
  std::vector<size_t> open(w.size());
  for (size_t k = 0; k < open.size(); ++k) open[k] = k;
  dataset_index->resize(static_cast<size_t>(size));
  dataset_sample_index->resize(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    const double x = std::max(static_cast<double>(i), 1.0);
    size_t best_at = 0;
    double best_err = std::numeric_limits<double>::lowest();
    for (size_t u = 0; u < open.size(); ++u) {
      const double err = w[open[u]] * x - static_cast<double>(count[open[u]]);
      if (err > best_err) {
        best_err = err;
        best_at = u;
      }
    }
    const size_t best = open[best_at];
    (*dataset_index)[static_cast<size_t>(i)] = static_cast<int16_t>(best);
    (*dataset_sample_index)[static_cast<size_t>(i)] = count[best]++;
    if (!limits.empty() && count[best] == limits[best]) open.erase(open.begin() + static_cast<std::ptrdiff_t>(best_at));
  }
}

}  // namespace

void build_blending_indices(const std::vector<double>& w, int64_t size, std::vector<int16_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index) {
  greedy_blend(w, size, {}, dataset_index, dataset_sample_index);
}

void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>* dataset_index,
                                       std::vector<int64_t>* dataset_sample_index) {
  int64_t total = 0;
  for (int64_t n : sizes) {
    if (n <= 0) throw DataError("blend: a dataset read whole has no samples");
    total += n;
  }
  std::vector<double> w;
  for (int64_t n : sizes) w.push_back(static_cast<double>(n) / static_cast<double>(total));
  greedy_blend(w, total, sizes, dataset_index, dataset_sample_index);
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const TokenDataset>> datasets,
                               const std::vector<double>& weights, int64_t size, const BlendCacheOptions& cache)
    : datasets_(std::move(datasets)), cache_(cache) {
  if (datasets_.empty() || datasets_.size() != weights.size()) {
    throw DataError("blend: " + std::to_string(datasets_.size()) + " datasets but " + std::to_string(weights.size()) +
                    " weights");
  }
  for (const auto& d : datasets_) {
    if (!d) throw DataError("blend: a blended dataset is empty");
    if (d->sample_length() != datasets_[0]->sample_length()) throw DataError("blend: datasets differ in sample length");
  }
  if (cache_.order == MegatronOrder::kLegacy && datasets_.size() >= 255)
    throw DataError("blend: legacy Megatron blends fewer than 255 datasets");
  if (cache_.weights_from_sizes && cache_.order == MegatronOrder::kLegacy)
    throw DataError("blend: legacy Megatron needs blend weights (it has no blend weighted by the datasets' sizes)");
  const bool exhaustive = size == kExhaustive;
  if (exhaustive && !cache_.weights_from_sizes)
    throw DataError("blend: only a blend weighted by its datasets' sizes reads every sample once");
  // Both Megatrons normalize the (already normalized) weights again, with numpy; weights that are
  // the datasets' sizes are normalized once (Megatron-core's BlendedDataset), and not at all when
  // the blend is exhaustive (its description keeps the sizes).
  std::vector<double> w;
  if (exhaustive) {
    std::vector<int64_t> sizes;
    for (size_t k = 0; k < datasets_.size(); ++k) sizes.push_back(static_cast<int64_t>(datasets_[k]->size()));
    build_exhaustive_blending_indices(sizes, &dataset_index_, &dataset_sample_index_);
  } else {
    w = cache_.weights_from_sizes ? (normalize_weights(weights, cache_.order), numpy_normalize(weights))
                                  : numpy_normalize(normalize_weights(weights, cache_.order));
    build_blending_indices(w, size, &dataset_index_, &dataset_sample_index_);
  }
  for (size_t i = 0; i < dataset_index_.size(); ++i) {
    const auto& d = datasets_[static_cast<size_t>(dataset_index_[i])];
    if (static_cast<size_t>(dataset_sample_index_[i]) >= d->size()) {
      throw DataError("blend: dataset " + std::to_string(dataset_index_[i]) + " has only " + std::to_string(d->size()) +
                      " samples, fewer than the blend draws from it");
    }
  }

  // The description Megatron names the cache by (when every part is a GPTDataset).
  std::vector<const GPTDataset*> gpt;
  for (const auto& d : datasets_) {
    const auto* g = dynamic_cast<const GPTDataset*>(d.get());
    if (!g) return;
    gpt.push_back(g);
  }
  if (cache_.order == MegatronOrder::kCore) {
    PyJson o = PyJson::object();
    o.set("class", PyJson::string("BlendedDataset"));
    PyJson ds = PyJson::array();
    for (const auto* g : gpt) ds.items.push_back(g->unique_identifiers());
    o.set("datasets", ds);
    o.set("split", PyJson::string(cache_.name));
    PyJson wj = PyJson::array();
    if (exhaustive) {
      for (size_t k = 0; k < datasets_.size(); ++k)
        wj.items.push_back(PyJson::integer(static_cast<int64_t>(datasets_[k]->size())));
    } else {
      for (double x : w) wj.items.push_back(PyJson::real(x));
    }
    o.set("weights", wj);
    o.set("size", exhaustive ? PyJson::null() : PyJson::integer(size));
    description_ = dumps_indent4(o);
  } else {
    const std::string ws = numpy_float_array_str(w);
    if (ws.empty()) return;  // weights numpy prints in a form DTK does not reproduce: no cache
    description_ = "Blendable dataset\n\nDatasets:\n";
    for (const auto* g : gpt) description_ += g->description() + "\n\n";
    description_ += "Weights: " + ws + "\nSize: " + std::to_string(size) + "\n";
  }
  hash_ = md5_hex(description_);
  if (cache_.cache_dir.empty()) return;

  // Read when present and equal to what was just built (cheap: the blend is built in a single
  // pass); write when absent or different.
  const std::string fdsc = cache_file("description"), fi = cache_file("dataset_index"),
                    fs = cache_file("dataset_sample_index");
  auto same_as_built = [&](const std::string& index, const std::string& sample) {
    try {
      if (!is_file(index) || !is_file(sample)) return false;
      const NpyArray a = NpyArray::load(index), b = NpyArray::load(sample);
      bool same = a.size() == dataset_index_.size() && b.size() == dataset_sample_index_.size();
      for (size_t i = 0; same && i < a.size(); ++i)
        same = a[i] == dataset_index_[i] && b[i] == dataset_sample_index_[i];
      return same;
    } catch (const DataError&) {
      return false;  // unreadable: rewritten below
    }
  };
  if (same_as_built(fi, fs)) {
    loaded_from_cache_ = true;
    loaded_from_ = fdsc;
    return;
  }
  if (cache_.order == MegatronOrder::kCore) {
    // Megatron's own name holds the tokenizer's identifiers DTK may not know: a description in
    // the folder that names these datasets (as the descriptions they were read from say), these
    // weights, this split and size is this blend's.
    PyJson want = parse_json(description_, "the blend's description");
    PyJson& parts = want.members[1].second;
    for (size_t k = 0; k < gpt.size(); ++k) {
      if (gpt[k]->loaded_from().empty()) continue;
      try {
        parts.items[k] = parse_json(read_file(gpt[k]->loaded_from()), gpt[k]->loaded_from());
      } catch (const DataError&) {
      }
    }
    const std::string want_text = dumps_indent4(want);
    const std::string tail = "-BlendedDataset-" + cache_.name + "-description.txt";
    std::error_code ec;
    std::vector<std::string> found;
    for (std::filesystem::directory_iterator it(cache_.cache_dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.size() == 32 + tail.size() && name.compare(32, std::string::npos, tail) == 0) found.push_back(name);
    }
    std::sort(found.begin(), found.end());
    for (const std::string& name : found) {
      const std::string path = python_join(cache_.cache_dir, name);
      try {
        if (dumps_indent4(parse_json(read_file(path), path)) != want_text) continue;
      } catch (const DataError&) {
        continue;
      }
      const std::string base = path.substr(0, path.size() - std::string("description.txt").size());
      if (same_as_built(base + "dataset_index.npy", base + "dataset_sample_index.npy")) {
        loaded_from_cache_ = true;
        loaded_from_ = path;
        return;
      }
    }
  }
  if (!cache_.write) return;
  std::error_code ec;
  std::filesystem::create_directories(cache_.cache_dir, ec);
  if (ec) throw DataError("cannot create the index cache directory '" + cache_.cache_dir + "': " + ec.message());
  std::vector<int64_t> di(dataset_index_.begin(), dataset_index_.end());
  NpyArray::from_int64(di, {di.size()}, cache_.order == MegatronOrder::kCore ? "<i2" : "|u1").save(fi);
  NpyArray::from_int64(dataset_sample_index_, {dataset_sample_index_.size()}, "<i8").save(fs);
  write_file_atomically(fdsc, description_);
}

std::string BlendedDataset::cache_file(const std::string& which) const {
  if (cache_.cache_dir.empty() || hash_.empty()) return "";
  if (cache_.order == MegatronOrder::kCore) {
    const std::string base = python_join(cache_.cache_dir, hash_ + "-BlendedDataset-" + cache_.name + "-");
    if (which == "description") return base + "description.txt";
    if (which == "dataset_index") return base + "dataset_index.npy";
    if (which == "dataset_sample_index") return base + "dataset_sample_index.npy";
  } else {
    const std::string base = python_join(cache_.cache_dir, hash_);
    if (which == "description") return base + ".dsc";
    if (which == "dataset_index") return base + "_index.npy";
    if (which == "dataset_sample_index") return base + "_sample_index.npy";
  }
  throw DataError("unknown blend cache file '" + which + "'");
}

void BlendedDataset::get(size_t i, int64_t* out) const {
  if (i >= size())
    throw DataError("blend: sample " + std::to_string(i) + " out of range (" + std::to_string(size()) + ")");
  datasets_[static_cast<size_t>(dataset_index_[i])]->get(static_cast<size_t>(dataset_sample_index_[i]), out);
}

namespace {

// Python's float(word) for the words Megatron's get_blend_from_list tries as weights.
// As Python's float() reads Megatron's --data-path weights: decimal only (no hexadecimal), and a
// number below the normal range is the tiny number it is (std::stod would refuse it).
bool parse_weight(const std::string& word, double* v) {
  if (word.empty() || word.find_first_of("xX") != std::string::npos) return false;
  char* end = nullptr;
  *v = std::strtod(word.c_str(), &end);
  return end == word.c_str() + word.size();
}

}  // namespace

DataBlend parse_data_path(const std::string& data_path) {
  std::istringstream in(data_path);
  std::vector<std::string> tokens;
  std::string t;
  while (in >> t) tokens.push_back(t);
  DataBlend b;
  if (tokens.empty()) throw DataError("data_path is empty");
  // get_blend_from_list: an odd count is prefixes only; an even count is weight/prefix pairs
  // when every first word of a pair is a number, prefixes only when none is.
  size_t numbers = 0;
  std::vector<double> weights;
  if (tokens.size() % 2 == 0) {
    for (size_t k = 0; k < tokens.size(); k += 2) {
      double v = 0;
      if (parse_weight(tokens[k], &v)) {
        ++numbers;
        weights.push_back(v);
      }
    }
  }
  if (numbers == 0) {
    for (const std::string& p : tokens) {
      double v = 0;
      if (parse_weight(p, &v)) {
        throw DataError("data_path '" + data_path + "': '" + p +
                        "' is a number where a prefix was expected (expected one prefix, prefixes without weights, "
                        "or pairs of 'weight prefix')");
      }
    }
    b.prefixes = tokens;
    b.weights.assign(tokens.size(), 1.0);
    return b;
  }
  if (numbers != tokens.size() / 2) {
    for (size_t k = 0; k < tokens.size(); k += 2) {
      double v = 0;
      if (!parse_weight(tokens[k], &v)) {
        throw DataError("data_path '" + data_path + "': weight '" + tokens[k] +
                        "' is not a number (give a weight before every prefix, or none)");
      }
    }
  }
  for (size_t k = 0; k < tokens.size(); k += 2) b.prefixes.push_back(tokens[k + 1]);
  b.weights = weights;
  normalize_weights(b.weights);  // checks them
  b.weighted = true;
  return b;
}

namespace {

const char* kSplitNames[3] = {"train", "valid", "test"};

// One split (s) of a blend: the GPT dataset of each prefix over its documents ranges[p], and
// the blend Megatron builds over them. `plain_single`: a single prefix is a plain dataset even
// with a weight (Megatron-core's per-split paths).
std::shared_ptr<const TokenDataset> build_split(const DataBlend& blend,
                                                const std::vector<std::shared_ptr<const IndexedDataset>>& data,
                                                const std::vector<std::array<size_t, 2>>& ranges, int s, int64_t n,
                                                const GptDatasetOptions& base, bool plain_single) {
  if (n <= 0 && n != kWholeSplit) return nullptr;
  GptDatasetOptions o = base;
  o.name = kSplitNames[s];
  const size_t count = blend.prefixes.size();
  if (count == 1 && (!blend.weighted || plain_single)) {
    if (ranges[0][1] <= ranges[0][0]) return nullptr;
    o.num_samples = std::max<int64_t>(n, 0);
    o.whole_epoch = n == kWholeSplit;
    return std::make_shared<const GPTDataset>(data[0], ranges[0][0], ranges[0][1], o);
  }
  if (n == kWholeSplit && blend.weighted) {
    const std::string what = count == 1 ? "weighted blend (a weight before its prefix)"
                                        : "weighted blend of " + std::to_string(count) + " prefixes";
    throw DataError(std::string("the ") + kSplitNames[s] + " split is read whole (eval.full_validation), but it is a " +
                    what +
                    ", whose size must be given (Megatron: \"Using client-specified weights requires client-specified "
                    "size\"); give the split prefixes without weights (data_path, or per split "
                    "dataset.train_data_path, valid_data_path and test_data_path)");
  }
  size_t empty = 0;
  for (const auto& r : ranges) empty += r[1] <= r[0];
  if (empty == count) return nullptr;
  for (size_t p = 0; p < count; ++p) {
    if (ranges[p][1] <= ranges[p][0]) {
      throw DataError(std::string("data_path blend: the ") + kSplitNames[s] + " split of '" + blend.prefixes[p] +
                      "' is empty while other datasets of the blend have one");
    }
  }
  if (!blend.weighted && base.order == MegatronOrder::kLegacy) {
    throw DataError("data_path '" + blend.prefixes[0] + " " + blend.prefixes[1] +
                    (count > 2 ? " ..." : "") +
                    "': legacy Megatron (order megatron_legacy) needs a weight before every prefix "
                    "('W1 PREFIX1 W2 PREFIX2 ...'); blends weighted by the datasets' sizes are Megatron-core's");
  }
  BlendCacheOptions c;
  c.order = base.order;
  c.name = kSplitNames[s];
  c.cache_dir = base.cache_dir;
  c.write = base.cache_mode == GptDatasetOptions::CacheMode::kBuild;
  if (base.cache_mode == GptDatasetOptions::CacheMode::kNoCache) c.cache_dir.clear();
  std::vector<std::shared_ptr<const TokenDataset>> parts;
  if (blend.weighted) {
    const std::vector<double> weights = normalize_weights(blend.weights, base.order);
    const std::vector<int64_t> per = blend_samples_per_dataset(weights, n, base.order);
    for (size_t p = 0; p < count; ++p) {
      o.num_samples = per[p];
      parts.push_back(std::make_shared<const GPTDataset>(data[p], ranges[p][0], ranges[p][1], o));
    }
    return std::make_shared<const BlendedDataset>(parts, weights, blend_size(weights, n, base.order), c);
  }
  // Megatron-core, weights None: each dataset one epoch; weighted by their sizes; min(N, all), or
  // all of them once when the split is read whole.
  o.whole_epoch = true;
  std::vector<double> sizes;
  int64_t total = 0;
  for (size_t p = 0; p < count; ++p) {
    parts.push_back(std::make_shared<const GPTDataset>(data[p], ranges[p][0], ranges[p][1], o));
    sizes.push_back(static_cast<double>(parts.back()->size()));
    total += static_cast<int64_t>(parts.back()->size());
  }
  c.weights_from_sizes = true;
  return std::make_shared<const BlendedDataset>(parts, sizes,
                                                n == kWholeSplit ? BlendedDataset::kExhaustive : std::min(n, total), c);
}

std::vector<std::shared_ptr<const IndexedDataset>> open_all(const DataBlend& blend) {
  std::vector<std::shared_ptr<const IndexedDataset>> data;
  for (const std::string& p : blend.prefixes) data.push_back(std::make_shared<const IndexedDataset>(p));
  return data;
}

}  // namespace

TrainValidTest build_train_valid_test_datasets(const std::string& data_path, const std::array<int64_t, 3>& num_samples,
                                               const GptDatasetOptions& base) {
  const DataBlend blend = parse_data_path(data_path);
  const auto data = open_all(blend);
  std::array<std::vector<std::array<size_t, 2>>, 3> ranges;
  for (const auto& d : data) {
    const auto bounds = split_boundaries(base.split, d->num_sequences(), base.order);
    for (int s = 0; s < 3; ++s) ranges[s].push_back({bounds[s], bounds[s + 1]});
  }
  TrainValidTest out;
  out.train = build_split(blend, data, ranges[0], 0, num_samples[0], base, false);
  out.valid = build_split(blend, data, ranges[1], 1, num_samples[1], base, false);
  out.test = build_split(blend, data, ranges[2], 2, num_samples[2], base, false);
  return out;
}

TrainValidTest build_per_split_datasets(const std::array<std::string, 3>& data_paths,
                                        const std::array<int64_t, 3>& num_samples, const GptDatasetOptions& base) {
  GptDatasetOptions o = base;
  // Megatron-core's config has no split with per-split paths; legacy Megatron keeps --split in
  // its descriptions.
  if (base.order == MegatronOrder::kCore) o.split.clear();
  TrainValidTest out;
  std::array<std::shared_ptr<const TokenDataset>*, 3> dst{&out.train, &out.valid, &out.test};
  for (int s = 0; s < 3; ++s) {
    if (data_paths[static_cast<size_t>(s)].find_first_not_of(" \t\n") == std::string::npos) continue;
    const DataBlend blend = parse_data_path(data_paths[static_cast<size_t>(s)]);
    const auto data = open_all(blend);
    std::vector<std::array<size_t, 2>> ranges;
    for (const auto& d : data) ranges.push_back({0, d->num_sequences()});
    *dst[static_cast<size_t>(s)] =
        build_split(blend, data, ranges, s, num_samples[static_cast<size_t>(s)], o, base.order == MegatronOrder::kCore);
  }
  return out;
}

}  // namespace dtk::data
