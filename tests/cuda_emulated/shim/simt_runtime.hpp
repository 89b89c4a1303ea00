// simt_runtime.hpp — CUDA's execution model on CPU threads, for running DTK's warp-level kernels
// in CI (no GPU): each block's threads are std::threads, __syncthreads and the warp collectives
// are barriers over them, and the kernels' own source (core/cuda/src/*.cu) compiles unchanged as
// C++ with this directory's cuda_runtime.h, cuda_bf16.h and cuda_fp16.h in front of the real
// ones. simt.hpp adds the tensor-core instructions (warp_mma.cuh's functions).
//
// What it proves and what it does not: the kernels' indexing, fragment layouts, masks, tile
// loop and the ordering of their asynchronous copies (copies land as late as cp.async allows;
// shared memory starts as NaN bytes), against a reference on the CPU. Not speed, and not the
// hardware's exact rounding inside a product (the emulation sums each product in fp32 in order).
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

namespace simt {

// One warp's exchange slots: each collective writes its lane's part, meets the other lanes at
// the barrier, reads what it needs and meets them again before the slots are reused.
struct Warp {
  std::barrier<> meet{32};
  const void* rows[32] = {};
  uint32_t a[32][4] = {};
  uint32_t b[32][2] = {};
  uint64_t value[32] = {};
};

struct Block {
  explicit Block(int threads) : meet(threads) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
  std::barrier<> meet;
  std::vector<std::unique_ptr<Warp>> warps;
};

// The thread's lane, warp and its asynchronous copies: committed groups and the open one.
struct Thread {
  int lane = 0, warp = 0;
  std::deque<std::vector<std::function<void()>>> groups;
  std::vector<std::function<void()>> open;
};

inline Block* current = nullptr;
inline thread_local Thread self;
// Misuse the kernels must not show: copies never waited for, ldmatrix rows not 16-byte aligned.
inline std::atomic<long> faults{0};

inline Warp& warp() { return *current->warps[self.warp]; }

// f() on every thread of block `index` of `grid`, `threads` a block.
template <class F>
void run_block(dim3 grid, dim3 index, int threads, F f) {
  Block block(threads);
  current = &block;
  gridDim = grid;
  blockDim = {static_cast<unsigned>(threads), 1, 1};
  std::vector<std::thread> team;
  team.reserve(threads);
  for (int i = 0; i < threads; ++i)
    team.emplace_back([&, i] {
      threadIdx = {static_cast<unsigned>(i), 0, 0};
      blockIdx = index;
      self = Thread{i % 32, i / 32, {}, {}};
      f();
      if (!self.groups.empty() || !self.open.empty()) ++faults;
    });
  for (std::thread& t : team) t.join();
  current = nullptr;
}

// Every block of the grid in turn (blocks are independent in the kernels this runs).
template <class F>
void run_grid(dim3 grid, int threads, F f) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) run_block(grid, {x, y, z}, threads, f);
}

}  // namespace simt

inline void __syncthreads() { simt::current->meet.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { simt::warp().meet.arrive_and_wait(); }

template <class T>
T __shfl_xor_sync(unsigned, T x, int mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  simt::Warp& w = simt::warp();
  std::memcpy(&w.value[simt::self.lane], &x, sizeof x);
  w.meet.arrive_and_wait();
  T r;
  std::memcpy(&r, &w.value[simt::self.lane ^ mask], sizeof r);
  w.meet.arrive_and_wait();
  return r;
}
