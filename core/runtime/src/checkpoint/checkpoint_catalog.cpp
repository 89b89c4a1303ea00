// What a save directory holds: see dtk/core/checkpoint/checkpoint_catalog.hpp.
#include "dtk/core/checkpoint/checkpoint_catalog.hpp"

#include <glog/logging.h>
#include <google/protobuf/text_format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint_io.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/checkpoint/layout.hpp"
#include "dtk/core/checkpoint/sha256.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

namespace fs = std::filesystem;
using host::HostError;

int64_t read_checkpoint_tracker(const std::string& dir) {
  const std::string tracker = checkpoint_tracker_file(dir);
  std::string text;
  if (!ckpt::read_file_bytes(tracker, &text))
    throw HostError("checkpoint: cannot read " + tracker + " (no checkpoint in " + dir + "?)");
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  int64_t iteration = -1;
  try {
    size_t pos = 0;
    iteration = std::stoll(text, &pos);
    if (pos != text.size()) iteration = -1;
  } catch (const std::exception&) {
  }
  if (iteration >= 0) return iteration;
  // Show what it holds, escaped and cut short: it may be any bytes.
  std::string shown;
  for (unsigned char c : text.substr(0, 40)) {
    if (c >= 0x20 && c < 0x7f) {
      shown += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      shown += buf;
    }
  }
  throw HostError("checkpoint: " + tracker + " does not hold an iteration number: '" + shown +
                  (text.size() > 40 ? "...'" : "'") + " (" + std::to_string(text.size()) + " bytes)");
}

namespace {

std::string megabytes(double bytes) {
  char buf[32];
  if (bytes < 1e6)
    std::snprintf(buf, sizeof buf, "%.1f kB", bytes / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// Every regular file below an iteration directory, relative to it, in path order.
std::vector<std::string> files_below(const std::string& iter_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(iter_dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec))
    if (it->is_regular_file()) out.push_back(fs::relative(it->path(), iter_dir).string());
  std::sort(out.begin(), out.end());
  return out;
}

struct TensorStats {
  int64_t count = 0, elements = 0, bytes = 0;
};

TensorStats stats_of(const c10::IValue& v) {
  TensorStats s;
  if (!v.isGenericDict()) return s;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.value().isTensor()) continue;
    const at::Tensor& t = kv.value().toTensor();
    ++s.count, s.elements += t.numel(), s.bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return s;
}

void list_tensors(const c10::IValue& v, std::ostream& out) {
  if (!v.isGenericDict()) return;
  std::vector<std::tuple<std::string, std::string, std::string, int64_t>> rows;
  size_t wn = 4, ws = 5;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.key().isString() || !kv.value().isTensor()) continue;
    const at::Tensor& t = kv.value().toTensor();
    rows.emplace_back(kv.key().toStringRef(), shape_of(t), dtype_name(t.scalar_type()),
                      t.numel() * static_cast<int64_t>(t.element_size()));
    wn = std::max(wn, std::get<0>(rows.back()).size());
    ws = std::max(ws, std::get<1>(rows.back()).size());
  }
  char buf[512];
  std::snprintf(buf, sizeof buf, "      %-*s  %-*s  %-8s  %s\n", static_cast<int>(wn), "name", static_cast<int>(ws),
                "shape", "dtype", "bytes");
  out << buf;
  for (const auto& [name, shape, dtype, bytes] : rows) {
    std::snprintf(buf, sizeof buf, "      %-*s  %-*s  %-8s  %lld\n", static_cast<int>(wn), name.c_str(),
                  static_cast<int>(ws), shape.c_str(), dtype.c_str(), static_cast<long long>(bytes));
    out << buf;
  }
}

std::string int_entry(const c10::impl::GenericDict& d, const char* key) {
  auto it = d.find(c10::IValue(std::string(key)));
  if (it == d.end()) return "?";
  if (it->value().isInt()) return std::to_string(it->value().toInt());
  if (it->value().isDouble()) {
    std::ostringstream s;
    s << it->value().toDouble();
    return s.str();
  }
  if (it->value().isString()) return it->value().toStringRef();
  return "?";
}

}  // namespace

std::vector<int64_t> list_checkpoint_iterations(const std::string& dir) {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t it = iteration_of(e.path().filename().string());
    if (it >= 0 && e.is_directory()) out.push_back(it);
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {
// " is a directory, not a file" or " is missing": what a load says of a file it cannot open.
std::string not_a_file(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) ? " is a directory, not a file" : " is missing";
}
}  // namespace

