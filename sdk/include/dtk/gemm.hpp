// dtk/gemm.hpp — matrix products on the CPU: fp32 through the fastest engine in the process,
// bf16 and fp16 widened to fp32 and rounded once, as a GPU computes them.
//
// LibTorch computes an fp32 CPU product with its BLAS (Debian's: OpenBLAS). Debian's LibTorch
// also loads oneDNN (libdnnl.so.2, for its bf16 and convolution kernels), whose sgemm measured
// 10-40% faster on a GPT's shapes on a Zen 4 VM ([2048 x 384] x [384 x 1152]: 138 against 107
// GFLOP/s; docs/benchmarks.md). The products here go to oneDNN's sgemm when LibTorch's process
// has loaded it, and to LibTorch otherwise (a LibTorch without a shared oneDNN, a GPU tensor,
// another dtype, a layout sgemm cannot take). Same arithmetic, fp32 in and out, fp32
// accumulation; the order of the sums differs between engines, so results differ in the last
// bits, as they do between BLAS builds.
//
// DTK_CPU_GEMM picks the engine for the whole process: "auto" (the default: oneDNN when loaded),
// "onednn" (oneDNN, or an error naming why not), "aten" (LibTorch's at::mm, as before). Each
// plugin holds its own copy of this header's state; all read the same variable.
//
// bf16 CPU products on a CPU without AVX-512 (all operands of one type) are widened to fp32,
// which is exact, multiplied with fp32 accumulation as above, and the result rounded once to
// bf16: what a GPU's tensor cores compute and what Megatron's bf16 numerics assume. There LibTorch
// 1.13's own bf16 kernels are both slow and inexact: at::mm with an untransposed right operand (the
// backward's g W and g^T x) accumulates in bf16 (15-30x the error of the widened product on a
// GPT's shapes, measured against fp64), and every layout, at::linear's included, runs 30-70x
// slower than sgemm (docs/benchmarks.md, the dtk_bench_gpt table). On a CPU with AVX-512 (BW,
// VL, DQ) LibTorch hands bf16 products above 16^3 multiply-adds to oneDNN's bf16 kernels, which
// accumulate in fp32 and with AVX512-BF16 run faster than sgemm: those stay LibTorch's. fp16
// products, which LibTorch 1.13 cannot multiply on a CPU at all, are widened on every CPU (only
// where autograd does not record them). The widened copies are transient: one product's
// operands and its fp32 result at a time. DTK_CPU_GEMM=aten keeps LibTorch's kernels for every
// type.
//
// oneDNN threads with OpenMP like LibTorch, on the calling thread's OpenMP thread count, which
// at::set_num_threads sets (dtk's --threads).
#pragma once

#include <dtk/plugin.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

namespace dtk {
namespace gemm_detail {

// oneDNN's row-major sgemm (oneapi/dnnl/dnnl.h, stable since oneDNN 1.0):
// C = alpha op(A) op(B) + beta C, returns dnnl_status_t (0 = success).
using Sgemm = int (*)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
struct DnnlVersion {  // dnnl_version_t
  int major, minor, patch;
  const char* hash;
  unsigned cpu_runtime, gpu_runtime;
};
constexpr unsigned kDnnlRuntimeOmp = 2u;  // DNNL_RUNTIME_OMP

struct Engine {
  Sgemm sgemm = nullptr;
  bool widen_bf16 = false, widen_fp16 = false;  // which narrow CPU products are widened to fp32
  std::string description;  // for the run's start-up line
};

inline Engine find_engine() {
  const char* env = std::getenv("DTK_CPU_GEMM");
  const std::string choice = env && *env ? env : "auto";
  if (choice != "auto" && choice != "onednn" && choice != "aten")
    throw Error("DTK_CPU_GEMM='" + choice + "' is not one of auto, onednn, aten", DTK_ERR_INVALID_ARGUMENT);
  Engine e;
  e.description = "LibTorch's BLAS (at::mm)";
  if (choice == "aten") return e;
  // LibTorch 1.13's condition for oneDNN's bf16 products (mkldnn_bf16_device_check).
  const bool avx512_core =
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  e.widen_bf16 = !avx512_core;
  e.widen_fp16 = true;
  // Only a oneDNN that LibTorch itself loaded (RTLD_NOLOAD): never a second copy of the library.
  std::string why;
  void* lib = dlopen("libdnnl.so.2", RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) {
    why = "LibTorch did not load a shared oneDNN (libdnnl.so.2)";
  } else {
    auto version = reinterpret_cast<const DnnlVersion* (*)()>(dlsym(lib, "dnnl_version"));
    auto sgemm = reinterpret_cast<Sgemm>(dlsym(lib, "dnnl_sgemm"));
    const DnnlVersion* v = version ? version() : nullptr;
    if (!sgemm || !v) {
      why = "libdnnl.so.2 has no dnnl_sgemm";
    } else if (v->cpu_runtime != kDnnlRuntimeOmp) {
      why = "oneDNN was not built with OpenMP threading";
    } else {
      e.sgemm = sgemm;
      e.description = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                      std::to_string(v->patch) + " sgemm";
    }
  }
  if (!e.sgemm && choice == "onednn")
    throw Error("DTK_CPU_GEMM=onednn: " + why, DTK_ERR_INVALID_ARGUMENT);
  return e;
}

inline const Engine& engine() {
  static const Engine e = find_engine();
  return e;
}

// A 2-D CPU fp32 tensor as sgemm takes it: row-major ('N', leading dimension stride(0)) or the
// transpose of a row-major matrix ('T', leading dimension stride(1)).
struct Operand {
  char trans = 'N';
  int64_t ld = 0;
  bool ok = false;
};
inline Operand operand(const at::Tensor& t) {
  Operand o;
  if (t.dim() != 2 || t.scalar_type() != at::kFloat || !t.device().is_cpu() || t.numel() == 0) return o;
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= cols) {
    o = {'N', t.stride(0), true};
  } else if (t.stride(0) == 1 && t.stride(1) >= rows) {
    o = {'T', t.stride(1), true};
  } else if (rows == 1 && t.stride(1) == 1) {
    o = {'N', cols, true};
  } else if (cols == 1 && t.stride(0) == 1) {
    o = {'T', rows, true};
  }
  return o;
}

// Whether autograd would record a product of these (it must then go through ATen).
inline bool recorded(const at::Tensor& a, const at::Tensor& b) {
  return at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad());
}

