// param_swap.hpp — the disk tier of ZeRO-3's parameters (offload_param=nvme, ZeRO-Infinity): this
// rank's parameter partition (its chunk of every on-demand bucket, in the parameter dtype) lives
// in one swap file under strategy.nvme_path, and only `param_buffer_count` host buffers of one
// chunk each hold parameters in host memory.
//
// As DeepSpeed's AsyncPartitionedParameterSwapper: a buffer (a "slot") holds one bucket's chunk.
// Before a module's buckets are all-gathered their chunks are read into slots (acquire); entering
// a module issues the reads of the next modules' chunks into free slots (prefetch), so the disk
// works while the current module computes. A slot is pinned while an all-gather reads it (on a
// CPU run the gather's input is the slot itself) and otherwise stays a clean cache of its chunk
// until another chunk needs the slot. After the optimizer step the updated chunks are written
// back through the slots (begin_write/end_write: fill, then an asynchronous write), and the slots
// keep them as cache for the next forward. Reads and writes go through aio.hpp (io_uring, O_DIRECT
// where the filesystem allows it): each chunk starts on the I/O boundary in the file.
//
// Setup (the initial values, one parameter at a time, and the masters made from them) reads and
// writes the file through a second, buffered descriptor (write_at/read_at), flushed before the
// first direct read. The swap file is not a checkpoint: removed when the strategy ends; one left
// by a killed run is removed by the next run using the directory (swap.hpp).
#pragma once

#include <dtk/tensor.hpp>

#include <memory>
#include <string>
#include <vector>

#include "aio.hpp"

namespace dtk::zero {

class ParamSwap {
 public:
  // `chunk_numels[b]`: elements of this rank's chunk of bucket b in the file (0: not in the file,
  // a bucket that stays whole). `buffers`: the host slots (at least 2).
  ParamSwap(const std::string& dir, const std::string& rank_tag, const std::vector<int64_t>& chunk_numels,
            at::ScalarType dtype, int64_t buffers);
  ~ParamSwap();
  ParamSwap(const ParamSwap&) = delete;
  ParamSwap& operator=(const ParamSwap&) = delete;

  // Setup: values of bucket b's chunk at element `offset` (buffered I/O).
  void write_at(size_t b, int64_t offset, const at::Tensor& values);
  at::Tensor read_at(size_t b, int64_t offset, int64_t numel);
  void finish_setup();  // flushes what write_at wrote before any direct read

  // Whether a slot holds bucket b's chunk (read, or its read in flight).
  bool holds(size_t b) const { return holder(b) >= 0; }
  // Issues the read of b's chunk into a slot whose chunk was used already (or a write of it is in
  // flight, waited for), never one pinned or read ahead and not used yet; false when there is none.
  // Every decision here depends on the sequence of calls only, never on how far the disk got: the
  // ranks' all-gathers, issued from what holds() says, stay in the same order on every rank.
  bool prefetch(size_t b);
  // The slot holding b's chunk, read (waits for it, reads it first if needed), pinned.
  int acquire(size_t b);
  void release(int slot);
  int pinned() const;  // slots pinned now
  int64_t slots() const { return static_cast<int64_t>(slots_.size()); }
  // The chunk in slot `slot` (its bucket's chunk_numels elements, parameter dtype).
  at::Tensor chunk(int slot) const;

  // Write-back: a slot for b's new values (any slot that held b is dropped), zeroed; then the
  // write of its chunk is issued. wait_writes completes every write.
  int begin_write(size_t b);
  void end_write(int slot);
  void wait_writes();

  int64_t buffer_bytes() const { return buffer_.defined() ? static_cast<int64_t>(buffer_.nbytes()) : 0; }
  int64_t file_bytes() const { return file_bytes_; }
  int64_t partition_bytes() const { return partition_bytes_; }
  const std::string& path() const;
  std::string describe() const;  // where the partition lives and how it moves (one log line)
  std::string stats() const;     // reads (and how many were prefetched), writes, so far

 private:
  struct Slot {
    int64_t bucket = -1;
    bool reading = false;  // a read is in flight (tag = the slot)
    bool writing = false;  // a write is in flight
    bool fresh = false;    // read ahead and not acquired yet
    int pins = 0;
    uint64_t used = 0;  // last acquire, for least-recently-used eviction
  };
  int holder(size_t b) const;   // the slot holding b's chunk, or -1
  void settle(int slot);        // waits for the slot's I/O
  int take(bool for_prefetch);  // a slot to overwrite (-1: none for a prefetch)
  void read_into(int slot, size_t b);
  [[noreturn]] void io_failed(const std::exception& e) const;

  std::vector<int64_t> numel_, offset_;  // per bucket: chunk elements, byte offset in the file
  at::ScalarType dtype_;
  int64_t elem_ = 0, slot_bytes_ = 0, file_bytes_ = 0, partition_bytes_ = 0;
  std::unique_ptr<AsyncFile> file_;
  int buffered_fd_ = -1;
  at::Tensor buffer_;        // the slots (host memory of the DTK allocator, pinned on a GPU run)
  char* aligned_ = nullptr;  // the first slot, on AsyncFile::kAlign
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
  int64_t reads_ = 0, prefetched_ = 0, writes_ = 0, cache_hits_ = 0;
};

}  // namespace dtk::zero