IterationState check_checkpoint_iteration(const std::string& dir, int64_t iteration, bool hash_files) {
  IterationState s;
  const std::string iter_dir = checkpoint_iter_dir(dir, iteration);
  std::error_code ec;
  if (!fs::is_directory(iter_dir, ec)) {
    s.problem = iter_dir + ckpt::not_a_directory(iter_dir);
    return s;
  }
  ckpt::Checksums sums;
  try {
    sums = ckpt::read_checksums(iter_dir);
  } catch (const std::exception& e) {
    s.problem = ckpt::first_line(e.what());
    return s;
  }
  s.checksummed = sums.present;
  if (!sums.present) {
    const fs::path main = fs::path(iter_dir) / ckpt::first_rank_dir(iter_dir) / ckpt::kModelFile;
    if (!fs::is_regular_file(main, ec)) {
      s.problem = main.string() + not_a_file(main);
      return s;
    }
    s.complete = true;
    return s;
  }
  if (sums.sha256.empty()) {
    s.problem = std::string(ckpt::kChecksumsFile) + " lists no file";
    return s;
  }
  for (const auto& [relative, hex] : sums.sha256) {
    const std::string file = (fs::path(iter_dir) / relative).string();
    if (!fs::is_regular_file(file, ec)) {
      s.problem = file + not_a_file(file) + " (listed in " + ckpt::kChecksumsFile + ")";
      return s;
    }
    if (!hash_files) continue;
    try {
      const std::string actual = sha256_file_hex(file);
      if (actual != hex) {
        s.problem = file + " is damaged: its SHA-256 is " + actual.substr(0, 16) + "..., " + ckpt::kChecksumsFile +
                    " recorded " + hex.substr(0, 16) + "...";
        return s;
      }
    } catch (const std::exception& e) {
      s.problem = ckpt::first_line(e.what());
      return s;
    }
  }
  s.complete = true;
  return s;
}

std::string checkpoint_verdict(const std::string& dir, int64_t iteration, bool hash_files) {
  const IterationState st = check_checkpoint_iteration(dir, iteration, hash_files);
  return st.complete ? "" : st.problem;
}

void require_complete_iteration(const std::string& dir, int64_t iteration) {
  if (const std::string verdict = checkpoint_verdict(dir, iteration, false); !verdict.empty())
    throw HostError("checkpoint: iteration " + std::to_string(iteration) + " of " + dir + " is incomplete: " + verdict);
}

int64_t older_complete_iteration(const std::string& dir, int64_t before) {
  std::vector<int64_t> all = list_checkpoint_iterations(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if ((before < 0 || *it < before) && check_checkpoint_iteration(dir, *it, false).complete) return *it;
  return -1;
}

std::vector<int64_t> rotate_checkpoints(const std::string& dir, int64_t keep_last) {
  std::vector<int64_t> removed;
  if (keep_last <= 0) return removed;
  std::vector<int64_t> all = list_checkpoint_iterations(dir);
  std::set<int64_t> keep;
  for (size_t i = all.size() > static_cast<size_t>(keep_last) ? all.size() - keep_last : 0; i < all.size(); ++i)
    keep.insert(all[i]);
  try {
    keep.insert(read_checkpoint_tracker(dir));
  } catch (const std::exception& e) {
    // No readable tracker: remove nothing rather than guess which one a resume would want.
    LOG(WARNING) << "checkpoint.keep_last: removing nothing: " << ckpt::first_line(e.what());
    return removed;
  }
  for (int64_t it : all) {
    if (keep.count(it)) continue;
    const std::string from = checkpoint_iter_dir(dir, it);
    // Renamed first: out of the catalog at once, and a removal cut short is a dead process's
    // temporary that the next save or load removes.
    const std::string doomed = from + ".tmp-" + ckpt::temp_owner(::getpid());
    std::error_code ec;
    fs::rename(from, doomed, ec);
    if (!ec) fs::remove_all(doomed, ec);
    if (ec) {
      LOG(WARNING) << "checkpoint.keep_last: could not remove " << from << ": " << ec.message();
      continue;
    }
    removed.push_back(it);
  }
  return removed;
}

int64_t tracked_or_newest_iteration(const std::string& dir, int64_t newest) {
  std::error_code ec;
  return fs::exists(checkpoint_tracker_file(dir), ec) ? read_checkpoint_tracker(dir) : newest;
}

std::string resolve_iteration_dir(const std::string& path, int64_t* iteration, bool verify) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) throw HostError("checkpoint " + path + " is not a directory");
  fs::path normal = fs::path(path).lexically_normal();
  if (normal.filename().empty()) normal = normal.parent_path();  // a trailing '/'
  int64_t it = iteration_of(normal.filename().string());
  std::string save_dir = normal.parent_path().string();
  if (it < 0) {
    const std::vector<int64_t> all = list_checkpoint_iterations(normal.string());
    if (all.empty()) throw HostError("checkpoint " + path + " holds no iter_NNNNNNN directory");
    // As training's load takes it: a tracker that holds no number is an error, not a reason to read
    // another iteration.
    save_dir = normal.string();
    it = tracked_or_newest_iteration(save_dir, all.back());
    normal = checkpoint_iter_dir(save_dir, it);
  }
  if (iteration) *iteration = it;
  if (const std::string why = ckpt::megatron_distributed_checkpoint(normal.string()); !why.empty())
    throw HostError("checkpoint: " + why);
  // The verdict inspect and training's load give: every file the manifest lists is there.
  if (verify) require_complete_iteration(save_dir, it);
  return normal.string();
}

