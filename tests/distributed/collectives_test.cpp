// Collectives through the host services table (what every plugin calls) on 2, 3 and 4
// processes over loopback with Gloo. Each rank is this test binary in worker mode.
#include <gtest/gtest.h>

#include <dtk/tensor.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#if DTK_HAVE_CUDA
#include "dtk/cuda/runtime.hpp"
#endif

#include "dtk/core/config/config.hpp"
#include "dtk/core/launch/distributed.hpp"
#include "dtk/core/components/services.hpp"
#include "spawn.hpp"

namespace {

// Whether this build can see a GPU (CI's machines cannot: the CUDA half must refuse cleanly).
bool gpu_visible() {
#if DTK_HAVE_CUDA
  return dtk::cuda::device_count() > 0;
#else
  return false;
#endif
}

int g_failures = 0;
int g_rank = 0;

#define WCHECK(cond, what)                                                                \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "rank %d FAIL %s:%d: %s\n", g_rank, __FILE__, __LINE__, what); \
      ++g_failures;                                                                       \
    }                                                                                     \
  } while (0)

// Calls a collective; returns the status code (and releases the status).
int code_of(dtk_status* s, std::string* msg = nullptr) {
  const int c = dtk_status_get_code(s);
  if (s && msg) *msg = dtk_status_get_message(s);
  if (s && !msg && c) std::fprintf(stderr, "rank %d status %d: %s\n", g_rank, c, dtk_status_get_message(s));
  dtk_status_release(s);
  return c;
}

bool same(const at::Tensor& a, const at::Tensor& b) { return a.sizes() == b.sizes() && at::allclose(a, b); }

at::Tensor f(std::initializer_list<double> v) { return at::tensor(std::vector<double>(v), at::kFloat); }

// ABI 2.0 passes a collective's arguments in a dtk_collective_args; these build it from the
// positional arguments the checks below were written with.
dtk_collective_args cargs(int32_t group, dtk_tensor* tensor, dtk_tensor* output, int32_t op, int32_t root,
                          int32_t async, dtk_comm_work** work) {
  dtk_collective_args a{};
  a.struct_size = dtk_collective_args_STRUCT_SIZE;
  a.group = group, a.tensor = tensor, a.output = output, a.op = op, a.root = root, a.async = async, a.work = work;
  return a;
}
dtk_status* all_reduce(const dtk_comm_services* c, int32_t g, dtk_tensor* t, int32_t op, int32_t async,
                       dtk_comm_work** w) {
  const dtk_collective_args a = cargs(g, t, nullptr, op, 0, async, w);
  return c->all_reduce(c->ctx, &a);
}
dtk_status* broadcast(const dtk_comm_services* c, int32_t g, dtk_tensor* t, int32_t root, int32_t async,
                      dtk_comm_work** w) {
  const dtk_collective_args a = cargs(g, t, nullptr, DTK_REDUCE_SUM, root, async, w);
  return c->broadcast(c->ctx, &a);
}
dtk_status* all_gather(const dtk_comm_services* c, int32_t g, dtk_tensor* out, dtk_tensor* in, int32_t async,
                       dtk_comm_work** w) {
  const dtk_collective_args a = cargs(g, in, out, DTK_REDUCE_SUM, 0, async, w);
  return c->all_gather(c->ctx, &a);
}
dtk_status* reduce_scatter(const dtk_comm_services* c, int32_t g, dtk_tensor* out, dtk_tensor* in, int32_t op,
                           int32_t async, dtk_comm_work** w) {
  const dtk_collective_args a = cargs(g, in, out, op, 0, async, w);
  return c->reduce_scatter(c->ctx, &a);
}
// ABI 2.19's personalised exchange; NULL splits: equal parts.
dtk_status* all_to_all(const dtk_comm_services* c, int32_t g, dtk_tensor* out, dtk_tensor* in,
                       const std::vector<int64_t>* out_splits, const std::vector<int64_t>* in_splits, int32_t async,
                       dtk_comm_work** w) {
  dtk_collective_args a = cargs(g, in, out, DTK_REDUCE_SUM, 0, async, w);
  a.output_splits = out_splits ? out_splits->data() : nullptr;
  a.input_splits = in_splits ? in_splits->data() : nullptr;
  return c->all_to_all(c->ctx, &a);
}
dtk_status* barrier(const dtk_comm_services* c, int32_t g) {
  const dtk_collective_args a = cargs(g, nullptr, nullptr, DTK_REDUCE_SUM, 0, 0, nullptr);
  return c->barrier(c->ctx, &a);
}

}  // namespace

