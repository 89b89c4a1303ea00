#!/usr/bin/env bash
# ZeRO benchmarks (docs/benchmarks.md), both in one run on this machine:
#
#  1. Throughput at data-parallel size 2: tokens/s of the ddp strategy (plain all-reduce, the
#     peer) and of zero stages 1-3 with and without CPU offload, on the same model and data, plus
#     each run's memory report and data-parallel traffic per iteration.
#  2. Capacity: the largest GPT (4 layers, growing hidden size) that trains under a device memory
#     budget (train.memory_limit_mb) with ddp, with zero stage 2 + optimizer offload (cpu_adam), and
#     with zero stage 3 + optimizer and parameter offload, and with the optimizer offloaded to disk
#     (offload_optimizer=nvme, and offload_param=nvme at stage 3; swap files in NVME_DIR, default a fresh directory under $TMPDIR or
#     /tmp), one process; the host memory each needs at its largest size (the memory report's host
#     max allocated), and the step time of every row at one size all of them hold (hidden 512).
#
#   tools/bench/zero.sh [--budget_mb 256] [--quick] [--capacity]   (--capacity: part 2 only)
#   NVME_DIR=/mnt/nvme/dtk tools/bench/zero.sh --capacity           (swap files on that disk)
# Needs a build (tools/build.sh). Uses tcmalloc when Debian's libtcmalloc-minimal4 is installed
# (the same allocator for every row).
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
BUDGET=256
QUICK=0
CAPACITY_ONLY=0
while (($#)); do
  case "$1" in
    --budget_mb) BUDGET=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --capacity) CAPACITY_ONLY=1; shift ;;
    *) echo "usage: tools/bench/zero.sh [--budget_mb N] [--quick] [--capacity]" >&2; exit 2 ;;
  esac
done
bench_start zero.sh

# ---- 1. throughput at DP=2 -----------------------------------------------------------------
# tokens/s of a run = the median over its logging windows of 5 iterations, the first window (start-up)
# left out; each strategy runs REPS times, interleaved with the others, and the median run is shown.
# This VM's figures wander by 20% and more from run to run: read the ratios within one table.
ITERS=$((QUICK ? 20 : 40))
REPS=$((QUICK ? 1 : 3))
TRAIN="train --config configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=4
  --set model.hidden_size=256 --set model.num_attention_heads=8 --set model.vocab_size=8192
  --set dataset.vocab_size=8192 --set train.seq_length=128 --set train.micro_batch_size=4
  --set train.global_batch_size=16 --set train.train_iters=$ITERS --set logging.log_interval=5
  --set eval.eval_iters=0 --set eval.eval_interval=0 --set lr.lr_warmup_iters=2"
NAMES=("ddp (all-reduce, the peer)" "zero stage 1" "zero stage 2" "zero stage 2, overlap_comm"
  "zero stage 2, offload_optimizer=cpu, cpu_adam" "zero stage 2, offload, delayed_param_update" "zero stage 3")
ARGS=("--strategy ddp" "--strategy zero --set strategy.stage=1" "--strategy zero --set strategy.stage=2"
  "--strategy zero --set strategy.stage=2 --set strategy.overlap_comm=true"
  "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu --optimizer cpu_adam"
  "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu --optimizer cpu_adam --set strategy.delayed_param_update=true"
  "--strategy zero --set strategy.stage=3")
declare -A RATES TRAFFIC MEM
((CAPACITY_ONLY)) && REPS=0
for ((rep = 0; rep < REPS; rep++)); do
  for i in "${!NAMES[@]}"; do
    out=$($DTK launch --nproc_per_node 2 $TRAIN ${ARGS[$i]} 2>&1) || { echo "${NAMES[$i]}: failed"; echo "$out" | tail -3; continue; }
    rate=$(echo "$out" | grep -o "tokens per second: [0-9]*" | grep -o "[0-9]*$" | tail -n +2 | median)
    RATES[$i]="${RATES[$i]:-} $rate"
    TRAFFIC[$i]=$(echo "$out" | grep -o "data-parallel traffic .* total: [0-9.]*" | grep -o "[0-9.]*$")
    MEM[$i]=$(echo "$out" | grep -o "memory (MB) | allocated: [0-9.]*" | grep -o "[0-9.]*$")
  done
