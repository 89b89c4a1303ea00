#include "swap.hpp"

#include <algorithm>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <unordered_map>

namespace fs = std::filesystem;

namespace dtk::zero {

namespace {

constexpr int64_t kAlignElems = AsyncFile::kAlign / static_cast<int64_t>(sizeof(float));
int64_t padded(int64_t numel) { return (numel + kAlignElems - 1) / kAlignElems * kAlignElems; }
double mb(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::string host_name() {
  char h[256] = {0};
  if (::gethostname(h, sizeof h - 1) != 0) return "host";
  return h;
}

// "dtk-zero-<kind>-<host>-": the swap files of this host (kind: optimizer, params); the pid and
// the rank follow.
std::string file_prefix(const std::string& kind) { return "dtk-zero-" + kind + "-" + host_name() + "-"; }

std::string fixed(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

[[noreturn]] void not_adam(const std::string& what) {
  throw Error(
      "zero: offload_optimizer=nvme steps the optimizer one slice of parameters at a time and needs the "
      "Adam plugins' state (cpu_adam): " +
      what);
}

}  // namespace

struct OptimizerSwap::Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (base) ::munmap(base, bytes);
  }
};

std::string swap_file_path(const std::string& dir, const std::string& kind, const std::string& rank_tag) {
  return (fs::path(dir) / (file_prefix(kind) + std::to_string(::getpid()) + "-" + rank_tag + ".swap")).string();
}

std::vector<std::string> remove_stale_swap_files(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::string prefix;
    for (const char* kind : {"optimizer", "params"})
      if (name.rfind(file_prefix(kind), 0) == 0) prefix = file_prefix(kind);
    if (prefix.empty() || name.size() < 5 || name.substr(name.size() - 5) != ".swap") continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    // Only a process that is gone: another run sharing the directory keeps its files.
    if (pid <= 0 || pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code rm;
    if (fs::remove(e.path(), rm)) removed.push_back(e.path().string());
  }
  return removed;
}

OptimizerSwap::OptimizerSwap(const std::string& dir, const std::string& rank_tag, const std::vector<int64_t>& numels,
                             const std::vector<std::string>& names, int64_t buffer_bytes)
    : names_(names) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw Error("zero: strategy.nvme_path '" + dir + "' does not exist");
  if (!fs::is_directory(dir, ec)) throw Error("zero: strategy.nvme_path '" + dir + "' is not a directory");
  plan_slices(numels, buffer_bytes);
  params_.resize(numel_.size());
  has_moments_.assign(numel_.size(), 0);
  if (file_bytes_ == 0) return;  // no parameter on this rank
  const std::string path = swap_file_path(dir, "optimizer", rank_tag);
  try {
    file_ = std::make_unique<AsyncFile>(path, file_bytes_);
  } catch (const std::exception& e) {
    throw Error(std::string("zero: offload_optimizer=nvme: ") + e.what());
  }
  mapping_ = std::make_shared<Mapping>();
  void* base = ::mmap(nullptr, static_cast<size_t>(file_bytes_), PROT_READ | PROT_WRITE, MAP_SHARED, file_->fd(), 0);
  if (base == MAP_FAILED) throw Error("zero: cannot map swap file " + path + ": " + std::strerror(errno));
  mapping_->base = base, mapping_->bytes = static_cast<size_t>(file_bytes_);
  // Two halves of slot_numel_ elements on the I/O boundary, from the host allocator (pinned on a
  // GPU run, so the updated masters copy to the device from it directly).
  buffer_ = Device::pinned_empty({2 * slot_numel_ + kAlignElems}, at::kFloat);
  const auto addr = reinterpret_cast<uintptr_t>(buffer_.data_ptr<float>());
  aligned_ = reinterpret_cast<float*>((addr + AsyncFile::kAlign - 1) / AsyncFile::kAlign * AsyncFile::kAlign);
  for (size_t i = 0; i < params_.size(); ++i) params_[i] = file_view(i, kMaster);
}

OptimizerSwap::~OptimizerSwap() = default;  // the file goes with file_; the mapping with its last view

