// The counting CPU allocator behind the memory report and the device budget
// (dtk/core/memory/memory.hpp): live bytes and peaks per pool, host attribution inside a HostScope and
// through the pinned-memory service, and the budget's one-line refusal.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <dtk/tensor.hpp>

#include <string>

#include "dtk/core/memory/memory.hpp"
#include "dtk/core/components/services.hpp"

namespace memory = dtk::core::memory;

TEST(Memory, CountsDeviceBytesAndPeak) {
  memory::install();
  ASSERT_TRUE(memory::installed());
  const int64_t before = memory::stats().device.bytes;
  memory::reset_peak();
  {
    at::Tensor a = at::empty({1 << 20}, at::kFloat);  // 4 MiB
    EXPECT_EQ(memory::stats().device.bytes - before, 4 << 20);
    at::Tensor b = at::empty({1 << 18}, at::kDouble);  // 2 MiB
    EXPECT_EQ(memory::stats().device.bytes - before, 6 << 20);
  }
  EXPECT_EQ(memory::stats().device.bytes, before);
  EXPECT_EQ(memory::stats().device.peak - before, 6 << 20);
  // Views share their storage: no new bytes.
  at::Tensor base = at::zeros({1000}, at::kFloat);
  const int64_t with_base = memory::stats().device.bytes;
  at::Tensor view = base.narrow(0, 10, 100).view({10, 10});
  EXPECT_EQ(memory::stats().device.bytes, with_base);
}

TEST(Memory, HostScopeAndPinnedMemoryCountAsHost) {
  memory::install();
  const memory::Stats s0 = memory::stats();
  at::Tensor host_tensor;
  {
    memory::HostScope host;
    host_tensor = at::empty({1 << 18}, at::kFloat);  // 1 MiB
  }
  const memory::Stats s1 = memory::stats();
  EXPECT_EQ(s1.host.bytes - s0.host.bytes, 1 << 20);
  EXPECT_EQ(s1.device.bytes, s0.device.bytes);
  // The device services' pinned buffers are host memory too.
  const int64_t shape[] = {1 << 16};
  dtk_tensor* pinned = nullptr;
  const dtk_device_services* dev = dtk::core::host_services()->device;
  ASSERT_EQ(dev->alloc_pinned(dev->ctx, shape, 1, DTK_DTYPE_FLOAT32, &pinned), nullptr);
  EXPECT_EQ(memory::stats().host.bytes - s1.host.bytes, 1 << 18);
  dtk::release(pinned);
  EXPECT_EQ(memory::stats().host.bytes, s1.host.bytes);
  host_tensor.reset();  // freed into the pool it came from
  EXPECT_EQ(memory::stats().host.bytes, s0.host.bytes);
}

TEST(Memory, DeviceBudgetRefusesWithOneLine) {
  memory::install();
  const int64_t in_use = memory::stats().device.bytes;
  memory::set_device_limit(in_use + (8 << 20));
  at::Tensor fits = at::empty({1 << 20}, at::kFloat);  // 4 MiB of the 8
  try {
    at::Tensor too_big = at::empty({1 << 21}, at::kFloat);  // 8 more
    ADD_FAILURE() << "allocation past the budget succeeded";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("device memory budget of"), std::string::npos) << msg;
    EXPECT_NE(msg.find("exceeded: allocating 8.0 MB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(train.memory_limit_mb)"), std::string::npos) << msg;
  }
  {
    memory::HostScope host;  // host memory is outside the device budget
    at::Tensor on_host = at::empty({1 << 21}, at::kFloat);
  }
  memory::set_device_limit(0);
  at::Tensor no_budget = at::empty({1 << 21}, at::kFloat);
}
