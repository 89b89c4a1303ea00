#!/usr/bin/env bash
# Data-parallel overlap benchmark (docs/benchmarks.md): the ddp strategy's gradient buckets
# all-reduced after the backward (strategy.overlap_grad_reduce=false, the peer: what ddp did before
# the overlap) vs during the last backward (the default) vs split across the step
# (overlap_param_gather: reduce-scattered during the backward, the reduced gradients all-gathered
# and each bucket's update applied during the next forward); and ZeRO stage 2 without overlap vs with
# its reduce-scatters during the backward (overlap_comm) and its parameter all-gathers during the
# next forward (overlap_param_gather), its speed-up against its own non-overlapped row, and ZeRO
# stage 1 the same (its reduce-scatters during the last backward since 2026-11-30); at DP=2 on
# this machine, in one run, printed side by side: iteration time, tokens/s, and per iteration the
# data-parallel communication in flight and the part of it the training thread waited for
# (exposed). Each overlapped row's losses are compared with its non-overlapped row's.
#
#  1. over loopback Gloo as it is;
#  2. with distributed.simulated_link: latency 10us and a bandwidth chosen from run 1 so that the
#     link's transfers take as long as the peer's computation (communication ~50% of a
#     non-overlapped iteration over the link), to study overlap when communication is slow.
#
#   tools/bench/ddp.sh [--quick] [--recompute] [--layers N]
# --recompute: model.recompute_activations=full in every row (the backward is then ~3/4 of the
# computation: more of it to hide the all-reduces behind). --layers N: N layers instead of 4 (the
# first and last layers' share of the iteration, which no overlap can hide, shrinks as 1/N).
# Needs a build (tools/build.sh). Uses tcmalloc when Debian's libtcmalloc-minimal4 is installed.
# One thread per rank (2 ranks): communication competes with compute for this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
QUICK=0
EXTRA=""
LAYERS=4
while (($#)); do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --recompute) EXTRA="--set model.recompute_activations=full"; shift ;;
    --layers) LAYERS=$2; shift 2 ;;
    *) echo "usage: tools/bench/ddp.sh [--quick] [--recompute] [--layers N]" >&2; exit 2 ;;
  esac
done
bench_start ddp.sh

# Windows of 4 iterations; the first (start-up) is left out, the median of the rest is reported;
# each configuration runs REPS times interleaved with the other and the median run is shown.
# Buckets of 1 MB (ZeRO: 262144 elements): the model's 13 MB of fp32 gradients in 13 buckets
# (PyTorch's 25 MB default would make it one bucket, complete only at the end of the backward).
ITERS=$((QUICK ? 12 : 20))
REPS=$((QUICK ? 1 : 3))
TRAIN="train --config configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=$LAYERS
  --set model.hidden_size=256 --set model.num_attention_heads=8 --set model.vocab_size=512
  --set dataset.vocab_size=512 --set train.seq_length=128 --set train.micro_batch_size=8
  --set train.global_batch_size=16 --set train.train_iters=$ITERS --set logging.log_interval=4
  --set eval.eval_iters=0 --set eval.eval_interval=0 --set lr.lr_warmup_iters=1
  $EXTRA"
DDP="--strategy ddp --set strategy.bucket_size_mb=1"
ZERO="--strategy zero --set strategy.stage=2 --set strategy.reduce_bucket_size=262144"
ZERO1="--strategy zero --set strategy.stage=1 --set strategy.reduce_bucket_size=262144"
NAMES=("ddp, after the backward (peer)" "ddp, overlapped buckets" "ddp, split across the step"
  "ZeRO-2, not overlapped" "ZeRO-2, overlapped" "ZeRO-1, not overlapped" "ZeRO-1, overlapped")
ARGS=("$DDP --set strategy.overlap_grad_reduce=false" "$DDP --set strategy.overlap_grad_reduce=true"
  "$DDP --set strategy.overlap_grad_reduce=true --set strategy.overlap_param_gather=true"
  "$ZERO --set strategy.overlap_comm=false --set strategy.overlap_param_gather=false"
  "$ZERO --set strategy.overlap_comm=true --set strategy.overlap_param_gather=true"
  "$ZERO1 --set strategy.overlap_comm=false --set strategy.overlap_param_gather=false"
  "$ZERO1 --set strategy.overlap_comm=true --set strategy.overlap_param_gather=true")
PEER=(0 0 0 3 3 5 5)  # each row's speed-up and losses against this row
field() { echo "$1" | grep -o "$2 [0-9.]*" | grep -o "[0-9.]*$" | tail -n +2 | median; }

