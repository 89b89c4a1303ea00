#include "dtk/cuda/nccl.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace dtk::cuda {
namespace {

ncclDataType_t nccl_type(DataType t) {
  switch (t) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kUInt8: return ncclUint8;
    case DataType::kInt8: return ncclInt8;
  }
  throw CudaError("nccl: unknown data type");
}

size_t element_size(DataType t) {
  switch (t) {
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kUInt8:
    case DataType::kInt8:
      return 1;
  }
  throw CudaError("nccl: unknown data type");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  throw CudaError("nccl: unknown reduce op");
}

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) s += std::string(": ") + last;
  }
  return s;
}

}  // namespace

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

// Shared with the watchdog thread, which outlives nothing: the destructor stops and joins it.
// Every NCCL call on the communicator is made under `mu`, except ncclCommAbort: an abort can
// block (it synchronizes NCCL's stream), so fail() only records the reason and hands the
// communicator over, and whoever failed aborts it after releasing the lock (abort_outside()).
struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  ncclComm_t to_abort = nullptr;  // failed, not yet aborted
  int rank = 0, size = 1, device = 0;
  std::chrono::milliseconds timeout{0};
  std::unique_ptr<Stream> stream;  // the communication stream
  std::unique_ptr<Event> ready;    // reused: the producer's position at each issue

  std::mutex mu;
  std::condition_variable cv;
  struct InFlight {
    std::shared_ptr<Event> done;
    std::string what;
    std::chrono::steady_clock::time_point issued;
  };
  std::deque<InFlight> in_flight;  // issue order = completion order on the one stream
  std::string error;               // set once: the communicator was aborted for this reason
  bool stop = false;
  std::thread watchdog;

  void fail(const std::string& why) {  // under mu
    if (!error.empty()) return;
    error = why;
    to_abort = comm;
    comm = nullptr;
  }
  void throw_if_failed() {  // under mu
    if (!error.empty()) throw CudaError(error);
  }
  // Aborts a communicator fail() handed over: ends NCCL's kernels on this rank, so streams
  // waiting on them drain. Called without `mu`.
  void abort_outside() {
    ncclComm_t c = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      std::swap(c, to_abort);
    }
    if (c) ncclCommAbort(c);
  }
  // Runs f under `mu`; on failure aborts outside the lock, then rethrows.
  template <class F>
  auto locked(F&& f) -> decltype(f()) {
    try {
      std::lock_guard<std::mutex> lock(mu);
      return f();
    } catch (...) {
      abort_outside();
      throw;
    }
  }

  // NCCL calls on a non-blocking communicator may return ncclInProgress: poll until the call
  // took effect, bounded by the timeout. Any other result but success fails the communicator.
  void settle(ncclResult_t r, const std::string& what) {  // under mu
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() >= deadline) {
        fail(what + ": NCCL did not finish within the timeout (" + std::to_string(timeout.count()) + " ms)");
        throw_if_failed();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      const ncclResult_t q = ncclCommGetAsyncError(comm, &r);
      if (q != ncclSuccess) r = q;
    }
    if (r != ncclSuccess) {
      fail(what + " failed: " + nccl_error(r, comm));
      throw_if_failed();
    }
  }

  void watch() {
    // This thread's CUDA calls must not create a context on another device.
    if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      cv.wait_for(lock, std::chrono::milliseconds(50));
      if (stop || !error.empty()) continue;
      try {
        while (!in_flight.empty() && in_flight.front().done->query()) in_flight.pop_front();
        ncclResult_t async = ncclSuccess;
        if (comm && ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress)
          fail("nccl: communicator failed: " + nccl_error(async, comm));
        else if (!in_flight.empty() && std::chrono::steady_clock::now() - in_flight.front().issued > timeout)
          fail(in_flight.front().what + " failed: not finished after " + std::to_string(timeout.count()) +
               " ms (a peer is gone or stuck); communicator aborted");
      } catch (const std::exception& e) {  // a sticky CUDA error: the device is unusable
        fail(std::string("nccl: ") + e.what());
      }
      if (to_abort) {
        lock.unlock();
        abort_outside();
        lock.lock();
      }
    }
  }

  // Issues `launch` (one NCCL call) on the communication stream after `producer`'s work so far.
  Pending issue(const std::string& what, StreamHandle producer,
                const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& launch) {
    return locked([&] {
      throw_if_failed();
      DeviceGuard on(device);
      ready->record(producer);
      ready->block(stream->get());
      settle(launch(comm, stream->get()), what);
      auto done = std::make_shared<Event>();
      done->record(stream->get());
      in_flight.push_back({done, what, std::chrono::steady_clock::now()});
      return Pending{done, what};
    });
  }
};

