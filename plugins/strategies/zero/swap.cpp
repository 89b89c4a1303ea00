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
  try {
    buffer_ = Device::pinned_empty({2 * slot_numel_ + kAlignElems}, at::kFloat);
  } catch (const std::exception& e) {  // the host's allocator refused
    throw Error("zero: strategy.nvme_buffer_mb=" + std::to_string(buffer_bytes >> 20) +
                ": cannot allocate that much host memory for the buffer (its two halves); give a smaller one (" +
                dtk::one_line(e.what()) + ")");
  }
  const auto addr = reinterpret_cast<uintptr_t>(buffer_.data_ptr<float>());
  aligned_ = reinterpret_cast<float*>((addr + AsyncFile::kAlign - 1) / AsyncFile::kAlign * AsyncFile::kAlign);
  for (size_t i = 0; i < params_.size(); ++i) params_[i] = file_view(i, kMaster);
}

OptimizerSwap::~OptimizerSwap() = default;  // the file goes with file_; the mapping with its last view

void OptimizerSwap::plan_slices(const std::vector<int64_t>& numels, int64_t buffer_bytes) {
  numel_ = numels;
  start_.assign(numels.size(), 0);
  // Each half holds a slice's three kinds of state, each in a part on the I/O boundary.
  slot_numel_ = buffer_bytes / 2 / static_cast<int64_t>(sizeof(float)) / kAlignElems * kAlignElems;
  part_numel_ = slot_numel_ / 3 / kAlignElems * kAlignElems;
  if (part_numel_ == 0)
    throw Error("zero: strategy.nvme_buffer_mb=" + std::to_string(buffer_bytes >> 20) +
                " is too small: each half of the buffer holds three parts of at least " +
                std::to_string(AsyncFile::kAlign) + " bytes");
  for (size_t i = 0; i < numels.size(); ++i) start_[i] = region_numel_, region_numel_ += padded(numels[i]);
  file_bytes_ = 3 * region_numel_ * static_cast<int64_t>(sizeof(float));
  // Slices in the parameters' order, each at most a part: a parameter that fits a part is never
  // cut (it starts the next slice instead); a larger one is cut wherever a slice ends.
  size_t first = 0;  // the first parameter that ends after `begin`
  for (int64_t begin = 0; begin < region_numel_;) {
    int64_t end = std::min(begin + part_numel_, region_numel_);
    for (size_t j = first; j < numels.size() && start_[j] < end; ++j)
      if (start_[j] > begin && start_[j] + padded(numels[j]) > end && padded(numels[j]) <= part_numel_) {
        end = start_[j];
        break;
      }
    Slice slice{begin, end - begin, {}};
    for (size_t j = first; j < numels.size() && start_[j] < end; ++j) {
      const int64_t lo = std::max(begin, start_[j]), hi = std::min(end, start_[j] + numels[j]);
      if (hi > lo) slice.pieces.push_back({j, lo - start_[j], hi - lo, lo - begin});
    }
    while (first < numels.size() && start_[first] + padded(numels[first]) <= end) ++first;
    slices_.push_back(std::move(slice));
    begin = end;
  }
}

float* OptimizerSwap::file_ptr(size_t i, Kind kind) const {
  return static_cast<float*>(mapping_->base) + kind * region_numel_ + start_[i];
}

at::Tensor OptimizerSwap::file_view(size_t i, Kind kind) const {
  // The view keeps the mapping: the optimizer's tensors may outlive this object.
  std::shared_ptr<Mapping> keep = mapping_;
  return at::from_blob(
      file_ptr(i, kind), {numel_[i]}, [keep](void*) {}, at::TensorOptions().dtype(at::kFloat));
}

float* OptimizerSwap::slot_base(int slot) const { return aligned_ + slot * slot_numel_; }

at::Tensor OptimizerSwap::slot_view(const Piece& p, Kind kind, int slot) const {
  const int64_t start = (slot_base(slot) - buffer_.data_ptr<float>()) + kind * part_numel_ + p.at;
  return buffer_.narrow(0, start, p.numel);
}

