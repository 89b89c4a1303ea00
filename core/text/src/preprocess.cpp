#include "dtk/text/preprocess.hpp"

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "dtk/data/error.hpp"
#include "dtk/data/indexed_dataset.hpp"
#include "dtk/text/jsonl.hpp"
#include "dtk/data/mapped_file.hpp"
#include "dtk/data/pair_fingerprint.hpp"
#include "dtk/data/utf8.hpp"

namespace dtk::text {

using data::bin_path;
using data::DataError;
using data::DType;
using data::find_invalid_utf8;
using data::idx_path;
using data::remove_pair_fingerprint;
using data::write_pair_fingerprint;
using data::IndexedDataset;
using data::IndexedDatasetBuilder;
using data::MappedFile;
using data::optimal_dtype;
namespace {

constexpr size_t kBatchLines = 4096;

bool is_jsonl(const std::string& path) {
  auto ends = [&](const char* suf) {
    const size_t n = std::strlen(suf);
    return path.size() >= n && path.compare(path.size() - n, n, suf) == 0;
  };
  return ends(".jsonl") || ends(".json") || ends(".jsonl.txt") || ends(".ndjson");
}

struct Batch {
  size_t seq = 0;
  size_t file = 0;
  bool text = false;
  bool start_of_file = false;
  bool end_of_file = false;
  std::vector<std::string_view> lines;  // jsonl lines
  std::vector<int64_t> line_numbers;    // 1-based
  std::string_view chunk;               // plain text
  size_t bytes = 0;
};

struct LineResult {
  std::string error;                                   // non-empty: bad line
  std::vector<std::vector<std::vector<int32_t>>> ids;  // [key][sentence] -> ids
};

struct BatchResult {
  Batch batch;
  std::vector<LineResult> lines;
  std::vector<int32_t> text_ids;
  std::string fatal;  // unexpected failure
};

// A pool of encoders with ordered delivery of results to the calling thread.
class Pipeline {
 public:
  Pipeline(const Tokenizer& tok, const PreprocessOptions& o, int workers) : tok_(tok), o_(o) {
    max_inflight_ = static_cast<size_t>(workers) * 4;
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
  }
  ~Pipeline() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      queue_.clear();
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  template <typename Sink>
  void submit(Batch b, Sink&& sink) {
    b.seq = submitted_;
    while (true) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (submitted_ - written_ < max_inflight_) {
          queue_.push_back(std::move(b));
          ++submitted_;
          work_cv_.notify_one();
          break;
        }
        done_cv_.wait(lk, [&] { return results_.count(written_) > 0; });
      }
      write_ready(sink);
    }
    write_ready(sink);
  }