void OptimizerSwap::plan_slices(const std::vector<int64_t>& numels, int64_t buffer_bytes) {
  numel_ = numels;
  local_.assign(numels.size(), 0);
  slice_of_.assign(numels.size(), 0);
  // Each half holds a slice's three kinds of state.
  slot_numel_ = buffer_bytes / 2 / static_cast<int64_t>(sizeof(float)) / kAlignElems * kAlignElems;
  int64_t largest = 0;
  size_t at = 0;
  for (size_t i = 0; i < numels.size(); ++i)
    if (padded(numels[i]) > largest) largest = padded(numels[i]), at = i;
  if (3 * largest > slot_numel_) {
    const int64_t need_mb = (2 * 3 * largest * static_cast<int64_t>(sizeof(float)) + (1 << 20) - 1) >> 20;
    throw Error("zero: strategy.nvme_buffer_mb=" + std::to_string(buffer_bytes >> 20) + " is too small: this rank's " +
                "shard of '" + names_[at] + "' (" + std::to_string(numels[at]) + " elements) needs " +
                std::to_string(need_mb) + " MB (fp32 master, exp_avg and exp_avg_sq, in each of the buffer's two " +
                "halves); set strategy.nvme_buffer_mb to at least " + std::to_string(need_mb));
  }
  int64_t offset = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    if (slices_.empty() || 3 * (slices_.back().numel + padded(numels[i])) > slot_numel_) {
      if (!slices_.empty()) offset += 3 * slices_.back().numel * static_cast<int64_t>(sizeof(float));
      slices_.push_back({i, i, offset, 0});
    }
    Slice& s = slices_.back();
    local_[i] = s.numel;
    slice_of_[i] = slices_.size() - 1;
    s.numel += padded(numels[i]);
    s.end = i + 1;
  }
  file_bytes_ = slices_.empty() ? 0 : offset + 3 * slices_.back().numel * static_cast<int64_t>(sizeof(float));
}

float* OptimizerSwap::file_ptr(size_t i, Kind kind) const {
  const Slice& s = slices_[slice_of_[i]];
  return reinterpret_cast<float*>(static_cast<char*>(mapping_->base) + s.offset) + kind * s.numel + local_[i];
}

at::Tensor OptimizerSwap::file_view(size_t i, Kind kind) const {
  // The view keeps the mapping: the optimizer's tensors may outlive this object.
  std::shared_ptr<Mapping> keep = mapping_;
  return at::from_blob(
      file_ptr(i, kind), {numel_[i]}, [keep](void*) {}, at::TensorOptions().dtype(at::kFloat));
}

float* OptimizerSwap::slot_base(int slot) const { return aligned_ + slot * slot_numel_; }

at::Tensor OptimizerSwap::slot_view(size_t i, Kind kind, int slot) const {
  const Slice& s = slices_[slice_of_[i]];
  const int64_t start = (slot_base(slot) - buffer_.data_ptr<float>()) + kind * s.numel + local_[i];
  return buffer_.narrow(0, start, numel_[i]);
}

OptimizerSwap::Moments OptimizerSwap::moments(const dtk_optimizer_ref* optimizer) const {
  const TensorList state = optimizer_state(optimizer);
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < names_.size(); ++i) index.emplace(names_[i], i);
  Moments m;
  m.exp_avg.resize(names_.size()), m.exp_avg_sq.resize(names_.size());
  for (const auto& [name, t] : state) {
    if (name == "step") {
      m.step = t.item<int64_t>();
      continue;
    }
    // "g<group>.<parameter>.exp_avg" / ".exp_avg_sq"
    const bool sq = name.size() > 11 && name.compare(name.size() - 11, 11, ".exp_avg_sq") == 0;
    const bool avg = !sq && name.size() > 8 && name.compare(name.size() - 8, 8, ".exp_avg") == 0;
    const size_t dot = name.find('.');
    if ((!sq && !avg) || name[0] != 'g' || dot == std::string::npos) continue;
    auto it = index.find(name.substr(dot + 1, name.size() - (sq ? 11 : 8) - dot - 1));
    if (it == index.end()) continue;
    (sq ? m.exp_avg_sq : m.exp_avg)[it->second] = t;
  }
  return m;
}

void OptimizerSwap::set_step(const dtk_optimizer_ref* optimizer, int64_t step) const {
  const TensorList state{{"step", at::scalar_tensor(step, at::kLong)}};
  MapView view(state);
  check(optimizer->api->state_load(optimizer->optimizer, view.get()));
}

void OptimizerSwap::take_moments(Moments& held, size_t i, const at::Tensor& m, const at::Tensor& v) {
  at::Tensor& a = held.exp_avg[i];
  at::Tensor& b = held.exp_avg_sq[i];
  if (!a.defined() || !b.defined()) not_adam("no exp_avg/exp_avg_sq for '" + names_[i] + "' after its step");
  if (a.numel() != numel_[i] || b.numel() != numel_[i] || a.scalar_type() != at::kFloat)
    not_adam("the moments of '" + names_[i] + "' are not fp32 tensors of its " + std::to_string(numel_[i]) +
             " elements");
  if (a.data_ptr() != m.data_ptr()) {
    m.copy_(a.reshape({-1}));
    a.set_data(m);
  }
  if (b.data_ptr() != v.data_ptr()) {
    v.copy_(b.reshape({-1}));
    b.set_data(v);
  }
  has_moments_[i] = 1;
}

// Re-points, never copies: the buffer halves hold other slices by now; the file has every one.
void OptimizerSwap::bind_to_file(const dtk_optimizer_ref* optimizer) {
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(file_view(i, kMaster));
  Moments held = moments(optimizer);
  for (size_t i = 0; i < params_.size(); ++i)
    if (has_moments_[i]) {
      held.exp_avg[i].set_data(file_view(i, kExpAvg));
      held.exp_avg_sq[i].set_data(file_view(i, kExpAvgSq));
    }
}

