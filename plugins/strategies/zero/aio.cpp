#include "aio.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dtk::zero {

namespace {

// Requests are cut into blocks of this size with up to kQueueDepth of them in flight: enough to
// keep an NVMe device's queues busy (DeepSpeed's defaults are 1 MiB blocks, depth 8-32).
constexpr int64_t kBlock = 4 << 20;
constexpr unsigned kQueueDepth = 32;

std::string reason(int err) { return std::strerror(err); }

}  // namespace

AsyncFile::AsyncFile(std::string path, int64_t bytes, bool io_uring) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL)  // the filesystem has no direct I/O (tmpfs before Linux 6.6)
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0) throw std::runtime_error("cannot create swap file " + path_ + ": " + reason(errno));
  // Reserve the blocks now: a disk too small fails here, naming the size. Filesystems without
  // fallocate get a sparse file of the size (a full disk then shows in a step's writes).
  if (bytes > 0) {
    const int e = ::posix_fallocate(fd_, 0, bytes);
    if (e == EOPNOTSUPP || e == EINVAL) {
      if (::ftruncate(fd_, bytes) != 0) {
        const int err = errno;
        ::close(fd_), ::unlink(path_.c_str());
        throw std::runtime_error("cannot size swap file " + path_ + " to " + std::to_string(bytes) +
                                 " bytes: " + reason(err));
      }
    } else if (e != 0) {
      ::close(fd_), ::unlink(path_.c_str());
      throw std::runtime_error("cannot reserve " + std::to_string(bytes) + " bytes for swap file " + path_ + ": " +
                               reason(e));
    }
  }
  const int e = io_uring ? io_uring_queue_init(kQueueDepth, &ring_, 0) : -ENOSYS;
  if (e == 0) {
    ring_ready_ = true;
    return;
  }
  engine_ = "an I/O thread (io_uring: " + (io_uring ? reason(-e) : std::string("not asked for")) + ")";
  io_thread_ = std::thread([this] { thread_main(); });
}

AsyncFile::~AsyncFile() {
  try {
    wait_all();
  } catch (...) {
    // Failures were reported by the step that issued them; the file goes either way.
  }
  if (ring_ready_) io_uring_queue_exit(&ring_);
  if (io_thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    changed_.notify_all();
    io_thread_.join();
  }
  if (fd_ >= 0) ::close(fd_);
  ::unlink(path_.c_str());
}

void AsyncFile::read(int tag, void* buffer, int64_t offset, int64_t bytes) {
  for (int64_t done = 0; done < bytes; done += kBlock)
    submit({tag, false, static_cast<char*>(buffer) + done, offset + done, std::min(kBlock, bytes - done)});
}

void AsyncFile::write(int tag, const void* buffer, int64_t offset, int64_t bytes) {
  char* b = const_cast<char*>(static_cast<const char*>(buffer));  // io_uring's write takes void*
  for (int64_t done = 0; done < bytes; done += kBlock)
    submit({tag, true, b + done, offset + done, std::min(kBlock, bytes - done)});
}

void AsyncFile::submit(Request r) {
  if (!ring_ready_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++pending_[r.tag];
      queue_.push_back(r);
    }
    changed_.notify_all();
    return;
  }
  while (in_flight_.size() >= kQueueDepth) reap_one();
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) {  // not expected with in_flight_ below the ring's depth; reap and retry once
    reap_one();
    sqe = io_uring_get_sqe(&ring_);
    if (!sqe) throw std::runtime_error("swap file " + path_ + ": io_uring submission queue full");
  }
  if (r.write)
    io_uring_prep_write(sqe, fd_, r.buffer, static_cast<unsigned>(r.bytes), static_cast<uint64_t>(r.offset));
  else
    io_uring_prep_read(sqe, fd_, r.buffer, static_cast<unsigned>(r.bytes), static_cast<uint64_t>(r.offset));
  const uint64_t id = next_id_++;
  io_uring_sqe_set_data64(sqe, id);
  const int e = io_uring_submit(&ring_);
  if (e < 0) throw std::runtime_error("swap file " + path_ + ": io_uring_submit: " + reason(-e));
  ++pending_[r.tag];
  in_flight_.emplace(id, r);
}

void AsyncFile::reap_one() {
  io_uring_cqe* cqe = nullptr;
  int e;
  do e = io_uring_wait_cqe(&ring_, &cqe);
  while (e == -EINTR);
  if (e < 0) throw std::runtime_error("swap file " + path_ + ": io_uring_wait_cqe: " + reason(-e));
  const uint64_t id = io_uring_cqe_get_data64(cqe);
  const int res = cqe->res;
  io_uring_cqe_seen(&ring_, cqe);
  auto it = in_flight_.find(id);
  if (it == in_flight_.end()) return;
  Request r = it->second;
  in_flight_.erase(it);
  --pending_[r.tag];
  std::string error;
  if (res < 0) {
    error = reason(-res);
  } else if (res == 0) {
    error = r.write ? "nothing written" : "unexpected end of file";
  } else if (res < r.bytes) {
    // A short transfer: the rest goes again (a full disk then answers with ENOSPC).
    r.buffer += res, r.offset += res, r.bytes -= res;
    submit(r);
    return;
  }
  if (!error.empty()) record_failure(r, error);
}

void AsyncFile::record_failure(const Request& r, const std::string& error) {
  if (!failed_.count(r.tag))
    failed_[r.tag] = "swap file " + path_ + ": " + (r.write ? "writing " : "reading ") + std::to_string(r.bytes) +
                     " bytes at offset " + std::to_string(r.offset) + ": " + error;
}

std::string AsyncFile::transfer(Request r) const {
  while (r.bytes > 0) {
    const ssize_t n = r.write ? ::pwrite(fd_, r.buffer, static_cast<size_t>(r.bytes), r.offset)
                              : ::pread(fd_, r.buffer, static_cast<size_t>(r.bytes), r.offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return reason(errno);
    if (n == 0) return r.write ? "nothing written" : "unexpected end of file";
    r.buffer += n, r.offset += n, r.bytes -= n;
  }
  return "";
}

void AsyncFile::thread_main() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    const Request r = queue_.front();
    queue_.pop_front();
    lock.unlock();
    const std::string error = transfer(r);
    lock.lock();
    if (!error.empty()) record_failure(r, error);
    --pending_[r.tag];
    changed_.notify_all();
  }
}

// mu_ is contended only by the I/O thread (no ring); with a ring it is this thread's alone.
void AsyncFile::wait(int tag) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!ring_ready_) changed_.wait(lock, [&] { return pending_[tag] == 0; });
  while (pending_[tag] > 0) reap_one();
  auto f = failed_.find(tag);
  if (f != failed_.end()) {
    const std::string message = f->second;
    failed_.erase(f);
    throw std::runtime_error(message);
  }
}

void AsyncFile::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!ring_ready_)
    changed_.wait(lock, [&] {
      return std::all_of(pending_.begin(), pending_.end(), [](const auto& p) { return p.second == 0; });
    });
  while (!in_flight_.empty()) reap_one();
  if (!failed_.empty()) {
    const std::string message = failed_.begin()->second;
    failed_.clear();
    throw std::runtime_error(message);
  }
}

}  // namespace dtk::zero
