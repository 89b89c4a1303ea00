// dtk_bench_kernels — DTK's fused layer kernels against their LibTorch-op references: each SDK
// function that has a kernel (add_layer_norm, add_bias_layer_norm, add_bias_dropout_layer_norm,
// add_rms_norm, rms_norm, bias_gelu, swiglu, apply_rotary, fused_attention;
// dtk/layers/fused_kernels.hpp) and dropout timed forward + backward through autograd, once with
// its kernel and once with the kernel left out (the same function running the ops), at
// GPT-2 124M's and the same-size Llama's shapes (32 sequences of 1024 tokens: 32768 rows, hidden
// 768, GPT's MLP 3072, Llama's 2048, 12 query and 4 key/value heads of 64). Next to each, the
// floor: the passes over memory the fused function cannot avoid at the rate of a plain copy
// measured in the same run. On a GPU in bf16 (what tools/gpu_check.sh runs); on the CPU (fp32,
// fewer rows) both columns run the same ops: that only checks the program (give it dtk's allocator
// there, LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4, or glibc's malloc pages
// in every temporary).
//   build/bin/dtk_bench_kernels [--device cuda|cpu] [--rows N] [--reps N]
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <dtk/layers/activations.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/fused_kernels.hpp>
#include <dtk/layers/norms.hpp>
#include <dtk/layers/rotary.hpp>

namespace {

using Clock = std::chrono::steady_clock;
using dtk::layers::FusedKernels;

struct Setup {
  at::Device device = at::kCPU;
  at::ScalarType type = at::kFloat;
  int64_t rows = 0;
  int reps = 20;
};

void sync(const Setup& s) {
  if (s.device.is_cuda()) torch::cuda::synchronize();
}

// Milliseconds per call of f (after three untimed calls), the device synchronised around them.
double time_ms(const Setup& s, const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  sync(s);
  const auto start = Clock::now();
  for (int i = 0; i < s.reps; ++i) f();
  sync(s);
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / s.reps;
}

// The function's outputs' gradients w.r.t. `inputs` for incoming gradients `grads`: one forward
// and one backward, nothing accumulated between calls.
using Forward = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs, const FusedKernels& k)>;

void forward_backward(const Forward& f, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& grads,
                      const FusedKernels& k) {
  const std::vector<at::Tensor> out = f(inputs, k);
  std::vector<at::Tensor> differentiable;
  for (const at::Tensor& t : inputs)
    if (t.requires_grad()) differentiable.push_back(t);
  torch::autograd::grad(out, differentiable, std::vector<at::Tensor>(grads.begin(), grads.begin() + out.size()));
}

struct Case {
  const char* name;
  std::string shape;
  double passes;  // passes over a [rows, width] tensor of the run's type, forward and backward, fused
  int64_t width;
  std::vector<at::Tensor> inputs, grads;
  Forward f;
};

at::Tensor input(const Setup& s, std::vector<int64_t> shape, double scale = 1.0, double shift = 0.0, bool grad = true) {
  at::Tensor t = (at::randn(shape, at::TensorOptions().device(s.device)) * scale + shift).to(s.type);
  return grad ? t.requires_grad_(true) : t;
}

