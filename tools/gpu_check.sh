#!/usr/bin/env bash
# Run ON THE GPU MACHINE (PyTorch 2.x with CUDA, nvcc, CMake, ninja; no network), with the
# folder tools/gpu_bundle.sh filled here carried along: unpacks the Debian packages into a
# prefix, configures dtk against the Python package's CUDA LibTorch (DTK_WITH_CUDA=ON), builds,
# runs the GPU-labelled tests and the GPT-2 124M and same-size Llama benchmarks against their
# PyTorch peers (tools/bench/gpu_gpt2.sh) and prints one summary. Under 10 minutes on 16 cores.
#   tools/gpu_check.sh [--configure-only] [--no-tests] [--no-bench] [--capacity] [--sanitize] [--torch-prefix DIR]
# --capacity: also issue 38's rows (tools/bench/gpu_capacity.sh: the largest GPT under a device
# budget with ddp and with ZeRO stage 3 + offload, tokens/s; 4-6 minutes): a call of its own,
# `tools/gpu_check.sh --no-tests --no-bench --capacity`, on a machine still warm from the first.
# --torch-prefix: a LibTorch CMake prefix other than python3's torch.utils.cmake_prefix_path.
# --sanitize: also run DTK's attention kernel test under compute-sanitizer's racecheck and
# synccheck (shared-memory races and barrier misuse, which no result check sees; about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIGURE_ONLY=0
BENCH=1
TESTS=1
CAPACITY=0
SANITIZE=0
TORCH_PREFIX=""
while (($#)); do
  case "$1" in
    --configure-only) CONFIGURE_ONLY=1; shift ;;
    --no-bench) BENCH=0; shift ;;
    --no-tests) TESTS=0; shift ;;
    --capacity) CAPACITY=1; shift ;;
    --sanitize) SANITIZE=1; shift ;;
    --torch-prefix) TORCH_PREFIX=$2; shift 2 ;;
    *) echo "usage: tools/gpu_check.sh [--configure-only] [--no-tests] [--no-bench] [--capacity] [--sanitize] [--torch-prefix DIR]" >&2; exit 2 ;;
  esac
