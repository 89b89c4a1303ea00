// aio.hpp — asynchronous reads and writes of one swap file through io_uring (liburing), the
// disk tier of ZeRO offload (swap.hpp). DeepSpeed's AsyncIO does the same over libaio: requests
// cut into blocks, several in flight, O_DIRECT on aligned buffers so the page cache neither holds a
// second copy of the state nor throttles the transfers.
//
// Requests carry a tag (swap.hpp: the buffer half they fill or drain); wait(tag) completes that
// tag's requests only, so the reads of the next slice and the writes of the previous one stay in
// flight while the current one is updated. Where io_uring is unavailable (a kernel without it, a
// container whose seccomp profile blocks it), one I/O thread runs the same requests in order with
// pread/pwrite: still overlapped with the update, one transfer at a time. No LibTorch and no SDK
// here: errors are std::runtime_error lines naming the file, the operation and the system's reason.
#pragma once

#include <liburing.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace dtk::zero {

class AsyncFile {
 public:
  // O_DIRECT needs offsets, lengths and buffer addresses on this boundary (the logical block size
  // of every common device is at most 4 KiB); swap.cpp lays everything out on it.
  static constexpr int64_t kAlign = 4096;

  // Creates `path` (truncating a leftover), opened with O_DIRECT where the filesystem allows it
  // (tmpfs before Linux 6.6 does not: then buffered), and reserves `bytes` for it, so a disk that
  // cannot hold the state says so now rather than in a later step.
  // `io_uring` false: the I/O thread from the start (tests of the fallback).
  AsyncFile(std::string path, int64_t bytes, bool io_uring = true);
  ~AsyncFile();  // waits for what is in flight, closes and removes the file
  AsyncFile(const AsyncFile&) = delete;
  AsyncFile& operator=(const AsyncFile&) = delete;

  bool direct() const { return direct_; }
  // "io_uring", or "an I/O thread (io_uring: <why not>)".
  const std::string& engine() const { return engine_; }
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

  // Queue a transfer of `bytes` at `offset` (submitted at once, completed by wait()).
  void read(int tag, void* buffer, int64_t offset, int64_t bytes);
  void write(int tag, const void* buffer, int64_t offset, int64_t bytes);
  // Completes every request of `tag`; throws the first failure among them.
  void wait(int tag);
  void wait_all();

 private:
  struct Request {
    int tag;
    bool write;
    char* buffer;
    int64_t offset, bytes;  // what is left of it (a short transfer is resubmitted for the rest)
  };
  void submit(Request r);
  void reap_one();  // completes one request (blocking), resubmitting a short one
  void record_failure(const Request& r, const std::string& error);
  // The I/O thread's side (no io_uring): requests queue in order, the thread transfers each whole.
  void thread_main();
  std::string transfer(Request r) const;  // "" or the system's reason

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  std::string engine_ = "io_uring";
  io_uring ring_{};
  bool ring_ready_ = false;
  std::mutex mu_;  // the I/O thread's queue and the counts below, when there is no ring
  std::condition_variable changed_;
  std::deque<Request> queue_;
  bool stopping_ = false;
  std::thread io_thread_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Request> in_flight_;
  std::map<int, int64_t> pending_;     // per tag: requests in flight
  std::map<int, std::string> failed_;  // per tag: the first failure, reported by wait(tag)
};

}  // namespace dtk::zero
