// The SDK's fused functions, used by the gpt and llama layers, on the CPU (and wherever DTK's GPU
// kernels do not apply) run exactly the ops the layers ran before, so every model's CPU losses stay
// bit-identical:
//   * residual add + norm (dtk/layers/norms.hpp: add_layer_norm, add_rms_norm): the sum, the
//     norm's output and the gradients of x, the residual, the weight and the bias are bit-equal to
//     `x + residual` followed by the plain norm (and to ATen's LayerNorm itself in fp32), in fp32
//     and bf16, with gradients arriving through both outputs or through the norm's alone;
//     add_bias_layer_norm is the branch's bias add, then add_layer_norm;
//   * the activations (dtk/layers/activations.hpp): bias_gelu is gelu(x + b), column_linear_gelu
//     gelu(fc.forward(x)) (exact and tanh), swiglu silu(gate) * up, values and gradients.
// The GPU kernels' own tests are in tests/cuda/gpu_kernels_test.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <dtk/layers/activations.hpp>
#include <dtk/layers/decoder_lm.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/norms.hpp>
#include <dtk/layers/param_factory.hpp>
#include <dtk/layers/tensor_parallel.hpp>

namespace {

struct Run {
  std::vector<at::Tensor> values;  // sum, y, dx, dresidual, dweight, dbias
};

// The fused function (or the separate ops) on clones of the inputs; `stream_grad`: the sum gets
// an incoming gradient of its own (the residual stream's), else only the norm's output does.
Run run(bool fused, bool layer, at::ScalarType type, bool stream_grad) {
  at::manual_seed(3);
  const int64_t hidden = 48;
  const at::Tensor x0 = (at::randn({2, 5, hidden}) * 2 + 0.3).to(type);
  const at::Tensor r0 = at::randn({2, 5, hidden}).to(type);
  const at::Tensor w0 = (1 + 0.1 * at::randn({hidden})).to(type), b0 = (0.1 * at::randn({hidden})).to(type);
  const at::Tensor dy = at::randn({2, 5, hidden}).to(type), dsum = at::randn({2, 5, hidden}).to(type);
  at::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
  at::Tensor w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
  at::Tensor sum, y;
  if (fused) {
    std::tie(sum, y) = layer ? dtk::layers::add_layer_norm(x, r, w, b, 1e-5) : dtk::layers::add_rms_norm(x, r, w, 1e-5);
  } else {  // what the layers ran before
    sum = x + r;
    y = layer ? dtk::layers::layer_norm(sum, w, b, 1e-5) : dtk::layers::rms_norm(sum, w, 1e-5);
  }
  if (stream_grad)
    torch::autograd::backward({sum, y}, {dsum, dy});
  else
    torch::autograd::backward({y}, {dy});
  return {{sum.detach(), y.detach(), x.grad(), r.grad(), w.grad(), layer ? b.grad() : at::zeros({1})}};
}

void expect_bit_equal(const Run& a, const Run& b, const std::string& what) {
  const char* names[] = {"sum", "y", "dx", "dresidual", "dweight", "dbias"};
  for (size_t i = 0; i < a.values.size(); ++i) {
    ASSERT_TRUE(a.values[i].defined() && b.values[i].defined()) << what << ": " << names[i];
    EXPECT_EQ(a.values[i].scalar_type(), b.values[i].scalar_type()) << what << ": " << names[i];
    EXPECT_TRUE(at::equal(a.values[i], b.values[i])) << what << ": " << names[i] << " differs";
  }
}

TEST(FusedNorms, AddLayerNormOnTheCpuIsTheAddAndTheNormBitForBit) {
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16})
    for (const bool stream_grad : {true, false})
      expect_bit_equal(run(true, true, type, stream_grad), run(false, true, type, stream_grad),
                       std::string("add_layer_norm ") + c10::toString(type) + (stream_grad ? ", both grads" : ""));
}

TEST(FusedNorms, AddRmsNormOnTheCpuIsTheAddAndTheNormBitForBit) {
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16})
    for (const bool stream_grad : {true, false})
      expect_bit_equal(run(true, false, type, stream_grad), run(false, false, type, stream_grad),
                       std::string("add_rms_norm ") + c10::toString(type) + (stream_grad ? ", both grads" : ""));
}

