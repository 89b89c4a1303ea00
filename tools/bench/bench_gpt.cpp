// dtk_bench_gpt — forward+backward throughput of the shipped "gpt" model + "causal_lm" step
// plugins on the CPU, next to the rate of one large fp32 matmul measured in the same run (the
// machine's practical ceiling for a GEMM-bound training step), after the two kernels the step
// stands on, each next to what it replaces, alternated call by call:
//   * the fp32 products on the models' shapes through dtk/gemm.hpp (oneDNN's sgemm where
//     LibTorch loaded it) against LibTorch's at::mm (OpenBLAS on Debian);
//   * bf16 products on the 6L model's linear shapes through dtk/gemm.hpp (widened to fp32 on a
//     CPU without AVX-512) against LibTorch's bf16 kernels, with each one's error against fp64;
//   * one 6L/384h layer's causal attention, forward and backward with dropout 0.1, through
//     dtk::layers::causal_attention_qkv against Megatron's CoreAttention in ATen operations.
//
//   build/bin/dtk_bench_gpt [iterations]        (default 10 timed iterations per model)
//
// Times are the median over iterations (the best of 10 matmuls for the ceiling, as bench mode's).
//
// The plugins are loaded from the build tree through the host's loader and driven through the
// C ABI, exactly as `dtk train` drives them. All cores are used (at::set_num_threads).
// FLOPs per iteration count every matmul of forward and backward (backward = 2 x forward):
//   3 x [ 2 B s (L (4h^2 + 2 h f) + h V) + 4 B s^2 h L ]      (attention counted as full s x s)
#include <dtk/core/memory/allocator.hpp>
#include <dtk/core/perf/bench_report.hpp>
#include <dtk/gemm.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/core/components/services.hpp>
#include <dtk/host/plugin_host.hpp>
#include <dtk/tensor.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void check(dtk_status* s) {
  if (!s) return;
  std::string m = dtk_status_get_message(s);
  dtk_status_release(s);
  throw std::runtime_error(m);
}

// The median of per-call times: robust to other processes on a shared machine.
double median(std::vector<double> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The machine's ceiling in GFLOP/s: the best 2048^3 fp32 matmul of at::mm and dtk::mm, as bench
// mode measures it for MFU (dtk/core/perf/bench_report.hpp), 5 of each.
double matmul_ceiling_gflops() { return 1e3 * dtk::core::measure_matmul_tflops(2048, 5); }

// Median seconds of `a` and of `b`, called alternately `reps` times after one warm-up call each.
template <class A, class B>
std::pair<double, double> alternate(int reps, A&& a, B&& b) {
  a();
  b();
  std::vector<double> ta, tb;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    a();
    ta.push_back(seconds_since(t0));
    t0 = Clock::now();
    b();
    tb.push_back(seconds_since(t0));
  }
  return {median(ta), median(tb)};
}

// A product of a model's step, C [m, n] = op(A) op(B) with K the inner size; a_t, b_t: the
// operand is the transpose of a row-major matrix, as the layers pass weight.t() and g.t().
struct Product {
  const char* name;
  int64_t m, k, n;
  bool a_t, b_t;
};

// Random operands of `p` in `type`, laid out as the step forms them.
std::pair<at::Tensor, at::Tensor> operands(const Product& p, at::ScalarType type) {
  const at::Tensor a = p.a_t ? at::randn({p.k, p.m}).t() : at::randn({p.m, p.k});
  const at::Tensor b = p.b_t ? at::randn({p.n, p.k}).t() : at::randn({p.k, p.n});
  return {a.to(type), b.to(type)};
}