done
if ((!CAPACITY_ONLY)); then
echo
echo "== 1. tokens/s at data-parallel size 2 (4 layers, hidden 256, vocab 8192, seq 128, micro-batch 4,"
echo "      global batch 16 = 2 micro-batches per rank, fp32; median of $REPS runs, each the median of its windows)"
printf '%-46s %10s %8s %-22s %14s %12s\n' "strategy" "tokens/s" "vs ddp" "  (runs)" "DP MB/iter" "device MB"
ddp_rate=$(echo ${RATES[0]} | tr ' ' '\n' | median)
for i in "${!NAMES[@]}"; do
  rate=$(echo ${RATES[$i]} | tr ' ' '\n' | median)
  printf '%-46s %10s %7.2fx %-22s %14s %12s\n' "${NAMES[$i]}" "$rate" "$(calc "$rate / $ddp_rate")" \
    "  (${RATES[$i]# })" "${TRAFFIC[$i]}" "${MEM[$i]}"
done
fi

# ---- 2. capacity under a device memory budget -----------------------------------------------
echo
echo "== 2. largest model under a device budget of $BUDGET MB, one process (4 layers, vocab 512, seq 64,"
echo "      batch 1, fp32; hidden grows until the budget refuses an allocation)"
HIDDEN=(256 384 512 640 768 896 1024 1280 1536 1792 2048 2560 3072)
((QUICK)) && HIDDEN=(256 512 768 1024 1536 2048)
CAP="train --config configs/gpt-tiny.pbtxt --dataset synthetic --set model.num_layers=4 --set model.num_attention_heads=8
  --set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=64 --set train.micro_batch_size=1
  --set train.global_batch_size=1 --set train.train_iters=2 --set logging.log_interval=1 --set eval.eval_iters=0
  --set eval.eval_interval=0 --set lr.lr_warmup_iters=0 --set train.memory_limit_mb=$BUDGET
  --set train.skip_memory_check=true"
printf '%-52s %8s %14s %14s %12s\n' "strategy" "hidden" "parameters" "max device MB" "max host MB"
# largest NAME ARGS DIMENSION SIZES...: the largest size (hidden width, or layers at hidden 512)
# that trains under the budget, with its parameters and the memory report's peaks.
largest() {
  local name=$1 args=$2 dim=$3 best="" params="" peak="" host="" out run
  shift 3
  for v in "$@"; do
    if [[ $dim == hidden ]]; then run="$CAP --set model.hidden_size=$v"; else run="${CAP/num_layers=4/num_layers=$v} --set model.hidden_size=512"; fi
    if out=$($DTK $run $args 2>&1); then
      best=$v
      params=$(echo "$out" | grep -o "model parallel rank (0, 0): [0-9]*" | grep -o "[0-9]*$")
      peak=$(echo "$out" | grep -o "| max allocated: [0-9.]*" | head -1 | grep -o "[0-9.]*$")
      host=$(echo "$out" | grep -o "| host max allocated: [0-9.]*" | head -1 | grep -o "[0-9.]*$")
    else
      echo "$out" | grep -q "device memory budget" || { echo "$name: $dim $v failed: $(echo "$out" | tail -1)"; }
      break
    fi
  done
  printf '%-52s %8s %14s %14s %12s\n' "$name" "${best:-none}" "${params:--}" "${peak:--}" "${host:--}"
}
capacity() { largest "$1" "$2" hidden "${HIDDEN[@]}"; }  # name, args
capacity "ddp" "--strategy ddp"
# Gradient buckets of 2M elements: DeepSpeed's default (5e8) would stage the whole model's fp32
# gradient at once on a model this size.
BUCKETS="--set strategy.reduce_bucket_size=2000000 --set strategy.allgather_bucket_size=2000000"
capacity "zero stage 3 (no offload), cpu_adam" "--strategy zero --set strategy.stage=3 --optimizer cpu_adam $BUCKETS"
capacity "zero stage 2, offload_optimizer=cpu, cpu_adam" \
  "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu --optimizer cpu_adam $BUCKETS"