TEST(FusedNorms, AddLayerNormMatchesAtenLayerNormAndTheOpsReferences) {
  // In fp32 the SDK's LayerNorm is ATen's: the fused function's norm output is at::layer_norm's.
  at::manual_seed(5);
  const at::Tensor x = at::randn({3, 7, 32}), r = at::randn({3, 7, 32});
  const at::Tensor w = at::randn({32}), b = at::randn({32});
  const auto [sum, y] = dtk::layers::add_layer_norm(x, r, w, b, 1e-5);
  EXPECT_TRUE(at::equal(sum, x + r));
  EXPECT_TRUE(at::equal(y, at::layer_norm(x + r, {32}, w, b, 1e-5)));
  // And the _ops references (what the GPU kernels are tested against) are the same computation.
  const auto [sum_ops, y_ops] = dtk::layers::add_layer_norm_ops(x, r, w, b, 1e-5);
  EXPECT_TRUE(at::equal(sum, sum_ops) && at::equal(y, y_ops));
  const auto [rsum, ry] = dtk::layers::add_rms_norm(x, r, w, 1e-5);
  const auto [rsum_ops, ry_ops] = dtk::layers::add_rms_norm_ops(x, r, w, 1e-5);
  EXPECT_TRUE(at::equal(rsum, rsum_ops) && at::equal(ry, ry_ops));
  EXPECT_TRUE(at::equal(ry, dtk::layers::rms_norm_ops(x + r, w, 1e-5)));
}

// The add + LayerNorm of a branch whose bias is still to add (add_bias_layer_norm, what a
// row-parallel product made without its bias hands on): on the CPU exactly `branch + bias`, then
// add_layer_norm, values and gradients (the bias's is the column sums of the branch's); the bias
// undefined, add_layer_norm itself. And on the CPU no layer leaves a bias out: the kernel that
// would take it does not apply, so the CPU's losses stay those of the product with its bias.
TEST(FusedNorms, AddBiasLayerNormIsTheBiasAddThenAddLayerNorm) {
  at::manual_seed(8);
  const at::Tensor x0 = at::randn({3, 5, 40}), r0 = at::randn({3, 5, 40}), c0 = at::randn({40});
  const at::Tensor w0 = 1 + 0.1 * at::randn({40}), b0 = 0.1 * at::randn({40});
  const at::Tensor dy = at::randn({3, 5, 40}), dsum = at::randn({3, 5, 40});
  auto run_both = [&](bool fused) {
    at::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
    at::Tensor c = c0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor b = b0.clone().requires_grad_(true);
    const auto [sum, y] = fused ? dtk::layers::add_bias_layer_norm(x, r, c, w, b, 1e-5)
                                : dtk::layers::add_layer_norm(x, r + c, w, b, 1e-5);
    torch::autograd::backward({sum, y}, {dsum, dy});
    return std::vector<at::Tensor>{sum.detach(), y.detach(), x.grad(), r.grad(), c.grad(), w.grad(), b.grad()};
  };
  const auto fused = run_both(true), plain = run_both(false);
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_TRUE(at::equal(fused[i], plain[i])) << "value " << i;
  EXPECT_TRUE(at::allclose(fused[4], fused[3].sum(at::IntArrayRef{0, 1}), 1e-5, 1e-5));
  const auto [sum, y] = dtk::layers::add_bias_layer_norm(x0, r0, at::Tensor(), w0, b0, 1e-5);
  const auto [sum2, y2] = dtk::layers::add_layer_norm(x0, r0, w0, b0, 1e-5);
  EXPECT_TRUE(at::equal(sum, sum2) && at::equal(y, y2));
  const auto [osum, oy] = dtk::layers::add_bias_layer_norm_ops(x0, r0, c0, w0, b0, 1e-5);
  EXPECT_TRUE(at::equal(osum, fused[0]) && at::equal(oy, fused[1]));
  EXPECT_FALSE(dtk::layers::layer_norm_takes_branch_bias(x0, w0, b0, {}));
}