int collectives_worker(int, char**) {
  using namespace dtk::core;
  dtk::config::RunConfig cfg = default_config();
  const int tp = std::atoi(std::getenv("DTK_TEST_TP") ? std::getenv("DTK_TEST_TP") : "1");
  cfg.mutable_distributed()->set_tensor_model_parallel_size(tp);
  cfg.mutable_distributed()->set_timeout_seconds(20);
  try {
    set_run_config(cfg);
    init_distributed(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "init failed: %s\n", e.what());
    return 1;
  }
  const Topology& t = topology();
  g_rank = t.world_rank;
  const int W = t.world_size, r = t.world_rank;
  const dtk_comm_services* c = host_services()->comm;
  void* ctx = c->ctx;

  // Sizes and ranks of the groups (Megatron: TP consecutive, DP strided by TP).
  WCHECK(c->size(ctx, DTK_GROUP_WORLD) == W && c->rank(ctx, DTK_GROUP_WORLD) == r, "world size/rank");
  WCHECK(c->size(ctx, DTK_GROUP_TENSOR_PARALLEL) == tp && c->rank(ctx, DTK_GROUP_TENSOR_PARALLEL) == r % tp, "tp");
  WCHECK(c->size(ctx, DTK_GROUP_DATA_PARALLEL) == W / tp && c->rank(ctx, DTK_GROUP_DATA_PARALLEL) == r / tp, "dp");
  WCHECK(c->size(ctx, DTK_GROUP_PIPELINE_PARALLEL) == 1 && c->size(ctx, DTK_GROUP_MODEL_PARALLEL) == tp, "pp/mp");

  // all_reduce SUM / AVG / MAX / MIN on the world.
  {
    dtk_tensor h{f({1.0 * (r + 1), 2.0 * (r + 1)})};
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &h, DTK_REDUCE_SUM, 0, nullptr)) == 0, "sum status");
    const double s = W * (W + 1) / 2.0;
    WCHECK(same(h.value, f({s, 2 * s})), "all_reduce SUM");
    h.value = f({1.0 * r, 10.0});
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &h, DTK_REDUCE_AVG, 0, nullptr)) == 0, "avg status");
    WCHECK(same(h.value, f({(W - 1) / 2.0, 10.0})), "all_reduce AVG");
    h.value = f({1.0 * r, -1.0 * r});
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &h, DTK_REDUCE_MAX, 0, nullptr)) == 0, "max status");
    WCHECK(same(h.value, f({W - 1.0, 0.0})), "all_reduce MAX");
    h.value = f({1.0 * r, -1.0 * r});
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &h, DTK_REDUCE_MIN, 0, nullptr)) == 0, "min status");
    WCHECK(same(h.value, f({0.0, 1.0 - W})), "all_reduce MIN");
    // A non-contiguous tensor (a transposed view) is reduced in place too.
    at::Tensor base = at::arange(6, at::kFloat).reshape({2, 3}).add(r);
    dtk_tensor v{base.t()};
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &v, DTK_REDUCE_SUM, 0, nullptr)) == 0, "noncontig status");
    WCHECK(same(base, at::arange(6, at::kFloat).reshape({2, 3}).mul(W).add(W * (W - 1) / 2.0)),
           "all_reduce of a non-contiguous view");
    // Integers: SUM works; AVG is refused (no single right rounding).
    dtk_tensor iv{at::full({2}, 2 * r + 1, at::kLong)};
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &iv, DTK_REDUCE_SUM, 0, nullptr)) == 0, "int status");
    WCHECK(iv.value[0].item<int64_t>() == int64_t(W) * W, "int all_reduce SUM");
    dtk_tensor ia{at::full({2}, 3, at::kLong)};
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &ia, DTK_REDUCE_AVG, 0, nullptr)) == DTK_ERR_INVALID_ARGUMENT,
           "int AVG refused");
  }
  // broadcast from the last group rank.
  {
    dtk_tensor h{at::full({3}, 1.0 * r, at::kFloat)};
    WCHECK(code_of(broadcast(c, DTK_GROUP_WORLD, &h, W - 1, 0, nullptr)) == 0, "broadcast status");
    WCHECK(same(h.value, at::full({3}, W - 1.0, at::kFloat)), "broadcast");
    std::string msg;
    WCHECK(code_of(broadcast(c, DTK_GROUP_WORLD, &h, W, 0, nullptr), &msg) == DTK_ERR_INVALID_ARGUMENT,
           "broadcast from a rank outside the group is refused");
  }
  // all_gather in rank order; reduce_scatter.
  {
    dtk_tensor in{f({10.0 * r, 10.0 * r + 1})}, out{at::zeros({2 * W}, at::kFloat)};
    WCHECK(code_of(all_gather(c, DTK_GROUP_WORLD, &out, &in, 0, nullptr)) == 0, "all_gather status");
    at::Tensor want = at::empty({2 * W}, at::kFloat);
    for (int i = 0; i < W; ++i) want[2 * i] = 10.0 * i, want[2 * i + 1] = 10.0 * i + 1;
    WCHECK(same(out.value, want), "all_gather");
    dtk_tensor rs_in{at::arange(2 * W, at::kFloat).add(r)}, rs_out{at::zeros({2}, at::kFloat)};
    WCHECK(code_of(reduce_scatter(c, DTK_GROUP_WORLD, &rs_out, &rs_in, DTK_REDUCE_SUM, 0, nullptr)) == 0,
           "reduce_scatter status");
    const double base = W * (W - 1) / 2.0;
    WCHECK(same(rs_out.value, f({base + W * (2.0 * r), base + W * (2.0 * r + 1)})), "reduce_scatter SUM");
    WCHECK(same(rs_in.value, at::arange(2 * W, at::kFloat).add(r)), "reduce_scatter leaves its input alone");
    std::string msg;
    dtk_tensor bad{at::zeros({2 * W + 1}, at::kFloat)};
    WCHECK(code_of(all_gather(c, DTK_GROUP_WORLD, &bad, &in, 0, nullptr), &msg) == DTK_ERR_INVALID_ARGUMENT,
           "all_gather with a wrong output shape is refused");
  }
  // reduce_scatter (a ring over send/recv on Gloo) against a reference computed from every rank's
  // input: every rank draws all inputs from the same seeds. 2-D tensors, SUM/AVG/MAX/MIN, and four
  // in flight at once finished out of order.
  {
    auto input_of = [&](int rank) {
      at::Generator g = at::detail::createCPUGenerator(1000 + rank);
      return at::randn({3 * W, 5}, g, at::kFloat);
    };
    std::vector<at::Tensor> all;
    for (int k = 0; k < W; ++k) all.push_back(input_of(k));
    const at::Tensor stacked = at::stack(all);  // [W, 3W, 5]
    const at::Tensor mine = stacked.narrow(1, 3 * r, 3);
    const std::pair<int32_t, at::Tensor> cases[] = {
        {DTK_REDUCE_SUM, mine.sum(0)},
        {DTK_REDUCE_AVG, mine.sum(0) / W},
        {DTK_REDUCE_MAX, std::get<0>(mine.max(0))},
        {DTK_REDUCE_MIN, std::get<0>(mine.min(0))},
    };
    std::vector<dtk_tensor> ins(4, dtk_tensor{input_of(r)}), outs;
    for (int k = 0; k < 4; ++k) outs.push_back(dtk_tensor{at::zeros({3, 5}, at::kFloat)});
    std::vector<dtk_comm_work*> works(4, nullptr);
    for (int k = 0; k < 4; ++k)
      WCHECK(code_of(reduce_scatter(c, DTK_GROUP_WORLD, &outs[k], &ins[k], cases[k].first, 1, &works[k])) == 0,
             "async ring reduce_scatter status");
    for (int k = 3; k >= 0; --k) {
      WCHECK(code_of(c->wait(ctx, works[k], 0)) == 0, "wait ring reduce_scatter");
      c->work_release(ctx, works[k]);
      WCHECK(at::allclose(outs[k].value, cases[k].second, 1e-5, 1e-6), "ring reduce_scatter value");
    }
    WCHECK(same(ins[0].value, input_of(r)), "ring reduce_scatter leaves its input alone");
  }
  // bf16: copies move the bits unchanged; reductions sum in fp32 and round once.
  {
    const at::Tensor mine = at::arange(4, at::kFloat).add(0.5 * r).to(at::kBFloat16);
    dtk_tensor in{mine}, out{at::zeros({4 * W}, at::kBFloat16)};
    WCHECK(code_of(all_gather(c, DTK_GROUP_WORLD, &out, &in, 0, nullptr)) == 0, "bf16 all_gather status");
    for (int k = 0; k < W; ++k)
      WCHECK(at::equal(out.value.narrow(0, 4 * k, 4), at::arange(4, at::kFloat).add(0.5 * k).to(at::kBFloat16)),
             "bf16 all_gather bits");
    dtk_tensor b{mine.clone()};
    WCHECK(code_of(broadcast(c, DTK_GROUP_WORLD, &b, 0, 0, nullptr)) == 0, "bf16 broadcast status");
    WCHECK(at::equal(b.value, at::arange(4, at::kFloat).to(at::kBFloat16)), "bf16 broadcast bits");
    dtk_tensor s{at::full({3}, 1.0 + r, at::kBFloat16)};
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &s, DTK_REDUCE_SUM, 0, nullptr)) == 0, "bf16 all_reduce status");
    WCHECK(s.value.scalar_type() == at::kBFloat16 && s.value[0].item<float>() == W * (W + 1) / 2.0f,
           "bf16 all_reduce SUM");
  }
  // all_to_all (ABI 2.19): rank r sends rank j (r + 2 j) % 3 rows of {100 r + 10 j + i, r} (some
  // parts empty), in fp32 and as int64; equal parts with NULL splits and in bf16 (bits unchanged),
  // asynchronously; a 2.0-sized args (no splits) is equal parts; splits that miss the rows are
  // refused in one line naming the collective.
  {
    const auto rows = [](int from, int to) { return static_cast<int64_t>((from + 2 * to) % 3); };
    const auto part = [](int from, int to, int64_t n) {
      at::Tensor p = at::empty({n, 2}, at::kFloat);
      for (int64_t i = 0; i < n; ++i) p[i][0] = 100.0 * from + 10.0 * to + i, p[i][1] = from;
      return p;
    };
    std::vector<int64_t> send, recv;
    std::vector<at::Tensor> sent, want;
    for (int j = 0; j < W; ++j) {
      send.push_back(rows(r, j)), sent.push_back(part(r, j, rows(r, j)));
      recv.push_back(rows(j, r)), want.push_back(part(j, r, rows(j, r)));
    }
    for (const at::ScalarType type : {at::kFloat, at::kLong}) {
      dtk_tensor in{at::cat(sent).to(type)}, out{at::full({at::cat(want).size(0), 2}, -1, type)};
      WCHECK(code_of(all_to_all(c, DTK_GROUP_WORLD, &out, &in, &recv, &send, 0, nullptr)) == 0, "all_to_all status");
      WCHECK(at::equal(out.value, at::cat(want).to(type)), "all_to_all with uneven splits, rank order");
    }
    // Rank 0 receives nothing at all (an empty output tensor), the others one or two rows from each.
    {
      const auto rows_to = [](int from, int to) { return to == 0 ? int64_t{0} : int64_t{1 + (from + to) % 2}; };
      std::vector<int64_t> to, from;
      std::vector<at::Tensor> out_parts, expected;
      for (int j = 0; j < W; ++j) {
        to.push_back(rows_to(r, j)), out_parts.push_back(part(r, j, rows_to(r, j)));
        from.push_back(rows_to(j, r)), expected.push_back(part(j, r, rows_to(j, r)));
      }
      dtk_tensor in{at::cat(out_parts)}, out{at::zeros({at::cat(expected).size(0), 2}, at::kFloat)};
      WCHECK(code_of(all_to_all(c, DTK_GROUP_WORLD, &out, &in, &from, &to, 0, nullptr)) == 0,
             "all_to_all into an empty tensor: status");
      WCHECK(at::equal(out.value, at::cat(expected)) && (r != 0 || out.value.size(0) == 0),
             "all_to_all into an empty tensor");
    }
    const at::Tensor mine = at::arange(3 * W, at::kFloat).add(0.5 * r).to(at::kBFloat16).view({W, 3});
    dtk_tensor in{mine}, out{at::zeros({W, 3}, at::kBFloat16)};
    dtk_comm_work* w = nullptr;
    WCHECK(code_of(all_to_all(c, DTK_GROUP_WORLD, &out, &in, nullptr, nullptr, 1, &w)) == 0 && w, "async all_to_all");
    WCHECK(code_of(c->wait(ctx, w, 0)) == 0, "wait all_to_all");
    c->work_release(ctx, w);
    for (int j = 0; j < W; ++j)
      WCHECK(at::equal(out.value[j], at::arange(3 * r, 3 * r + 3, at::kFloat).add(0.5 * j).to(at::kBFloat16)),
             "bf16 all_to_all of equal parts, bits unchanged");
    out.value.zero_();
    dtk_collective_args old = cargs(DTK_GROUP_WORLD, &in, &out, DTK_REDUCE_SUM, 0, 0, nullptr);
    old.struct_size = dtk_collective_args_STRUCT_SIZE_2_0;
    old.output_splits = recv.data();  // past a 2.0 struct: never read
    WCHECK(code_of(c->all_to_all(ctx, &old)) == 0, "all_to_all with 2.0-sized args");
    for (int j = 0; j < W; ++j)
      WCHECK(at::equal(out.value[j], at::arange(3 * r, 3 * r + 3, at::kFloat).add(0.5 * j).to(at::kBFloat16)),
             "2.0-sized args: equal parts");
    std::vector<int64_t> short_by_one = send;
    short_by_one[0] += 1;
    std::string msg;
    dtk_tensor uneven{at::cat(sent)}, into{at::zeros({at::cat(want).size(0), 2}, at::kFloat)};
    WCHECK(code_of(all_to_all(c, DTK_GROUP_WORLD, &into, &uneven, &recv, &short_by_one, 0, nullptr), &msg) ==
                   DTK_ERR_INVALID_ARGUMENT &&
               msg.find("all_to_all: the input splits") != std::string::npos && msg.find('\n') == std::string::npos,
           ("splits that miss the rows are refused: " + msg).c_str());
  }
  // Async + wait: all three kinds in flight at once, finished in reverse order.
  {
    dtk_tensor a{f({1.0 * r})}, gi{f({1.0 * r})}, go{at::zeros({W}, at::kFloat)};
    dtk_tensor ri{at::ones({W}, at::kFloat)}, ro{at::zeros({1}, at::kFloat)};
    dtk_comm_work *w1 = nullptr, *w2 = nullptr, *w3 = nullptr;
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &a, DTK_REDUCE_AVG, 1, &w1)) == 0 && w1, "async all_reduce");
    WCHECK(code_of(all_gather(c, DTK_GROUP_WORLD, &go, &gi, 1, &w2)) == 0 && w2, "async all_gather");
    WCHECK(code_of(reduce_scatter(c, DTK_GROUP_WORLD, &ro, &ri, DTK_REDUCE_AVG, 1, &w3)) == 0 && w3,
           "async reduce_scatter");
    WCHECK(code_of(c->wait(ctx, w3, 10000)) == 0, "wait reduce_scatter");
    WCHECK(code_of(c->wait(ctx, w2, 0)) == 0, "wait all_gather");
    WCHECK(code_of(c->wait(ctx, w1, -1)) == 0, "wait all_reduce");
    c->work_release(ctx, w1), c->work_release(ctx, w2), c->work_release(ctx, w3);
    WCHECK(same(a.value, f({(W - 1) / 2.0})), "async all_reduce AVG value");
    WCHECK(same(go.value, at::arange(W, at::kFloat)), "async all_gather value");
    WCHECK(same(ro.value, f({1.0})), "async reduce_scatter AVG value");
  }
  // Sub-groups: TP (consecutive ranks) and DP (stride tp).
  if (tp > 1 || W / tp > 1) {
    dtk_tensor h{f({1.0 * r})};
    WCHECK(code_of(all_reduce(c, DTK_GROUP_TENSOR_PARALLEL, &h, DTK_REDUCE_SUM, 0, nullptr)) == 0, "tp status");
    const int first = (r / tp) * tp;
    WCHECK(same(h.value, f({tp * first + tp * (tp - 1) / 2.0})), "TP all_reduce sums consecutive ranks");
    dtk_tensor d{f({1.0 * r})};
    WCHECK(code_of(all_reduce(c, DTK_GROUP_DATA_PARALLEL, &d, DTK_REDUCE_SUM, 0, nullptr)) == 0, "dp status");
    const int dp = W / tp;
    WCHECK(same(d.value, f({dp * (r % tp) + tp * dp * (dp - 1) / 2.0})), "DP all_reduce sums ranks strided by tp");
    dtk_tensor b{f({1.0 * r})};
    WCHECK(code_of(broadcast(c, DTK_GROUP_TENSOR_PARALLEL, &b, tp - 1, 0, nullptr)) == 0, "tp bcast status");
    WCHECK(same(b.value, f({first + tp - 1.0})), "TP broadcast from group rank tp-1");
  }
  WCHECK(code_of(barrier(c, DTK_GROUP_WORLD)) == 0, "barrier");

  // A wait that runs out: rank 0 waits 200 ms for an all_reduce the others join 1.5 s later.
  {
    dtk_tensor h{f({1.0})};
    dtk_comm_work* w = nullptr;
    if (r != 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    WCHECK(code_of(all_reduce(c, DTK_GROUP_WORLD, &h, DTK_REDUCE_SUM, 1, &w)) == 0, "late async all_reduce");
    std::string msg;
    if (r == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      const int code = code_of(c->wait(ctx, w, 200), &msg);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      WCHECK(code == DTK_ERR_COMM, ("timed-out wait returns DTK_ERR_COMM, got: " + msg).c_str());
      WCHECK(msg.find('\n') == std::string::npos && msg.find("all_reduce") != std::string::npos,
             ("one-line message naming the collective: " + msg).c_str());
      WCHECK(ms < 1400, "the wait returned at its timeout");
      WCHECK(code_of(c->wait(ctx, w, 0)) == 0, "a second wait completes");  // the others arrive
    } else {
      WCHECK(code_of(c->wait(ctx, w, 0)) == 0, "peers complete the late all_reduce");
    }
    c->work_release(ctx, w);
    WCHECK(h.value.item<float>() == W, "late all_reduce value");
  }
  try {
    shutdown_distributed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d shutdown: %s\n", r, e.what());
    ++g_failures;
  }
  std::printf("rank %d: %s\n", r, g_failures ? "FAILED" : "ok");
  return g_failures ? 1 : 0;
}

