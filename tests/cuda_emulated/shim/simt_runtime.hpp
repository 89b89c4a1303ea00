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
#define __shared__ static  // one block runs at a time: its threads share the function's static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct dim3 {
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  unsigned x, y, z;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// The runtime calls the kernels' host code makes: no device, everything succeeds at once.
enum cudaError_t { cudaSuccess = 0 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "no error"; }
struct CUstream_st;
using cudaStream_t = CUstream_st*;
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int) {
  return cudaSuccess;
}
struct cudaFuncAttributes {
  size_t sharedSizeBytes = 0;  // static shared memory is the kernel's own statics here
};
template <class Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, Kernel) {
  *attributes = {};
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
// An H100's: compute capability 9.0, 227 KB of shared memory a block.
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor, cudaDevAttrMaxSharedMemoryPerBlockOptin };
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  *value = attribute == cudaDevAttrComputeCapabilityMajor ? 9 : 232448;
  return cudaSuccess;
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

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
// Misuse the kernels must not show: copies never waited for, ldmatrix rows not 16-byte aligned,
// more dynamic shared memory than a block has.
inline std::atomic<long> faults{0};
// The running block's dynamic shared memory, NaN bytes (bf16, fp16 and fp32) when it starts.
alignas(128) inline unsigned char shared_memory[232448];

inline Warp& warp() { return *current->warps[self.warp]; }

// f() on every thread of every block of `grid`, `threads` a block, one block after another (blocks
// are independent in DTK's kernels). The same std::threads run every block: between blocks they
// meet, and the next block's shared memory is made NaN bytes again.
template <class F>
void run_grid(dim3 grid, int threads, F f) {
  Block block(threads);
  current = &block;
  gridDim = grid;
  blockDim = {static_cast<unsigned>(threads), 1, 1};
  std::vector<dim3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back({x, y, z});
  std::vector<std::thread> team;
  team.reserve(threads);
  for (int i = 0; i < threads; ++i)
    team.emplace_back([&, i] {
      threadIdx = {static_cast<unsigned>(i), 0, 0};
      for (const dim3& index : blocks) {
        if (i == 0) std::memset(shared_memory, 0xff, sizeof shared_memory);
        block.meet.arrive_and_wait();
        blockIdx = index;
        self = Thread{i % 32, i / 32, {}, {}};
        f();
        if (!self.groups.empty() || !self.open.empty()) ++faults;
        block.meet.arrive_and_wait();  // the block is done before the next one's memory is reset
      }
    });
  for (std::thread& t : team) t.join();
  current = nullptr;
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

// launch.cuh's pieces: a kernel launch runs its grid here, block by block.
#define DTK_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(simt::shared_memory)
namespace dtk::cuda {
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t, Args&&... args) {
  if (shared > sizeof simt::shared_memory) ++simt::faults;
  simt::run_grid(grid, static_cast<int>(block.x), [&] { kernel(static_cast<Params>(args)...); });
}
}  // namespace dtk::cuda
