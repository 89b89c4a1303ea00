// Checkpoint files: see checkpoint_io.hpp.
#include "checkpoint_io.hpp"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "dtk/core/checkpoint/layout.hpp"
#include "dtk/core/checkpoint/sha256.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core::ckpt {

namespace fs = std::filesystem;
using host::HostError;

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

bool read_file_bytes(const std::string& path, std::string* bytes) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) return false;
  if (st.type() == fs::file_type::directory) throw HostError("checkpoint: " + path + " is a directory, not a file");
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    if (errno == ENOENT) return false;
    throw HostError("checkpoint: cannot read " + path + ": " + std::strerror(errno));
  }
  bytes->clear();
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes->append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) throw HostError("checkpoint: reading " + path + " failed: " + std::strerror(err));
  return true;
}

std::string mp_rank_dir(int tp_rank, int pp_rank, int pp_size, int ep_rank, int ep_size) {
  char buf[48];
  if (pp_size > 1)
    std::snprintf(buf, sizeof buf, "mp_rank_%02d_%03d", tp_rank, pp_rank);
  else
    std::snprintf(buf, sizeof buf, "mp_rank_%02d", tp_rank);
  std::string name = buf;
  // Megatron's expert-parallel suffix: each expert-parallel rank saves its own experts.
  if (ep_size > 1) {
    std::snprintf(buf, sizeof buf, "_%03d", ep_rank);
    name += buf;
  }
  return name;
}

std::string first_rank_dir(const std::string& iter_dir) {
  std::error_code ec;
  // One stage, pipeline stages (or one stage with expert parallelism: the same name), or both.
  for (const std::string& name : {mp_rank_dir(0), mp_rank_dir(0, 0, 2), mp_rank_dir(0, 0, 2, 0, 2)})
    if (fs::is_directory(fs::path(iter_dir) / name, ec)) return name;
  return mp_rank_dir(0);
}

std::string megatron_distributed_checkpoint(const std::string& iter_dir) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::path(iter_dir) / "metadata.json", ec) ||
      fs::is_directory(fs::path(iter_dir) / first_rank_dir(iter_dir), ec))
    return "";
  return iter_dir +
         " is a Megatron distributed checkpoint (--ckpt-format torch_dist: metadata.json, no mp_rank_* "
         "directories); DTK reads Megatron's torch format: convert it with Megatron (--load <its save directory> "
         "--ckpt-convert-format torch --ckpt-convert-save <D>), then load <D>/torch";
}

int64_t saved_expert_parallel_size(const std::string& iter_dir) {
  try {
    const auto d = read_pickled_dict((fs::path(iter_dir) / first_rank_dir(iter_dir) / kModelFile).string());
    auto it = d.find(c10::IValue(std::string("expert_model_parallel_size")));
    return it != d.end() && it->value().isInt() ? std::max<int64_t>(1, it->value().toInt()) : 1;
  } catch (const std::exception&) {
    return -1;
  }
}

StageDirs saved_stage_dirs(const std::string& iter_dir, const Checksums& sums) {
  const std::string first = first_rank_dir(iter_dir);
  if (first == mp_rank_dir(0)) return {};
  if (first == mp_rank_dir(0, 0, 2, 0, 2)) return {true, 1};
  const std::string relative = first + "/" + kModelFile;
  const auto d = read_pickled_dict((fs::path(iter_dir) / relative).string(), "", &sums, relative);
  StageDirs out;
  auto ep = d.find(c10::IValue(std::string("expert_model_parallel_size")));
  if (ep != d.end() && ep->value().isInt()) out.ep = std::max<int64_t>(1, ep->value().toInt());
  auto pp = d.find(c10::IValue(std::string("pipeline_model_parallel_size")));
  // Saved before the file recorded its pipeline size: the suffix is expert parallelism's only when
  // the file records that.
  out.staged = pp != d.end() && pp->value().isInt() ? pp->value().toInt() > 1 : out.ep == 1;
  return out;
}

TensorList read_stage_model(const std::string& iter_dir, int tp_rank, int64_t ep_size, const Checksums& sums,
                            c10::impl::GenericDict* first, const std::string& hint) {
  TensorList out;
  std::set<std::string> seen;
  for (int64_t ep = 0; ep < ep_size; ++ep) {
    const std::string relative =
        mp_rank_dir(tp_rank, 0, 1, static_cast<int>(ep), static_cast<int>(ep_size)) + "/" + kModelFile;
    const std::string file = (fs::path(iter_dir) / relative).string();
    const c10::impl::GenericDict d = read_pickled_dict(file, hint, &sums, relative);
    if (ep == 0 && first) *first = d;
    if (!d.contains("model")) throw HostError("checkpoint " + file + " has no 'model' entry");
    for (auto& [name, t] : from_dict(d.at("model"), file, "model"))
      if (seen.insert(name).second) out.emplace_back(name, t);
  }
  return out;
}

