#include "dtk/core/perf/startup_report.hpp"

#include <cstdio>

namespace dtk::core {

namespace {

std::string flops_line(const StartupFacts& f) {
  char line[640];
  char n[160];
  if (f.stats.active_parameters > 0 && f.stats.active_parameters != f.stats.model_parameters)  // experts
    std::snprintf(n, sizeof n, "%lld parameters a token runs (of the whole model's %lld: its routed experts only)",
                  static_cast<long long>(f.stats.active_parameters), static_cast<long long>(f.stats.model_parameters));
  else
    std::snprintf(n, sizeof n, "%lld parameters of the whole model", static_cast<long long>(f.stats.model_parameters));
  std::snprintf(line, sizeof line,
                " > training FLOPs per token: %.4g (2cN + 4cLhs with c = %d%s, N = %s, L = %lld layers, h = %lld, s = "
                "%lld); TFLOP/s per device = FLOPs per token x tokens/s / %d ranks",
                f.stats.flops_per_token, f.stats.passes, f.stats.passes == 4 ? " (full recompute)" : "", n,
                static_cast<long long>(f.num_layers), static_cast<long long>(f.hidden_size),
                static_cast<long long>(f.seq_length), f.world_size);
  return line;
}

}  // namespace

std::vector<std::string> startup_report(const StartupFacts& f) {
  std::vector<std::string> lines{flops_line(f)};
  if (!f.bf16_line.empty()) lines.push_back(f.bf16_line);
  if (!f.cpu_gemm_engine.empty())
    lines.push_back(" > CPU matrix products: " + f.cpu_gemm_engine +
                    " (DTK_CPU_GEMM=aten selects LibTorch's BLAS; dtk/gemm.hpp)");
  // glibc malloc re-faults large activations every iteration (dtk/core/memory/allocator.hpp).
  if (f.malloc_name == "tcmalloc")
    lines.push_back(" > memory allocator: tcmalloc (DTK_ALLOCATOR=system selects glibc malloc)");
  else
    lines.push_back(
        " > memory allocator: glibc malloc (training runs several times slower than on tcmalloc: "
        "apt-get install libtcmalloc-minimal4, and leave DTK_ALLOCATOR unset)");
  if (f.loss_scaling) {
    char line[160];
    std::snprintf(line, sizeof line, " > loss scaling: %s, scale %.6g", f.dynamic_scale ? "dynamic" : "static",
                  f.loss_scale);
    lines.push_back(line);
  }
  return lines;
}

}  // namespace dtk::core