// Whether this process widens CPU products of `type` (bf16, fp16) to fp32 and rounds them once.
inline bool widens(at::ScalarType type) {
  return type == at::kBFloat16 ? engine().widen_bf16 : type == at::kHalf && engine().widen_fp16;
}

// A CPU product of narrow operands, all of one type that this CPU widens, that autograd does not
// record: the widened path below takes it.
inline bool widened(std::initializer_list<const at::Tensor*> ts) {
  const at::ScalarType type = (*ts.begin())->scalar_type();
  if (!widens(type)) return false;
  for (const at::Tensor* t : ts)
    if (!t->defined() || t->scalar_type() != type || !t->device().is_cpu() || t->dim() != 2 ||
        (at::GradMode::is_enabled() && t->requires_grad()))
      return false;
  return true;
}

// c = a b + beta c through oneDNN; false (nothing done) where oneDNN cannot take it.
inline bool try_sgemm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float beta) {
  const Engine& e = engine();
  if (!e.sgemm || recorded(a, b) || (at::GradMode::is_enabled() && c.requires_grad())) return false;
  const Operand oa = operand(a), ob = operand(b), oc = operand(c);
  if (!oa.ok || !ob.ok || !oc.ok || oc.trans != 'N' || a.size(1) != b.size(0) || c.size(0) != a.size(0) ||
      c.size(1) != b.size(1))
    return false;
  const int status = e.sgemm(oa.trans, ob.trans, a.size(0), b.size(1), a.size(1), 1.0f, a.data_ptr<float>(), oa.ld,
                             b.data_ptr<float>(), ob.ld, beta, c.data_ptr<float>(), oc.ld);
  if (status != 0)
    throw Error("oneDNN sgemm failed (status " + std::to_string(status) + ") on [" + std::to_string(a.size(0)) +
                ", " + std::to_string(a.size(1)) + "] x [" + std::to_string(b.size(0)) + ", " +
                std::to_string(b.size(1)) + "]; DTK_CPU_GEMM=aten uses LibTorch's BLAS");
  return true;
}

// c = a b + beta c in fp32 (c, a, b fp32 CPU; beta 0 or 1): oneDNN's sgemm where it takes them, else ATen.
inline void fp32_product(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float beta) {
  if (try_sgemm(c, a, b, beta)) return;
  if (beta == 0.0f)
    at::mm_out(const_cast<at::Tensor&>(c), a, b);
  else
    const_cast<at::Tensor&>(c).addmm_(a, b);
}

// a b (+ c, beta = 1), of a narrow type, widened: one fp32 product, rounded once into c's type.
inline void widened_product(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float beta) {
  const at::Tensor wide = beta == 0.0f ? at::empty(c.sizes(), c.options().dtype(at::kFloat)) : c.to(at::kFloat);
  fp32_product(wide, a.to(at::kFloat), b.to(at::kFloat), beta);
  const_cast<at::Tensor&>(c).copy_(wide);
}

}  // namespace gemm_detail