// Megatron's bias-dropout-add before the LayerNorm (add_bias_dropout_layer_norm): on the CPU
// exactly apply_dropout(branch + bias), then add_layer_norm, in values and every gradient, for a
// whole mask and a sequence shard's (strided) one; the tensor-op reference (what the GPU kernel is
// tested against) and a ResidualStream carrying the bias and the mask give the same values; the
// bias's gradient is the column sums of the branch's; dropout_mask draws dropout()'s mask.
TEST(FusedNorms, AddBiasDropoutLayerNormIsDropoutThenAddLayerNorm) {
  at::manual_seed(9);
  const at::Tensor x0 = at::randn({3, 5, 40}), r0 = at::randn({3, 5, 40}), c0 = at::randn({40});
  const at::Tensor w0 = 1 + 0.1 * at::randn({40}), b0 = 0.1 * at::randn({40});
  const at::Tensor dy = at::randn({3, 5, 40}), dsum = at::randn({3, 5, 40});
  at::Generator gen = dtk::layers::seeded_generator(41);
  const dtk::layers::DropoutMask whole = dtk::layers::draw_keep_mask({3, 5, 40}, 0.3, gen);
  const dtk::layers::DropoutMask shard = dtk::layers::draw_keep_mask({3, 15, 40}, 0.3, gen).sequence_rows(15, 5, 5);
  for (const auto& [name, keep] :
       {std::pair<const char*, dtk::layers::DropoutMask>{"whole", whole}, {"shard", shard}}) {
    auto run = [&, keep = keep](int path) {
      at::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
      at::Tensor c = c0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      at::Tensor b = b0.clone().requires_grad_(true);
      const auto [sum, y] = path == 0 ? dtk::layers::add_bias_dropout_layer_norm(x, r, c, keep, w, b, 1e-5)
                            : path == 1
                                ? dtk::layers::add_layer_norm(x, dtk::layers::apply_dropout(r + c, keep), w, b, 1e-5)
                                : dtk::layers::add_bias_dropout_layer_norm_ops(x, r, c, keep, w, b, 1e-5);
      torch::autograd::backward({sum, y}, {dsum, dy});
      return std::vector<at::Tensor>{sum.detach(), y.detach(), x.grad(), r.grad(), c.grad(), w.grad(), b.grad()};
    };
    const auto fused = run(0), plain = run(1), ops = run(2);
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_TRUE(at::equal(fused[i], plain[i])) << name << ": value " << i;
      EXPECT_TRUE(at::equal(fused[i], ops[i])) << name << ": against the ops, value " << i;
    }
    // Dropped elements get no gradient; the kept ones x's gradient scaled; the bias the column sums.
    const at::Tensor kept = dtk::layers::keep_bits(keep, x0.numel()).view(x0.sizes());
    EXPECT_TRUE(at::allclose(fused[3], at::where(kept, fused[2] / 0.7, at::zeros_like(fused[2])), 1e-6, 1e-6)) << name;
    EXPECT_TRUE(at::allclose(fused[4], fused[3].sum(at::IntArrayRef{0, 1}), 1e-5, 1e-5)) << name;
    const dtk::layers::ResidualStream stream{x0, r0, c0, keep};
    EXPECT_TRUE(at::equal(stream.sum(), fused[0])) << name;
  }
  // The mask dropout() applies, drawn without applying it.
  at::Generator g1 = dtk::layers::seeded_generator(43), g2 = dtk::layers::seeded_generator(43);
  const at::Tensor applied = dtk::layers::dropout(x0, 0.3, true, g1, dtk::layers::TPGroup{});
  const dtk::layers::DropoutMask drawn = dtk::layers::dropout_mask(x0, 0.3, true, g2, dtk::layers::TPGroup{});
  EXPECT_TRUE(at::equal(applied, dtk::layers::apply_dropout(x0, drawn)));
  EXPECT_FALSE(dtk::layers::dropout_mask(x0, 0.3, false, g2, dtk::layers::TPGroup{}).defined());
}

// Values and gradients of f(inputs) for clones of `inputs` (each requiring a gradient) under `dy`.
template <class F>
std::vector<at::Tensor> values_and_grads(const std::vector<at::Tensor>& inputs, const at::Tensor& dy, F&& f) {
  std::vector<at::Tensor> in;
  for (const at::Tensor& t : inputs) in.push_back(t.detach().clone().requires_grad_(true));
  const at::Tensor y = f(in);
  torch::autograd::backward({y}, {dy});
  std::vector<at::Tensor> out{y.detach()};
  for (const at::Tensor& t : in) out.push_back(t.grad());
  return out;
}

void expect_all_bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].defined() && b[i].defined()) << what << ": value " << i;
    EXPECT_TRUE(at::equal(a[i], b[i])) << what << ": value " << i << " (0: the output, then the inputs' gradients)";
  }
}