namespace {

void run_collectives(int world, int tp) {
  const dtk_test::ReservedPort reserved;  // held until the ranks exit
  const int port = reserved.number();
  std::vector<std::string> cmds;
  for (int r = 0; r < world; ++r)
    cmds.push_back("env DTK_TEST_WORKER=collectives DTK_TEST_TP=" + std::to_string(tp) + " RANK=" + std::to_string(r) +
                   " WORLD_SIZE=" + std::to_string(world) + " LOCAL_RANK=" + std::to_string(r) +
                   " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " + dtk_test::self_exe());
  const auto results = dtk_test::run_all(cmds, 90);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].code, 0) << "rank " << r << ":\n" << results[r].out;
    EXPECT_NE(results[r].out.find("rank " + std::to_string(r) + ": ok"), std::string::npos) << results[r].out;
  }
}

}  // namespace

TEST(Collectives, TwoProcesses) { run_collectives(2, 1); }
TEST(Collectives, ThreeProcesses) { run_collectives(3, 1); }
TEST(Collectives, ThreeProcessesOneTensorParallelGroup) { run_collectives(3, 3); }
TEST(Collectives, FourProcessesTp2Dp2) { run_collectives(4, 2); }

// Without a distributed environment every group has size one and collectives are the identity.
TEST(Collectives, SingleProcessIsIdentity) {
  using namespace dtk::core;
  for (const char* v :
       {"RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"})
    unsetenv(v);
  const LaunchEnv le = launch_env_from_environment();
  EXPECT_FALSE(le.distributed);
  const dtk_comm_services* c = host_services()->comm;
  dtk_tensor h{at::ones({2})};
  dtk_comm_work* w = nullptr;
  ASSERT_EQ(code_of(all_reduce(c, DTK_GROUP_WORLD, &h, DTK_REDUCE_SUM, 1, &w)), 0);
  EXPECT_EQ(code_of(c->wait(c->ctx, w, 0)), 0);
  c->work_release(c->ctx, w);
  EXPECT_TRUE(same(h.value, at::ones({2})));
}