void insert_pipeline_split(c10::impl::GenericDict& d, const PipelineSplit& split) {
  for (const char* key : {"decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                          "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"})
    (void)d.erase(key);
  if (split.first_stage_layers) d.insert("decoder_first_pipeline_num_layers", split.first_stage_layers);
  if (split.last_stage_layers) d.insert("decoder_last_pipeline_num_layers", split.last_stage_layers);
  if (split.embedding_in_split) d.insert("account_for_embedding_in_pipeline_split", true);
  if (split.loss_in_split) d.insert("account_for_loss_in_pipeline_split", true);
}

PipelineSplit read_pipeline_split(const c10::impl::GenericDict& d, int32_t stages, int32_t chunks) {
  PipelineSplit s;
  s.stages = stages, s.chunks = chunks;
  auto entry = [&](const char* key) {
    auto it = d.find(c10::IValue(std::string(key)));
    return it == d.end() ? c10::IValue() : it->value();
  };
  if (const c10::IValue v = entry("decoder_first_pipeline_num_layers"); v.isInt()) s.first_stage_layers = v.toInt();
  if (const c10::IValue v = entry("decoder_last_pipeline_num_layers"); v.isInt()) s.last_stage_layers = v.toInt();
  s.embedding_in_split = entry("account_for_embedding_in_pipeline_split").isBool() &&
                         entry("account_for_embedding_in_pipeline_split").toBool();
  s.loss_in_split =
      entry("account_for_loss_in_pipeline_split").isBool() && entry("account_for_loss_in_pipeline_split").toBool();
  return s;
}

// "optim_dp_rank_003.pt": data-parallel rank 3's optimizer and strategy state (sharded strategies).
std::string shard_file_name(int dp_rank) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "optim_dp_rank_%03d.pt", dp_rank);
  return buf;
}

// The host keeps a save directory shared between machines safe from another machine's cleanup.
std::string temp_owner(int64_t pid) {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  std::string h = host;
  for (char& c : h)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_') c = '_';
  return h + "-" + std::to_string(pid);
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) throw HostError("checkpoint: cannot open " + path + " to sync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw HostError("checkpoint: fsync " + path + " failed: " + std::strerror(err));
}

void write_file_synced(const std::string& path, const char* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw HostError("checkpoint: cannot create " + path + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      std::string room;
      if (err == ENOSPC || err == EDQUOT) {  // say how much was needed
        struct statvfs fs_info {};
        const std::string dir = fs::path(path).parent_path().string();
        const double free_mb =
            ::statvfs(dir.c_str(), &fs_info) == 0 ? static_cast<double>(fs_info.f_bavail) * fs_info.f_frsize / 1e6 : -1;
        char buf[160];
        std::snprintf(buf, sizeof buf, " (this file needs %.1f MB; %.1f MB free there)", static_cast<double>(size) / 1e6,
                      std::max(0.0, free_mb + static_cast<double>(done) / 1e6));
        room = buf;
      }
      throw HostError("checkpoint: writing " + path + " failed: " + std::strerror(err) + room);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0)
    throw HostError("checkpoint: syncing " + path + " failed: " + std::strerror(errno));
}

Written write_pickle(const std::string& path, const c10::IValue& value) {
  const std::vector<char> data = torch::jit::pickle_save(value);
  Written w;
  w.sha256 = sha256_hex(data.data(), data.size());
  write_file_synced(path, data.data(), data.size());
  w.bytes = static_cast<int64_t>(data.size());
  return w;
}