  template <typename Sink>
  void finish(Sink&& sink) {
    while (written_ < submitted_) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        done_cv_.wait(lk, [&] { return results_.count(written_) > 0; });
      }
      write_ready(sink);
    }
  }

 private:
  template <typename Sink>
  void write_ready(Sink& sink) {
    while (true) {
      BatchResult r;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = results_.find(written_);
        if (it == results_.end()) return;
        r = std::move(it->second);
        results_.erase(it);
      }
      ++written_;
      sink(r);
    }
  }

  void work() {
    JsonlLineParser json(o_.json_keys);
    while (true) {
      Batch b;
      {
        std::unique_lock<std::mutex> lk(mu_);
        work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      BatchResult r;
      try {
        process(b, &r, &json);
      } catch (const std::exception& e) {
        r.fatal = e.what();
      }
      r.batch = std::move(b);
      {
        std::lock_guard<std::mutex> lk(mu_);
        results_[r.batch.seq] = std::move(r);
      }
      done_cv_.notify_all();
    }
  }

  void process(const Batch& b, BatchResult* r, JsonlLineParser* json) {
    const std::string& file = o_.inputs[b.file];
    if (b.text) {
      if (b.start_of_file) r->text_ids = tok_.text_prefix();
      tok_.encode(b.chunk, &r->text_ids);
      if (b.end_of_file) r->text_ids.insert(r->text_ids.end(), tok_.text_suffix().begin(), tok_.text_suffix().end());
      return;
    }
    r->lines.resize(b.lines.size());
    std::vector<std::vector<std::string_view>> values;  // [key][sentence]
    for (size_t k = 0; k < b.lines.size(); ++k) {
      LineResult& lr = r->lines[k];
      const std::string where = file + ":" + std::to_string(b.line_numbers[k]);
      try {
        json->parse(b.lines[k], where, &values);
        lr.ids.resize(o_.json_keys.size());
        for (size_t key = 0; key < o_.json_keys.size(); ++key) {
          auto& out = lr.ids[key];
          for (const std::string_view s : values[key]) {
            std::vector<int32_t> ids;
            try {
              ids = tok_.tokenize(s);
            } catch (const DataError& e) {
              throw DataError(where + ": " + e.what());
            }
            if (!ids.empty()) out.push_back(std::move(ids));
          }
          if (o_.append_eod && !out.empty()) out.back().push_back(tok_.eod());
        }
      } catch (const DataError& e) {
        lr.error = e.what();
        lr.ids.clear();
      }
    }
  }

  const Tokenizer& tok_;
  const PreprocessOptions& o_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Batch> queue_;
  std::map<size_t, BatchResult> results_;
  size_t max_inflight_ = 4;
  size_t submitted_ = 0;  // touched by the calling thread only (read under mu_ by none)
  size_t written_ = 0;
  bool stop_ = false;
};

std::string format_mb(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << bytes / 1e6;
  return os.str();
}

int64_t line_of_offset(std::string_view s, size_t offset) {
  return 1 + std::count(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(std::min(offset, s.size())), '\n');
}

}  // namespace

namespace {

// The calling thread's end of the pipeline: writes each encoded batch, in input order, into the
// .bin builders (one per json key), counts, and reports progress.
class Writer {
 public:
  // The outputs are written under temporary names and renamed into place only when every file
  // is complete: a failed or interrupted run leaves no .bin without its .idx (or a short one).
  Writer(const PreprocessOptions& o, const Tokenizer& tok, DType dtype)
      : o_(o), tok_(tok), suffix_(".tmp-" + std::to_string(::getpid())) {
    for (const std::string& key : o.json_keys) {
      const std::string prefix = o.output_prefix + "_" + key + "_document";
      stats_.output_prefixes.push_back(prefix);
      temporaries_.push_back(bin_path(prefix) + suffix_);
      builders_.push_back(std::make_unique<IndexedDatasetBuilder>(temporaries_.back(), dtype));
    }
    const auto text = std::find(o.json_keys.begin(), o.json_keys.end(), "text");
    text_key_ = text == o.json_keys.end() ? -1 : text - o.json_keys.begin();
    next_log_ = o.log_interval_mb > 0 ? o.log_interval_mb * 1e6 : -1;
  }
  bool has_text_key() const { return text_key_ >= 0; }
  PreprocessStats& stats() { return stats_; }

  void operator()(BatchResult& r) {
    if (!r.fatal.empty()) throw DataError(r.fatal);
    if (r.batch.text)
      write_text(r);
    else
      write_lines(r);
    stats_.input_bytes += static_cast<int64_t>(r.batch.bytes);
    ++stats_.batches;
    if (next_log_ > 0 && static_cast<double>(stats_.input_bytes) >= next_log_) {
      progress("");
      // The next multiple of the interval past what was read (a loop of additions would not end
      // for an interval below the rounding of next_log_).
      const double step = o_.log_interval_mb * 1e6;
      next_log_ = (std::floor(static_cast<double>(stats_.input_bytes) / step) + 1) * step;
      if (!(next_log_ > static_cast<double>(stats_.input_bytes)))
        next_log_ = static_cast<double>(stats_.input_bytes) + step;
    }
  }