TEST(LaunchEnv, TorchrunSlurmOpenMpi) {
  using namespace dtk::core;
  auto clear = [] {
    for (const char* v :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
          "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_RANK",
          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"})
      unsetenv(v);
  };
  clear();
  setenv("RANK", "3", 1), setenv("WORLD_SIZE", "4", 1), setenv("LOCAL_RANK", "1", 1);
  setenv("MASTER_ADDR", "node7", 1), setenv("MASTER_PORT", "1234", 1);
  LaunchEnv le = launch_env_from_environment();
  EXPECT_TRUE(le.distributed);
  EXPECT_EQ(le.source, "torchrun");
  EXPECT_EQ(le.rank, 3);
  EXPECT_EQ(le.world_size, 4);
  EXPECT_EQ(le.local_rank, 1);
  EXPECT_EQ(le.master_addr, "node7");
  EXPECT_EQ(le.master_port, 1234);
  EXPECT_EQ(rank_prefix(), "[rank 3] ");
  setenv("RANK", "4", 1);
  EXPECT_THROW(launch_env_from_environment(), std::exception);
  setenv("RANK", "x", 1);
  EXPECT_THROW(launch_env_from_environment(), std::exception);
  clear();
  setenv("SLURM_PROCID", "0", 1), setenv("SLURM_NTASKS", "2", 1), setenv("SLURM_NNODES", "1", 1);
  le = launch_env_from_environment();
  EXPECT_EQ(le.source, "");  // an sbatch script (no srun step): one process, not rank 0 of 2
  setenv("SLURM_PROCID", "1", 1), setenv("SLURM_LOCALID", "1", 1), setenv("SLURM_STEP_NUM_TASKS", "2", 1);
  le = launch_env_from_environment();
  EXPECT_EQ(le.source, "slurm");
  EXPECT_EQ(le.rank, 1);
  EXPECT_EQ(le.world_size, 2);
  EXPECT_EQ(le.master_addr, "127.0.0.1");
  EXPECT_EQ(le.master_port, 29500);
  setenv("SLURM_NNODES", "2", 1);  // several nodes: MASTER_ADDR is required
  EXPECT_THROW(launch_env_from_environment(), std::exception);
  clear();
  setenv("OMPI_COMM_WORLD_RANK", "0", 1), setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  le = launch_env_from_environment();
  EXPECT_EQ(le.source, "openmpi");
  EXPECT_FALSE(le.distributed);  // a world of one: no store
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1), setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1), setenv("MASTER_PORT", "4321", 1);
  le = launch_env_from_environment();
  EXPECT_TRUE(le.distributed);
  EXPECT_EQ(le.master_addr, "127.0.0.1");
  EXPECT_EQ(le.master_port, 4321);
  clear();
  EXPECT_EQ(rank_prefix(), "");
}