// The raw form, for kernels that work on strided blocks of larger tensors (dtk/layers/attention.hpp):
// C = alpha op(A) op(B) + beta C, row-major, op(X) = X ('N') or X^T ('T'), leading dimensions in
// elements, as oneDNN's sgemm (and BLAS's with rows and columns exchanged). Falls back to LibTorch
// on blobs over the same memory. Inside an at::parallel_for body each call runs on its thread.
inline void sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (const auto fn = gemm_detail::engine().sgemm; fn && k > 0) {
    const int status = fn(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    if (status != 0)
      throw Error("oneDNN sgemm failed (status " + std::to_string(status) + "); DTK_CPU_GEMM=aten uses LibTorch's BLAS");
    return;
  }
  auto matrix = [](const float* p, char trans, int64_t rows, int64_t cols, int64_t ld) {
    // op(X) [rows, cols]: X itself, or the transpose of X [cols, rows].
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    void* data = const_cast<float*>(p);
    return trans == 'N' ? at::from_blob(data, {rows, cols}, {ld, 1}, f32) : at::from_blob(data, {rows, cols}, {1, ld}, f32);
  };
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, at::TensorOptions().dtype(at::kFloat));
  if (k <= 0) {
    if (beta == 0.0f) out.zero_(); else out.mul_(beta);
    return;
  }
  const at::Tensor opa = matrix(a, transa, m, k, lda), opb = matrix(b, transb, k, n, ldb);
  if (beta == 0.0f) {
    at::mm_out(out, opa, opb);
    if (alpha != 1.0f) out.mul_(alpha);
  } else {
    out.addmm_(opa, opb, beta, alpha);
  }
}

// What computes fp32 CPU products in this process (for the run's start-up line).
inline const std::string& cpu_gemm_engine() { return gemm_detail::engine().description; }

// Whether this process widens CPU products of `type` (bf16, fp16) to fp32 and rounds them once.
inline bool cpu_widens(at::ScalarType type) { return gemm_detail::widens(type); }

// a [m, k] b [k, n], as at::mm. Where autograd would record the product (grad mode on and an
// operand requiring a gradient) it goes to ATen, so gradients still flow; inside an autograd
// function's forward or backward, or under no_grad, it takes the fast path.
inline at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (gemm_detail::widened({&a, &b}) && a.size(1) == b.size(0)) {
    at::Tensor c = at::empty({a.size(0), b.size(1)}, a.options());
    gemm_detail::widened_product(c, a, b, 0.0f);
    return c;
  }
  if (gemm_detail::engine().sgemm && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0)) {
    at::Tensor c = at::empty({a.size(0), b.size(1)}, a.options());
    if (gemm_detail::try_sgemm(c, a, b, 0.0f)) return c;
  }
  return at::mm(a, b);
}

// c = a b, into c (as at::mm_out).
inline void mm_out(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  if (gemm_detail::widened({&c, &a, &b}) && a.size(1) == b.size(0) && c.size(0) == a.size(0) && c.size(1) == b.size(1))
    gemm_detail::widened_product(c, a, b, 0.0f);
  else if (!gemm_detail::try_sgemm(c, a, b, 0.0f))
    at::mm_out(const_cast<at::Tensor&>(c), a, b);
}

// c += a b (as c.addmm_(a, b)); a narrow c is rounded once, after the sum.
inline void addmm_(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  if (gemm_detail::widened({&c, &a, &b}) && a.size(1) == b.size(0) && c.size(0) == a.size(0) && c.size(1) == b.size(1))
    gemm_detail::widened_product(c, a, b, 1.0f);
  else if (!gemm_detail::try_sgemm(c, a, b, 1.0f))
    const_cast<at::Tensor&>(c).addmm_(a, b);
}

// x [..., in] weight^T (+ bias), weight [out, in]: at::linear's forward.
inline at::Tensor linear_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {}) {
  if (x.dim() >= 1 && x.numel() > 0 && x.device().is_cpu() && cpu_widens(x.scalar_type()) && weight.dim() == 2 &&
      x.size(-1) == weight.size(1) && x.is_contiguous() &&
      (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)))) {
    const at::Tensor x2 = x.view({-1, x.size(-1)}), w = weight;
    const at::Tensor b2 = bias.defined() ? bias.view({1, -1}) : weight;  // the bias as one 2-D row
    if (gemm_detail::widened({&x2, &w, &b2})) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape.back() = weight.size(0);
      at::Tensor y = at::empty(shape, x.options());
      const at::Tensor y2 = y.view({x2.size(0), weight.size(0)});
      if (bias.defined()) y2.copy_(bias.expand_as(y2));  // exact: the bias already has y's type
      gemm_detail::widened_product(y2, x2, weight.t(), bias.defined() ? 1.0f : 0.0f);
      return y;
    }
  }
  if (gemm_detail::engine().sgemm && x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) &&
      x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
      x.is_contiguous() && !gemm_detail::recorded(x, weight) &&
      (!bias.defined() || (bias.scalar_type() == at::kFloat && bias.device().is_cpu() &&
                           !gemm_detail::recorded(bias, bias)))) {
    const at::Tensor x2 = x.view({-1, x.size(-1)});
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    // Made in its final shape and filled through a 2-D view: the result is not a view (autograd
    // refuses in-place changes to a view returned by a custom function).
    at::Tensor y = at::empty(shape, x.options());
    const at::Tensor y2 = y.view({x2.size(0), weight.size(0)});
    if (bias.defined()) y2.copy_(bias.expand_as(y2));  // at::addmm's order: the bias, then += x w^T
    if (gemm_detail::try_sgemm(y2, x2, weight.t(), bias.defined() ? 1.0f : 0.0f)) return y;
  }
  return at::linear(x, weight, bias);
}

}  // namespace dtk