  ~Writer() {
    builders_.clear();  // closes the files
    if (committed_) return;
    std::error_code ec;
    for (const auto& t : temporaries_) std::filesystem::remove(t, ec);
  }

  // Writes the .idx files and moves every output into place; the run's totals.
  PreprocessStats finish() {
    // An empty corpus would make a dataset that fails only when training starts ("too small for
    // one sample"), far from its cause: refuse it here, writing nothing.
    if (stats_.tokens == 0) {
      std::string skipped;
      if (stats_.bad_lines > 0) skipped = ", " + std::to_string(stats_.bad_lines) + " bad lines skipped";
      std::string named;  // the input files, cut to a readable length
      for (size_t f = 0; f < o_.inputs.size() && f < 3; ++f) named += (f ? ", '" : "'") + o_.inputs[f] + "'";
      if (o_.inputs.size() > 3) named += " and " + std::to_string(o_.inputs.size() - 3) + " more";
      throw DataError("the input " + named + " holds no tokens (" + std::to_string(stats_.documents) +
                      " document(s), all without text" + skipped + "): nothing to write, an empty dataset cannot train");
    }
    for (size_t key = 0; key < builders_.size(); ++key) {
      temporaries_.push_back(idx_path(stats_.output_prefixes[key]) + suffix_);
      builders_[key]->finalize(temporaries_.back());
    }
    for (const auto& p : stats_.output_prefixes) {
      remove_pair_fingerprint(p);  // an earlier pair's: it must not outlive the files it describes
      for (const std::string& final_path : {bin_path(p), idx_path(p)}) {
        std::error_code ec;
        std::filesystem::rename(final_path + suffix_, final_path, ec);
        if (ec) throw DataError("cannot move " + final_path + suffix_ + " to " + final_path + ": " + ec.message());
      }
    }
    committed_ = true;
    for (const auto& p : stats_.output_prefixes) write_pair_fingerprint(p);
    stats_.seconds = elapsed();
    if (o_.log) {
      progress("done: ");
      if (stats_.bad_lines > 0) *o_.log << "dtk preprocess: skipped " << stats_.bad_lines << " bad lines" << std::endl;
      for (const auto& p : stats_.output_prefixes)
        *o_.log << "dtk preprocess: wrote " << p << ".{bin,idx,fingerprint}" << std::endl;
    }
    return stats_;
  }

  void progress(const char* what) const {
    if (o_.log == nullptr) return;
    const double s = std::max(elapsed(), 1e-9);
    *o_.log << "dtk preprocess: " << what << stats_.documents << " docs, " << stats_.tokens << " tokens, "
            << format_mb(static_cast<double>(stats_.input_bytes)) << " MB, "
            << format_mb(static_cast<double>(stats_.input_bytes) / s) << " MB/s" << std::endl;
  }

 private:
  double elapsed() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }

  // A plain-text file is one document, encoded in chunks: its tokens accumulate into one item.
  void write_text(const BatchResult& r) {
    IndexedDatasetBuilder& bld = *builders_[static_cast<size_t>(text_key_)];
    bld.append_to_item(r.text_ids.data(), r.text_ids.size());
    text_doc_tokens_ += static_cast<int64_t>(r.text_ids.size());
    stats_.tokens += static_cast<int64_t>(r.text_ids.size());
    if (!r.batch.end_of_file) return;
    if (o_.append_eod && text_doc_tokens_ > 0) {
      const int32_t eod = tok_.eod();
      bld.append_to_item(&eod, 1);
      ++stats_.tokens;
    }
    if (text_doc_tokens_ > 0) bld.close_item();
    bld.end_document();
    ++stats_.documents;
    text_doc_tokens_ = 0;
  }

  // jsonl: each good line is one document per key (one item per sentence).
  void write_lines(const BatchResult& r) {
    for (const LineResult& lr : r.lines) {
      if (!lr.error.empty()) {
        if (!o_.skip_bad_lines) throw DataError(lr.error + " (use --skip_bad_lines to skip bad lines)");
        ++stats_.bad_lines;
        continue;
      }
      for (size_t key = 0; key < builders_.size(); ++key) {
        for (const auto& ids : lr.ids[key]) {
          builders_[key]->add_item(ids.data(), ids.size());
          stats_.tokens += static_cast<int64_t>(ids.size());
        }
        builders_[key]->end_document();
      }
      ++stats_.documents;
    }
  }

