// The cpu_adam kernel against LibTorch's own optimizers on the same tensors: 20 steps of
// torch::optim::AdamW (adamw=true) or torch::optim::Adam (adamw=false, L2 decay) next to 20 kernel
// steps, for every ISA this CPU can run, sizes that are not multiples of any vector width, weight
// decay on and off, loss scaling on and off, 1 and 2 threads.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include <dtk/kernels/cpu_adam.hpp>

namespace ca = dtk::cpu_adam;

// Readable test parameters in gtest's output ("avx512" rather than "4-byte object <02-00 00-00>").
namespace dtk::cpu_adam {
void PrintTo(Isa isa, std::ostream* os) { *os << isa_name(isa); }
}  // namespace dtk::cpu_adam

namespace {

std::vector<ca::Isa> supported_isas() {
  std::vector<ca::Isa> out;
  for (ca::Isa isa : {ca::Isa::kScalar, ca::Isa::kAvx2, ca::Isa::kAvx512})
    if (ca::isa_supported(isa)) out.push_back(isa);
  return out;
}

struct Diff {
  double max_abs = 0;                 // largest |a - b|
  int64_t max_ulp = 0;                // largest distance in representable floats
  double ref_max = 0;                 // largest |b|: the scale the errors are measured against
  int64_t differing = 0, first = -1;  // elements not bit-identical, and the first of them
};

int64_t ordered(float f) {
  int32_t i;
  std::memcpy(&i, &f, 4);
  return i < 0 ? -static_cast<int64_t>(i & 0x7FFFFFFF) : i;
}

Diff compare(const at::Tensor& a, const at::Tensor& b) {
  Diff d;
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double e = std::fabs(static_cast<double>(pa[i]) - pb[i]);
    d.max_abs = std::max(d.max_abs, e);
    d.max_ulp = std::max(d.max_ulp, std::abs(ordered(pa[i]) - ordered(pb[i])));
    d.ref_max = std::max(d.ref_max, std::fabs(static_cast<double>(pb[i])));
    if (pa[i] != pb[i] && d.differing++ == 0) d.first = i;
  }
  return d;
}

at::Tensor u16_as(const std::vector<uint16_t>& v, at::ScalarType t) {
  return at::from_blob(const_cast<uint16_t*>(v.data()), {static_cast<int64_t>(v.size())}, t).clone();
}

bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

constexpr int kSteps = 20;

// Parameters: size, adamw, weight decay, grad scale, ISA, threads.
using Case = std::tuple<int64_t, bool, float, float, ca::Isa, int>;

class VsTorch : public ::testing::TestWithParam<Case> {};

