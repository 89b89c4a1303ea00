// The multi-tensor sum of squares (dtk/cuda/squares.hpp). A launch carries up to kMaxTensors
// tensors of one element type by value; block b squares and sums one kSlice-element slice of one
// tensor into workspace[first + b] (threads accumulate in fp64 with a fixed stride, then a fixed
// shared-memory tree), and a single block then adds the workspace in a fixed order. The same
// inputs therefore give the same bits on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "dtk/cuda/squares.hpp"
#include "launch.cuh"

namespace dtk::cuda {
namespace {

constexpr int kMaxTensors = 32;
constexpr int kThreads = 256;
constexpr int64_t kSlice = 65536;  // elements per block
constexpr int kMaxBlocks = 65536;  // a launch is flushed here (4G elements)

struct Launch {
  const void* x[kMaxTensors];
  int64_t n[kMaxTensors];
  int first_block[kMaxTensors + 1];  // blocks of tensor i: [first_block[i], first_block[i + 1])
  int count;
};

template <ElementType kType>
__device__ __forceinline__ double load(const void* x, int64_t i) {
  if constexpr (kType == ElementType::kBFloat16)
    return static_cast<double>(__bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]));
  else if constexpr (kType == ElementType::kFloat16)
    return static_cast<double>(__half2float(static_cast<const __half*>(x)[i]));
  else
    return static_cast<double>(static_cast<const float*>(x)[i]);
}

// Sums `v` over the block in a fixed tree; thread 0 gets the total.
__device__ double block_sum(double v) {
  __shared__ double s[kThreads];
  s[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
  return s[0];
}

template <ElementType kType>
__global__ void squares_kernel(Launch l, double* partials) {
  const int block = static_cast<int>(blockIdx.x);
  int t = 0;
  while (t + 1 < l.count && l.first_block[t + 1] <= block) ++t;
  const int64_t begin = static_cast<int64_t>(block - l.first_block[t]) * kSlice;
  const int64_t end = min(begin + kSlice, l.n[t]);
  double acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double x = load<kType>(l.x[t], i);
    acc += x * x;
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[block] = total;
}

__global__ void add_partials(const double* partials, int64_t n, double* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += partials[i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) *out = total;
}

void launch(const Launch& l, int blocks, ElementType type, double* partials, StreamHandle stream) {
  if (blocks == 0) return;
  switch (type) {
    case ElementType::kFloat32:
      launch_kernel(squares_kernel<ElementType::kFloat32>, blocks, kThreads, 0, stream, l, partials);
      break;
    case ElementType::kBFloat16:
      launch_kernel(squares_kernel<ElementType::kBFloat16>, blocks, kThreads, 0, stream, l, partials);
      break;
    case ElementType::kFloat16:
      launch_kernel(squares_kernel<ElementType::kFloat16>, blocks, kThreads, 0, stream, l, partials);
      break;
  }
  check(cudaGetLastError(), "sum_of_squares: kernel launch");
}

size_t element_bytes(ElementType type) { return type == ElementType::kFloat32 ? 4 : 2; }

}  // namespace

int64_t sum_of_squares_workspace(const std::vector<SquaresTensor>& tensors) {
  int64_t blocks = 0;
  for (const SquaresTensor& t : tensors)
    if (t.n > 0) blocks += (t.n + kSlice - 1) / kSlice;
  return std::max<int64_t>(blocks, 1);
}

void sum_of_squares(const std::vector<SquaresTensor>& tensors, double* workspace, double* out, StreamHandle stream) {
  Launch l{};
  int blocks = 0;
  int64_t written = 0;  // workspace entries filled by earlier launches
  ElementType type = ElementType::kFloat32;
  auto flush = [&] {
    l.first_block[l.count] = blocks;
    launch(l, blocks, type, workspace + written, stream);
    written += blocks;
    l = Launch{};
    blocks = 0;
  };
  for (const SquaresTensor& t : tensors) {
    if (t.n <= 0) continue;
    if (l.count > 0 && t.type != type) flush();
    type = t.type;
    // A tensor larger than one launch's blocks goes in pieces.
    for (int64_t off = 0; off < t.n; off += int64_t{kMaxBlocks} * kSlice) {
      const int64_t n = std::min<int64_t>(t.n - off, int64_t{kMaxBlocks} * kSlice);
      const int64_t nb = (n + kSlice - 1) / kSlice;
      if (l.count == kMaxTensors || blocks + nb > kMaxBlocks) flush();
      const int i = l.count++;
      l.x[i] = static_cast<const char*>(t.data) + off * static_cast<int64_t>(element_bytes(t.type));
      l.n[i] = n;
      l.first_block[i] = blocks;
      blocks += static_cast<int>(nb);
    }
  }
  flush();
  if (written == 0) check(cudaMemsetAsync(workspace, 0, sizeof(double), stream), "sum_of_squares: memset");
  launch_kernel(add_partials, 1, kThreads, 0, stream, static_cast<const double*>(workspace),
                std::max<int64_t>(written, 1), out);
  check(cudaGetLastError(), "sum_of_squares: kernel launch");
}

}  // namespace dtk::cuda
