#include "param_swap.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "swap.hpp"

namespace fs = std::filesystem;

namespace dtk::zero {

namespace {

int64_t aligned(int64_t bytes) { return (bytes + AsyncFile::kAlign - 1) / AsyncFile::kAlign * AsyncFile::kAlign; }

std::string fixed(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}
double mb(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

ParamSwap::ParamSwap(const std::string& dir, const std::string& rank_tag, const std::vector<int64_t>& chunk_numels,
                     at::ScalarType dtype, int64_t buffers)
    : numel_(chunk_numels), dtype_(dtype), elem_(static_cast<int64_t>(c10::elementSize(dtype))) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw Error("zero: strategy.nvme_path '" + dir + "' does not exist");
  if (!fs::is_directory(dir, ec)) throw Error("zero: strategy.nvme_path '" + dir + "' is not a directory");
  offset_.assign(numel_.size(), 0);
  for (size_t b = 0; b < numel_.size(); ++b) {
    offset_[b] = file_bytes_;
    file_bytes_ += aligned(numel_[b] * elem_);
    partition_bytes_ += numel_[b] * elem_;
    slot_bytes_ = std::max(slot_bytes_, aligned(numel_[b] * elem_));
  }
  if (file_bytes_ == 0) return;  // every bucket stays whole
  const std::string path = swap_file_path(dir, "params", rank_tag);
  try {
    file_ = std::make_unique<AsyncFile>(path, file_bytes_);
  } catch (const std::exception& e) {
    throw Error(std::string("zero: offload_param=nvme: ") + e.what());
  }
  buffered_fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (buffered_fd_ < 0)
    throw Error("zero: offload_param=nvme: cannot open swap file " + path + ": " + std::strerror(errno));
  slots_.resize(static_cast<size_t>(buffers));
  buffer_ = Device::pinned_empty({buffers * slot_bytes_ + AsyncFile::kAlign}, at::kByte);
  const auto addr = reinterpret_cast<uintptr_t>(buffer_.data_ptr());
  aligned_ = reinterpret_cast<char*>((addr + AsyncFile::kAlign - 1) / AsyncFile::kAlign * AsyncFile::kAlign);
}

ParamSwap::~ParamSwap() {
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  try {
    if (file_) file_->wait_all();  // before the buffers go (file_ is removed after them)
  } catch (...) {
    // A failure was reported by the call that waited for it, or the run is ending on another error.
  }
}

const std::string& ParamSwap::path() const {
  static const std::string none;
  return file_ ? file_->path() : none;
}

void ParamSwap::io_failed(const std::exception& e) const {
  throw Error(std::string("zero: offload_param=nvme: ") + e.what());
}

void ParamSwap::write_at(size_t b, int64_t offset, const at::Tensor& values) {
  const at::Tensor v = values.to(at::kCPU, dtype_).contiguous();
  const char* p = static_cast<const char*>(v.data_ptr());
  int64_t left = v.numel() * elem_, at = offset_[b] + offset * elem_;
  while (left > 0) {
    const ssize_t n = ::pwrite(buffered_fd_, p, static_cast<size_t>(left), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw Error("zero: offload_param=nvme: swap file " + path() + ": writing " + std::to_string(left) +
                  " bytes at offset " + std::to_string(at) + ": " + (n < 0 ? std::strerror(errno) : "nothing written"));
    p += n, left -= n, at += n;
  }
}

at::Tensor ParamSwap::read_at(size_t b, int64_t offset, int64_t numel) {
  at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(dtype_));
  char* p = static_cast<char*>(out.data_ptr());
  int64_t left = numel * elem_, at = offset_[b] + offset * elem_;
  while (left > 0) {
    const ssize_t n = ::pread(buffered_fd_, p, static_cast<size_t>(left), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw Error("zero: offload_param=nvme: swap file " + path() + ": reading " + std::to_string(left) +
                  " bytes at offset " + std::to_string(at) + ": " +
                  (n < 0 ? std::strerror(errno) : "unexpected end of file"));
    p += n, left -= n, at += n;
  }
  return out;
}

void ParamSwap::finish_setup() {
  if (buffered_fd_ >= 0 && ::fdatasync(buffered_fd_) != 0)
    throw Error("zero: offload_param=nvme: flushing swap file " + path() + ": " + std::strerror(errno));
}

int ParamSwap::holder(size_t b) const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].bucket == static_cast<int64_t>(b)) return static_cast<int>(i);
  return -1;
}

void ParamSwap::settle(int slot) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (!s.reading && !s.writing) return;
  try {
    file_->wait(slot);
  } catch (const std::exception& e) {
    s.reading = s.writing = false;
    s.bucket = -1;
    io_failed(e);
  }
  s.reading = s.writing = false;
}