capacity "zero stage 3, offload optimizer + param, cpu_adam" \
  "--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=cpu --set strategy.offload_param=cpu --optimizer cpu_adam $BUCKETS"
# Stage 3 is built partitioned (zero_init, the default): what bounds it is what one step holds on
# the device: the modules gathered at once (stage3_max_live_parameters), their gradients and the
# activations; full recomputation keeps only each layer's input.
LIVE="--set strategy.stage3_max_live_parameters=4000000 --set strategy.stage3_prefetch_bucket_size=2000000 --set model.recompute_activations=full"
capacity "zero stage 3, offload, recompute, max_live 4M" \
  "--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=cpu --set strategy.offload_param=cpu --optimizer cpu_adam $BUCKETS $LIVE"
capacity "  the same, built whole first (zero_init=false)" \
  "--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=cpu --set strategy.offload_param=cpu --optimizer cpu_adam $BUCKETS $LIVE --set strategy.zero_init=false"
# Disk offload: masters and Adam state in a swap file, streamed through a 96 MB host buffer (a
# shard whose state is larger than a slice, from hidden 1280 on an MLP weight, steps in pieces).
if [[ -z ${NVME_DIR:-} ]]; then
  NVME_DIR=$(mktemp -d "${TMPDIR:-/tmp}/dtk-nvme-bench.XXXXXX")
  trap 'rm -rf "$NVME_DIR"' EXIT
fi
NVME="--set strategy.offload_optimizer=nvme --set strategy.nvme_path=$NVME_DIR --set strategy.nvme_buffer_mb=96"
echo "(disk offload rows: swap files in $NVME_DIR, $(df -T "$NVME_DIR" | awk 'NR==2 {print $2 " on " $1}'))"
capacity "zero stage 2, offload_optimizer=nvme, cpu_adam" \
  "--strategy zero --set strategy.stage=2 $NVME --optimizer cpu_adam $BUCKETS"
capacity "zero stage 3, optimizer to nvme + param to cpu" \
  "--strategy zero --set strategy.stage=3 $NVME --set strategy.offload_param=cpu --optimizer cpu_adam $BUCKETS"
# Parameters on disk too (ZeRO-Infinity): the host keeps the gradient partition, the optimizer's
# buffer and param_buffer_count (5) chunks of 2M elements; recompute and max_live as above.
NVME_PARAM="--set strategy.offload_param=nvme"
capacity "zero stage 3, optimizer + param to nvme, recompute" \
  "--strategy zero --set strategy.stage=3 $NVME $NVME_PARAM --optimizer cpu_adam $BUCKETS $LIVE"

# Depth instead of width: at hidden 512 every layer is 3.1 M parameters, and stage 3 with offload
# keeps on the device only the layers in flight, so the layers it holds are bounded by host memory.
echo
echo "== 2a. the same budget, hidden 512, layers grow (ddp's largest at hidden 512 is 4 layers, above)"
printf '%-52s %8s %14s %14s %12s\n' "strategy" "layers" "parameters" "max device MB" "max host MB"
LAYERS=(4 8 16 32 48 64)
((QUICK)) && LAYERS=(4 16 48)
capacity_layers() { largest "$1" "$2" layers "${LAYERS[@]}"; }  # name, args
capacity_layers "ddp" "--strategy ddp"
capacity_layers "zero stage 3, offload, recompute, max_live 4M" \
  "--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=cpu --set strategy.offload_param=cpu --optimizer cpu_adam $BUCKETS $LIVE"
