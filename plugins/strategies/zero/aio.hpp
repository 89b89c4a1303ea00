// aio.hpp — asynchronous reads and writes of one swap file through io_uring (liburing), the
// disk tier of ZeRO offload (swap.hpp). DeepSpeed's AsyncIO does the same over libaio: requests
// cut into blocks, several in flight, O_DIRECT on aligned buffers so the page cache neither holds a
// second copy of the state nor throttles the transfers.
//
// Requests carry a tag (swap.hpp: the buffer half they fill or drain); wait(tag) completes that
// tag's requests only, so the reads of the next slice and the writes of the previous one stay in
// flight while the current one is updated. No LibTorch and no SDK here: errors are
// std::runtime_error lines naming the file, the operation and the system's reason.
#pragma once

#include <liburing.h>

#include <cstdint>
#include <map>
#include <string>

namespace dtk::zero {

class AsyncFile {
 public:
  // O_DIRECT needs offsets, lengths and buffer addresses on this boundary (the logical block size
  // of every common device is at most 4 KiB); swap.cpp lays everything out on it.
  static constexpr int64_t kAlign = 4096;

  // Creates `path` (truncating a leftover), opened with O_DIRECT where the filesystem allows it
  // (tmpfs before Linux 6.6 does not: then buffered), and reserves `bytes` for it, so a disk that
  // cannot hold the state says so now rather than in a later step.
  AsyncFile(std::string path, int64_t bytes);
  ~AsyncFile();  // waits for what is in flight, closes and removes the file
  AsyncFile(const AsyncFile&) = delete;
  AsyncFile& operator=(const AsyncFile&) = delete;

  bool direct() const { return direct_; }
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

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  io_uring ring_{};
  bool ring_ready_ = false;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Request> in_flight_;
  std::map<int, int64_t> pending_;     // per tag: requests in flight
  std::map<int, std::string> failed_;  // per tag: the first failure, reported by wait(tag)
};

}  // namespace dtk::zero