// The device services of a CPU run (abi.h dtk_device_services): valid streams and events that
// order nothing (CPU work is synchronous), plain host memory for "pinned" tensors.
TEST(HostServices, DeviceServicesOnCpuAreValidNoOps) {
  const dtk_host_services* h = dtk::core::host_services();
  ASSERT_TRUE(DTK_STRUCT_COVERS(dtk_host_services, h, 2_0));
  const dtk_device_services* d = h->device;
  ASSERT_TRUE(DTK_STRUCT_COVERS(dtk_device_services, d, 2_0));
  const dtk_device cpu{DTK_DEVICE_CPU, -1};
  dtk_stream* current = d->current_stream(d->ctx, cpu);
  ASSERT_NE(current, nullptr);
  dtk_stream* s = nullptr;
  ASSERT_EQ(code_of(d->stream_create(d->ctx, cpu, -1, &s)), 0);
  dtk_stream* previous = nullptr;
  ASSERT_EQ(code_of(d->set_current_stream(d->ctx, s, &previous)), 0);
  EXPECT_EQ(previous, current);
  EXPECT_EQ(d->current_stream(d->ctx, cpu), s);
  dtk_event* e = nullptr;
  ASSERT_EQ(code_of(d->event_create(d->ctx, &e)), 0);
  EXPECT_EQ(code_of(d->event_record(d->ctx, e, s)), 0);
  EXPECT_EQ(code_of(d->stream_wait_event(d->ctx, current, e)), 0);
  EXPECT_EQ(code_of(d->event_synchronize(d->ctx, e, 100)), 0);
  EXPECT_EQ(code_of(d->stream_synchronize(d->ctx, s)), 0);
  ASSERT_EQ(code_of(d->set_current_stream(d->ctx, previous, nullptr)), 0);
  d->event_destroy(d->ctx, e);
  d->stream_destroy(d->ctx, s);
  std::string msg;
  // Without a device the CUDA half refuses with one line: a CPU-only build says it lacks CUDA, a
  // CUDA build on a machine without a GPU (CI) says why the runtime sees none.
  if (!gpu_visible()) {
    EXPECT_EQ(code_of(d->stream_create(d->ctx, dtk_device{DTK_DEVICE_CUDA, 0}, 0, &s), &msg), DTK_ERR_UNSUPPORTED);
    const std::string expected = DTK_HAVE_CUDA ? "stream_create: no CUDA device"
                                               : "stream_create: CUDA device services need a CUDA build of dtk";
    EXPECT_EQ(msg.rfind(expected, 0), 0u) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }

  const int64_t shape[] = {3, 4};
  dtk_tensor* handle = nullptr;
  ASSERT_EQ(code_of(d->alloc_pinned(d->ctx, shape, 2, DTK_DTYPE_BFLOAT16, &handle)), 0);
  const at::Tensor pinned = dtk::unwrap(handle);
  h->tensor_release(handle);
  EXPECT_EQ(pinned.sizes(), at::IntArrayRef({3, 4}));
  EXPECT_EQ(pinned.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(pinned.is_contiguous());
}

// Collectives refuse a non-zero priority: reserved in ABI 2.0, never silently ignored.
TEST(HostServices, ReservedCollectivePriorityIsRefused) {
  const dtk_comm_services* c = dtk::core::host_services()->comm;
  dtk_tensor t{at::ones({2})};
  dtk_collective_args a = cargs(DTK_GROUP_WORLD, &t, nullptr, DTK_REDUCE_SUM, 0, 0, nullptr);
  a.priority = 1;
  std::string msg;
  EXPECT_EQ(code_of(c->all_reduce(c->ctx, &a), &msg), DTK_ERR_UNSUPPORTED);
  EXPECT_EQ(msg, "all_reduce: priority is reserved and must be 0 in ABI 2.0");
  a.priority = 0;
  a.struct_size = offsetof(dtk_collective_args, stream);  // a writer missing 2.0 fields
  EXPECT_EQ(code_of(c->all_reduce(c->ctx, &a)), DTK_ERR_ABI);
}

// No host extensions in ABI 2.0: every id is unknown (abi.h rule 8).
TEST(HostServices, UnknownExtensionIsNull) {
  const dtk_host_services* h = dtk::core::host_services();
  ASSERT_TRUE(DTK_HAS_FIELD(dtk_host_services, h, get_extension));
  EXPECT_EQ(h->get_extension("dtk.ext.nothing.v1"), nullptr);
  EXPECT_EQ(h->get_extension(nullptr), nullptr);
}
