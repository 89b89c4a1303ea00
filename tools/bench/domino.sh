#!/usr/bin/env bash
# Domino benchmark (docs/domino.md, docs/benchmarks.md): plain tensor parallelism (the peer) vs
# Domino with 2 and 4 chunks at TP=2 on this machine, in one run, printed side by side:
# iteration time, tokens/s, and per iteration the tensor-parallel communication in flight and the
# part of it the training thread waited for (exposed).
#
#  1. over loopback Gloo as it is;
#  2. with distributed.simulated_link: latency 10us and a bandwidth chosen from run 1 so that the
#     link's transfers take as long as plain TP's computation (communication ~50% of a plain-TP
#     iteration over the link), to study overlap when communication is slow.
#
#   tools/bench/domino.sh [--quick]
# Needs a build (tools/build.sh). Uses tcmalloc when Debian's libtcmalloc-minimal4 is installed.
# One thread per rank (2 ranks): communication competes with compute for this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
QUICK=0
while (($#)); do
  case "$1" in
    --quick) QUICK=1; shift ;;
    *) echo "usage: tools/bench/domino.sh [--quick]" >&2; exit 2 ;;
  esac
done
bench_start domino.sh

# Windows of 4 iterations; the first (start-up) is left out, the median of the rest is reported;
# each configuration runs REPS times interleaved with the others and the median run is shown.
ITERS=$((QUICK ? 12 : 20))
REPS=$((QUICK ? 1 : 3))
TRAIN="train --config configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=4
  --set model.hidden_size=256 --set model.num_attention_heads=8 --set model.vocab_size=512
  --set dataset.vocab_size=512 --set train.seq_length=128 --set train.micro_batch_size=8
  --set train.global_batch_size=8 --set train.train_iters=$ITERS --set logging.log_interval=4
  --set eval.eval_iters=0 --set eval.eval_interval=0 --set lr.lr_warmup_iters=1
  --set distributed.tensor_model_parallel_size=2"
NAMES=("plain TP (the peer)" "Domino, 2 chunks" "Domino, 4 chunks")
ARGS=("--set model.domino_chunks=1" "--set model.domino_chunks=2" "--set model.domino_chunks=4")
field() { echo "$1" | grep -o "$2 [0-9.]*" | grep -o "[0-9.]*$" | tail -n +2 | median; }

# Runs every configuration REPS times with extra args $1; fills MS, TOK, FLIGHT, EXPOSED (medians).
declare -A MS TOK FLIGHT EXPOSED
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
      [[ -z ${TP_MB:-} ]] && TP_MB=$(echo "$out" | grep -o "tensor-parallel traffic .* total: [0-9.]*" | grep -o "[0-9.]*$")
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
  printf "%-22s %12s %10s %9s %16s %13s %9s\n" "" "ms/iteration" "tokens/s" "speed-up" "TP comm in flight" "exposed (ms)" "exposed"
  for i in "${!NAMES[@]}"; do
    printf "%-22s %12.1f %10.0f %8.2fx %14.1f ms %13.1f %8.0f%%\n" "${NAMES[$i]}" "${MS[$i]}" "${TOK[$i]}" \
      "$(calc "${MS[0]} / ${MS[$i]}")" "${FLIGHT[$i]}" "${EXPOSED[$i]}" "$(calc "100 * ${EXPOSED[$i]} / ${FLIGHT[$i]}")"
  done
}

MODEL="4 layers, hidden 256, 8 heads, seq 128, micro-batch 8, TP=2, 1 thread per rank"
run_all ""
echo
echo "== 1. loopback Gloo ($MODEL; TP traffic sent per rank per iteration: ${TP_MB} MB)"
table
# A link whose transfers take as long as plain TP's computation (its iteration time less the
# exposed loopback communication): over it, communication is ~50% of a plain-TP iteration.
BW=$(calc "${TP_MB} * 1048576 / ((${MS[0]} - ${EXPOSED[0]}) / 1000) / 1000000000")
LINK=$(printf "10us,%.3fGBps" "$BW")
run_all "--set distributed.simulated_link=$LINK"
# Per-collective costs beyond the link's bytes (latency, Gloo's own transfer) move the share away
# from 50%: scale the bandwidth once so that plain TP's communication is half its iteration.
SHARE=$(calc "${FLIGHT[0]} / ${MS[0]}")
if [[ $(calc "($SHARE < 0.47 || $SHARE > 0.53) ? 1 : 0") == 1 ]]; then
  echo "(link $LINK: communication $(calc "int(100 * $SHARE)")% of a plain-TP iteration; recalibrating)"
  BW=$(calc "$BW * ${FLIGHT[0]} / (${MS[0]} - ${FLIGHT[0]})")
  LINK=$(printf "10us,%.3fGBps" "$BW")
  run_all "--set distributed.simulated_link=$LINK"
fi
echo
echo "== 2. simulated link $LINK (plain TP's communication: $(calc "int(100 * ${FLIGHT[0]} / ${MS[0]} + 0.5)")% of its iteration)"
table