void OptimizerSwap::step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args,
                         const std::vector<at::Tensor>& grads,
                         const std::function<void(size_t, const at::Tensor&)>& updated) {
  if (slices_.empty()) {  // nothing on this rank: the optimizer still counts the step
    dtk::optimizer_step(optimizer, args);
    return;
  }
  Moments held = moments(optimizer);
  if (held.step < 0) not_adam("its state has no 'step'");
  // Moments the optimizer holds elsewhere (a resumed run loaded them) move into the file; then
  // every page written through the mapping reaches the disk before the direct reads below.
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].mutable_grad() = at::Tensor();
    if (held.exp_avg[i].defined() || held.exp_avg_sq[i].defined())
      take_moments(held, i, file_view(i, kExpAvg), file_view(i, kExpAvgSq));
  }
  if (::msync(mapping_->base, mapping_->bytes, MS_SYNC) != 0)
    throw Error("zero: flushing swap file " + file_->path() + ": " + std::strerror(errno));
  const int64_t step0 = held.step;
  auto bytes = [](const Slice& s) { return 3 * s.numel * static_cast<int64_t>(sizeof(float)); };
  try {
    file_->read(0, slot_base(0), slices_[0].offset, bytes(slices_[0]));
    for (size_t k = 0; k < slices_.size(); ++k) {
      const Slice& slice = slices_[k];
      const int s = static_cast<int>(k % 2);
      file_->wait(s);  // slice k is in half s
      if (k + 1 < slices_.size()) {
        file_->wait(1 - s);  // slice k-1 is written back: half 1-s takes slice k+1
        file_->read(1 - s, slot_base(1 - s), slices_[k + 1].offset, bytes(slices_[k + 1]));
      }
      for (size_t i = slice.first; i < slice.end; ++i) {
        params_[i].set_data(slot_view(i, kMaster, s));
        if (has_moments_[i]) {
          held.exp_avg[i].set_data(slot_view(i, kExpAvg, s));
          held.exp_avg_sq[i].set_data(slot_view(i, kExpAvgSq, s));
        }
        params_[i].mutable_grad() = grads[i];
      }
      if (k > 0) set_step(optimizer, step0);
      dtk::optimizer_step(optimizer, args);
      // The optimizer's state is asked again (a state_save over every parameter) only where this
      // step created moments (a parameter's first step) or nothing was checked yet: otherwise the
      // tensors in `held` are the ones it stepped, re-pointed above (once per slice, not
      // slices x parameters lookups per step).
      const bool created = std::any_of(has_moments_.begin() + static_cast<std::ptrdiff_t>(slice.first),
                                       has_moments_.begin() + static_cast<std::ptrdiff_t>(slice.end),
                                       [](char has) { return !has; });
      if (created || !checked_) {
        held = moments(optimizer);
        if (held.step != step0 + 1)
          not_adam("its step count went from " + std::to_string(step0) + " to " + std::to_string(held.step) +
                   " in one step of a slice ('step' not restored by state_load)");
      }
      for (size_t i = slice.first; i < slice.end; ++i) {
        // A first step created the moments in memory of its own: they move into the buffer.
        take_moments(held, i, slot_view(i, kExpAvg, s), slot_view(i, kExpAvgSq, s));
        params_[i].mutable_grad() = at::Tensor();
        updated(i, slot_view(i, kMaster, s));
      }
      if (!checked_) {
        const Moments again = moments(optimizer);
        for (size_t i = slice.first; i < slice.end; ++i)
          if (again.exp_avg[i].data_ptr() != slot_view(i, kExpAvg, s).data_ptr())
            not_adam("its state_save returns copies of the moments, not the tensors it steps in place");
        // Checked on a step that found the moments in place (the second): an optimizer that makes
        // new moment tensors each step instead of updating them is caught there.
        checked_ = !created;
      }
      file_->write(s, slot_base(s), slice.offset, bytes(slice));
    }
    file_->wait_all();
  } catch (const std::runtime_error& e) {
    if (dynamic_cast<const Error*>(&e)) throw;
    throw Error(std::string("zero: offload_optimizer=nvme: ") + e.what());  // an I/O failure (aio.cpp)
  }
  bind_to_file(optimizer);
}

std::string OptimizerSwap::describe() const {
  if (!file_) return "optimizer state on disk: none on this rank";
  return "optimizer state (fp32 masters, exp_avg, exp_avg_sq) on disk: " + file_->path() + " (" +
         fixed(mb(file_bytes_)) + " MB), streamed through 2 x " + fixed(mb(slot_numel_ * 4)) +
         " MB of host buffer in " + std::to_string(slices_.size()) + " slice" + (slices_.size() == 1 ? "" : "s") +
         ", " + file_->engine() + ", " + (file_->direct() ? "direct I/O" : "buffered I/O (the filesystem refuses O_DIRECT)");
}

}  // namespace dtk::zero