  const PreprocessOptions& o_;
  const Tokenizer& tok_;
  const std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders_;
  std::string suffix_;                   // of the temporary names: ".tmp-PID"
  std::vector<std::string> temporaries_;  // removed unless committed
  bool committed_ = false;
  std::ptrdiff_t text_key_ = -1;
  PreprocessStats stats_;
  int64_t text_doc_tokens_ = 0;
  double next_log_ = -1;
};

// Plain text: chunks of about batch_bytes, cut where the tokenizer says encoding splits.
void submit_text_file(Pipeline& pipe, Writer& writer, const Tokenizer& tok, size_t file, std::string_view data,
                      size_t batch_bytes) {
  size_t pos = 0;
  do {
    size_t cut = data.size();
    if (data.size() - pos > batch_bytes) cut = std::min(cut, tok.next_cut(data, pos + batch_bytes));
    Batch b;
    b.file = file;
    b.text = true;
    b.chunk = data.substr(pos, cut - pos);
    b.bytes = cut - pos;
    b.start_of_file = pos == 0;
    b.end_of_file = cut == data.size();
    pos = cut;
    pipe.submit(std::move(b), writer);
  } while (pos < data.size());
}

// jsonl: batches of whole non-blank lines (about batch_bytes, at most kBatchLines).
void submit_jsonl_file(Pipeline& pipe, Writer& writer, size_t file, std::string_view data, size_t batch_bytes) {
  Batch b;
  b.file = file;
  int64_t line_no = 0;
  size_t pos = 0;
  while (pos < data.size()) {
    const size_t nl = data.find('\n', pos);
    const size_t end = nl == std::string_view::npos ? data.size() : nl;
    std::string_view line = data.substr(pos, end - pos);
    ++line_no;
    b.bytes += end - pos + (nl == std::string_view::npos ? 0 : 1);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") != std::string_view::npos) {
      b.lines.push_back(line);
      b.line_numbers.push_back(line_no);
    }
    if (b.bytes >= batch_bytes || b.lines.size() >= kBatchLines) {
      pipe.submit(std::move(b), writer);
      b = Batch();
      b.file = file;
    }
  }
  if (b.bytes > 0) pipe.submit(std::move(b), writer);
}

// Encoder threads: each holds its own tokenizer caches and batches in flight; beyond this, a typo.
constexpr int kMaxWorkers = 1024;

void check_options(const PreprocessOptions& o) {
  if (o.inputs.empty()) throw DataError("no --input given");
  if (o.output_prefix.empty()) throw DataError("no --output_prefix given");
  if (o.tokenizer == nullptr) throw DataError("no tokenizer given");
  if (o.json_keys.empty()) throw DataError("--json_keys is empty");
  // Each key writes PREFIX_KEY_document.bin/.idx: a key given twice would write one pair twice.
  for (size_t k = 0; k < o.json_keys.size(); ++k)
    if (std::find(o.json_keys.begin(), o.json_keys.begin() + k, o.json_keys[k]) != o.json_keys.begin() + k)
      throw DataError("--json_keys names '" + o.json_keys[k] + "' twice");
  if (o.workers < 0 || o.workers > kMaxWorkers)
    throw DataError("--workers must be 0 (all cores) to " + std::to_string(kMaxWorkers) + ", got " +
                    std::to_string(o.workers));
  // A prefix that ends in a folder would write files named "_text_document.bin" in it.
  if (std::filesystem::path(o.output_prefix).filename().empty())
    throw DataError("--output_prefix '" + o.output_prefix + "' is a folder: give a file prefix in it (e.g. " +
                    (std::filesystem::path(o.output_prefix) / "corpus").string() + ")");
  // An input that is one of the outputs would be overwritten as it is read.
  for (const std::string& input : o.inputs)
    for (const std::string& key : o.json_keys) {
      const std::string prefix = o.output_prefix + "_" + key + "_document";
      for (const std::string& output : {prefix + ".bin", prefix + ".idx", data::fingerprint_path(prefix)}) {
        std::error_code ec;
        if (input == output || std::filesystem::equivalent(input, output, ec))
          throw DataError("--input '" + input + "' is one of the outputs (" + output +
                          "): it would be overwritten; give another --output_prefix");
      }
    }
}

}  // namespace

