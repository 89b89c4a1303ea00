#include "dtk/data/preprocess.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iomanip>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "dtk/data/error.hpp"
#include "dtk/data/gpt2_tokenizer.hpp"
#include "dtk/data/indexed_dataset.hpp"
#include "dtk/data/jsonl.hpp"
#include "dtk/data/mapped_file.hpp"
#include "dtk/data/utf8.hpp"

namespace dtk::data {
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
  Pipeline(const Gpt2Tokenizer& tok, const PreprocessOptions& o, int workers) : tok_(tok), o_(o) {
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
    Gpt2Tokenizer::Cache cache;
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
        process(b, &r, &cache, &json);
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

  void process(const Batch& b, BatchResult* r, Gpt2Tokenizer::Cache* cache, JsonlLineParser* json) {
    const std::string& file = o_.inputs[b.file];
    if (b.text) {
      tok_.encode(b.chunk, &r->text_ids, cache);
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
              tok_.encode(s, &ids, cache);
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

  const Gpt2Tokenizer& tok_;
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

PreprocessStats preprocess(const PreprocessOptions& o) {
  if (o.inputs.empty()) throw DataError("no --input given");
  if (o.output_prefix.empty()) throw DataError("no --output_prefix given");
  if (o.vocab_file.empty() || o.merge_file.empty()) {
    throw DataError("--vocab_file (encoder.json) and --merge_file (vocab.bpe) are required");
  }
  if (o.json_keys.empty()) throw DataError("--json_keys is empty");
  const auto t0 = std::chrono::steady_clock::now();
  const Gpt2Tokenizer tok(o.vocab_file, o.merge_file);
  if (o.append_eod && tok.eod() < 0)
    throw DataError("vocab file '" + o.vocab_file + "' has no <|endoftext|> token for --append_eod");
  const DType dtype = optimal_dtype(static_cast<int64_t>(tok.vocab_size()));

  PreprocessStats st;
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  for (const std::string& key : o.json_keys) {
    const std::string prefix = o.output_prefix + "_" + key + "_document";
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(bin_path(prefix), dtype));
    st.output_prefixes.push_back(prefix);
  }
  const auto text_key = std::find(o.json_keys.begin(), o.json_keys.end(), "text");

  int workers = o.workers;
  if (workers <= 0) workers = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double next_log = o.log_interval_mb > 0 ? o.log_interval_mb * 1e6 : -1;
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  auto progress = [&](const char* what) {
    if (o.log == nullptr) return;
    const double s = std::max(elapsed(), 1e-9);
    *o.log << "dtk preprocess: " << what << st.documents << " docs, " << st.tokens << " tokens, "
           << format_mb(static_cast<double>(st.input_bytes)) << " MB, "
           << format_mb(static_cast<double>(st.input_bytes) / s) << " MB/s" << std::endl;
  };

  std::vector<MappedFile> files(o.inputs.size());
  int64_t text_doc_tokens = 0;
  auto sink = [&](BatchResult& r) {
    if (!r.fatal.empty()) throw DataError(r.fatal);
    const Batch& b = r.batch;
    if (b.text) {
      IndexedDatasetBuilder& bld = *builders[static_cast<size_t>(text_key - o.json_keys.begin())];
      bld.append_to_item(r.text_ids.data(), r.text_ids.size());
      text_doc_tokens += static_cast<int64_t>(r.text_ids.size());
      st.tokens += static_cast<int64_t>(r.text_ids.size());
      if (b.end_of_file) {
        if (o.append_eod && text_doc_tokens > 0) {
          const int32_t eod = tok.eod();
          bld.append_to_item(&eod, 1);
          ++st.tokens;
        }
        if (text_doc_tokens > 0) bld.close_item();
        bld.end_document();
        ++st.documents;
        text_doc_tokens = 0;
      }
    } else {
      for (const LineResult& lr : r.lines) {
        if (!lr.error.empty()) {
          if (!o.skip_bad_lines) throw DataError(lr.error + " (use --skip_bad_lines to skip bad lines)");
          ++st.bad_lines;
          continue;
        }
        for (size_t key = 0; key < builders.size(); ++key) {
          for (const auto& ids : lr.ids[key]) {
            builders[key]->add_item(ids.data(), ids.size());
            st.tokens += static_cast<int64_t>(ids.size());
          }
          builders[key]->end_document();
        }
        ++st.documents;
      }
    }
    st.input_bytes += static_cast<int64_t>(b.bytes);
    ++st.batches;
    if (next_log > 0 && static_cast<double>(st.input_bytes) >= next_log) {
      progress("");
      while (next_log <= static_cast<double>(st.input_bytes)) next_log += o.log_interval_mb * 1e6;
    }
  };

  {
    Pipeline pipe(tok, o, workers);
    for (size_t f = 0; f < o.inputs.size(); ++f) {
      const std::string& path = o.inputs[f];
      files[f] = MappedFile(path);
      std::string_view data(reinterpret_cast<const char*>(files[f].data()), files[f].size());
      if (!is_jsonl(path)) {
        if (text_key == o.json_keys.end()) {
          throw DataError("plain-text input '" + path + "' needs 'text' among --json_keys");
        }
        const size_t bad = find_invalid_utf8(data);
        if (bad != std::string::npos) {
          const std::string msg =
              path + ":" + std::to_string(line_of_offset(data, bad)) + ": invalid UTF-8 at byte " + std::to_string(bad);
          if (!o.skip_bad_lines) throw DataError(msg + " (use --skip_bad_lines to skip the file)");
          ++st.bad_lines;
          if (o.log) *o.log << "dtk preprocess: skipping " << msg << std::endl;
          continue;
        }
        size_t pos = 0;
        do {
          size_t cut = data.size();
          if (data.size() - pos > o.batch_bytes) {
            for (size_t k = pos + o.batch_bytes; k + 1 < data.size(); ++k) {
              const char* nl = static_cast<const char*>(std::memchr(data.data() + k, '\n', data.size() - k - 1));
              if (nl == nullptr) break;
              k = static_cast<size_t>(nl - data.data());
              const unsigned char next = static_cast<unsigned char>(data[k + 1]);
              if (next >= 0x21 && next <= 0x7e) {
                cut = k;
                break;
              }
            }
          }
          Batch b;
          b.file = f;
          b.text = true;
          b.chunk = data.substr(pos, cut - pos);
          b.bytes = cut - pos;
          b.end_of_file = cut == data.size();
          pos = cut;
          pipe.submit(std::move(b), sink);
        } while (pos < data.size());
        continue;
      }
      // jsonl
      Batch b;
      b.file = f;
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
        if (b.bytes >= o.batch_bytes || b.lines.size() >= kBatchLines) {
          pipe.submit(std::move(b), sink);
          b = Batch();
          b.file = f;
        }
      }
      if (b.bytes > 0) pipe.submit(std::move(b), sink);
    }
    pipe.finish(sink);
  }
  for (size_t key = 0; key < builders.size(); ++key) builders[key]->finalize(idx_path(st.output_prefixes[key]));
  st.seconds = elapsed();
  if (o.log) {
    progress("done: ");
    if (st.bad_lines > 0) *o.log << "dtk preprocess: skipped " << st.bad_lines << " bad lines" << std::endl;
    for (const auto& p : st.output_prefixes) *o.log << "dtk preprocess: wrote " << p << ".{bin,idx}" << std::endl;
  }
  return st;
}

void decode_documents(const std::string& prefix, const std::string& vocab_file, const std::string& merge_file,
                      int64_t begin, int64_t end, std::ostream& out) {
  const IndexedDataset ds(prefix);
  const Gpt2Tokenizer tok(vocab_file, merge_file);
  const int64_t ndocs = static_cast<int64_t>(ds.num_documents());
  if (end < 0) end = ndocs;
  if (begin < 0 || begin > end || end > ndocs) {
    throw DataError("'" + prefix + "': document range " + std::to_string(begin) + ":" + std::to_string(end) +
                    " is outside [0, " + std::to_string(ndocs) + "]");
  }
  std::vector<int64_t> ids;
  for (int64_t d = begin; d < end; ++d) {
    const int64_t s0 = ds.document_index(static_cast<size_t>(d));
    const int64_t s1 = ds.document_index(static_cast<size_t>(d) + 1);
    for (int64_t s = s0; s < s1; ++s) {
      ids.clear();
      ds.get(static_cast<size_t>(s), 0, static_cast<size_t>(ds.sequence_length(static_cast<size_t>(s))), &ids);
      out << tok.decode(ids.data(), ids.size());
    }
  }
  out.flush();
}

}  // namespace dtk::data