Checksums read_checksums(const std::string& iter_dir) {
  Checksums sums;
  const std::string file = (fs::path(iter_dir) / kChecksumsFile).string();
  std::string text;
  if (!read_file_bytes(file, &text)) return sums;
  std::istringstream in(text);
  sums.present = true;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    // "<hex>  <name>" (text mode) or "<hex> *<name>" (binary mode): both sha256sum's.
    const bool ok = line.size() > 66 && line[64] == ' ' && (line[65] == ' ' || line[65] == '*') &&
                    std::all_of(line.begin(), line.begin() + 64, [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
    if (!ok) throw HostError("checkpoint " + file + " line " + std::to_string(number) + " is not '<sha256>  <file>'");
    std::string hex = line.substr(0, 64);
    for (char& c : hex) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const std::string name = line.substr(66);
    // Every entry names a file inside the iteration folder (what a save writes); one outside it
    // would verify, or be reported missing, in another folder.
    const fs::path path(name);
    if (path.is_absolute() || std::any_of(path.begin(), path.end(), [](const fs::path& part) { return part == ".."; }))
      throw HostError("checkpoint " + file + " line " + std::to_string(number) + " names '" + name +
                      "', a path outside the checkpoint");
    sums.sha256[name] = hex;
  }
  return sums;
}

Checksums checksums_to_check(const std::string& iter_dir, bool verify, const std::string& skip_hint) {
  Checksums sums = verify ? read_checksums(iter_dir) : Checksums{};
  sums.skip_hint = skip_hint;
  return sums;
}

c10::impl::GenericDict read_pickled_dict(const std::string& file, const std::string& hint, const Checksums* sums,
                                         const std::string& relative) {
  std::string bytes;
  if (!read_file_bytes(file, &bytes)) throw HostError("checkpoint: " + file + " does not exist" + hint);
  std::vector<char> data(bytes.begin(), bytes.end());
  bytes = std::string();
  if (sums && sums->present) {
    auto it = sums->sha256.find(relative);
    if (it == sums->sha256.end())
      throw HostError("checkpoint " + file + " is not listed in its " + kChecksumsFile + " (" + sums->skip_hint +
                      " loads it unverified)");
    const std::string actual = sha256_hex(data.data(), data.size());
    if (actual != it->second)
      throw HostError("checkpoint " + file + " is damaged: its SHA-256 is " + actual.substr(0, 16) + "..., " +
                      kChecksumsFile + " recorded " + it->second.substr(0, 16) + "... when it was saved (" +
                      std::to_string(data.size()) + " bytes now; " + sums->skip_hint + " loads it anyway)");
  }
  c10::IValue root;
  try {
    if (data.empty()) throw std::runtime_error("empty file");
    root = torch::jit::pickle_load(data);
  } catch (const std::exception& e) {
    throw HostError("checkpoint " + file + " is truncated or corrupt: " + first_line(e.what()));
  }
  if (!root.isGenericDict()) throw HostError("checkpoint " + file + " does not hold a dict");
  return root.toGenericDict();
}

// Atomically puts `from` at `to`: rename when `to` does not exist, else exchange the two
// (renameat2 RENAME_EXCHANGE) so that `to` is the old or the new directory at every instant;
// `from` then holds the old one, which the caller removes.
void move_into_place(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (!fs::exists(to, ec)) {
    fs::rename(from, to, ec);
    if (ec) throw HostError("checkpoint: rename " + from + " -> " + to + " failed: " + ec.message());
    return;
  }
#ifdef SYS_renameat2
  constexpr unsigned kExchange = 1u << 1;  // RENAME_EXCHANGE
  if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), kExchange) == 0) return;
#endif
  // No exchange on this filesystem: move the old one aside first (the tracker file still names
  // the previous iteration unless this one is re-saved, so the window is that of a re-save only).
  const std::string aside = from + ".old";
  fs::rename(to, aside, ec);
  if (ec) throw HostError("checkpoint: replacing " + to + " failed: " + ec.message());
  fs::rename(from, to, ec);
  if (ec) {
    // The old one goes back where it was: `from` (the new save) is the caller's to remove.
    std::error_code back;
    fs::rename(aside, to, back);
    throw HostError("checkpoint: replacing " + to + " failed: " + ec.message());
  }
  fs::rename(aside, from, ec);
}

// latest_checkpointed_iteration.txt through a temporary file, fsync and rename.
void write_tracker(const std::string& save_dir, int64_t iteration) {
  const std::string tracker = checkpoint_tracker_file(save_dir);
  const std::string tracker_tmp = tracker + ".tmp-" + temp_owner(::getpid());
  const std::string text = std::to_string(iteration) + "\n";
  write_file_synced(tracker_tmp, text.data(), text.size());
  std::error_code ec;
  fs::rename(tracker_tmp, tracker, ec);
  if (ec) {
    std::error_code rm;
    fs::remove(tracker_tmp, rm);
    throw HostError("checkpoint: rename " + tracker_tmp + " -> " + tracker + " failed: " + ec.message());
  }
  fsync_path(save_dir, true);
}