TEST(FusedActivations, BiasGeluAndSwigluOnTheCpuAreTheOpsBitForBit) {
  at::manual_seed(9);
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    const std::string name = c10::toString(type);
    const at::Tensor x = (at::randn({2, 5, 24}) * 2).to(type), b = at::randn({24}).to(type);
    const at::Tensor dy = at::randn({2, 5, 24}).to(type);
    for (const bool tanh : {false, true}) {
      const auto fused =
          values_and_grads({x, b}, dy, [&](const auto& in) { return dtk::layers::bias_gelu(in[0], in[1], tanh); });
      const auto ops = values_and_grads(
          {x, b}, dy, [&](const auto& in) { return tanh ? at::gelu(in[0] + in[1], "tanh") : at::gelu(in[0] + in[1]); });
      expect_all_bit_equal(fused, ops, "bias_gelu " + name + (tanh ? " tanh" : " erf"));
    }
    const at::Tensor u = at::randn({2, 5, 24}).to(type);
    const auto fused = values_and_grads({x, u}, dy, [](const auto& in) { return dtk::layers::swiglu(in[0], in[1]); });
    const auto ops = values_and_grads({x, u}, dy, [](const auto& in) { return at::silu(in[0]) * in[1]; });
    expect_all_bit_equal(fused, ops, "swiglu " + name);
  }
}

TEST(FusedActivations, ColumnLinearGeluOnTheCpuIsTheProductAndTheGelu) {
  dtk::layers::ParamFactory f;
  f.gen = dtk::layers::seeded_generator(7);
  dtk::layers::ColumnParallelLinear fc(16, 24, /*bias=*/true, 0.02, dtk::layers::TPGroup{}, f);
  at::manual_seed(4);
  const at::Tensor bias = at::randn({24}), x = at::randn({3, 5, 16}), dy = at::randn({3, 5, 24});
  for (const bool tanh : {false, true}) {
    // x, the weight and the bias as inputs (the layer's parameters replaced by the clones).
    auto run = [&](bool fused) {
      return values_and_grads({x, fc.weight, bias}, dy, [&](const auto& in) {
        dtk::layers::ColumnParallelLinear layer = fc;
        layer.weight = in[1];
        layer.bias = in[2];
        if (fused) return dtk::layers::column_linear_gelu(layer, in[0], tanh);
        return tanh ? at::gelu(layer.forward(in[0]), "tanh") : at::gelu(layer.forward(in[0]));
      });
    };
    expect_all_bit_equal(run(true), run(false), tanh ? "column_linear_gelu tanh" : "column_linear_gelu erf");
  }
}

}  // namespace

// The option that leaves kernels out (model.unfused_kernels): names, "all", spaces, and an
// unknown name refused naming it and the names there are.
TEST(FusedKernels, UnfusedKernelsParsesNamesAndRefusesUnknownOnes) {
  using dtk::layers::unfused_kernels;
  auto on = [](const dtk::layers::FusedKernels& k) {
    return std::vector<bool>{k.add_norm, k.bias_add, k.rms_norm, k.bias_gelu, k.swiglu, k.rotary, k.attention};
  };
  EXPECT_EQ(on(unfused_kernels("")), std::vector<bool>(7, true));
  EXPECT_EQ(on(unfused_kernels("all")), std::vector<bool>(7, false));
  EXPECT_EQ(on(unfused_kernels("swiglu, rotary")), (std::vector<bool>{true, true, true, true, false, false, true}));
  EXPECT_EQ(on(unfused_kernels("add_norm,rms_norm,")), (std::vector<bool>{false, true, false, true, true, true, true}));
  EXPECT_EQ(on(unfused_kernels("bias_gelu")), (std::vector<bool>{true, true, true, false, true, true, true}));
  EXPECT_EQ(on(unfused_kernels(" bias_add ")), (std::vector<bool>{true, false, true, true, true, true, true}));
  EXPECT_EQ(on(unfused_kernels("attention")), (std::vector<bool>{true, true, true, true, true, true, false}));
  try {
    unfused_kernels("rotary,gelu");
    ADD_FAILURE() << "'gelu' accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "unknown kernel 'gelu' (add_norm, bias_add, rms_norm, bias_gelu, swiglu, rotary, attention, all)");
  }
}