TEST_P(VsTorch, TwentyStepsMatch) {
  const auto [n, adamw, wd, grad_scale, isa, threads] = GetParam();
  ca::AdamParams hp;
  hp.lr = 1e-2f;  // large enough that the updates dominate the parameters' own rounding
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = wd;
  hp.adamw = adamw;
  hp.grad_scale = grad_scale;

  at::manual_seed(1234 + n);
  const at::Tensor init = at::randn({n});
  at::Tensor ref = init.clone().set_requires_grad(true);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (adamw) {
    opt = std::make_unique<torch::optim::AdamW>(
        std::vector<at::Tensor>{ref},
        torch::optim::AdamWOptions(hp.lr).betas({hp.beta1, hp.beta2}).eps(hp.eps).weight_decay(wd));
  } else {
    opt = std::make_unique<torch::optim::Adam>(
        std::vector<at::Tensor>{ref},
        torch::optim::AdamOptions(hp.lr).betas({hp.beta1, hp.beta2}).eps(hp.eps).weight_decay(wd));
  }

  at::Tensor p = init.clone(), m = at::zeros({n}), v = at::zeros({n});
  std::vector<uint16_t> bf16(n), fp16(n);
  const ca::RunOptions run{isa, threads};
  for (int step = 1; step <= kSteps; ++step) {
    // Gradients of varying magnitude per step, times the loss scale the kernel divides out.
    const at::Tensor scaled = at::randn({n}) * (0.1 * step) * grad_scale;
    ref.mutable_grad() = scaled / grad_scale;  // what a user of torch::optim does: unscale, then step
    opt->step();
    hp.step = step;
    ca::adam_step(p.data_ptr<float>(), scaled.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, hp,
                  bf16.data(), fp16.data(), run);
  }
  at::Tensor ref_m, ref_v;
  // torch::optim keys its state by the TensorImpl: its address as a string in 1.13, the pointer in 2.x.
#if TORCH_VERSION_MAJOR >= 2
  const auto& state = opt->state().at(ref.unsafeGetTensorImpl());
#else
  const auto& state = opt->state().at(c10::guts::to_string(ref.unsafeGetTensorImpl()));
#endif
  if (adamw) {
    ref_m = static_cast<torch::optim::AdamWParamState&>(*state).exp_avg();
    ref_v = static_cast<torch::optim::AdamWParamState&>(*state).exp_avg_sq();
  } else {
    ref_m = static_cast<torch::optim::AdamParamState&>(*state).exp_avg();
    ref_v = static_cast<torch::optim::AdamParamState&>(*state).exp_avg_sq();
  }
  const at::Tensor ref_p = ref.detach();
  const Diff dp = compare(p, ref_p), dm = compare(m, ref_m), dv = compare(v, ref_v);
  RecordProperty("param_max_abs", std::to_string(dp.max_abs));
  RecordProperty("param_max_ulp", std::to_string(dp.max_ulp));
  auto show = [](const char* what, const Diff& d) {
    std::printf(" %s: %lld differ (first %lld) max abs %.3g ulp %lld |", what, static_cast<long long>(d.differing),
                static_cast<long long>(d.first), d.max_abs, static_cast<long long>(d.max_ulp));
  };
  std::printf("  n=%lld %s wd=%g scale=%g %s t=%d:", static_cast<long long>(n), adamw ? "adamw" : "adam", wd,
              grad_scale, ca::isa_name(isa), threads);
  show("p", dp);
  show("m", dm);
  show("v", dv);
  std::printf("\n");
  // The kernel repeats LibTorch's float operations in LibTorch's order, so on this LibTorch build the
  // results are bit-identical (the "differ" counts above are 0). The bound asserted is the issue's
  // 1e-6, relative to each array's scale rather than per element: a one-ulp difference in a
  // parameter (possible with a LibTorch built with other contraction flags) shows up as a large
  // relative error in moments that cancel to near zero, not as a wrong optimizer.
  EXPECT_LE(dp.max_abs, 1e-6 * std::max(dp.ref_max, 1.0));
  EXPECT_LE(dm.max_abs, 1e-6 * dm.ref_max);
  EXPECT_LE(dv.max_abs, 1e-6 * dv.ref_max);
  // The copy-outs are the fp32 result converted exactly as LibTorch converts.
  EXPECT_TRUE(bit_equal(u16_as(bf16, at::kBFloat16), p.to(at::kBFloat16)));
  EXPECT_TRUE(bit_equal(u16_as(fp16, at::kHalf), p.to(at::kHalf)));
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [n, adamw, wd, grad_scale, isa, threads] = info.param;
  return std::string(adamw ? "AdamW" : "Adam") + "_n" + std::to_string(n) + (wd != 0 ? "_wd" : "_nowd") +
         (grad_scale != 1 ? "_scaled" : "") + "_" + ca::isa_name(isa) + "_t" + std::to_string(threads);
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (ca::Isa isa : supported_isas())
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000003}})
      for (bool adamw : {true, false})
        for (float wd : {0.f, 0.1f})
          for (float scale : {1.f, 1000.f}) out.emplace_back(n, adamw, wd, scale, isa, n > 1000 ? 2 : 1);
  return out;
}

INSTANTIATE_TEST_SUITE_P(CpuAdam, VsTorch, ::testing::ValuesIn(all_cases()), case_name);

// Runs `steps` kernel steps from fixed inputs and returns (p, m, v, bf16, fp16) as tensors.
struct Result {
  at::Tensor p, m, v, bf16, fp16;
};
// stream: RunOptions::stream (the copy-outs are 64-byte aligned LibTorch buffers, so 1 streams on a
// vector ISA).
Result run_kernel(ca::Isa isa, int threads, int64_t n, const ca::AdamParams& base, bool bf16_grads,
                  int stream = -1) {
  at::manual_seed(7);
  at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  at::Tensor bf16_t = at::zeros({n}, at::kBFloat16), fp16_t = at::zeros({n}, at::kHalf);
  auto* bf16 = reinterpret_cast<uint16_t*>(bf16_t.data_ptr());
  auto* fp16 = reinterpret_cast<uint16_t*>(fp16_t.data_ptr());
  for (int step = 1; step <= 5; ++step) {
    ca::AdamParams hp = base;
    hp.step = step;
    const at::Tensor g = (at::randn({n}) * 3.f).to(at::kBFloat16);
    if (bf16_grads) {
      ca::adam_step_bf16_grad(p.data_ptr<float>(), reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>()),
                              m.data_ptr<float>(), v.data_ptr<float>(), n, hp, bf16, fp16, {isa, threads, stream});
    } else {
      const at::Tensor g32 = g.to(at::kFloat);
      ca::adam_step(p.data_ptr<float>(), g32.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, hp, bf16,
                    fp16, {isa, threads, stream});
    }
  }
  return {p, m, v, bf16_t, fp16_t};
}

void expect_identical(const Result& a, const Result& b) {
  EXPECT_TRUE(bit_equal(a.p, b.p));
  EXPECT_TRUE(bit_equal(a.m, b.m));
  EXPECT_TRUE(bit_equal(a.v, b.v));
  EXPECT_TRUE(bit_equal(a.bf16, b.bf16));
  EXPECT_TRUE(bit_equal(a.fp16, b.fp16));
}

