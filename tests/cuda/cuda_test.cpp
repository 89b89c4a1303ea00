// core/cuda: the CUDA runtime wrappers, the fused multi-tensor AdamW kernel and the multi-tensor
// sum of squares against plain CPU loops, and the NCCL communicator (one rank per visible GPU, threads of this
// process).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <condition_variable>
#include <memory>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "dtk/cuda/adamw.hpp"
#include "dtk/cuda/nccl.hpp"
#include "dtk/cuda/runtime.hpp"
#include "dtk/cuda/squares.hpp"

namespace {

using namespace dtk::cuda;

#define REQUIRE_GPU()                                                          \
  do {                                                                         \
    std::string why;                                                           \
    if (device_count(&why) == 0) GTEST_SKIP() << "needs a CUDA device: " << why; \
  } while (0)

// A device buffer of n floats (freed at scope end).
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t b) : bytes(b) { check(cudaMalloc(&p, std::max<size_t>(b, 1)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(p); }
  template <class T>
  void upload(const std::vector<T>& v) {
    check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  template <class T>
  std::vector<T> download(size_t n) const {
    std::vector<T> v(n);
    check(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return v;
  }
};

}  // namespace

// Runs everywhere: no device is a reason in one line, never a crash.
TEST(CudaRuntime, DeviceCountSaysWhyWhenThereIsNone) {
  std::string why;
  const int n = device_count(&why);
  EXPECT_GE(n, 0);
  if (n == 0) {
    EXPECT_EQ(why.rfind("no CUDA device", 0), 0u) << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
  EXPECT_GE(runtime_version(), 12000);
  EXPECT_NE(nccl_version(), "unknown");
}

TEST(CudaRuntime, StreamsEventsPinnedCopies) {
  REQUIRE_GPU();
  set_device(0);
  EXPECT_FALSE(device_description(0).empty());
  Stream s(-1);
  const size_t n = 1 << 20;
  float* host = static_cast<float*>(alloc_pinned(n * sizeof(float)));
  float* back = static_cast<float*>(alloc_pinned(n * sizeof(float)));
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i), back[i] = -1;
  DeviceBuffer d(n * sizeof(float));
  // Host -> device on one stream; device -> host on another ordered after it by an event.
  copy_async(d.p, host, n * sizeof(float), s.get());
  Event uploaded;
  uploaded.record(s.get());
  Stream t(0);
  uploaded.block(t.get());
  copy_async(back, d.p, n * sizeof(float), t.get());
  Event done;
  done.record(t.get());
  ASSERT_TRUE(wait_event(done.get(), std::chrono::seconds(10)));
  EXPECT_TRUE(done.query());
  for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(back[i], static_cast<float>(i));
  EXPECT_EQ(back[n - 1], static_cast<float>(n - 1));
  free_pinned(host);
  free_pinned(back);
}

TEST(CudaAdamW, FusedKernelEqualsCpuLoop) {
  REQUIRE_GPU();
  set_device(0);
  // 40 tensors (two launches of at most 32), sizes around the 16384-element chunk.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const AdamWScalars k{0.9f, 0.95f, 0.1f, 0.05f, 1.0f - 1e-3f * 0.1f, 1e-3f / (1 - 0.9f * 0.9f),
                       1.0f / std::sqrt(1 - 0.95f * 0.95f), 1e-8f, 0.5f};
  for (const bool bf16 : {false, true}) {
    std::vector<std::vector<float>> p, g, m, v;
    std::vector<std::unique_ptr<DeviceBuffer>> dp, dg, dm, dv;
    std::vector<AdamWTensor> tensors;
    for (int t = 0; t < 40; ++t) {
      const size_t n = t == 0 ? 1 : t == 1 ? 16384 : t == 2 ? 16385 : 1000 + 977 * static_cast<size_t>(t);
      std::vector<float> pi(n), gi(n), mi(n), vi(n);
      for (size_t i = 0; i < n; ++i) {
        pi[i] = normal(rng), gi[i] = normal(rng), mi[i] = 0.1f * normal(rng), vi[i] = std::abs(normal(rng));
        if (bf16) {  // round the gradient to bf16 so both sides read the same value
          uint32_t bits;
          std::memcpy(&bits, &gi[i], 4);
          bits &= 0xffff0000u;
          std::memcpy(&gi[i], &bits, 4);
        }
      }
      dp.push_back(std::make_unique<DeviceBuffer>(n * 4));
      dg.push_back(std::make_unique<DeviceBuffer>(n * (bf16 ? 2 : 4)));
      dm.push_back(std::make_unique<DeviceBuffer>(n * 4));
      dv.push_back(std::make_unique<DeviceBuffer>(n * 4));
      dp.back()->upload(pi), dm.back()->upload(mi), dv.back()->upload(vi);
      if (bf16) {
        std::vector<uint16_t> gb(n);
        for (size_t i = 0; i < n; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &gi[i], 4);
          gb[i] = static_cast<uint16_t>(bits >> 16);
        }
        dg.back()->upload(gb);
      } else {
        dg.back()->upload(gi);
      }
      tensors.push_back({static_cast<float*>(dp.back()->p), dg.back()->p, static_cast<float*>(dm.back()->p),
                         static_cast<float*>(dv.back()->p), static_cast<int64_t>(n)});
      p.push_back(pi), g.push_back(gi), m.push_back(mi), v.push_back(vi);
    }
    fused_adamw(tensors, bf16, k, default_stream());
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (size_t t = 0; t < tensors.size(); ++t) {
      const size_t n = p[t].size();
      const auto gp = dp[t]->download<float>(n), gm = dm[t]->download<float>(n), gv = dv[t]->download<float>(n);
      for (size_t i = 0; i < n; ++i) {
        const float grad = g[t][i] * k.inv_grad_scale;
        const float mi = k.beta1 * m[t][i] + k.one_minus_beta1 * grad;
        const float vi = k.beta2 * v[t][i] + k.one_minus_beta2 * grad * grad;
        const float pi = p[t][i] * k.decay - k.step_size * mi / (std::sqrt(vi) * k.inv_sqrt_bc2 + k.eps);
        ASSERT_NEAR(gm[i], mi, 1e-6f * (1 + std::abs(mi))) << "tensor " << t << " element " << i;
        ASSERT_NEAR(gv[i], vi, 1e-6f * (1 + std::abs(vi))) << "tensor " << t << " element " << i;
        ASSERT_NEAR(gp[i], pi, 1e-6f * (1 + std::abs(pi))) << "tensor " << t << " element " << i << " bf16 " << bf16;
      }
    }
  }
}