NcclCommunicator::NcclCommunicator(const Rendezvous& rendezvous, const std::string& key, int rank, int size, int device,
                                   std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.rank = rank, s.size = size, s.device = device, s.timeout = timeout;
  ncclUniqueId id{};
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) throw CudaError("nccl: ncclGetUniqueId failed: " + nccl_error(r, nullptr));
    rendezvous.set(key, std::string(id.internal, sizeof id.internal));
  } else {
    const std::string v = rendezvous.get(key);
    if (v.size() != sizeof id.internal)
      throw CudaError("nccl: the unique id under '" + key + "' has " + std::to_string(v.size()) + " bytes, not " +
                      std::to_string(sizeof id.internal));
    std::copy(v.begin(), v.end(), id.internal);
  }
  DeviceGuard on(device);
  s.stream = std::make_unique<Stream>(/*priority=*/-1000);  // clamped: the device's highest
  s.ready = std::make_unique<Event>();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // initialisation polled below, bounded by the timeout
  const std::string what =
      "nccl: creating the communicator (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
  s.locked([&] {
    ncclResult_t r = ncclCommInitRankConfig(&s.comm, size, id, rank, &config);
    if (r == ncclInProgress && s.comm) {
      const ncclResult_t q = ncclCommGetAsyncError(s.comm, &r);
      if (q != ncclSuccess) r = q;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      s.fail(what + " failed: " + nccl_error(r, s.comm));  // hands a half-made communicator to abort
      s.throw_if_failed();
    }
    s.settle(r, what);
  });
  s.watchdog = std::thread([st = state_] { st->watch(); });
}

NcclCommunicator::~NcclCommunicator() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stop = true;
  }
  s.cv.notify_all();
  if (s.watchdog.joinable()) s.watchdog.join();
  s.abort_outside();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.comm) return;
  // Pending work drains first, all of it within one timeout; a communicator that cannot finish
  // (or a device in error) is aborted. Nothing here throws.
  bool drained = true;
  try {
    DeviceGuard on(s.device);
    const auto deadline = std::chrono::steady_clock::now() + s.timeout;
    for (auto& f : s.in_flight) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !wait_event(f.done->get(), left)) {
        drained = false;
        break;
      }
    }
    if (drained) {
      ncclResult_t r = ncclCommFinalize(s.comm);
      while (r == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(s.comm, &r) != ncclSuccess) break;
      }
      if (r == ncclSuccess) {
        ncclCommDestroy(s.comm);
        return;
      }
    }
  } catch (const std::exception&) {
  }
  ncclCommAbort(s.comm);
}

int NcclCommunicator::rank() const { return state_->rank; }
int NcclCommunicator::size() const { return state_->size; }

NcclCommunicator::Pending NcclCommunicator::all_reduce(void* buf, size_t count, DataType type, ReduceOp op,
                                                       StreamHandle producer) {
  return state_->issue("nccl all_reduce", producer, [&](ncclComm_t c, cudaStream_t s) {
    return ncclAllReduce(buf, buf, count, nccl_type(type), nccl_op(op), c, s);
  });
}

NcclCommunicator::Pending NcclCommunicator::broadcast(void* buf, size_t count, DataType type, int root,
                                                      StreamHandle producer) {
  return state_->issue("nccl broadcast", producer, [&](ncclComm_t c, cudaStream_t s) {
    return ncclBroadcast(buf, buf, count, nccl_type(type), root, c, s);
  });
}

NcclCommunicator::Pending NcclCommunicator::all_gather(const void* in, void* out, size_t count, DataType type,
                                                       StreamHandle producer) {
  return state_->issue("nccl all_gather", producer, [&](ncclComm_t c, cudaStream_t s) {
    return ncclAllGather(in, out, count, nccl_type(type), c, s);
  });
}

NcclCommunicator::Pending NcclCommunicator::reduce_scatter(const void* in, void* out, size_t count, DataType type,
                                                           ReduceOp op, StreamHandle producer) {
  return state_->issue("nccl reduce_scatter", producer, [&](ncclComm_t c, cudaStream_t s) {
    return ncclReduceScatter(in, out, count, nccl_type(type), nccl_op(op), c, s);
  });
}

NcclCommunicator::Pending NcclCommunicator::all_to_all(const void* in, void* out, const std::vector<size_t>& in_counts,
                                                       const std::vector<size_t>& out_counts, DataType type,
                                                       StreamHandle producer) {
  const size_t element = element_size(type);
  return state_->issue("nccl all_to_all", producer, [&](ncclComm_t c, cudaStream_t s) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    size_t sent = 0, received = 0;
    for (size_t peer = 0; peer < in_counts.size() && r == ncclSuccess; ++peer) {
      if (in_counts[peer] > 0)
        r = ncclSend(static_cast<const char*>(in) + sent * element, in_counts[peer], nccl_type(type),
                     static_cast<int>(peer), c, s);
      if (r == ncclSuccess && out_counts[peer] > 0)
        r = ncclRecv(static_cast<char*>(out) + received * element, out_counts[peer], nccl_type(type),
                     static_cast<int>(peer), c, s);
      sent += in_counts[peer];
      received += out_counts[peer];
    }
    const ncclResult_t end = ncclGroupEnd();  // always closes the group it opened
    return r != ncclSuccess ? r : end;
  });
}

void NcclCommunicator::finish(const Pending& p, StreamHandle consumer, bool host_wait) {
  State& s = *state_;
  s.locked([&] {
    s.throw_if_failed();
    DeviceGuard on(s.device);
    p.done->block(consumer);
  });
  if (!host_wait) return;
  bool done = false;
  {
    DeviceGuard on(s.device);
    done = wait_event(p.done->get(), s.timeout, [&s] {
      std::lock_guard<std::mutex> lock(s.mu);
      return s.error;
    });
  }
  // An abort completes the events of collectives that never ran: the error decides, not the event.
  s.locked([&] {
    if (!done) s.fail(p.what + " failed: not finished after " + std::to_string(s.timeout.count()) +
                      " ms; communicator aborted");
    s.throw_if_failed();
  });
}

}  // namespace dtk::cuda
