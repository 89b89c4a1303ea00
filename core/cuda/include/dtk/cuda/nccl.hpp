// dtk/cuda/nccl.hpp — an NCCL communicator over NCCL's C API (no LibTorch): the `nccl` backend
// of dtk's process groups for CUDA tensors (core/runtime/src/comm/nccl_backend.cpp).
//
// Every collective runs on the communicator's own high-priority stream, ordered after the work
// the producer stream had queued when it was issued (an event), and signals an event when done;
// finishing it makes the consumer stream wait for that event on the device, so the host never
// blocks and compute overlaps communication (DDP buckets, Domino chunks, ZeRO prefetch).
// Bounded like every dtk wait: initialisation is non-blocking and polled against the timeout, and
// a watchdog thread aborts the communicator when a collective stays unfinished past the timeout
// (or NCCL reports an asynchronous error); the next call on it then throws the reason.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtk/cuda/runtime.hpp"

namespace dtk::cuda {

enum class DataType { kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kInt64, kUInt8, kInt8 };
enum class ReduceOp { kSum, kAvg, kMax, kMin };

// How the ranks of a group exchange NCCL's unique id: rank 0 sets `key`, the others get it
// (a c10d store's set/get; get blocks, bounded by the store's own timeout).
struct Rendezvous {
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<std::string(const std::string& key)> get;
};

// NCCL's version as "2.28.9" (the library loaded at run time).
std::string nccl_version();

class NcclCommunicator {
 public:
  // Every member of the group calls this with the same key and size; `device` is this rank's GPU.
  NcclCommunicator(const Rendezvous& rendezvous, const std::string& key, int rank, int size, int device,
                   std::chrono::milliseconds timeout);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const;
  int size() const;

  // An issued collective: done once its event completed on the communication stream.
  struct Pending {
    std::shared_ptr<Event> done;
    std::string what;
  };
  // Issue after the work queued so far on `producer`. Buffers must stay alive (and untouched)
  // until finish(). count: elements of `buf` (all_reduce, broadcast) or per rank (all_gather:
  // in has count, out size*count; reduce_scatter: in size*count, out count).
  Pending all_reduce(void* buf, size_t count, DataType type, ReduceOp op, StreamHandle producer);
  Pending broadcast(void* buf, size_t count, DataType type, int root, StreamHandle producer);
  Pending all_gather(const void* in, void* out, size_t count, DataType type, StreamHandle producer);
  Pending reduce_scatter(const void* in, void* out, size_t count, DataType type, ReduceOp op, StreamHandle producer);
  // Personalised exchange: `in` holds size() consecutive parts, in_counts[j] elements to rank j;
  // `out` receives rank j's part (out_counts[j] elements) at the sum of the counts before j. One
  // NCCL group of sends and receives.
  Pending all_to_all(const void* in, void* out, const std::vector<size_t>& in_counts,
                     const std::vector<size_t>& out_counts, DataType type, StreamHandle producer);

  // Makes `consumer` wait for the collective (device side) and rethrows an error the watchdog
  // found. host_wait: also block the host until it completed (bounded by the timeout), for
  // results the host reads.
  void finish(const Pending& p, StreamHandle consumer, bool host_wait);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace dtk::cuda
