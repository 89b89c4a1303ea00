#include "dtk/data/gpt_dataset.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <sstream>
#include <thread>

#include "dtk/data/error.hpp"

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

int64_t num_epochs(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples) {
  int64_t epochs = 0, total = 0;
  while (true) {
    ++epochs;
    total += tokens_per_epoch;
    if ((total - 1) / seq_length >= num_samples) return epochs;
  }
}

bool separate_last_epoch(int64_t tokens_per_epoch, int64_t seq_length, int64_t num_samples, int64_t num_epochs) {
  if (num_epochs <= 1) return false;
  const int64_t before_last = ((num_epochs - 1) * tokens_per_epoch - 1) / seq_length;
  const int64_t from_last = num_samples - before_last;
  const int64_t per_epoch = (tokens_per_epoch - 1) / seq_length;
  return from_last < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
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
                                      int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  std::vector<int64_t> out(2 * static_cast<size_t>(num_samples + 1));
  int64_t row = 0, pos = 0, offset = 0;
  out[0] = 0;
  out[1] = 0;
  ++row;
  const int64_t last_pos = static_cast<int64_t>(doc_idx.size()) - 1;
  while (row <= num_samples) {
    int64_t remaining = seq_length + 1;
    while (remaining != 0) {
      const int64_t doc_len = sizes[static_cast<size_t>(doc_idx[static_cast<size_t>(pos)])] - offset;
      remaining -= doc_len;
      if (remaining <= 0) {
        offset += remaining + doc_len - 1;
        remaining = 0;
      } else {
        if (pos == last_pos) {  // ran out of documents (only for the very last sample)
          offset = sizes[static_cast<size_t>(doc_idx[static_cast<size_t>(pos)])] - 1;
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

std::string basename(const std::string& p) {
  const size_t s = p.rfind('/');
  return s == std::string::npos ? p : p.substr(s + 1);
}

}  // namespace

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, size_t doc_begin, size_t doc_end,
                       const GptDatasetOptions& options)
    : data_(std::move(data)), doc_begin_(doc_begin), doc_end_(doc_end), options_(options) {
  const std::string& prefix = data_->prefix();
  // Token ids are integers: a float dataset's bit patterns are not ids (Megatron's GPT dataset
  // would also read them as garbage).
  if (data_->dtype() == DType::kFloat32 || data_->dtype() == DType::kFloat64) {
    throw DataError("'" + idx_path(prefix) + "' holds " + dtype_name(data_->dtype()) + " values (dtype code " +
                    std::to_string(static_cast<int>(data_->dtype())) +
                    "), which cannot be token ids: a GPT dataset needs an integer dtype (1-5 or 8)");
  }
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
  if (tokens_per_epoch_ < options_.seq_length + 1) {
    throw DataError("'" + prefix + "' " + options_.name + " split: " + std::to_string(tokens_per_epoch_) +
                    " tokens in documents [" + std::to_string(doc_begin_) + ", " + std::to_string(doc_end_) +
                    "), too small for one sample of seq_length+1 = " + std::to_string(options_.seq_length + 1) +
                    " tokens");
  }
  num_epochs_ = data::num_epochs(tokens_per_epoch_, options_.seq_length, options_.num_samples);
  if (static_cast<double>(num_epochs_) * static_cast<double>(doc_end_ - doc_begin_) > 2e9) {
    throw DataError("'" + prefix + "' " + options_.name + " split: " + std::to_string(options_.num_samples) +
                    " samples would need " + std::to_string(num_epochs_) +
                    " epochs over the documents; the document index would exceed 2^31 entries");
  }
  total_samples_ = (num_epochs_ * tokens_per_epoch_ - 1) / options_.seq_length;

  using Mode = GptDatasetOptions::CacheMode;
  if (options_.cache_mode == Mode::kNoCache) {
    build();
    return;
  }
  std::string why;
  if (try_load(&why)) return;
  if (options_.cache_mode == Mode::kBuild) {
    build();
    if (!options_.cache_dir.empty()) {  // as Megatron's os.makedirs(path_to_cache, exist_ok=True)
      std::error_code ec;
      std::filesystem::create_directories(options_.cache_dir, ec);
      if (ec)
        throw DataError("cannot create the index cache directory '" + options_.cache_dir + "': " + ec.message());
    }
    doc_idx_.save(cache_file("doc_idx"));
    sample_idx_.save(cache_file("sample_idx"));
    shuffle_idx_.save(cache_file("shuffle_idx"));
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
  const std::string& prefix = data_->prefix();
  std::string base = options_.cache_dir.empty() ? prefix : options_.cache_dir + "/" + basename(prefix);
  std::ostringstream os;
  // Megatron's legacy name, plus what it leaves out: a "dtk2" tag (the layout is DTK's; 2: the
  // order is numpy's RandomState, Megatron's, where dtk1 files hold DTK's earlier order and are
  // never read), the document range (two split strings give two ranges), and, in a shared
  // cache_dir, a hash of the full prefix (two corpora with one basename).
  os << base << "_" << options_.name << "_indexmap_" << options_.num_samples << "ns_" << options_.seq_length << "sl_"
     << options_.seed << "s_dtk2_d" << doc_begin_ << "-" << doc_end_;
  if (!options_.cache_dir.empty()) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the prefix as given
    for (unsigned char c : prefix) h = (h ^ c) * 1099511628211ull;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    os << "_" << std::string(hex, 8);
  }
  os << "_" << which << ".npy";
  return os.str();
}

void GPTDataset::build() {
  std::vector<int32_t> documents;
  documents.reserve(doc_end_ - doc_begin_);
  for (size_t d = doc_begin_; d < doc_end_; ++d) documents.push_back(static_cast<int32_t>(d));
  const bool separate = separate_last_epoch(tokens_per_epoch_, options_.seq_length, options_.num_samples, num_epochs_);
  NumpyRandomState rng(options_.seed);
  std::vector<int32_t> doc_idx = build_doc_idx(documents, num_epochs_, &rng, separate);
  const std::vector<int32_t> sizes = data_->sequence_lengths();
  std::vector<int64_t> sample_idx =
      build_sample_idx(sizes, doc_idx, options_.seq_length, num_epochs_, tokens_per_epoch_);
  const int64_t first_part =
      separate ? ((num_epochs_ - 1) * tokens_per_epoch_ - 1) / options_.seq_length : total_samples_;
  std::vector<int64_t> shuffle_idx = build_shuffle_idx(first_part, total_samples_, &rng);

  int64_t max_sample = 0;
  for (int64_t v : sample_idx) max_sample = std::max(max_sample, v);
  const size_t ndoc = doc_idx.size();
  doc_idx_ = NpyArray::from_int32(std::move(doc_idx), {ndoc});
  sample_idx_ = NpyArray::from_int64(sample_idx, {static_cast<size_t>(total_samples_ + 1), 2},
                                     max_sample <= std::numeric_limits<int32_t>::max() ? "<i4" : "<i8");
  shuffle_idx_ = NpyArray::from_int64(
      shuffle_idx, {static_cast<size_t>(total_samples_)},
      total_samples_ < static_cast<int64_t>(std::numeric_limits<uint32_t>::max()) - 1 ? "<u4" : "<i8");
  loaded_from_cache_ = false;
}

bool GPTDataset::try_load(std::string* why) {
  const std::string fd = cache_file("doc_idx"), fs = cache_file("sample_idx"), fh = cache_file("shuffle_idx");
  if (!is_file(fd) || !is_file(fs) || !is_file(fh)) {
    *why = "not all three index files exist yet";
    return false;
  }
  try {
    NpyArray d = NpyArray::load(fd), s = NpyArray::load(fs), h = NpyArray::load(fh);
    const size_t ndoc = static_cast<size_t>(num_epochs_) * (doc_end_ - doc_begin_);
    if (d.shape().size() != 1 || d.size() != ndoc) throw DataError("'" + fd + "' has the wrong shape");
    for (size_t k = 0; k < d.size(); ++k) {
      const int64_t v = d[k];
      if (v < static_cast<int64_t>(doc_begin_) || v >= static_cast<int64_t>(doc_end_)) {
        throw DataError("'" + fd + "' holds document " + std::to_string(v) + " outside this split");
      }
    }
    const size_t rows = static_cast<size_t>(total_samples_) + 1;
    if (s.shape().size() != 2 || s.shape()[0] != rows || s.shape()[1] != 2) {
      throw DataError("'" + fs + "' has the wrong shape");
    }
    for (size_t r = 0; r < rows; ++r) {
      const int64_t pos = s[2 * r], off = s[2 * r + 1];
      if (pos < 0 || static_cast<size_t>(pos) >= ndoc || off < 0 ||
          off > data_->sequence_length(static_cast<size_t>(d[static_cast<size_t>(pos)]))) {
        throw DataError("'" + fs + "' row " + std::to_string(r) + " is out of range");
      }
    }
    if (h.shape().size() != 1 || h.size() != static_cast<size_t>(total_samples_)) {
      throw DataError("'" + fh + "' has the wrong shape");
    }
    for (size_t k = 0; k < h.size(); ++k) {
      if (h[k] < 0 || h[k] >= total_samples_) throw DataError("'" + fh + "' holds an out-of-range sample");
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
  if (pos_f == pos_l) {
    append(pos_f, off_f, off_l - off_f + 1);
  } else {
    const size_t first_len = static_cast<size_t>(data_->sequence_length(static_cast<size_t>(doc_idx_[pos_f])));
    append(pos_f, off_f, first_len >= off_f ? first_len - off_f : want + 1);
    for (size_t p = pos_f + 1; p < pos_l; ++p) {
      append(p, 0, static_cast<size_t>(data_->sequence_length(static_cast<size_t>(doc_idx_[p]))));
    }
    append(pos_l, 0, off_l + 1);
  }
  if (n != want) {
    throw DataError("'" + data_->prefix() + "': corrupt sample index at sample " + std::to_string(i) + " (" +
                    std::to_string(n) + " tokens instead of " + std::to_string(want) + ")");
  }
}

// ------------------------------------------------------------------ blending

std::vector<double> normalize_weights(const std::vector<double>& weights) {
  if (weights.empty()) throw DataError("blend weights: no datasets given");
  double sum = 0;
  for (double w : weights) {
    if (!std::isfinite(w) || w < 0)
      throw DataError("blend weights: weight " + std::to_string(w) + " is not a non-negative number");
    sum += w;
  }
  if (!(sum > 0)) throw DataError("blend weights: the weights sum to 0");
  std::vector<double> out;
  for (double w : weights) out.push_back(w / sum);
  return out;
}

std::vector<int64_t> blend_samples_per_dataset(const std::vector<double>& w, int64_t n) {
  std::vector<int64_t> out;
  for (double x : w) out.push_back(static_cast<int64_t>(std::ceil(static_cast<double>(n) * x * 1.005)));
  return out;
}

void build_blending_indices(const std::vector<double>& w, int64_t size, std::vector<int16_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index) {
  if (w.size() > 32767) throw DataError("blend: at most 32767 datasets");
  std::vector<int64_t> current(w.size(), 0);
  dataset_index->resize(static_cast<size_t>(size));
  dataset_sample_index->resize(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    const double x = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double best_err = w[0] * x - static_cast<double>(current[0]);
    for (size_t k = 1; k < w.size(); ++k) {
      const double err = w[k] * x - static_cast<double>(current[k]);
      if (err > best_err) {
        best_err = err;
        best = k;
      }
    }
    (*dataset_index)[static_cast<size_t>(i)] = static_cast<int16_t>(best);
    (*dataset_sample_index)[static_cast<size_t>(i)] = current[best]++;
  }
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const TokenDataset>> datasets,
                               const std::vector<double>& weights, int64_t size)
    : datasets_(std::move(datasets)) {
  if (datasets_.empty() || datasets_.size() != weights.size()) {
    throw DataError("blend: " + std::to_string(datasets_.size()) + " datasets but " + std::to_string(weights.size()) +
                    " weights");
  }
  for (const auto& d : datasets_) {
    if (!d) throw DataError("blend: a blended dataset is empty");
    if (d->sample_length() != datasets_[0]->sample_length()) throw DataError("blend: datasets differ in sample length");
  }
  build_blending_indices(normalize_weights(weights), size, &dataset_index_, &dataset_sample_index_);
  for (size_t i = 0; i < dataset_index_.size(); ++i) {
    const auto& d = datasets_[static_cast<size_t>(dataset_index_[i])];
    if (static_cast<size_t>(dataset_sample_index_[i]) >= d->size()) {
      throw DataError("blend: dataset " + std::to_string(dataset_index_[i]) + " has only " + std::to_string(d->size()) +
                      " samples, fewer than the blend draws from it");
    }
  }
}

void BlendedDataset::get(size_t i, int64_t* out) const {
  if (i >= size())
    throw DataError("blend: sample " + std::to_string(i) + " out of range (" + std::to_string(size()) + ")");
  datasets_[static_cast<size_t>(dataset_index_[i])]->get(static_cast<size_t>(dataset_sample_index_[i]), out);
}

DataBlend parse_data_path(const std::string& data_path) {
  std::istringstream in(data_path);
  std::vector<std::string> tokens;
  std::string t;
  while (in >> t) tokens.push_back(t);
  DataBlend b;
  if (tokens.empty()) throw DataError("data_path is empty");
  if (tokens.size() == 1) {
    b.prefixes = tokens;
    b.weights = {1.0};
    return b;
  }
  if (tokens.size() % 2 != 0) {
    throw DataError("data_path '" + data_path + "': expected one prefix or pairs of 'weight prefix'");
  }
  std::vector<double> w;
  for (size_t k = 0; k < tokens.size(); k += 2) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(tokens[k], &used);
    } catch (...) {
      used = 0;
    }
    if (used != tokens[k].size()) {
      throw DataError("data_path '" + data_path + "': weight '" + tokens[k] + "' is not a number");
    }
    w.push_back(v);
    b.prefixes.push_back(tokens[k + 1]);
  }
  b.weights = normalize_weights(w);
  return b;
}

TrainValidTest build_train_valid_test_datasets(const std::string& data_path, const std::string& split,
                                               const std::array<int64_t, 3>& num_samples,
                                               const GptDatasetOptions& base) {
  static const char* kNames[3] = {"train", "valid", "test"};
  const DataBlend blend = parse_data_path(data_path);
  std::array<std::vector<std::shared_ptr<const TokenDataset>>, 3> parts;
  for (size_t p = 0; p < blend.prefixes.size(); ++p) {
    auto data = std::make_shared<const IndexedDataset>(blend.prefixes[p]);
    const auto bounds = split_boundaries(split, data->num_sequences());
    for (int s = 0; s < 3; ++s) {
      std::shared_ptr<const TokenDataset> ds;
      if (bounds[s + 1] > bounds[s] && num_samples[s] > 0) {
        GptDatasetOptions o = base;
        o.name = kNames[s];
        o.num_samples =
            blend.prefixes.size() == 1 ? num_samples[s] : blend_samples_per_dataset(blend.weights, num_samples[s])[p];
        ds = std::make_shared<const GPTDataset>(data, bounds[s], bounds[s + 1], o);
      }
      parts[s].push_back(ds);
    }
  }
  TrainValidTest out;
  std::array<std::shared_ptr<const TokenDataset>*, 3> dst{&out.train, &out.valid, &out.test};
  for (int s = 0; s < 3; ++s) {
    if (num_samples[s] <= 0) continue;
    if (blend.prefixes.size() == 1) {
      *dst[s] = parts[s][0];
      continue;
    }
    bool any = false;
    for (const auto& d : parts[s]) any = any || d;
    if (!any) continue;
    for (size_t p = 0; p < parts[s].size(); ++p) {
      if (!parts[s][p]) {
        throw DataError(std::string("data_path blend: the ") + kNames[s] + " split of '" + blend.prefixes[p] +
                        "' is empty while other datasets of the blend have one");
      }
    }
    *dst[s] = std::make_shared<const BlendedDataset>(parts[s], blend.weights, num_samples[s]);
  }
  return out;
}

}  // namespace dtk::data