done
[[ -d .gpu-bundle ]] && ls .gpu-bundle/*.deb >/dev/null 2>&1 ||
  { echo "gpu_check.sh: no .gpu-bundle/*.deb: run tools/gpu_bundle.sh on the build machine and carry .gpu-bundle" >&2; exit 2; }
START=$(date +%s)
# When each phase ended, for planning the next call's device time (a call may run 600 s at most).
phase() { echo "gpu_check.sh: $1 at $(($(date +%s) - START)) s"; }
PREFIX=${DTK_GPU_PREFIX:-/tmp/dtk-deps}
rm -rf "$PREFIX"
mkdir -p "$PREFIX"
for f in .gpu-bundle/*.deb; do dpkg-deb -x "$f" "$PREFIX"; done
MULTIARCH=x86_64-linux-gnu
export LD_LIBRARY_PATH="$PREFIX/usr/lib/$MULTIARCH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PREFIX/usr/bin:$PATH"
# Headers without a CMake package: Gloo's, which LibTorch's c10d headers include (a pip wheel
# ships LibTorch without them; Debian's libgloo-dev has them).
export CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}"
if [[ -z $TORCH_PREFIX ]]; then
  TORCH_PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
fi
TORCH_LIB=$(dirname "$TORCH_PREFIX")/../lib
[[ -d $TORCH_LIB ]] && export LD_LIBRARY_PATH="$(cd "$TORCH_LIB" && pwd):$LD_LIBRARY_PATH"
# The pip wheels' NCCL and CUDA runtime (nvidia-* packages), where the toolkit has no NCCL.
NCCL_HOME=${NCCL_HOME:-$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)}
[[ -n $NCCL_HOME ]] && export NCCL_HOME && export LD_LIBRARY_PATH="$NCCL_HOME/lib:$LD_LIBRARY_PATH"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
# Without nvidia-smi, LibTorch's own view (the phases that need a GPU would otherwise not run).
[[ -n $GPU ]] || GPU=$(python3 -c 'import torch; torch.cuda.is_available() and print(torch.cuda.get_device_name(0))' 2>/dev/null || true)
echo "gpu_check.sh: GPU '${GPU:-none}', LibTorch at $TORCH_PREFIX, deps in $PREFIX, NCCL_HOME '${NCCL_HOME:-}'"
ARCH=native
[[ -z $GPU ]] && ARCH="80;90"
mkdir -p build-gpu
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTK_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$PREFIX/usr" \
  -DCMAKE_LIBRARY_ARCHITECTURE=$MULTIARCH -DProtobuf_PROTOC_EXECUTABLE="$PREFIX/usr/bin/protoc" \
  -DDTK_BUILD_BENCHMARKS=ON >build-gpu/configure.log 2>&1 ||
  { tail -40 build-gpu/configure.log; cp build-gpu/configure.log "${OUT:-build-gpu}/" 2>/dev/null || true
    echo "gpu_check.sh: configure FAILED (build-gpu/configure.log)"; exit 1; }
grep "DTK:" build-gpu/configure.log || true
status=configured
if ((!CONFIGURE_ONLY)); then
  # What the GPU tests and the benchmarks run (dtk, its plugins, the gpu-labelled test binaries,
  # the kernel table), not the CPU suites: minutes of a GPU machine's lease saved; dtk and its
  # plugins alone for a call that runs neither. Ninja keeps going past a failed file (-k 0), so
  # that one test binary that does not compile costs its own rows, not the whole call's: what
  # built runs, and the summary names what did not. The log goes to a file first (a pipe that
  # closes early, as `head` does, would kill ninja mid-build).
  BINARIES=()
  ((TESTS)) && BINARIES+=(dtk_cuda_tests dtk_gpu_training_tests dtk_gpu_kernel_tests)
  ((SANITIZE && !TESTS)) && BINARIES+=(dtk_gpu_kernel_tests)
  ((BENCH)) && BINARIES+=(dtk_bench_kernels)
  cmake --build build-gpu -j "$(nproc)" --target dtk dtk_plugins "${BINARIES[@]}" -- -k 0 >build-gpu/build.log 2>&1 || true
  grep -E "error|FAILED|^ninja: " build-gpu/build.log | head -40 || true
  [[ -x build-gpu/bin/dtk ]] || { echo "gpu_check.sh: dtk did not build (build-gpu/build.log)"; exit 1; }
  built=""
  for bin in "${BINARIES[@]}"; do
    [[ -x build-gpu/bin/$bin ]] || built="$built; $bin did not build: FAILED"
  done
  if grep -q "^FAILED: " build-gpu/build.log; then
    built="$built; some files FAILED to compile (build.log)"
    cp build-gpu/build.log "${OUT:-build-gpu}/" 2>/dev/null || true
  fi
  build-gpu/bin/dtk --version
  phase "built"
  status="built$built"
  if ((TESTS)); then
    # Bounded as a whole (the tests' own TIMEOUT properties are longer than a call), the log also
    # written into $OUT as it goes, so a call cut short still brings back what ran.
    (cd build-gpu && timeout -k 10 300 ctest -L gpu -j 4 --output-on-failure) 2>&1 |
      tee build-gpu/ctest.log ${OUT:+"$OUT/ctest.log"} | tail -40 && status="gpu tests passed$built" ||
      status="gpu tests FAILED$built"
    phase "gpu tests done"
  fi
  if ((SANITIZE)) && [[ -z $GPU ]]; then
    status="$status; --sanitize: no GPU, sanitizers not run: FAILED"
  elif ((SANITIZE)) && [[ -x build-gpu/bin/dtk_gpu_kernel_tests ]]; then
    SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    for tool in racecheck synccheck; do
      "$SANITIZER" --tool "$tool" --error-exitcode 1 build-gpu/bin/dtk_gpu_kernel_tests \
        --gtest_filter=GpuKernels.AttentionKernelEqualsOps 2>&1 | tail -4 || status="$status; $tool FAILED"
    done
    phase "sanitizers done"
  fi
  ((BENCH)) && [[ -z $GPU ]] && status="$status; no GPU, benchmarks not run: FAILED"
  if ((BENCH)) && [[ -n $GPU ]]; then
    # Each fused layer kernel against its ops at GPT-2's and Llama's shapes, and a copy's rate.
    if [[ -x build-gpu/bin/dtk_bench_kernels ]]; then
      build-gpu/bin/dtk_bench_kernels 2>&1 | tee "${OUT:-build-gpu}/kernels.txt" || status="$status; kernel benchmark FAILED"
    fi
    phase "kernel table done"
    # The profiles land in $OUT (the device tool brings that folder back) or build-gpu/profile.
    # The variants measure, in the same call, the fused cross entropy kernel against its ops, the
    # layers' fused kernels against their ops (model.unfused_kernels=all) and the step replayed
    # from CUDA graphs (train.cuda_graphs) against launched kernel by kernel, hidden dropout 0.1
    # (its masks applied in the add + LayerNorm kernels); with Megatron's defaults (hidden and
    # attention dropout 0.1) DTK's attention kernel against the probabilities formed in memory,
    # and the same step replayed from CUDA graphs (the seeds drawn into the graph's table).
    tools/bench/gpu_gpt2.sh --dtk build-gpu/bin/dtk --steps 20 --profile "${OUT:-build-gpu}/profile" \
      --variant "ops cross entropy|--set model.cross_entropy_impl=ops" \
      --variant "unfused kernels|--set model.unfused_kernels=all" \
      --variant "cuda graphs|--set train.cuda_graphs=true" \
      --variant "hidden dropout 0.1|--set model.hidden_dropout=0.1" \
      --variant "both dropouts 0.1|--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1" \
      --variant "both dropouts, cuda graphs|--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 --set train.cuda_graphs=true" \
      --variant "both dropouts, attention off|--set model.hidden_dropout=0.1 --set model.attention_dropout=0.1 --set model.unfused_kernels=attention" ||
      status="$status; benchmark FAILED"
    phase "GPT rows done"
    # Issue 33's second row: a Llama of the same size against its compiled peer.
    tools/bench/gpu_gpt2.sh --model llama --dtk build-gpu/bin/dtk --steps 20 --profile "${OUT:-build-gpu}/profile-llama" \
      --variant "unfused kernels|--set model.unfused_kernels=all" \
      --variant "cuda graphs|--set train.cuda_graphs=true" || status="$status; llama benchmark FAILED"
    phase "Llama rows done"
  fi
  # What is left of the call's 600 s, less a minute for a run's kill grace, dd and the copy back.
  left=$((540 - ($(date +%s) - START)))
  if ((CAPACITY)) && [[ -z $GPU ]]; then
    status="$status; --capacity: no GPU, capacity rows not run: FAILED"
  elif ((CAPACITY && left < 120)); then
    status="$status; --capacity: $left s left of the call, capacity rows not run: FAILED"
  elif ((CAPACITY)); then
    tools/bench/gpu_capacity.sh --dtk build-gpu/bin/dtk --max_seconds "$left" --log_dir "${OUT:-build-gpu}" 2>&1 |
      tee "${OUT:-build-gpu}/capacity.txt" || status="$status; capacity benchmark FAILED"
    phase "capacity rows done"
  fi
fi
echo "gpu_check.sh: $status in $(($(date +%s) - START)) s"
[[ $status != *FAILED* ]]