std::string checkpoint_config_text(const std::string& iter_dir, const ChecksumCheck& check) {
  if (const std::string why = ckpt::megatron_distributed_checkpoint(iter_dir); !why.empty())
    throw HostError("checkpoint: " + why);
  const ckpt::Checksums sums = ckpt::checksums_to_check(iter_dir, check.verify, check.skip_hint);
  const std::string relative = ckpt::first_rank_dir(iter_dir) + "/" + ckpt::kModelFile;
  const auto d = ckpt::read_pickled_dict((fs::path(iter_dir) / relative).string(), "", &sums, relative);
  auto it = d.find(c10::IValue(std::string("config")));
  if (it == d.end() || !it->value().isString())
    throw HostError("checkpoint " + (fs::path(iter_dir) / relative).string() +
                    " records no run configuration (written by another program?)");
  return it->value().toStringRef();
}

namespace {

// What inspect shows: the save directory and one of its iterations.
struct InspectTarget {
  std::string save_dir;
  int64_t iteration = -1;
  std::string tracker_problem;  // a save directory's tracker exists but names no iteration
};

// The report's head: the save directory, its tracker and its iterations. `path` is an iteration
// directory (that iteration is shown) or a save directory (its tracker's iteration, else its newest).
InspectTarget print_save_dir(const std::string& path, std::ostream& out) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) throw HostError("checkpoint inspect: " + path + " is not a directory");
  fs::path normal = fs::path(path).lexically_normal();
  if (normal.filename().empty()) normal = normal.parent_path();  // a trailing '/'
  InspectTarget target;
  target.iteration = iteration_of(normal.filename().string());
  target.save_dir = target.iteration >= 0 ? normal.parent_path().string() : normal.string();
  if (target.save_dir.empty()) target.save_dir = ".";

  out << "checkpoint directory: " << target.save_dir << "\n";
  int64_t tracked = -1;
  try {
    tracked = read_checkpoint_tracker(target.save_dir);
    out << "  tracker: latest_checkpointed_iteration.txt names iteration " << tracked << "\n";
  } catch (const std::exception& e) {
    out << "  tracker: " << ckpt::first_line(e.what()) << "\n";
    // Loading the save directory reads the tracker first: one that exists but names no iteration
    // stops a load (checkpoint_verdict).
    if (target.iteration < 0 && fs::exists(checkpoint_tracker_file(target.save_dir), ec))
      target.tracker_problem = ckpt::first_line(e.what());
  }
  const std::vector<int64_t> all = list_checkpoint_iterations(target.save_dir);
  if (all.empty()) throw HostError("checkpoint inspect: " + target.save_dir + " holds no iter_NNNNNNN directory");
  if (target.iteration < 0) target.iteration = tracked >= 0 ? tracked : all.back();
  out << "  iterations:";
  for (int64_t it : all) {
    const IterationState st = check_checkpoint_iteration(target.save_dir, it, false);
    out << " " << it << (st.complete ? "" : " (incomplete)") << (it == tracked ? " (tracker)" : "")
        << (it == all.back() ? "\n" : ",");
  }
  return target;
}

