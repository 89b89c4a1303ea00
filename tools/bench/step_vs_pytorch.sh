#!/usr/bin/env bash
# The CPU training step, DTK next to its peer, eager PyTorch, in one run on this machine
# (docs/benchmarks.md "Training step vs eager PyTorch"):
#
#   * one full step (forward, backward, clipping, AdamW) of the same GPT, the same batch shape,
#     dropout 0.1 in both, the same threads and the same allocator (tcmalloc, which dtk runs on by
#     default and which is preloaded for the peer): `dtk train` in bench mode against
#     tools/bench/gpt_peer.py, for gpt-tiny and a 6-layer/384-hidden model with GPT-2's vocabulary;
#   * DTK's MFU against the best 2048^3 matmul measured in the same process;
#   * peak resident memory of each;
#   * the allocator's effect: dtk on glibc malloc (DTK_ALLOCATOR=system) next to tcmalloc.
#
#   tools/bench/step_vs_pytorch.sh [--reps 3] [--threads N] [--quick]
#
# Each row is the median over REPS runs, interleaved (dtk and the peer back to back, in turn first
# and second so a drifting machine favours neither, then dtk on glibc, next shape, ...), each run
# the median step time after its warm-up steps; tokens/s = batch x seq / that time. The dtk/peer
# column is the median of the REPS back-to-back pairs' ratios, each pair printed below the table:
# a shared VM's speed wanders by 10-30% between minutes, and a ratio taken within one pair is
# what that drift leaves alone. The peer needs Debian's
# python3-torch (`apt-get install python3-torch`; /usr/bin/python3 is used); without it its
# columns say "n/a".
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
REPS=3
THREADS=$(nproc)
QUICK=0
while (($#)); do
  case "$1" in
    --reps) REPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --quick) QUICK=1; REPS=1; shift ;;
    *) echo "usage: tools/bench/step_vs_pytorch.sh [--reps N] [--threads N] [--quick]" >&2; exit 2 ;;
  esac
done
bench_start step_vs_pytorch.sh
# dtk picks its allocator itself (DTK_ALLOCATOR); the peer gets the same tcmalloc preloaded.
PEER_PRELOAD=${LD_PRELOAD:-}
unset LD_PRELOAD
PY=/usr/bin/python3
PEER=1
$PY -c "import torch" 2>/dev/null || { PEER=0; echo "peer: /usr/bin/python3 has no torch (apt-get install python3-torch): skipped"; }
[[ $PEER == 1 ]] && echo "peer: eager PyTorch $($PY -c 'import torch; print(torch.__version__)'), $THREADS threads"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# name | layers hidden heads seq batch | measured steps, warm-up steps
SHAPES=("gpt-tiny (2L, h 64, 4 heads, seq 64, batch 8)|2 64 4 64 8|30 5"
  "6L, h 384, 6 heads, seq 256, batch 8|6 384 6 256 8|6 2")
((QUICK)) && SHAPES=("gpt-tiny (2L, h 64, 4 heads, seq 64, batch 8)|2 64 4 64 8|10 3"
  "6L, h 384, 6 heads, seq 256, batch 8|6 384 6 256 8|3 1")

# dtk_step NAME ALLOCATOR L H HEADS SEQ B STEPS WARMUP -> "tokens/s mfu rss_mb"
dtk_step() {
  local json=$tmp/$1.json
  DTK_ALLOCATOR=$2 $DTK train --config configs/gpt-tiny.pbtxt --dataset synthetic --threads "$THREADS" \
    --set model.num_layers=$3 --set model.hidden_size=$4 --set model.num_attention_heads=$5 \
    --set train.seq_length=$6 --set train.micro_batch_size=$7 --set train.global_batch_size=$7 \
    --set train.bench_steps=$8 --set train.perf_warmup_steps=$9 --set lr.lr_warmup_iters=0 \
    --set lr.lr_decay_style=constant --bench_out "$json" >"$tmp/$1.log" 2>&1 || { echo "n/a n/a n/a"; return; }
  $PY - "$json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["tokens_per_iteration"] / (r["step_time_ms_median"] / 1e3), 100 * r["mfu"], r["peak_rss_bytes"] / 2**20)
EOF
}