TEST(CpuAdamKernel, Bf16GradEqualsFp32KernelOnUpcastGrad) {
  ca::AdamParams hp;
  hp.weight_decay = 0.05f;
  hp.grad_scale = 4.f;
  for (ca::Isa isa : supported_isas())
    for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{300007}}) {
      SCOPED_TRACE(std::string(ca::isa_name(isa)) + " n=" + std::to_string(n));
      expect_identical(run_kernel(isa, 2, n, hp, true), run_kernel(isa, 2, n, hp, false));
    }
}

// Every ISA computes the same operations in the same order, so they agree bit for bit (and the
// thread count cannot matter for an elementwise update).
TEST(CpuAdamKernel, AllIsasAndThreadCountsBitIdentical) {
  for (bool adamw : {true, false}) {
    ca::AdamParams hp;
    hp.adamw = adamw;
    hp.weight_decay = 0.1f;
    hp.grad_scale = 3.f;
    const Result base = run_kernel(ca::Isa::kScalar, 1, 200003, hp, false);
    for (ca::Isa isa : supported_isas())
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(std::string(ca::isa_name(isa)) + " threads=" + std::to_string(threads));
        expect_identical(run_kernel(isa, threads, 200003, hp, false), base);
      }
  }
}

// Non-temporal stores (RunOptions::stream, the default above kStreamMinBytes) write the same values
// as ordinary ones, tail included, for both gradient types and several threads.
TEST(CpuAdamKernel, StreamingStoresBitIdentical) {
  ca::AdamParams hp;
  hp.weight_decay = 0.1f;
  for (ca::Isa isa : supported_isas())
    for (bool bf16_grads : {false, true})
      for (int threads : {1, 2}) {
        SCOPED_TRACE(std::string(ca::isa_name(isa)) + (bf16_grads ? " bf16" : " fp32") +
                     " threads=" + std::to_string(threads));
        expect_identical(run_kernel(isa, threads, 200003, hp, bf16_grads, 1),
                         run_kernel(isa, threads, 200003, hp, bf16_grads, 0));
      }
}

// The copy-out over the whole fp32 range: fp16 subnormals, overflow to infinity, exact ties of
// both formats and infinities, against at::Tensor::to(). lr = 0 leaves the parameters as they are.
TEST(CpuAdamKernel, CopyOutMatchesTensorToAcrossTheRange) {
  std::vector<float> vals;
  for (int e = -40; e <= 40; ++e)
    for (uint32_t mant : {0x000000u, 0x001000u, 0x002000u, 0x003000u, 0x008000u, 0x018000u, 0x7FFFFFu, 0x123457u}) {
      uint32_t u = (static_cast<uint32_t>(127 + e) << 23) | mant;
      float f;
      std::memcpy(&f, &u, 4);
      vals.push_back(f);
      vals.push_back(-f);
    }
  for (float f : {65504.f, 65519.f, 65520.f, 65536.f, 1e-8f, 6e-8f, 3e-8f, 0.f, INFINITY, -INFINITY}) vals.push_back(f);
  const int64_t n = static_cast<int64_t>(vals.size());
  ca::AdamParams hp;
  hp.lr = 0.f;
  for (ca::Isa isa : supported_isas()) {
    SCOPED_TRACE(ca::isa_name(isa));
    at::Tensor p = at::from_blob(vals.data(), {n}, at::kFloat).clone();
    at::Tensor g = at::ones({n}), m = at::zeros({n}), v = at::zeros({n});
    std::vector<uint16_t> bf16(n), fp16(n);
    ca::adam_step(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, hp,
                  bf16.data(), fp16.data(), {isa, 1});
    EXPECT_TRUE(bit_equal(p, at::from_blob(vals.data(), {n}, at::kFloat)));
    EXPECT_TRUE(bit_equal(u16_as(bf16, at::kBFloat16), p.to(at::kBFloat16)));
    EXPECT_TRUE(bit_equal(u16_as(fp16, at::kHalf), p.to(at::kHalf)));
  }
}

TEST(CpuAdamKernel, RejectsBadArguments) {
  float p = 1, g = 1, m = 0, v = 0;
  ca::AdamParams hp;
  hp.step = 0;
  EXPECT_THROW(ca::adam_step(&p, &g, &m, &v, 1, hp), std::invalid_argument);
  hp.step = 1;
  EXPECT_THROW(ca::adam_step(&p, &g, &m, &v, -1, hp), std::invalid_argument);
  hp.grad_scale = 0;
  EXPECT_THROW(ca::adam_step(&p, &g, &m, &v, 1, hp), std::invalid_argument);
}

TEST(CpuAdamKernel, ReportsIsa) {
  std::printf("  active ISA: %s (avx2 %s, avx512 %s)\n", ca::isa_name(ca::active_isa()),
              ca::isa_supported(ca::Isa::kAvx2) ? "yes" : "no", ca::isa_supported(ca::Isa::kAvx512) ? "yes" : "no");
  EXPECT_TRUE(ca::isa_supported(ca::active_isa()));
}

}  // namespace