capacity_layers "zero stage 3, optimizer + param to nvme, recompute" \
  "--strategy zero --set strategy.stage=3 $NVME $NVME_PARAM --optimizer cpu_adam $BUCKETS $LIVE"

# Step time at one size: hidden 512, 8 iterations, the median of iterations 3-8, without the
# budget (stage 3 at one process holds less than ddp: with one rank its partition is the whole
# model, and a gathered module is a second copy).
echo
echo "== 2b. step time at hidden 512 (12.9 M parameters), same settings without the budget, median of iterations 3-8"
printf '%-52s %10s %12s\n' "strategy" "step ms" "max host MB"
step_time() {  # name, args
  local out ms host
  local args=${CAP/train_iters=2/train_iters=8}
  out=$($DTK ${args/memory_limit_mb=$BUDGET/memory_limit_mb=0} --set model.hidden_size=512 $2 2>&1) || { echo "$1: failed: $(echo "$out" | tail -1)"; return; }
  ms=$(echo "$out" | grep -o "elapsed time per iteration (ms): [0-9.]*" | grep -o "[0-9.]*$" | tail -n +3 | median)
  host=$(echo "$out" | grep -o "| host max allocated: [0-9.]*" | tail -1 | grep -o "[0-9.]*$")
  printf '%-52s %10s %12s\n' "$1" "$ms" "${host:--}"
}
step_time "ddp, cpu_adam (the same optimizer as the other rows)" "--strategy ddp --optimizer cpu_adam"
step_time "zero stage 3 (no offload), cpu_adam" "--strategy zero --set strategy.stage=3 --optimizer cpu_adam $BUCKETS"
step_time "zero stage 2, offload_optimizer=cpu, cpu_adam" \
  "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu --optimizer cpu_adam $BUCKETS"
step_time "zero stage 2, offload, delayed_param_update" \
  "--strategy zero --set strategy.stage=2 --set strategy.offload_optimizer=cpu --optimizer cpu_adam $BUCKETS --set strategy.delayed_param_update=true"
step_time "zero stage 3, offload optimizer + param, cpu_adam" \
  "--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=cpu --set strategy.offload_param=cpu --optimizer cpu_adam $BUCKETS"
step_time "zero stage 2, offload_optimizer=nvme, cpu_adam" \
  "--strategy zero --set strategy.stage=2 $NVME --optimizer cpu_adam $BUCKETS"
step_time "zero stage 3, optimizer to nvme + param to cpu" \
  "--strategy zero --set strategy.stage=3 $NVME --set strategy.offload_param=cpu --optimizer cpu_adam $BUCKETS"
step_time "zero stage 3, optimizer + param to nvme" \
  "--strategy zero --set strategy.stage=3 $NVME $NVME_PARAM --optimizer cpu_adam $BUCKETS"
# The disk's own time for the bytes a disk-offload step moves at hidden 512 (12 bytes per
# parameter, read once and written once), sequentially with dd (O_DIRECT, 4 MiB blocks, one at a
# time): the floor of the nvme rows' extra step time, unless reads and writes overlap.
STATE_MB=$(( (12 * 12905472 + (1 << 20) - 1) >> 20 ))
dd_ms() {  # dd arguments -> milliseconds
  dd "$@" bs=4M 2>&1 | tail -1 | awk '{print $(NF-3) * 1000}'
}
if w=$(dd_ms if=/dev/zero of="$NVME_DIR/dd.bin" count=$(( (STATE_MB + 3) / 4 )) oflag=direct) &&
  r=$(dd_ms if="$NVME_DIR/dd.bin" of=/dev/null iflag=direct); then
  printf '%-52s %10s\n' "the disk alone: write + read ${STATE_MB} MiB (dd)" "$(calc "$w + $r")"
  echo "  (write $w ms, read $r ms, O_DIRECT, 4 MiB blocks, in $NVME_DIR)"
else
  echo "the disk alone: dd with O_DIRECT failed in $NVME_DIR (a filesystem without direct I/O?)"
fi
rm -f "$NVME_DIR/dd.bin"