declare -A DTK_RATE DTK_MFU DTK_RSS PEER_RATE PEER_RSS GLIBC_RATE PAIR
for ((rep = 0; rep < REPS; rep++)); do
  for i in "${!SHAPES[@]}"; do
    IFS='|' read -r name dims steps <<<"${SHAPES[$i]}"
    read -r L H NH S B <<<"$dims"
    read -r STEPS WARM <<<"$steps"
    run_dtk() {
      read -r rate mfu rss <<<"$(dtk_step "s$i-r$rep" tcmalloc $L $H $NH $S $B $STEPS $WARM)"
      DTK_RATE[$i]="${DTK_RATE[$i]:-} $rate" DTK_MFU[$i]="${DTK_MFU[$i]:-} $mfu" DTK_RSS[$i]="${DTK_RSS[$i]:-} $rss"
    }
    run_peer() {
      [[ $PEER == 1 ]] || return 0
      out=$(LD_PRELOAD=$PEER_PRELOAD $PY tools/bench/gpt_peer.py --layers $L --hidden $H --heads $NH --seq $S --batch $B --steps $STEPS \
        --warmup $WARM --threads "$THREADS")
      peer_rate=$(echo "$out" | grep -o '"tokens_per_second": [0-9.]*' | grep -o '[0-9.]*$')
      PEER_RATE[$i]="${PEER_RATE[$i]:-} $peer_rate"
      PEER_RSS[$i]="${PEER_RSS[$i]:-} $(echo "$out" | grep -o '"peak_rss_mb": [0-9.]*' | grep -o '[0-9.]*$')"
    }
    if ((rep % 2 == 0)); then run_dtk; run_peer; else run_peer; run_dtk; fi
    if [[ $PEER == 1 && $rate != n/a && -n $peer_rate ]]; then PAIR[$i]="${PAIR[$i]:-} $(calc "$rate / $peer_rate")"; fi
    read -r rate _ _ <<<"$(dtk_step "g$i-r$rep" system $L $H $NH $S $B $STEPS $WARM)"
    GLIBC_RATE[$i]="${GLIBC_RATE[$i]:-} $rate"
  done
done

med() { echo "$1" | tr ' ' '\n' | grep -v '^$' | median; }
echo
echo "== full training step (forward, backward, clip, AdamW), fp32, dropout 0.1, $THREADS threads;"
echo "   median of $REPS interleaved runs; dtk/peer: the median of the back-to-back pairs' ratios"
printf '%-44s %10s %10s %7s %7s %9s %9s %12s\n' "model" "dtk tok/s" "peer tok/s" "dtk/peer" "dtk MFU" "dtk RSS" "peer RSS" "dtk on glibc"
for i in "${!SHAPES[@]}"; do
  IFS='|' read -r name _ _ <<<"${SHAPES[$i]}"
  d=$(med "${DTK_RATE[$i]}") m=$(med "${DTK_MFU[$i]}") r=$(med "${DTK_RSS[$i]}") g=$(med "${GLIBC_RATE[$i]}")
  if [[ $PEER == 1 ]]; then
    p=$(med "${PEER_RATE[$i]}") pr=$(med "${PEER_RSS[$i]}")
    ratio=$(med "${PAIR[$i]:-}")
    [[ -n $ratio ]] || ratio=n/a
  else
    p=n/a pr=n/a ratio=n/a
  fi
  printf '%-44s %10.0f %10s %7s %6.1f%% %7.0f MB %6s MB %8.0f (%sx)\n' "$name" "$d" \
    "$([[ $p == n/a ]] && echo n/a || printf '%.0f' "$p")" "$([[ $ratio == n/a ]] && echo n/a || printf '%.2fx' "$ratio")" \
    "$m" "$r" "$([[ $pr == n/a ]] && echo n/a || printf '%.0f' "$pr")" "$g" "$(printf '%.2f' "$(calc "$d / $g")")"
done
for i in "${!SHAPES[@]}"; do
  IFS='|' read -r name _ _ <<<"${SHAPES[$i]}"
  printf 'runs, %s (tokens/s): dtk%s | peer%s | dtk on glibc%s\n' "${name%% (*}" \
    "$(printf ' %.0f' ${DTK_RATE[$i]})" "$([[ $PEER == 1 ]] && printf ' %.0f' ${PEER_RATE[$i]} || echo ' n/a')" \
    "$(printf ' %.0f' ${GLIBC_RATE[$i]})"
  if [[ -n ${PAIR[$i]:-} ]]; then printf '  dtk/peer of each back-to-back pair:%s\n' "$(printf ' %.2fx' ${PAIR[$i]})"; fi
done