int64_t write_offline_checkpoint(const std::string& save_dir, int64_t iteration,
                                 const std::vector<c10::impl::GenericDict>& rank_files, int tp_size, int pp_size,
                                 int ep_size) {
  if (tp_size <= 0) tp_size = static_cast<int>(rank_files.size());
  std::error_code ec;
  fs::create_directories(save_dir, ec);
  if (ec) throw HostError("checkpoint: cannot create " + save_dir + ": " + ec.message());
  const std::string final_dir = checkpoint_iter_dir(save_dir, iteration);
  const std::string tmp_dir = final_dir + ".tmp-" + temp_owner(::getpid());
  int64_t bytes = 0;
  try {
    std::string sums;
    for (size_t r = 0; r < rank_files.size(); ++r) {
      const int tp = static_cast<int>(r) % tp_size, ep = static_cast<int>(r) / tp_size % ep_size;
      const std::string name = mp_rank_dir(tp, static_cast<int>(r) / tp_size / ep_size, pp_size, ep, ep_size);
      const std::string rank_dir = (fs::path(tmp_dir) / name).string();
      fs::create_directories(rank_dir, ec);
      if (ec) throw HostError("checkpoint: cannot create " + rank_dir + ": " + ec.message());
      const Written w = write_pickle((fs::path(rank_dir) / kModelFile).string(), c10::IValue(rank_files[r]));
      fsync_path(rank_dir, true);
      sums += w.sha256 + "  " + name + "/" + kModelFile + "\n";
      bytes += w.bytes;
    }
    write_file_synced((fs::path(tmp_dir) / kChecksumsFile).string(), sums.data(), sums.size());
    fsync_path(tmp_dir, true);
    move_into_place(tmp_dir, final_dir);
    fs::remove_all(tmp_dir, ec);  // the replaced old directory, if any
    write_tracker(save_dir, iteration);
  } catch (...) {
    std::error_code rm;
    fs::remove_all(tmp_dir, rm);
    throw;
  }
  return bytes;
}

TensorList from_dict(const c10::IValue& v, const std::string& file, const char* key) {
  if (!v.isGenericDict()) throw HostError("checkpoint " + file + ": '" + key + "' is not a dict of tensors");
  TensorList out;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.key().isString() || !kv.value().isTensor())
      throw HostError("checkpoint " + file + ": '" + key + "' is not a dict of tensors");
    out.emplace_back(kv.key().toStringRef(), kv.value().toTensor());
  }
  return out;
}


c10::Dict<std::string, at::Tensor> slices_to_dict(const SliceMap& slices) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [name, s] : slices)
    d.insert(name, at::tensor(std::vector<int64_t>{s.offset, s.numel, s.full_numel}, at::kLong));
  return d;
}

SliceMap slices_from_dict(const TensorList& list, const std::string& file) {
  SliceMap out;
  for (const auto& [name, t] : list) {
    if (t.scalar_type() != at::kLong || t.numel() != 3)
      throw HostError("checkpoint " + file + ": param_slices['" + name + "'] is not [offset, numel, full_numel]");
    const int64_t* v = t.contiguous().data_ptr<int64_t>();
    if (v[0] < 0 || v[1] < 0 || v[0] + v[1] > v[2])
      throw HostError("checkpoint " + file + ": param_slices['" + name + "'] is outside its parameter");
    out[name] = ParamSlice{v[0], v[1], v[2]};
  }
  return out;
}

Shard read_shard(const std::string& rank_dir, int dp_rank, int64_t shards, const Checksums& sums) {
  const std::string name = shard_file_name(dp_rank);
  const std::string where = (fs::path(rank_dir) / name).string();
  const c10::impl::GenericDict d =
      read_pickled_dict(where, " (the checkpoint has " + std::to_string(shards) + " data-parallel shard files)", &sums,
                        fs::path(rank_dir).filename().string() + "/" + name);
  for (const char* key : {"optimizer", "strategy", "param_slices"})
    if (!d.contains(key)) throw host::HostError("checkpoint " + where + " has no '" + key + "' entry");
  Shard s;
  s.optimizer = from_dict(d.at("optimizer"), where, "optimizer");
  s.strategy = from_dict(d.at("strategy"), where, "strategy");
  s.slices = slices_from_dict(from_dict(d.at("param_slices"), where, "param_slices"), where);
  return s;
}

std::string not_a_directory(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::exists(dir, ec) ? " is not a directory" : " does not exist";
}

}  // namespace dtk::core::ckpt