// A slot another chunk may take, least recently used first, waiting for its I/O: empty, or a
// chunk used already (a write of it may be in flight); otherwise (not for a prefetch) a chunk read
// ahead and not used yet. Never a pinned one.
int ParamSwap::take(bool for_prefetch) {
  int best = -1;
  auto rank = [&](const Slot& s) -> int {  // lower is better; -1: not eligible
    if (s.pins > 0) return -1;
    if (s.bucket < 0) return 0;
    if (!s.fresh) return 1;
    return for_prefetch ? -1 : 2;  // a read-ahead not used yet
  };
  int best_rank = 100;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const int r = rank(slots_[i]);
    if (r < 0) continue;
    if (r < best_rank || (r == best_rank && slots_[i].used < slots_[static_cast<size_t>(best)].used))
      best = static_cast<int>(i), best_rank = r;
  }
  if (best < 0) {
    if (for_prefetch) return -1;
    throw Error("zero: offload_param=nvme: every one of the " + std::to_string(slots_.size()) +
                " parameter buffers is in use (strategy.param_buffer_count)");
  }
  settle(best);
  Slot& s = slots_[static_cast<size_t>(best)];
  s.bucket = -1, s.fresh = false;
  return best;
}

void ParamSwap::read_into(int slot, size_t b) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  s.bucket = static_cast<int64_t>(b);
  s.reading = true;
  ++reads_;
  try {
    file_->read(slot, aligned_ + slot * slot_bytes_, offset_[b], aligned(numel_[b] * elem_));
  } catch (const std::exception& e) {
    s.bucket = -1;
    io_failed(e);
  }
}

bool ParamSwap::prefetch(size_t b) {
  if (holder(b) >= 0) return false;
  const int slot = take(/*for_prefetch=*/true);
  if (slot < 0) return false;
  read_into(slot, b);
  slots_[static_cast<size_t>(slot)].fresh = true;
  ++prefetched_;
  return true;
}

int ParamSwap::acquire(size_t b) {
  int slot = holder(b);
  if (slot < 0) {
    slot = take(/*for_prefetch=*/false);
    read_into(slot, b);
  } else if (!slots_[static_cast<size_t>(slot)].fresh && !slots_[static_cast<size_t>(slot)].reading) {
    ++cache_hits_;
  }
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.reading) settle(slot);
  s.fresh = false;
  ++s.pins;
  s.used = ++clock_;
  return slot;
}

void ParamSwap::release(int slot) { --slots_[static_cast<size_t>(slot)].pins; }

int ParamSwap::pinned() const {
  return static_cast<int>(std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.pins > 0; }));
}

at::Tensor ParamSwap::chunk(int slot) const {
  const Slot& s = slots_[static_cast<size_t>(slot)];
  const int64_t start = (aligned_ - static_cast<char*>(buffer_.data_ptr())) + slot * slot_bytes_;
  return buffer_.narrow(0, start, numel_[static_cast<size_t>(s.bucket)] * elem_).view(dtype_);
}

int ParamSwap::begin_write(size_t b) {
  int slot = holder(b);
  if (slot >= 0) {
    if (slots_[static_cast<size_t>(slot)].pins > 0)
      throw Error("zero: offload_param=nvme: bucket " + std::to_string(b) + " is written while an all-gather reads it");
    settle(slot);
  } else {
    slot = take(/*for_prefetch=*/false);
  }
  Slot& s = slots_[static_cast<size_t>(slot)];
  s.bucket = static_cast<int64_t>(b), s.fresh = false, s.used = ++clock_;
  chunk(slot).zero_();
  return slot;
}

void ParamSwap::end_write(int slot) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  const size_t b = static_cast<size_t>(s.bucket);
  s.writing = true;
  ++writes_;
  try {
    file_->write(slot, aligned_ + slot * slot_bytes_, offset_[b], aligned(numel_[b] * elem_));
  } catch (const std::exception& e) {
    s.bucket = -1;
    io_failed(e);
  }
}

void ParamSwap::wait_writes() {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].writing && !slots_[i].reading) settle(static_cast<int>(i));
}

std::string ParamSwap::describe() const {
  if (!file_) return "parameters on disk: none on this rank (every bucket stays whole)";
  return "parameters (this rank's partition, " + fixed(mb(partition_bytes_)) + " MB) on disk: " + file_->path() + " (" +
         fixed(mb(file_bytes_)) + " MB), read and written through " + std::to_string(slots_.size()) + " x " +
         fixed(mb(slot_bytes_)) + " MB of host buffer (" + fixed(mb(buffer_bytes())) + " MB), " + file_->engine() +
         ", " + (file_->direct() ? "direct I/O" : "buffered I/O (the filesystem refuses O_DIRECT)");
}

std::string ParamSwap::stats() const {
  return "parameter swap: " + std::to_string(reads_) + " chunk reads (" + std::to_string(prefetched_) +
         " of them ahead of use), " + std::to_string(cache_hits_) + " chunks found in a buffer, " +
         std::to_string(writes_) + " chunk writes";
}

}  // namespace dtk::zero