// One rank per visible GPU, each in a thread; the unique id travels through a map (a store).
// The gradient norm's sum of squares: 45 tensors of three element types (launches split by type
// and at 32 tensors, sizes around the 64K slice) against an fp64 loop on the host, and the same
// bits on a second run (deterministic); no tensors at all gives 0.
TEST(CudaSquares, MultiTensorSumEqualsFp64LoopAndRepeats) {
  REQUIRE_GPU();
  set_device(0);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<SquaresTensor> tensors;
  double expected = 0;
  for (int t = 0; t < 45; ++t) {
    const ElementType type = t < 20 ? ElementType::kFloat32 : t < 35 ? ElementType::kBFloat16 : ElementType::kFloat16;
    const size_t n = t % 7 == 0 ? 65536 : t % 7 == 1 ? 65537 : t == 3 ? 0 : 1 + 5003 * static_cast<size_t>(t);
    std::vector<float> x(n);
    std::vector<uint16_t> half(n);
    for (size_t i = 0; i < n; ++i) {
      x[i] = normal(rng) * (1 + t);
      uint32_t bits;
      std::memcpy(&bits, &x[i], 4);
      if (type == ElementType::kBFloat16) {  // truncate to bf16: both sides square the same value
        bits &= 0xffff0000u;
        std::memcpy(&x[i], &bits, 4);
        half[i] = static_cast<uint16_t>(bits >> 16);
      } else if (type == ElementType::kFloat16) {  // small integers: exact in fp16
        x[i] = std::round(x[i]);
        const int v = static_cast<int>(std::abs(x[i]));
        uint16_t h = 0;
        if (v != 0) {
          int e = 0;
          while ((v >> (e + 1)) != 0) ++e;
          h = static_cast<uint16_t>(((e + 15) << 10) | ((static_cast<uint32_t>(v) << (10 - e)) & 0x3ffu));
        }
        half[i] = static_cast<uint16_t>(h | (x[i] < 0 ? 0x8000u : 0u));
      }
      expected += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    }
    const bool f32 = type == ElementType::kFloat32;
    buffers.push_back(std::make_unique<DeviceBuffer>(n * (f32 ? 4 : 2)));
    if (n > 0) f32 ? buffers.back()->upload(x) : buffers.back()->upload(half);
    tensors.push_back({buffers.back()->p, static_cast<int64_t>(n), type});
  }
  DeviceBuffer work((sum_of_squares_workspace(tensors) + 1) * sizeof(double));
  double* base = static_cast<double*>(work.p);
  const int64_t out = sum_of_squares_workspace(tensors);
  sum_of_squares(tensors, base, base + out, default_stream());
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const double first = work.download<double>(static_cast<size_t>(out) + 1)[static_cast<size_t>(out)];
  EXPECT_NEAR(first, expected, 1e-12 * expected);
  sum_of_squares(tensors, base, base + out, default_stream());
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const double second = work.download<double>(static_cast<size_t>(out) + 1)[static_cast<size_t>(out)];
  EXPECT_EQ(std::memcmp(&first, &second, sizeof(double)), 0) << first << " vs " << second;
  sum_of_squares({}, base, base + 1, default_stream());
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  EXPECT_EQ(work.download<double>(2)[1], 0.0);
}