std::vector<Case> cases(const Setup& s) {
  const int64_t r = s.rows, h = 768, gpt_ffn = 3072, llama_ffn = 2048, hd = 64;
  const std::string rows = std::to_string(r) + " x ";
  std::vector<Case> out;
  const at::Tensor w = input(s, {h}, 0.1, 1.0), b = input(s, {h}, 0.1);
  // gpt: the residual add and LayerNorm (after the attention, and before each next layer).
  out.push_back({"add_layer_norm",
                 rows + std::to_string(h),
                 8,
                 h,
                 {input(s, {r, h}), input(s, {r, h}), w, b},
                 {input(s, {r, h}, 1, 0, false), input(s, {r, h}, 1, 0, false)},
                 [](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   auto [sum, y] = dtk::layers::add_layer_norm(in[0], in[1], in[2], in[3], 1e-5, k);
                   return std::vector<at::Tensor>{sum, y};
                 }});
  // gpt: the same with the row-parallel product's bias (the attention's output projection's, the
  // MLP's second product's) added in the kernel and its gradient summed in the backward's pass.
  out.push_back({"add_bias_layer_norm",
                 rows + std::to_string(h),
                 8,
                 h,
                 {input(s, {r, h}), input(s, {r, h}), input(s, {h}, 0.1), w, b},
                 {input(s, {r, h}, 1, 0, false), input(s, {r, h}, 1, 0, false)},
                 [](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   auto [sum, y] = dtk::layers::add_bias_layer_norm(in[0], in[1], in[2], in[3], in[4], 1e-5, k);
                   return std::vector<at::Tensor>{sum, y};
                 }});
  // gpt with hidden dropout (p 0.1): the branch's mask applied in the same kernel too (Megatron's
  // bias-dropout-add), its bits hashed there forward and backward; the backward writes the
  // branch's gradient next to x's (one pass more than without dropout).
  at::Generator gen = dtk::layers::seeded_generator(7);
  const dtk::layers::DropoutMask mask = dtk::layers::draw_keep_mask({r, h}, 0.1, gen);
  out.push_back({"add_bias_dropout_layer_norm",
                 rows + std::to_string(h),
                 9,
                 h,
                 {input(s, {r, h}), input(s, {r, h}), input(s, {h}, 0.1), w, b},
                 {input(s, {r, h}, 1, 0, false), input(s, {r, h}, 1, 0, false)},
                 [mask](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   auto [sum, y] =
                       dtk::layers::add_bias_dropout_layer_norm(in[0], in[1], in[2], mask, in[3], in[4], 1e-5, k);
                   return std::vector<at::Tensor>{sum, y};
                 }});
  // llama: the same with RMSNorm, and RMSNorm alone (the first layer's input norm).
  out.push_back({"add_rms_norm",
                 rows + std::to_string(h),
                 8,
                 h,
                 {input(s, {r, h}), input(s, {r, h}), w},
                 {input(s, {r, h}, 1, 0, false), input(s, {r, h}, 1, 0, false)},
                 [](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   auto [sum, y] = dtk::layers::add_rms_norm(in[0], in[1], in[2], 1e-5, k);
                   return std::vector<at::Tensor>{sum, y};
                 }});
  out.push_back({"rms_norm",
                 rows + std::to_string(h),
                 5,
                 h,
                 {input(s, {r, h}), w},
                 {input(s, {r, h}, 1, 0, false)},
                 [](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   return std::vector<at::Tensor>{dtk::layers::rms_norm(in[0], in[1], 1e-5, k)};
                 }});
  // gpt: the MLP's bias + GELU (tanh, GPT-2's), its bias gradient in the same backward pass.
  out.push_back({"bias_gelu",
                 rows + std::to_string(gpt_ffn),
                 5,
                 gpt_ffn,
                 {input(s, {r, gpt_ffn}), input(s, {gpt_ffn}, 0.1)},
                 {input(s, {r, gpt_ffn}, 1, 0, false)},
                 [](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   return std::vector<at::Tensor>{dtk::layers::bias_gelu(in[0], in[1], true, k)};
                 }});
  // llama: SwiGLU's silu(gate) * up.
  out.push_back({"swiglu",
                 rows + std::to_string(llama_ffn),
                 8,
                 llama_ffn,
                 {input(s, {r, llama_ffn}, 3), input(s, {r, llama_ffn})},
                 {input(s, {r, llama_ffn}, 1, 0, false)},
                 [](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   return std::vector<at::Tensor>{dtk::layers::swiglu(in[0], in[1], k)};
                 }});
  // llama: rotary on the queries (12 heads) and keys (4), strided as the layer's split of one
  // projection leaves them (a head's 64 channels apart by the projection's row), with the angles
  // of 32 x 1024 positions. Each its own leaf: the timing holds the rotary passes alone.
  const int64_t b_seqs = std::max<int64_t>(1, r / 1024), seq = r / b_seqs;
  const at::Tensor angles = at::randn({b_seqs, seq, 1, hd}, at::TensorOptions().device(s.device)) * 3;
  const at::Tensor cos = angles.cos(), sin = angles.sin();
  out.push_back({"apply_rotary", std::to_string(b_seqs) + " x " + std::to_string(seq) + " x (12+4) x 64", 4, 16 * hd,
                 {input(s, {b_seqs, seq, 12, 2 * hd}), input(s, {b_seqs, seq, 4, 2 * hd}), cos, sin},
                 {input(s, {b_seqs, seq, 12, hd}, 1, 0, false), input(s, {b_seqs, seq, 4, hd}, 1, 0, false)},
                 [](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   const at::Tensor q = in[0].narrow(3, 0, 64), key = in[1].narrow(3, 0, 64);
                   return std::vector<at::Tensor>{dtk::layers::apply_rotary(q, in[2], in[3], k),
                                                  dtk::layers::apply_rotary(key, in[2], in[3], k)};
                 }});
  // Hidden dropout (p 0.1) on a [rows, 768] branch: DTK's kernel hashes each element's bits in
  // its one pass; its ops reference makes them with tensor operations. Dropout has no switch in
  // model.unfused_kernels (every layer's dropout goes through it): the "ops" run calls the
  // reference directly.
  out.push_back({"dropout",
                 rows + std::to_string(h),
                 4,
                 h,
                 {input(s, {r, h})},
                 {input(s, {r, h}, 1, 0, false)},
                 [mask](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                   const bool kernels = k.add_norm;  // false only in the run with every kernel left out
                   return std::vector<at::Tensor>{kernels ? dtk::layers::apply_dropout(in[0], mask)
                                                          : dtk::layers::apply_dropout_ops(in[0], mask)};
                 }});
  // gpt's core attention with attention dropout (p 0.1) on q, k, v strided in one projection [b,
  // s, 12, 3 * 64]: DTK's kernel (the probabilities never in memory) against Megatron's
  // CoreAttention in ops (attention_ops: the [b, 12, s, s] probabilities formed, with the same
  // mask). Bound by its products, not by memory: the floor column counts only q, k, v, the
  // context and their gradients.
  const at::Tensor causal =
      at::ones({seq, seq}, at::TensorOptions().dtype(at::kBool).device(s.device)).triu(1).view({1, 1, seq, seq});
  const dtk::layers::DropoutMask probs_mask = dtk::layers::draw_keep_mask({b_seqs, 12, seq, seq}, 0.1, gen);
  // A case of core attention: DTK's kernel where it applies (and the run leaves it on), else
  // `reference` on q, k, v; window -1 for none.
  using Reference = std::function<at::Tensor(const std::vector<at::Tensor>& qkv)>;
  const auto attention_case = [&](const char* name, const dtk::layers::DropoutMask& mask, Reference reference,
                                  int64_t window = -1) {
    return Case{name,
                std::to_string(b_seqs) + " x " + std::to_string(seq) + " x 12 x 64",
                12,
                h,
                {input(s, {b_seqs, seq, 12, 3 * hd})},
                {input(s, {b_seqs, seq, 12 * hd}, 1, 0, false)},
                [=](const std::vector<at::Tensor>& in, const FusedKernels& k) {
                  const std::vector<at::Tensor> qkv = in[0].split(64, 3);
                  if (dtk::layers::fused_attention_applies(qkv[0], qkv[1], qkv[2], mask, k))
                    return std::vector<at::Tensor>{
                        dtk::layers::fused_attention(qkv[0], qkv[1], qkv[2], 0.125, mask, window)};
                  return std::vector<at::Tensor>{reference(qkv)};
                }};
  };
  out.push_back(attention_case("attention (dropout 0.1)", probs_mask, [=](const std::vector<at::Tensor>& qkv) {
    return dtk::layers::attention_ops(qkv[0], qkv[1], qkv[2], 0.125, causal, probs_mask);
  }));
#if TORCH_VERSION_MAJOR >= 2
  // Without dropout, where the layers use LibTorch's fused attention: DTK's kernel (the "kernel"
  // column) against it (the "ops" column), how far DTK's kernel is from FlashAttention's.
  out.push_back(attention_case("attention (no dropout)", {}, [](const std::vector<at::Tensor>& qkv) {
    return at::scaled_dot_product_attention(qkv[0].transpose(1, 2), qkv[1].transpose(1, 2), qkv[2].transpose(1, 2), {},
                                            0.0, true)
        .transpose(1, 2)
        .reshape({qkv[0].size(0), qkv[0].size(1), 12 * 64});
  }));
#endif
  // A sliding window of 128 earlier keys (gpt-oss's are 127), no dropout: DTK's kernel walks 3 of
  // each query's key tiles against, on LibTorch 2.x, its fused attention given the window's [s,
  // s] mask (which computes every tile below the diagonal), else the ops with that mask.
  const at::Tensor windowed = dtk::layers::window_mask({}, seq, seq, 128, s.device);
  out.push_back(attention_case(
      "attention (window 128)", {},
      [=](const std::vector<at::Tensor>& qkv) {
#if TORCH_VERSION_MAJOR >= 2
        return at::scaled_dot_product_attention(qkv[0].transpose(1, 2), qkv[1].transpose(1, 2), qkv[2].transpose(1, 2),
                                                windowed.logical_not(), 0.0, false)
            .transpose(1, 2)
            .reshape({qkv[0].size(0), qkv[0].size(1), 12 * 64});
#else
        return dtk::layers::attention_ops(qkv[0], qkv[1], qkv[2], 0.125, windowed, {});
#endif
      },
      128));
  return out;
}

