// dtk/core/memory/memory.hpp — how many tensor bytes the process holds, as the memory report and the
// device memory budget see them.
//
// install() wraps LibTorch's CPU allocator with one that counts live bytes and their peak in two
// pools: "device" and "host". On a CPU run the CPU is the device: every tensor allocation counts
// as device memory, except those made inside a HostScope — pinned host buffers
// (dtk_device_services.alloc_pinned) and the optimizer's state when the strategy runs the
// optimizer on the host (ZeRO-Offload). That is where those bytes would live on a GPU run, so the
// device pool measures what a GPU would have to hold, and a device budget (train.memory_limit_mb)
// shows what offload makes fit.
#pragma once

#include <cstdint>
#include <functional>

namespace dtk::core::memory {

struct Pool {
  int64_t bytes = 0;  // live now
  int64_t peak = 0;   // highest since install() or the last reset_peak()
};

struct Stats {
  Pool device, host;
};

// Wraps the CPU allocator (idempotent; allocations made before keep their own deleters).
void install();
bool installed();
Stats stats();
// Starts a new peak at the current value (both pools).
void reset_peak();

// A GPU run: the device pool is the GPU's (`read`: LibTorch's CUDA caching allocator, allocated
// bytes and their peak; `reset`: starts its new peak), and every CPU allocation from now on
// counts as host memory (no budget: the GPU's memory is what the run's estimate is checked against).
void set_device_pool(std::function<Pool()> read, std::function<void()> reset);

// A budget for the device pool: an allocation that would take it past `bytes` fails with
// "device memory budget of N MB exceeded ..." (bytes <= 0: no budget). `machine`: the budget is
// this machine's memory (the default on a CPU run), not train.memory_limit_mb.
void set_device_limit(int64_t bytes, bool machine = false);
// Physical memory of this machine in bytes (0 when unknown).
int64_t machine_memory_bytes();

// While one is alive on a thread, that thread's allocations count as host memory.
class HostScope {
 public:
  HostScope();
  ~HostScope();
  HostScope(const HostScope&) = delete;
  HostScope& operator=(const HostScope&) = delete;
};

// This process's peak resident set size (getrusage), in bytes.
int64_t peak_rss_bytes();

}  // namespace dtk::core::memory