// The slice's three runs (master, exp_avg, exp_avg_sq: one per region of the file) from or into
// buffer half `slot`, as requests of tag `slot`.
void OptimizerSwap::transfer_slice(bool write, int slot, const Slice& slice) {
  constexpr int64_t f = sizeof(float);
  for (int kind = kMaster; kind <= kExpAvgSq; ++kind) {
    float* part = slot_base(slot) + kind * part_numel_;
    const int64_t offset = (kind * region_numel_ + slice.first) * f;
    if (write)
      file_->write(slot, part, offset, slice.numel * f);
    else
      file_->read(slot, part, offset, slice.numel * f);
  }
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
  if (a.numel() != m.numel() || b.numel() != m.numel() || a.scalar_type() != at::kFloat)
    not_adam("the moments of '" + names_[i] + "' are not fp32 tensors of its " + std::to_string(m.numel()) +
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
                         const std::vector<at::Tensor>& grads, const Updated& updated) {
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
  try {
    transfer_slice(false, 0, slices_[0]);
    for (size_t k = 0; k < slices_.size(); ++k) {
      const Slice& slice = slices_[k];
      const int s = static_cast<int>(k % 2);
      file_->wait(s);  // slice k is in half s
      if (k + 1 < slices_.size()) {
        file_->wait(1 - s);  // slice k-1 is written back: half 1-s takes slice k+1
        transfer_slice(false, 1 - s, slices_[k + 1]);
      }
      // Each piece's parameter (and its moments, once they exist: the file's zeros are a fresh
      // Adam's moments) becomes the piece's run of the buffer, with the gradient's run.
      for (const Piece& p : slice.pieces) {
        params_[p.param].set_data(slot_view(p, kMaster, s));
        if (has_moments_[p.param]) {
          held.exp_avg[p.param].set_data(slot_view(p, kExpAvg, s));
          held.exp_avg_sq[p.param].set_data(slot_view(p, kExpAvgSq, s));
        }
        const at::Tensor& g = grads[p.param];
        params_[p.param].mutable_grad() = p.numel == numel_[p.param] ? g : g.narrow(0, p.offset, p.numel);
      }
      if (k > 0) set_step(optimizer, step0);
      dtk::optimizer_step(optimizer, args);
      // The optimizer's state is asked again (a state_save over every parameter) only where this
      // step created moments (a parameter's first step) or nothing was checked yet: otherwise the
      // tensors in `held` are the ones it stepped, re-pointed above (once per slice, not
      // slices x parameters lookups per step).
      const bool created =
          std::any_of(slice.pieces.begin(), slice.pieces.end(), [&](const Piece& p) { return !has_moments_[p.param]; });
      if (created || !checked_) {
        held = moments(optimizer);
        if (held.step != step0 + 1)
          not_adam("its step count went from " + std::to_string(step0) + " to " + std::to_string(held.step) +
                   " in one step of a slice ('step' not restored by state_load)");
      }
      for (const Piece& p : slice.pieces) {
        // A first step created the moments in memory of its own: they move into the buffer.
        take_moments(held, p.param, slot_view(p, kExpAvg, s), slot_view(p, kExpAvgSq, s));
        params_[p.param].mutable_grad() = at::Tensor();
        updated(p.param, p.offset, slot_view(p, kMaster, s));
      }
      if (!checked_) {
        const Moments again = moments(optimizer);
        for (const Piece& p : slice.pieces)
          if (again.exp_avg[p.param].data_ptr() != slot_view(p, kExpAvg, s).data_ptr())
            not_adam("its state_save returns copies of the moments, not the tensors it steps in place");
        // Checked on a step that found the moments in place (the second): an optimizer that makes
        // new moment tensors each step instead of updating them is caught there.
        checked_ = !created;
      }
      transfer_slice(true, s, slice);
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
  size_t cut = 0;  // parameters larger than a slice, stepped in pieces
  for (const int64_t n : numel_) cut += padded(n) > part_numel_;
  const std::string pieces =
      cut ? " (" + std::to_string(cut) + " parameter" + (cut == 1 ? "" : "s") + " larger than a slice, in pieces)" : "";
  return "optimizer state (fp32 masters, exp_avg, exp_avg_sq) on disk: " + file_->path() + " (" +
         fixed(mb(file_bytes_)) + " MB), streamed through 2 x " + fixed(mb(slot_numel_ * 4)) +
         " MB of host buffer in " + std::to_string(slices_.size()) + " slice" + (slices_.size() == 1 ? "" : "s") +
         pieces + ", " + file_->engine() + ", " +
         (file_->direct() ? "direct I/O" : "buffered I/O (the filesystem refuses O_DIRECT)");
}

}  // namespace dtk::zero
