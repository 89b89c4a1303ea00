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

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <utility>
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

namespace simt {
// The most dynamic shared memory a block may have here (an H100's 227 KB).
constexpr size_t kMostShared = 232448;
// The device the host code asks about: an H100's compute capability 9.0 and 227 KB of shared
// memory a block by default; a test may set another GPU's (an A100: 8.0, 163 KB), up to that.
struct Device {
  int major = 9;
  int shared_optin = static_cast<int>(kMostShared);
};
inline Device device;
// The most dynamic shared memory a kernel may opt into on the device.
inline size_t shared_optin_limit() { return std::min<size_t>(device.shared_optin, kMostShared); }
// Misuse the kernels and their host code must not show: copies never waited for, ldmatrix rows
// not 16-byte aligned, a write past the dynamic shared memory the launch asked for, an opt-in or
// a launch a GPU would refuse.
inline std::atomic<long> faults{0};
// Each kernel's opt-in to more than 48 KB of dynamic shared memory (cudaFuncSetAttribute).
inline std::map<const void*, int> shared_allowed;
// Every kernel launched, in order (for a test to see which variant the host code chose).
inline std::vector<const void*> launched;
}  // namespace simt

// The runtime calls the kernels' host code makes: no device; a launch a GPU would refuse sets the
// error cudaGetLastError() then reports, as on a GPU.
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
inline cudaError_t last_error = cudaSuccess;
inline cudaError_t cudaGetLastError() { return std::exchange(last_error, cudaSuccess); }
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "invalid configuration";
}
struct CUstream_st;
using cudaStream_t = CUstream_st*;
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute, int bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) > simt::shared_optin_limit()) {
    ++simt::faults;
    return last_error = cudaErrorInvalidValue;
  }
  simt::shared_allowed[reinterpret_cast<const void*>(kernel)] = bytes;
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
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor, cudaDevAttrMaxSharedMemoryPerBlockOptin };
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  *value = attribute == cudaDevAttrComputeCapabilityMajor ? simt::device.major : simt::device.shared_optin;
  return cudaSuccess;
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// CUDA's integer min and max of device code.
inline int min(int a, int b) { return a < b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

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
// The running block's dynamic shared memory: NaN bytes (bf16, fp16 and fp32) when it starts, and
// past what the launch asked for guard bytes that must be unchanged when the block ends. The guard
// is 0xff and 0x7f (a huge value or NaN in every type) in turn, block after block over every
// launch, so that a kernel writing either pattern past its memory is seen in every other block.
alignas(128) inline unsigned char shared_memory[kMostShared + 4096];
inline size_t blocks_run = 0;
inline unsigned char guard_byte(size_t block) { return block % 2 ? 0x7f : 0xff; }

inline Warp& warp() { return *current->warps[self.warp]; }

// f() on every thread of every block of `grid`, `threads` a block, one block after another (blocks
// are independent in DTK's kernels), with `shared` bytes of dynamic shared memory. The same
// std::threads run every block: between blocks they meet, and the next block's shared memory is
// made NaN bytes again.
template <class F>
void run_grid(dim3 grid, int threads, size_t shared, F f) {
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
        const unsigned char guard = i == 0 ? guard_byte(blocks_run) : 0;  // thread 0 alone counts blocks
        if (i == 0) {
          std::memset(shared_memory, 0xff, shared);
          std::memset(shared_memory + shared, guard, sizeof shared_memory - shared);
        }
        block.meet.arrive_and_wait();
        blockIdx = index;
        self = Thread{i % 32, i / 32, {}, {}};
        f();
        if (!self.groups.empty() || !self.open.empty()) ++faults;
        block.meet.arrive_and_wait();  // the block is done before the next one's memory is reset
        if (i == 0) {
          if (std::any_of(shared_memory + shared, std::end(shared_memory), [&](unsigned char x) { return x != guard; }))
            ++faults;
          ++blocks_run;
        }
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
// Runs the grid, or refuses the launch as a GPU would (the error for cudaGetLastError(), and a
// fault: DTK's host code must never ask for it): more than 1024 threads a block, a grid dimension
// out of range, more dynamic shared memory than the kernel's opt-in (48 KB without one) or the
// device allows. Blocks of whole warps in x only: the emulation's warps, and all DTK launches.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t, Args&&... args) {
  const auto allowed = simt::shared_allowed.find(reinterpret_cast<const void*>(kernel));
  const size_t shared_limit =
      std::min<size_t>(allowed == simt::shared_allowed.end() ? 48 * 1024 : allowed->second, simt::shared_optin_limit());
  const bool refused = block.x == 0 || block.x > 1024 || grid.x == 0 || grid.x > 0x7fffffffu || grid.y == 0 ||
                       grid.z == 0 || grid.y > 65535 || grid.z > 65535 || shared > shared_limit;
  if (refused || block.y != 1 || block.z != 1 || block.x % 32 != 0) {
    if (refused) last_error = shared > shared_limit ? cudaErrorInvalidValue : cudaErrorInvalidConfiguration;
    ++simt::faults;
    return;
  }
  simt::launched.push_back(reinterpret_cast<const void*>(kernel));
  simt::run_grid(grid, static_cast<int>(block.x), shared, [&] { kernel(static_cast<Params>(args)...); });
}
}  // namespace dtk::cuda