// GB/s of a plain copy of a 1 GiB tensor (on the CPU 256 MiB): read and write counted.
double copy_rate(const Setup& s) {
  const int64_t n = (s.device.is_cuda() ? int64_t{1} << 30 : int64_t{1} << 28) / 4;
  const at::Tensor src = at::ones({n}, at::TensorOptions().device(s.device)), dst = at::empty_like(src);
  const double ms = time_ms(s, [&] { dst.copy_(src); });
  return 2.0 * static_cast<double>(n) * 4 / (ms * 1e6);
}

int usage() {
  std::fprintf(stderr, "usage: dtk_bench_kernels [--device cuda|cpu] [--rows N] [--reps N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Setup s;
  s.device = torch::cuda::is_available() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  int64_t rows = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage();
    const std::string v = argv[++i];
    if (a == "--device" && (v == "cuda" || v == "cpu")) {
      s.device = v == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    } else if (a == "--rows") {
      rows = std::atoll(v.c_str());
      if (rows < 1) return usage();
    } else if (a == "--reps") {
      s.reps = std::atoi(v.c_str());
      if (s.reps < 1) return usage();
    } else {
      return usage();
    }
  }
  if (s.device.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "dtk: error: dtk_bench_kernels: --device cuda, but this LibTorch sees no CUDA device\n");
    return 1;
  }
  s.type = s.device.is_cuda() ? at::kBFloat16 : at::kFloat;
  s.rows = rows ? rows : s.device.is_cuda() ? 32768 : 2048;
  at::manual_seed(1);
  const double rate = copy_rate(s);
  const double element = s.type == at::kFloat ? 4.0 : 2.0;
  std::printf("dtk_bench_kernels: %s, %s, %lld rows, %d reps; a plain copy: %.0f GB/s\n",
              s.device.is_cuda() ? "cuda" : "cpu (kernels and ops run the same ops here)",
              s.type == at::kFloat ? "fp32" : "bf16", static_cast<long long>(s.rows), s.reps, rate);
  std::printf("%-27s %-22s %10s %10s %9s %10s\n", "forward+backward", "shape", "kernel ms", "ops ms", "speed-up",
              "floor ms");
  const FusedKernels fused, none = dtk::layers::unfused_kernels("all");
  for (const Case& c : cases(s)) {
    const double kernel_ms = time_ms(s, [&] { forward_backward(c.f, c.inputs, c.grads, fused); });
    const double ops_ms = time_ms(s, [&] { forward_backward(c.f, c.inputs, c.grads, none); });
    const double floor_ms = c.passes * static_cast<double>(s.rows * c.width) * element / (rate * 1e6);
    std::printf("%-27s %-22s %10.3f %10.3f %8.2fx %10.3f\n", c.name, c.shape.c_str(), kernel_ms, ops_ms,
                ops_ms / kernel_ms, floor_ms);
  }
  return 0;
}