// The products of the gpt-tiny and 6L models' steps (per 512-token chunk for the output layer).
void bench_products(int reps) {
  const Product products[] = {
      {"tiny output layer x W^T", 512, 64, 50304, false, true},
      {"tiny output layer D W", 512, 50304, 64, false, false},
      {"tiny output layer D^T x", 50304, 512, 64, true, false},
      {"6L output layer x W^T", 512, 384, 50304, false, true},
      {"6L output layer D W", 512, 50304, 384, false, false},
      {"6L output layer D^T x", 50304, 512, 384, true, false},
      {"6L QKV x W^T", 2048, 384, 1152, false, true},
      {"6L QKV g W", 2048, 1152, 384, false, false},
      {"6L QKV g^T x", 1152, 2048, 384, true, false},
      {"6L fc1 x W^T", 2048, 384, 1536, false, true},
      {"6L fc2 x W^T", 2048, 1536, 384, false, true},
      {"6L fc2 g W", 2048, 384, 1536, false, false},
      {"6L fc1 g^T x", 1536, 2048, 384, true, false},
  };
  std::printf("fp32 products, GFLOP/s: LibTorch's at::mm | dtk::mm (%s), alternated, median of %d\n",
              dtk::cpu_gemm_engine().c_str(), reps);
  double total_aten = 0, total_dtk = 0;
  for (const Product& p : products) {
    const auto ab = operands(p, at::kFloat);  // named, not bound: lambdas capture them below
    const at::Tensor &a = ab.first, &b = ab.second;
    at::Tensor c1 = at::empty({p.m, p.n}), c2 = at::empty({p.m, p.n});
    const auto [t_aten, t_dtk] = alternate(reps, [&] { at::mm_out(c1, a, b); }, [&] { dtk::mm_out(c2, a, b); });
    const double gflop = 2.0 * static_cast<double>(p.m * p.n * p.k) / 1e9;
    total_aten += t_aten;
    total_dtk += t_dtk;
    std::printf("  %-26s [%5lld x %5lld] x [%5lld x %5lld] %7.1f | %7.1f  (%.2fx)\n", p.name,
                static_cast<long long>(p.m), static_cast<long long>(p.k), static_cast<long long>(p.k),
                static_cast<long long>(p.n), gflop / t_aten, gflop / t_dtk, t_aten / t_dtk);
  }
  std::printf("  %-26s %.1f ms | %.1f ms  (%.2fx)\n", "all of them, one each", 1e3 * total_aten, 1e3 * total_dtk,
              total_aten / total_dtk);
}

// bf16 products as a bf16 run's layers form them (the 6L model's linear shapes, and one linear
// with its bias): LibTorch's own bf16 kernels against dtk/gemm.hpp's, which on a CPU without
// AVX-512 widen the operands to fp32 and round the product once. The error column is each one's
// mean |error| against the fp64 product of the same bf16 operands.
void bench_bf16_products(int reps) {
  const Product products[] = {{"6L QKV x W^T", 2048, 384, 1152, false, true},
                              {"6L QKV g W", 2048, 1152, 384, false, false},
                              {"6L fc1 x W^T", 2048, 384, 1536, false, true},
                              {"6L fc2 g W", 2048, 384, 1536, false, false},
                              {"6L fc1 g^T x", 1536, 2048, 384, true, false}};
  std::printf(
      "bf16 products, GFLOP/s: LibTorch's at::mm | dtk::mm (%s), alternated, median of %d; mean |error| "
      "against fp64\n",
      dtk::cpu_widens(at::kBFloat16) ? "widened to fp32, rounded once" : "LibTorch's kernel on this CPU", reps);
  auto error = [](const at::Tensor& c, const at::Tensor& exact) {
    return (c.to(at::kDouble) - exact).abs().mean().item<double>();
  };
  for (const Product& p : products) {
    const auto ab = operands(p, at::kBFloat16);  // named, not bound: lambdas capture them below
    const at::Tensor &a = ab.first, &b = ab.second;
    at::Tensor c1 = at::empty({p.m, p.n}, a.options()), c2 = at::empty({p.m, p.n}, a.options());
    const auto [t_aten, t_dtk] = alternate(
        reps, [&] { at::mm_out(c1, a, b); }, [&] { dtk::mm_out(c2, a, b); });
    const at::Tensor exact = at::mm(a.to(at::kDouble), b.to(at::kDouble));
    const double gflop = 2.0 * static_cast<double>(p.m * p.n * p.k) / 1e9;
    std::printf("  %-26s [%5lld x %5lld] x [%5lld x %5lld] %7.1f | %7.1f  (%.2fx)  error %.3g | %.3g\n", p.name,
                static_cast<long long>(p.m), static_cast<long long>(p.k), static_cast<long long>(p.k),
                static_cast<long long>(p.n), gflop / t_aten, gflop / t_dtk, t_aten / t_dtk, error(c1, exact),
                error(c2, exact));
  }
  const at::Tensor x = at::randn({2048, 384}).to(at::kBFloat16), w = at::randn({1536, 384}).to(at::kBFloat16);
  const at::Tensor bias = at::randn({1536}).to(at::kBFloat16);
  const at::NoGradGuard no_grad;
  const auto [t_aten, t_dtk] = alternate(
      reps, [&] { at::linear(x, w, bias); }, [&] { dtk::linear_product(x, w, bias); });
  const double gflop = 2.0 * 2048 * 384 * 1536 / 1e9;
  std::printf("  %-26s [%5d x %5d] x [%5d x %5d] %7.1f | %7.1f  (%.2fx)  at::linear | dtk::linear_product\n",
              "6L fc1 with its bias", 2048, 384, 384, 1536, gflop / t_aten, gflop / t_dtk, t_aten / t_dtk);
}