// What the checksum manifest says of one file (`relative` below the iteration directory): its
// recorded digest, or with --verify whether the file still has it. The first damage becomes `problem`.
std::string file_status(const std::string& full, const std::string& relative, const ckpt::Checksums& sums, bool verify,
                        std::string& problem) {
  if (!sums.present) return "";
  auto it = sums.sha256.find(relative);
  if (it == sums.sha256.end()) return "not in " + std::string(ckpt::kChecksumsFile);
  if (!verify) return "sha256 " + it->second.substr(0, 16) + "... (recorded)";
  std::string actual;
  try {
    actual = sha256_file_hex(full);
  } catch (const std::exception& e) {
    actual = "unreadable";
  }
  if (actual != it->second && problem.empty())
    problem = full + " is damaged (its SHA-256 differs from " + ckpt::kChecksumsFile + ")";
  return actual == it->second
             ? "sha256 " + it->second.substr(0, 16) + "... ok"
             : "DAMAGED: sha256 " + actual.substr(0, 16) + "..., recorded " + it->second.substr(0, 16) + "...";
}

// Files: size, digest, and what the manifest says of each; then the manifest's files that are
// gone. The first damaged or missing file becomes `problem` (unless there is one already).
void print_files(const std::string& iter_dir, const ckpt::Checksums& sums, const InspectOptions& options,
                 std::string& problem, std::ostream& out) {
  std::error_code ec;
  const std::vector<std::string> files = files_below(iter_dir);
  std::set<std::string> listed;
  for (const auto& [relative, hex] : sums.sha256) listed.insert(relative);
  out << "  files (" << (sums.present ? std::string(ckpt::kChecksumsFile) + (options.verify ? ", verified" : ", not verified: --noverify")
                                      : std::string("no ") + ckpt::kChecksumsFile + ": written before checksums, unverified")
      << "):\n";
  size_t wn = 0;
  for (const auto& f : files) wn = std::max(wn, f.size());
  for (const auto& f : files) {
    if (f == ckpt::kChecksumsFile) continue;
    const std::string full = (fs::path(iter_dir) / f).string();
    const auto bytes = static_cast<double>(fs::file_size(full, ec));
    const std::string status = file_status(full, f, sums, options.verify, problem);
    char buf[640];
    std::snprintf(buf, sizeof buf, "    %-*s  %10s  %s\n", static_cast<int>(wn), f.c_str(), megabytes(bytes).c_str(),
                  status.c_str());
    out << buf;
  }
  for (const auto& f : listed)
    if (!std::binary_search(files.begin(), files.end(), f)) {
      const fs::path path = fs::path(iter_dir) / f;
      const std::string why = not_a_file(path);  // as the load says it
      out << "    " << f << (why == " is missing" ? "  MISSING" : "  A DIRECTORY") << " (listed in "
          << ckpt::kChecksumsFile << ")\n";
      if (problem.empty()) problem = path.string() + why;
    }
}

// The parallel layout, as the first rank's main file records it. Pipeline stages (Megatron's
// mp_rank_TT_PPP directories) are told apart from a single stage by the first rank directory's name.
struct RankLayout {
  int64_t tp_size = 1, pp_size = 1, ep_size = 1, shards = 0;
  // (Expert-parallel rank ep's: each holds its own experts and everything else the same.)
  std::string rank_dir(int64_t tp, int64_t pp, int64_t ep = 0) const {
    return ckpt::mp_rank_dir(static_cast<int>(tp), static_cast<int>(pp), static_cast<int>(pp_size),
                             static_cast<int>(ep), static_cast<int>(ep_size));
  }
};

c10::IValue dict_entry(const c10::impl::GenericDict& d, const char* key) {
  auto it = d.find(c10::IValue(std::string(key)));
  return it == d.end() ? c10::IValue() : it->value();
}