PreprocessStats preprocess(const PreprocessOptions& o) {
  check_options(o);
  const Tokenizer& tok = *o.tokenizer;
  if (o.append_eod && tok.eod() < 0) throw DataError(tok.type() + " has no end-of-document token for --append_eod");
  Writer writer(o, tok, optimal_dtype(static_cast<int64_t>(tok.vocab_size())));
  const int workers = o.workers > 0 ? o.workers : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<MappedFile> files(o.inputs.size());  // mapped until every batch is encoded
  {
    Pipeline pipe(tok, o, workers);
    for (size_t f = 0; f < o.inputs.size(); ++f) {
      const std::string& path = o.inputs[f];
      files[f] = MappedFile(path);
      const std::string_view data(reinterpret_cast<const char*>(files[f].data()), files[f].size());
      if (is_jsonl(path)) {
        submit_jsonl_file(pipe, writer, f, data, o.batch_bytes);
        continue;
      }
      if (!writer.has_text_key()) throw DataError("plain-text input '" + path + "' needs 'text' among --json_keys");
      const size_t bad = find_invalid_utf8(data);
      if (bad != std::string::npos) {
        const std::string msg =
            path + ":" + std::to_string(line_of_offset(data, bad)) + ": invalid UTF-8 at byte " + std::to_string(bad);
        if (!o.skip_bad_lines) throw DataError(msg + " (use --skip_bad_lines to skip the file)");
        ++writer.stats().bad_lines;
        if (o.log) *o.log << "dtk preprocess: skipping " << msg << std::endl;
        continue;
      }
      submit_text_file(pipe, writer, tok, f, data, o.batch_bytes);
    }
    pipe.finish(writer);
  }
  return writer.finish();
}

void decode_documents(const std::string& prefix, const Tokenizer& tok, int64_t begin, int64_t end,
                      std::ostream& out) {
  const IndexedDataset ds(prefix);
  data::require_token_dtype(ds);
  const int64_t ndocs = static_cast<int64_t>(ds.num_documents());
  if (end < 0) end = ndocs;
  if (begin < 0 || begin > end || end > ndocs) {
    throw DataError("'" + prefix + "': document range " + std::to_string(begin) + ":" + std::to_string(end) +
                    " is outside [0, " + std::to_string(ndocs) + "]");
  }
  std::vector<int64_t> ids;
  std::vector<int32_t> narrow;
  for (int64_t d = begin; d < end; ++d) {
    const int64_t s0 = ds.document_index(static_cast<size_t>(d));
    const int64_t s1 = ds.document_index(static_cast<size_t>(d) + 1);
    for (int64_t s = s0; s < s1; ++s) {
      ids.clear();
      ds.get(static_cast<size_t>(s), 0, static_cast<size_t>(ds.sequence_length(static_cast<size_t>(s))), &ids);
      for (int64_t id : ids)  // a uint32/int64 dataset's id beyond int32 would wrap into another one
        if (id < 0 || id > std::numeric_limits<int32_t>::max())
          throw DataError("'" + prefix + "': document " + std::to_string(d) + " holds token id " + std::to_string(id) +
                          ", outside the vocabulary of " + std::to_string(tok.vocab_size()));
      narrow.assign(ids.begin(), ids.end());
      out << tok.decode(narrow);
    }
  }
  out.flush();
}

}  // namespace dtk::text
