// Ring collectives over c10d point-to-point messages (see ring.hpp).
#include "ring.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace dtk::core::ring {
namespace {

// dst = received (op) mine, in place in `received`.
void combine(at::Tensor received, const at::Tensor& mine, c10d::ReduceOp op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      received.add_(mine);
      return;
    case c10d::ReduceOp::MAX:
      at::maximum_out(received, received, mine);
      return;
    case c10d::ReduceOp::MIN:
      at::minimum_out(received, received, mine);
      return;
    default:
      throw std::invalid_argument("ring reduce_scatter supports SUM, MAX and MIN");
  }
}

void wait(const c10::intrusive_ptr<c10d::Work>& w, std::chrono::milliseconds timeout) {
  if (!w->wait(timeout)) throw std::runtime_error("point-to-point message timed out");
}

// The communication thread: runs queued tasks in order. Never destroyed (collectives may still be
// in flight while the process exits after an error).
class Worker {
 public:
  Worker() { std::thread([this] { loop(); }).detach(); }
  std::shared_future<void> submit(std::function<void()> task) {
    std::packaged_task<void()> job(std::move(task));
    std::shared_future<void> done = job.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(job));
    }
    cv_.notify_one();
    return done;
  }

 private:
  void loop() {
    at::init_num_threads();  // the run's intra-op thread count (at::set_num_threads), not the default
    for (;;) {
      std::packaged_task<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
};

}  // namespace

void reduce_scatter(GroupBackend& pg, const at::Tensor& out, const at::Tensor& in, c10d::ReduceOp op, uint32_t tag,
                    std::chrono::milliseconds timeout) {
  at::NoGradGuard no_grad;
  const int n = pg.getSize(), rank = pg.getRank();
  if (n > 1025) throw std::invalid_argument("ring reduce_scatter supports groups of up to 1025 ranks (tag block)");
  const at::Tensor flat = in.reshape({-1});
  const int64_t m = flat.numel() / n;
  auto chunk = [&](int i) { return flat.narrow(0, static_cast<int64_t>(((i % n) + n) % n) * m, m); };
  at::Tensor partial = chunk(rank - 1).clone();  // step 0 sends this rank's own share of chunk r-1
  at::Tensor received = at::empty_like(partial);
  const int right = (rank + 1) % n, left = (rank - 1 + n) % n;
  for (int s = 0; s < n - 1; ++s) {
    std::vector<at::Tensor> send{partial}, recv{received};
    const auto sent = pg.send(send, right, static_cast<int>(tag) + s);
    const auto got = pg.recv(recv, left, static_cast<int>(tag) + s);
    wait(got, timeout);
    wait(sent, timeout);
    combine(received, chunk(rank - s - 2), op);
    std::swap(partial, received);
  }
  out.view({-1}).copy_(partial);
}

uint32_t next_tag(int32_t group) {
  // 1024 tags per collective (a group of up to 1025 ranks); 2^20 collectives before a block is
  // reused, long after the earlier one completed. Gloo's own collectives use slots with a prefix
  // in their high bits, so these never collide with them.
  static std::mutex mu;
  static std::array<uint32_t, 8> counters{};
  std::lock_guard<std::mutex> lock(mu);
  const uint32_t seq = counters[static_cast<size_t>(group) % counters.size()]++;
  return (seq % (1u << 20)) * 1024u;
}

std::shared_future<void> run_async(std::function<void()> task) {
  static Worker* worker = new Worker();
  return worker->submit(std::move(task));
}

}  // namespace dtk::core::ring