// Megatron's CoreAttention in ATen operations on the fused projection [b, s, heads * 3 * hd].
at::Tensor core_attention_aten(const at::Tensor& qkv, int64_t heads, const dtk::layers::DropoutMask& keep) {
  const int64_t b = qkv.size(0), s = qkv.size(1), hd = qkv.size(2) / (3 * heads);
  const at::Tensor mixed = qkv.view({b, s, heads, 3 * hd}).transpose(1, 2);
  const at::Tensor q = mixed.narrow(-1, 0, hd), k = mixed.narrow(-1, hd, hd), v = mixed.narrow(-1, 2 * hd, hd);
  const at::Tensor scores = at::matmul(q * (1.0 / std::sqrt(static_cast<double>(hd))), k.transpose(-1, -2));
  const at::Tensor future = at::ones({s, s}, at::kBool).triu(1);
  const at::Tensor probs = dtk::layers::apply_dropout(at::softmax(scores.masked_fill(future, -10000.0), -1), keep);
  return at::matmul(probs, v).transpose(1, 2).reshape({b, s, heads * hd});
}

void bench_attention(int reps) {
  const int64_t b = 8, s = 256, heads = 6, hd = 64;
  at::Generator gen = dtk::layers::seeded_generator(1);
  const dtk::layers::DropoutMask keep = dtk::layers::draw_keep_mask({b, heads, s, s}, 0.1, gen);
  const at::Tensor qkv = at::randn({b, s, heads * 3 * hd}).requires_grad_(true);
  const at::Tensor grad = at::randn({b, s, heads * hd});
  auto step = [&](auto&& attention) {
    attention(qkv).backward(grad);
    const_cast<at::Tensor&>(qkv).mutable_grad().reset();
  };
  const auto [t_dtk, t_aten] = alternate(
      reps, [&] { step([&](const at::Tensor& x) { return dtk::layers::causal_attention_qkv(x, heads, 0.125, keep); }); },
      [&] { step([&](const at::Tensor& x) { return core_attention_aten(x, heads, keep); }); });
  std::printf("causal attention, one 6L layer (b 8, s 256, 6 heads of 64, dropout 0.1), forward + backward: "
              "dtk::layers %.1f ms | ATen CoreAttention %.1f ms  (%.2fx)\n",
              1e3 * t_dtk, 1e3 * t_aten, t_aten / t_dtk);
}

struct Shape {
  const char* name;
  int64_t layers, hidden, heads, seq, batch, vocab;
};