TEST(Nccl, CollectivesAcrossTheVisibleGpus) {
  REQUIRE_GPU();
  const int n = device_count();
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::string> store;
  Rendezvous rv{[&](const std::string& key, const std::string& value) {
                  std::lock_guard<std::mutex> lock(mu);
                  store[key] = value;
                  cv.notify_all();
                },
                [&](const std::string& key) {
                  std::unique_lock<std::mutex> lock(mu);
                  cv.wait_for(lock, std::chrono::seconds(30), [&] { return store.count(key) > 0; });
                  return store.count(key) ? store[key] : std::string();
                }};
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      try {
        NcclCommunicator comm(rv, "test", r, n, r, std::chrono::seconds(60));
        set_device(r);
        const size_t count = 1000;
        std::vector<float> x(count);
        for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>(r + 1) * static_cast<float>(i);
        DeviceBuffer d(count * 4), gathered(count * 4 * n);
        d.upload(x);
        auto sum = comm.all_reduce(d.p, count, DataType::kFloat32, ReduceOp::kSum, default_stream());
        comm.finish(sum, default_stream(), /*host_wait=*/true);
        const auto y = d.download<float>(count);
        const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
        for (size_t i = 0; i < count; ++i)
          if (y[i] != ranks_sum * static_cast<float>(i)) throw std::runtime_error("all_reduce sum wrong at " + std::to_string(i));
        d.upload(x);
        auto all = comm.all_gather(d.p, gathered.p, count, DataType::kFloat32, default_stream());
        comm.finish(all, default_stream(), true);
        const auto z = gathered.download<float>(count * n);
        for (int q = 0; q < n; ++q)
          if (z[q * count + 7] != static_cast<float>(q + 1) * 7) throw std::runtime_error("all_gather wrong");
        // all_to_all: rank r sends rank q (r + q + 1) elements of 100 r + q (uneven parts, rank order).
        std::vector<size_t> sends, receives;
        std::vector<float> parts, want;
        for (int q = 0; q < n; ++q) {
          sends.push_back(static_cast<size_t>(r + q + 1)), receives.push_back(static_cast<size_t>(q + r + 1));
          parts.insert(parts.end(), static_cast<size_t>(r + q + 1), static_cast<float>(100 * r + q));
          want.insert(want.end(), static_cast<size_t>(q + r + 1), static_cast<float>(100 * q + r));
        }
        DeviceBuffer out_parts(want.size() * 4), in_parts(parts.size() * 4);
        in_parts.upload(parts);
        auto exchanged =
            comm.all_to_all(in_parts.p, out_parts.p, sends, receives, DataType::kFloat32, default_stream());
        comm.finish(exchanged, default_stream(), true);
        if (out_parts.download<float>(want.size()) != want) throw std::runtime_error("all_to_all wrong");
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}