// The learning-rate schedule, the loss scaler and the writers (dtk and its plugins), as saved.
void print_schedule_and_writers(const c10::impl::GenericDict& d, std::ostream& out) {
  const c10::IValue sched = dict_entry(d, "opt_param_scheduler");
  if (sched.isGenericDict()) {
    const auto g = sched.toGenericDict();
    out << "  learning-rate schedule: " << int_entry(g, "lr_decay_style") << ", max lr " << int_entry(g, "max_lr")
        << ", min lr " << int_entry(g, "min_lr") << ", warm-up " << int_entry(g, "lr_warmup_iters")
        << " iterations, decay over " << int_entry(g, "lr_decay_iters") << "\n";
    // Megatron-DeepSpeed's token counts, when the schedule has them.
    const bool warmup_tokens = dict_entry(g, "lr_warmup_tokens").isInt(),
               decay_tokens = dict_entry(g, "lr_decay_tokens").isInt();
    if (warmup_tokens || decay_tokens)
      out << "  counted in tokens: warm-up " << (warmup_tokens ? int_entry(g, "lr_warmup_tokens") : "in iterations")
          << ", decay " << (decay_tokens ? int_entry(g, "lr_decay_tokens") : "in iterations") << "; "
          << int_entry(g, "num_tokens") << " tokens at the last step\n";
  }
  const c10::IValue scaler = dict_entry(d, "grad_scaler");
  if (scaler.isGenericDict()) {
    const auto g = scaler.toGenericDict();
    out << "  loss scaler: scale " << int_entry(g, "scale") << ", growth tracker " << int_entry(g, "growth_tracker")
        << ", hysteresis " << int_entry(g, "hysteresis_tracker") << "\n";
  }
  if (dict_entry(d, "no_save_optim").isBool())
    out << "  saved without the optimizer's state (checkpoint.no_save_optim): load it with "
           "checkpoint.no_load_optim=true or checkpoint.finetune=true\n";
  if (!dict_entry(d, "rng").isTensor())
    out << "  saved without the host's random generators (checkpoint.no_save_rng): load it with "
           "checkpoint.no_load_rng=true or checkpoint.finetune=true\n";
  out << "  written by: dtk " << int_entry(d, "dtk_version") << "\n";
  if (dict_entry(d, "plugins").isString()) {
    std::istringstream lines(dict_entry(d, "plugins").toStringRef());
    std::string line;
    while (std::getline(lines, line))
      if (!line.empty()) out << "    " << line << "\n";
  }
}

// From the first rank's main file: progress, layout (read into `layout`), schedule, writers; the
// saved config into `config_text`.
void print_run_header(const c10::impl::GenericDict& d, RankLayout& layout, std::string& config_text,
                      std::ostream& out) {
  auto get = [&](const char* key) { return dict_entry(d, key); };
  if (get("tensor_model_parallel_size").isInt())
    layout.tp_size = std::max<int64_t>(1, get("tensor_model_parallel_size").toInt());
  if (get("pipeline_model_parallel_size").isInt())
    layout.pp_size = std::max<int64_t>(1, get("pipeline_model_parallel_size").toInt());
  if (get("optimizer_shards").isInt()) layout.shards = get("optimizer_shards").toInt();
  if (get("expert_model_parallel_size").isInt())
    layout.ep_size = std::max<int64_t>(1, get("expert_model_parallel_size").toInt());
  out << "  iteration " << int_entry(d, "iteration") << ", consumed samples: train "
      << int_entry(d, "consumed_train_samples") << ", validation " << int_entry(d, "consumed_valid_samples")
      << "; scheduler step " << int_entry(d, "scheduler_step") << "\n";
  out << "  layout: tensor-parallel " << layout.tp_size;
  const int64_t chunks =
      get("virtual_pipeline_model_parallel_size").isInt() ? get("virtual_pipeline_model_parallel_size").toInt() : 1;
  if (layout.pp_size > 1) out << ", pipeline-parallel " << layout.pp_size;
  if (chunks > 1) out << " with " << chunks << " model chunks per rank (interleaved)";
  if (layout.pp_size > 1) out << " (stage 0 shown)";
  out << ", data-parallel " << int_entry(d, "data_parallel_size");
  if (layout.ep_size > 1) out << " of which expert-parallel " << layout.ep_size << " (expert-parallel rank 0 shown)";
  if (layout.shards > 0) out << ", optimizer state sharded over " << layout.shards << " data-parallel files";
  out << "\n";
  const PipelineSplit split =
      ckpt::read_pipeline_split(d, static_cast<int32_t>(layout.pp_size * std::max<int64_t>(1, chunks)),
                                static_cast<int32_t>(std::max<int64_t>(1, chunks)));
  if (!split.even()) out << "  layers over the pipeline stages: " << describe_pipeline_split(split) << "\n";
  print_schedule_and_writers(d, out);
  if (get("config").isString()) config_text = get("config").toStringRef();
}

