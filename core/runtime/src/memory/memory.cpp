// The counting CPU allocator (dtk/core/memory/memory.hpp). Each block carries a 64-byte header in front
// of the data (its size and pool), so freeing needs no lookup and the data keeps LibTorch's
// 64-byte alignment; data and context are the same pointer, so raw_allocate() keeps working.
#include "dtk/core/memory/memory.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

namespace dtk::core::memory {
namespace {

constexpr size_t kHeader = 64;  // LibTorch's CPU alignment (c10::gAlignment)

struct Header {
  int64_t size;
  int32_t host;
};

struct Counter {
  std::atomic<int64_t> bytes{0}, peak{0};
  void add(int64_t n) {
    const int64_t now = bytes.fetch_add(n) + n;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
};

Counter g_device, g_host;
std::atomic<int64_t> g_limit{0};
std::atomic<bool> g_limit_is_machine{false};  // the default budget: this machine's memory
std::atomic<bool> g_installed{false};
std::atomic<bool> g_all_host{false};  // a GPU run: the CPU holds host memory only
std::function<Pool()> g_gpu_read;     // set once, before training (set_device_pool)
std::function<void()> g_gpu_reset;
thread_local int t_host_depth = 0;

std::string mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base), base_free_(base->raw_deleter()) {}

  // LibTorch 2.3 made allocate() non-const and copy_data() a required override.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(size_t n) override {
#else
  c10::DataPtr allocate(size_t n) const override {
#endif
    const bool host = t_host_depth > 0 || g_all_host.load(std::memory_order_relaxed);
    const int64_t size = static_cast<int64_t>(n);
    const int64_t limit = g_limit.load();
    if (!host && limit > 0 && g_device.bytes.load() + size > limit)
      TORCH_CHECK(false, "device memory budget of ", mb(limit), " exceeded: allocating ", mb(size), " with ",
                  mb(g_device.bytes.load()), " in use (",
                  g_limit_is_machine.load() ? "this machine's memory for this rank; train.memory_limit_mb sets another"
                                            : "train.memory_limit_mb",
                  ")");
    void* block = base_->raw_allocate(n + kHeader);
    auto* h = static_cast<Header*>(block);
    h->size = size;
    h->host = host ? 1 : 0;
    (host ? g_host : g_device).add(size);
    void* data = static_cast<char*>(block) + kHeader;
    return {data, data, &CountingAllocator::free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free; }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#endif

  static void free(void* data) {
    if (!data) return;
    void* block = static_cast<char*>(data) - kHeader;
    const auto* h = static_cast<const Header*>(block);
    (h->host ? g_host : g_device).add(-h->size);
    self()->base_free_(block);
  }

  static CountingAllocator*& self() {
    static CountingAllocator* instance = nullptr;
    return instance;
  }

 private:
  c10::Allocator* base_;
  c10::DeleterFnPtr base_free_;
};

}  // namespace

void install() {
  if (g_installed.exchange(true)) return;
  c10::Allocator* base = c10::GetCPUAllocator();
  if (!base->raw_deleter()) {  // cannot wrap it without a raw deleter: leave it, count nothing
    g_installed = false;
    return;
  }
  CountingAllocator::self() = new CountingAllocator(base);  // never freed: blocks outlive main
  c10::SetAllocator(c10::DeviceType::CPU, CountingAllocator::self(), /*priority=*/100);
}

bool installed() { return g_installed.load(); }

Stats stats() {
  Stats s;
  s.device = g_gpu_read ? g_gpu_read() : Pool{g_device.bytes.load(), g_device.peak.load()};
  s.host = {g_host.bytes.load(), g_host.peak.load()};
  return s;
}

void reset_peak() {
  g_device.peak = g_device.bytes.load();
  g_host.peak = g_host.bytes.load();
  if (g_gpu_reset) g_gpu_reset();
}

void set_device_pool(std::function<Pool()> read, std::function<void()> reset) {
  g_gpu_read = std::move(read);
  g_gpu_reset = std::move(reset);
  g_all_host = true;
}

void set_device_limit(int64_t bytes, bool machine) {
  g_limit = bytes > 0 ? bytes : 0;
  g_limit_is_machine = machine;
}

int64_t machine_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

HostScope::HostScope() { ++t_host_depth; }
HostScope::~HostScope() { --t_host_depth; }

int64_t peak_rss_bytes() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return static_cast<int64_t>(u.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace dtk::core::memory