void bench(dtk::host::PluginHost& host, const Shape& S, int iters, double peak) {
  const auto& gpt = host.get(DTK_KIND_MODEL, "gpt");
  const auto& step_p = host.get(DTK_KIND_STEP, "causal_lm");
  std::map<std::string, std::string> user{{"num_layers", std::to_string(S.layers)},
                                          {"hidden_size", std::to_string(S.hidden)},
                                          {"num_attention_heads", std::to_string(S.heads)},
                                          {"vocab_size", std::to_string(S.vocab)}};
  dtk::host::OptionValues mopts(dtk::host::resolve_options(gpt, user));
  dtk::host::OptionValues sopts(dtk::host::resolve_options(step_p, {}));
  dtk_build_context ctx{};
  ctx.struct_size = sizeof(ctx);
  ctx.device = {DTK_DEVICE_CPU, -1};
  ctx.params_dtype = DTK_DTYPE_FLOAT32;
  ctx.tp_size = ctx.pp_size = ctx.dp_size = 1;
  ctx.pre_process = ctx.post_process = 1;
  ctx.seq_length = S.seq;
  ctx.micro_batch_size = S.batch;
  ctx.seed = 1234;
  ctx.options = mopts.get();
  const auto* mapi = gpt.api_as<dtk_model_api>();
  const auto* sapi = step_p.api_as<dtk_step_api>();
  dtk_model* model = nullptr;
  check(mapi->create(&ctx, &model));
  ctx.options = sopts.get();
  dtk_step* step = nullptr;
  check(sapi->create(&ctx, &step));
  dtk_model_ref ref{sizeof(ref), mapi, model};
  dtk_model_info info{};
  info.struct_size = sizeof(info);
  check(mapi->get_info(model, &info));

  at::Tensor text = at::randint(S.vocab, {S.batch, S.seq + 1}, at::kLong);
  dtk::TensorList batch{{"text", text}};
  dtk::MapView view(batch);
  dtk_metric_sink sink{sizeof(sink), nullptr, [](void*, const char*, double) {}, [](void*, const char*, dtk_tensor* t) {
                         dtk::release(t);
                       }};
  auto one = [&] {
    dtk_step_forward_args args{dtk_step_forward_args_STRUCT_SIZE, &ref, view.get(), &sink, nullptr};
    check(sapi->forward_step(step, &args));
    dtk_tensor* loss = args.loss;
    dtk::TensorHandle owned(loss);
    dtk::unwrap(loss).backward();
  };
  one();  // warm-up (allocator, kernels)
  if (const char* trace = std::getenv("DTK_BENCH_PROFILE")) {  // one profiled iteration (chrome trace)
    std::string name = S.name;
    std::replace_if(name.begin(), name.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); }, '-');
    torch::autograd::profiler::RecordProfile profile(std::string(trace) + "." + name + ".json");
    one();
  }
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    one();
    times.push_back(seconds_since(t0));
  }
  const double secs = median(times);

  const double B = S.batch, s = S.seq, L = S.layers, h = S.hidden, f = info.ffn_hidden_size, V = info.vocab_size;
  const double flops = 3.0 * (2.0 * B * s * (L * (4 * h * h + 2 * h * f) + h * V) + 4.0 * B * s * s * h * L);
  const double gflops = flops / secs / 1e9;
  std::printf(
      "%-28s L=%-2lld h=%-4lld heads=%-2lld seq=%-4lld batch=%-2lld vocab=%lld | %8.1f ms/iter | "
      "%9.0f tokens/s | %6.1f GFLOP/s (%4.1f%% of the matmul)\n",
      S.name, static_cast<long long>(S.layers), static_cast<long long>(S.hidden), static_cast<long long>(S.heads),
      static_cast<long long>(S.seq), static_cast<long long>(S.batch), static_cast<long long>(info.vocab_size),
      secs * 1e3, B * s / secs, gflops, 100.0 * gflops / peak);
  sapi->destroy(step);
  mapi->destroy(model);
}

}  // namespace

int main(int argc, char** argv) {
  dtk::core::reexec_with_caching_allocator(argv);  // as dtk train runs (tcmalloc)
  try {
    const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 10;
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    at::set_num_threads(threads);
    dtk::host::PluginHost host(dtk::core::host_torch_version(), dtk::core::host_services());
    host.load_file(std::string(DTK_BENCH_PLUGIN_DIR) + "/dtk_plugin_gpt.so");
    host.load_file(std::string(DTK_BENCH_PLUGIN_DIR) + "/dtk_plugin_causal_lm.so");
    std::printf("LibTorch %s, %d threads, %s, fp32, training mode (dropout 0.1), %d timed iterations (median)\n",
                dtk::core::host_torch_version(), at::get_num_threads(), dtk::core::malloc_name().c_str(), iters);
    bench_products(9);
    bench_bf16_products(3);
    bench_attention(9);
    const double peak = matmul_ceiling_gflops();
    std::printf("%-28s %.1f GFLOP/s (2048 x 2048 x 2048 fp32, the best of at::mm and dtk::mm)\n",
                "ceiling: one large matmul", peak);
    bench(host, {"gpt-tiny", 2, 64, 4, 64, 8, 50257}, iters, peak);
    bench(host, {"6L/384h/6 heads/seq 256", 6, 384, 6, 256, 8, 50257}, iters, peak);
    std::printf("%-28s %.1f GFLOP/s (measured again after the models)\n", "ceiling: one large matmul",
                matmul_ceiling_gflops());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtk_bench_gpt: error: %s\n", e.what());
    return 1;
  }
}
