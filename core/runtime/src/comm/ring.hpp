// Collectives composed from point-to-point messages, for backends that lack a native one
// (Gloo's reduce_scatter). Internal to comm/.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/api/include/torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>

#include "dtk/core/comm/comm.hpp"  // GroupBackend

namespace dtk::core::ring {

// Ring reduce-scatter of `in` ([N * n, ...], contiguous) over `pg`: rank r ends with the reduced
// chunk r in `out` ([n, ...]). N - 1 steps; in step s rank r sends the partial result of chunk
// (r - s - 1) mod N to rank r + 1 and receives chunk (r - s - 2) mod N from rank r - 1, combining
// it with its own contribution, so after the last step it holds the whole reduction of chunk r.
// Every rank sends (N - 1) / N of the input: the bandwidth-optimal volume (an all-reduce moves
// twice that). `in` is not modified. Messages use tags [tag, tag + N - 1); every wait is bounded by
// `timeout`.
void reduce_scatter(GroupBackend& pg, const at::Tensor& out, const at::Tensor& in, c10d::ReduceOp op, uint32_t tag,
                    std::chrono::milliseconds timeout);

// A tag block for the next ring collective on `group`: identical on every rank because ranks
// issue collectives in the same order (c10d's rule).
uint32_t next_tag(int32_t group);

// Runs `task` on the communication thread (one per process, FIFO) and returns its completion.
// Exceptions thrown by the task are rethrown by the future's get().
std::shared_future<void> run_async(std::function<void()> task);

}  // namespace dtk::core::ring