// One rank's main file: its tensor counts and sizes, its model tensors, and with --all_tensors
// its optimizer and strategy tensors.
void print_rank_tensors(const std::string& relative, const c10::impl::GenericDict& d, const InspectOptions& options,
                        std::ostream& out) {
  auto get = [&](const char* key) { return dict_entry(d, key); };
  const TensorStats m = stats_of(get("model")), o = stats_of(get("optimizer")), s = stats_of(get("strategy"));
  char buf[256];
  std::snprintf(buf, sizeof buf, "  %s: model %lld tensors, %lld elements, %s", relative.c_str(),
                static_cast<long long>(m.count), static_cast<long long>(m.elements),
                megabytes(static_cast<double>(m.bytes)).c_str());
  out << buf;
  if (o.count) out << "; optimizer " << o.count << " tensors, " << megabytes(static_cast<double>(o.bytes));
  if (s.count) out << "; strategy " << s.count << " tensors, " << megabytes(static_cast<double>(s.bytes));
  out << "\n";
  list_tensors(get("model"), out);
  if (options.all_tensors) {
    if (o.count) {
      out << "    optimizer:\n";
      list_tensors(get("optimizer"), out);
    }
    if (s.count) {
      out << "    strategy:\n";
      list_tensors(get("strategy"), out);
    }
  }
}

// The main file of each tensor-parallel rank of the first stage: progress, layout, writers,
// tensors. Returns the layout the first rank records; stops at the first file it cannot read.
RankLayout print_rank_files(const std::string& iter_dir, const InspectOptions& options, std::string& config_text,
                            std::string& problem, std::ostream& out) {
  RankLayout layout;
  layout.pp_size = ckpt::first_rank_dir(iter_dir) != ckpt::mp_rank_dir(0) ? 2 : 1;
  for (int64_t tp = 0; tp < layout.tp_size; ++tp) {
    // The first rank's directory as found (its main file says the layout of the others).
    const std::string relative =
        (tp == 0 ? ckpt::first_rank_dir(iter_dir) : layout.rank_dir(tp, 0)) + "/" + ckpt::kModelFile;
    const std::string file = (fs::path(iter_dir) / relative).string();
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    try {
      d = ckpt::read_pickled_dict(file);
    } catch (const std::exception& e) {
      if (problem.empty()) problem = ckpt::first_line(e.what());
      out << "  " << relative << ": " << ckpt::first_line(e.what()) << "\n";
      break;
    }
    if (tp == 0) print_run_header(d, layout, config_text, out);
    print_rank_tensors(relative, d, options, out);
  }
  return layout;
}

// Every stage's files are checked, the first stage's shown: the sharded optimizer state (one file
// per data-parallel and tensor-parallel rank; its tensors with --all_tensors), then the main file
// of every rank not shown above (every expert-parallel rank's).
void check_other_files(const std::string& iter_dir, const RankLayout& layout, const InspectOptions& options,
                       std::string& problem, std::ostream& out) {
  std::error_code ec;
  for (int64_t pp = 0; pp < layout.pp_size; ++pp)
    for (int64_t tp = 0; tp < layout.tp_size && layout.shards > 0; ++tp)
      for (int64_t dp = 0; dp < layout.shards; ++dp) {
        // (Each DP rank's file is in its expert-parallel rank's directory: dp % ep_size.)
        const std::string relative =
            layout.rank_dir(tp, pp, dp % layout.ep_size) + "/" + ckpt::shard_file_name(static_cast<int>(dp));
        const std::string file = (fs::path(iter_dir) / relative).string();
        if (!fs::is_regular_file(file, ec)) {
          if (problem.empty())
            problem = file + " is missing (the checkpoint has " + std::to_string(layout.shards) + " shards)";
          continue;
        }
        if (!options.all_tensors || pp > 0) continue;
        try {
          const auto d = ckpt::read_pickled_dict(file);
          out << "  " << relative << ":\n    optimizer:\n";
          list_tensors(d.at("optimizer"), out);
        } catch (const std::exception& e) {
          if (problem.empty()) problem = ckpt::first_line(e.what());
        }
      }
  for (int64_t ep = 0; ep < layout.ep_size; ++ep)
    for (int64_t pp = 0; pp < layout.pp_size; ++pp)
      for (int64_t tp = pp == 0 && ep == 0 ? 1 : 0; tp < layout.tp_size; ++tp) {
        const fs::path f = fs::path(iter_dir) / layout.rank_dir(tp, pp, ep) / ckpt::kModelFile;
        if (!fs::is_regular_file(f, ec) && problem.empty()) problem = f.string() + not_a_file(f);
      }
}