# Runs every configuration REPS times with extra args $1; fills MS, TOK, FLIGHT, EXPOSED (medians)
# and LOSSES (each configuration's printed losses of its last run).
declare -A MS TOK FLIGHT EXPOSED LOSSES
run_all() {
  local extra=$1
  declare -A ms_runs=() tok_runs=() flight_runs=() exposed_runs=()
  for ((rep = 0; rep < REPS; rep++)); do
    for i in "${!NAMES[@]}"; do
      out=$($DTK launch --nproc_per_node 2 $TRAIN ${ARGS[$i]} $extra 2>&1) || { echo "${NAMES[$i]}: failed"; echo "$out" | tail -3; exit 1; }
      ms_runs[$i]+=" $(field "$out" "elapsed time per iteration (ms):")"
      tok_runs[$i]+=" $(field "$out" "tokens per second:")"
      flight_runs[$i]+=" $(field "$out" "comm (ms) in flight:")"
      exposed_runs[$i]+=" $(field "$out" "| exposed:")"
      LOSSES[$i]=$(echo "$out" | grep -o "lm loss: [0-9.E+-]*" | tr '\n' ' ')
      [[ -z ${DP_MB:-} ]] && DP_MB=$(echo "$out" | grep -o "data-parallel traffic .* total: [0-9.]*" | grep -o "[0-9.]*$")
    done
  done
  for i in "${!NAMES[@]}"; do
    MS[$i]=$(echo ${ms_runs[$i]} | tr ' ' '\n' | median)
    TOK[$i]=$(echo ${tok_runs[$i]} | tr ' ' '\n' | median)
    FLIGHT[$i]=$(echo ${flight_runs[$i]} | tr ' ' '\n' | median)
    EXPOSED[$i]=$(echo ${exposed_runs[$i]} | tr ' ' '\n' | median)
  done
}

table() {
  printf "%-32s %12s %10s %9s %16s %13s %9s\n" "" "ms/iteration" "tokens/s" "speed-up" "DP comm in flight" "exposed (ms)" "exposed"
  for i in "${!NAMES[@]}"; do
    local peer=${PEER[$i]}
    printf "%-32s %12.1f %10.0f %8.2fx %14.1f ms %13.1f %8.0f%%\n" "${NAMES[$i]}" "${MS[$i]}" "${TOK[$i]}" \
      "$(calc "${MS[$peer]} / ${MS[$i]}")" "${FLIGHT[$i]}" "${EXPOSED[$i]}" "$(calc "100 * ${EXPOSED[$i]} / ${FLIGHT[$i]}")"
  done
  for i in "${!NAMES[@]}"; do
    local peer=${PEER[$i]}
    ((peer == i)) && continue
    if [[ "${LOSSES[$peer]}" == "${LOSSES[$i]}" ]]; then echo "${NAMES[$i]}: losses identical to ${NAMES[$peer]} (${ITERS} iterations)"
    else echo "${NAMES[$i]}: losses DIFFER: ${LOSSES[$peer]} vs ${LOSSES[$i]}"; fi
  done
}

MODEL="$LAYERS layers, hidden 256, 8 heads, seq 128, micro-batch 8, DP=2, 1 thread per rank${EXTRA:+, recompute full}"
run_all ""
echo
echo "== 1. loopback Gloo ($MODEL; DP traffic sent per rank per iteration: ${DP_MB} MB, 1 MB buckets)"
table
# A link whose transfers take as long as the peer's computation (its iteration time less the
# exposed loopback communication): over it, communication is ~50% of a non-overlapped iteration.
BW=$(calc "${DP_MB} * 1048576 / ((${MS[0]} - ${EXPOSED[0]}) / 1000) / 1000000000")
LINK=$(printf "10us,%.4fGBps" "$BW")
run_all "--set distributed.simulated_link=$LINK"
SHARE=$(calc "${FLIGHT[0]} / ${MS[0]}")
if [[ $(calc "($SHARE < 0.47 || $SHARE > 0.53) ? 1 : 0") == 1 ]]; then
  echo "(link $LINK: communication $(calc "int(100 * $SHARE)")% of a non-overlapped iteration; recalibrating)"
  BW=$(calc "$BW * ${FLIGHT[0]} / (${MS[0]} - ${FLIGHT[0]})")
  LINK=$(printf "10us,%.4fGBps" "$BW")
  run_all "--set distributed.simulated_link=$LINK"
fi
echo
echo "== 2. simulated link $LINK (the peer's communication: $(calc "int(100 * ${FLIGHT[0]} / ${MS[0]} + 0.5)")% of its iteration)"
table
