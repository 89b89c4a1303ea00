// nccl_backend.hpp — distributed.backend=nccl (internal to the comm layer): CUDA tensors' collectives
// on a group go to one NCCL communicator per group (core/cuda, dtk/cuda/nccl.hpp), created by
// init_distributed next to the Gloo groups, which keep carrying the host tensors (the timers,
// the ranks' agreements, checkpoints). Each collective runs on the communicator's own stream
// after the work LibTorch's current stream had queued, and finishing it makes that stream wait
// on the device: the host does not block, so compute queued meanwhile overlaps it (DDP buckets,
// Domino's chunks, ZeRO's prefetch).
//
// Without CUDA (DTK_HAVE_CUDA 0) nothing is ever created and handles() is false.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "dtk/core/comm/comm.hpp"  // kNumGroups

namespace c10d {
class Store;
}

namespace dtk::core::nccl_backend {

// The members of each group (by dtk_group), in group-rank order, as world ranks; groups of one
// get no communicator.
using GroupMembers = std::array<std::vector<int>, dtk::core::kNumGroups>;

// Every rank calls it with the same layout: the communicators of this rank's groups on `device`,
// their unique ids exchanged through `store`. Bounded by `timeout`; throws HostError naming the group.
void create(const GroupMembers& members, int world_rank, const c10::intrusive_ptr<c10d::Store>& store, int device,
            std::chrono::milliseconds timeout);
void release();

// Whether `t` on `group` goes to NCCL: a CUDA tensor on a group with a communicator.
bool handles(const at::Tensor& t, int32_t group);

// Issue on NCCL; the returned function finishes the collective (what Work::wait runs: LibTorch's
// current stream waits for it on the device; the communicator's watchdog bounds it, and a failure
// it found throws). It keeps the buffers alive until then. Shapes are checked by the caller; `op`
// is a dtk_reduce_op (AVG is NCCL's own).
using Finish = std::function<void()>;
Finish all_reduce(const at::Tensor& inout, int32_t group, int32_t op);
Finish broadcast(const at::Tensor& inout, int32_t group, int32_t root);
Finish all_gather(const at::Tensor& out, const at::Tensor& in, int32_t group);
Finish reduce_scatter(const at::Tensor& out, const at::Tensor& in, int32_t group, int32_t op);
// Splits in rows along dim 0, one per group rank, checked by the caller.
Finish all_to_all(const at::Tensor& out, const at::Tensor& in, int32_t group, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits);

}  // namespace dtk::core::nccl_backend