// The saved config, one line per section (the text format in single-line mode); as saved if it
// does not parse.
void print_saved_config(const std::string& config_text, std::ostream& out) {
  out << "  config:\n";
  config::RunConfig cfg;
  if (google::protobuf::TextFormat::ParseFromString(config_text, &cfg)) {
    google::protobuf::TextFormat::Printer printer;
    printer.SetSingleLineMode(true);
    const auto* reflection = cfg.GetReflection();
    std::vector<const google::protobuf::FieldDescriptor*> fields;
    reflection->ListFields(cfg, &fields);
    for (const auto* field : fields) {
      std::string text;
      printer.PrintFieldValueToString(cfg, field, -1, &text);
      out << "    " << field->name() << " { " << text << "}\n";
    }
  } else {
    std::istringstream lines(config_text);
    std::string line;
    while (std::getline(lines, line)) out << "    " << line << "\n";
  }
}

}  // namespace

std::string inspect_checkpoint(const std::string& path, const InspectOptions& options, std::ostream& out) {
  const InspectTarget target = print_save_dir(path, out);
  std::error_code ec;
  const std::string iter_dir = checkpoint_iter_dir(target.save_dir, target.iteration);
  out << "\niteration " << target.iteration << ": " << iter_dir << "\n";
  if (!fs::is_directory(iter_dir, ec)) return iter_dir + ckpt::not_a_directory(iter_dir);
  if (std::string why = ckpt::megatron_distributed_checkpoint(iter_dir); !why.empty()) {
    out << "complete: NO: " << why << "\n";
    return why;
  }
  // The first thing found wrong, in the order the report finds it; empty when complete.
  std::string problem;
  ckpt::Checksums sums;
  try {
    sums = ckpt::read_checksums(iter_dir);
  } catch (const std::exception& e) {
    problem = ckpt::first_line(e.what());
  }
  print_files(iter_dir, sums, options, problem, out);
  std::string config_text;
  const RankLayout layout = print_rank_files(iter_dir, options, config_text, problem, out);
  check_other_files(iter_dir, layout, options, problem, out);
  if (!config_text.empty()) print_saved_config(config_text, out);
  // The verdict a load and checkpoint.fallback use, so that inspect never calls complete what
  // training refuses (the report above already hashed the files when verifying).
  if (problem.empty()) problem = checkpoint_verdict(target.save_dir, target.iteration, false);
  if (problem.empty() && !target.tracker_problem.empty())
    problem = target.tracker_problem + " (a load of " + target.save_dir +
              " stops there; checkpoint.fallback=true loads the newest complete iteration)";
  if (problem.empty() && !sums.present)
    out << "complete: yes (unverified: no " << ckpt::kChecksumsFile << ")\n";
  else if (problem.empty())
    out << "complete: yes (" << sums.sha256.size() << (sums.sha256.size() == 1 ? " file" : " files") << (options.verify ? ", every checksum matches" : "")
        << ")\n";
  else
    out << "complete: NO: " << problem << "\n";
  return problem;
}

TensorList read_model_state(const std::string& iter_dir, int tp_rank, bool verify) {
  const ckpt::Checksums sums = ckpt::checksums_to_check(iter_dir, verify, "--noverify");
  const ckpt::StageDirs dirs = ckpt::saved_stage_dirs(iter_dir, sums);
  if (dirs.staged)
    throw HostError("checkpoint " + iter_dir + " was saved with pipeline stages (" + ckpt::first_rank_dir(iter_dir) +
                    "): this command needs the whole model in one stage (dtk checkpoint convert SRC DST "
                    "--pipeline_model_parallel_size 1 makes one)");
  // Under expert parallelism every expert-parallel rank's directory, each with its own experts.
  return ckpt::read_stage_model(iter_dir, tp_rank, dirs.ep, sums);
}

}  // namespace dtk::core
