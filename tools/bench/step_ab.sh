#!/usr/bin/env bash
# Two dtk builds' training step on this machine in one run: "is the change no slower?"
# (docs/benchmarks.md). Build the other one first, e.g. main before the change:
#
#   git worktree add /tmp/dtk-before <commit> && (cd /tmp/dtk-before && tools/build.sh)
#   tools/bench/step_ab.sh /tmp/dtk-before/build/bin/dtk [build/bin/dtk] [--reps 5] [--threads N]
#
# Each shape (gpt-tiny and the 6-layer, 384-wide GPT of step_vs_pytorch.sh) runs in bench mode
# with A and B back to back, in turn first and second (ABBA...), REPS times; each run's figure is
# its median step after the warm-up. B/A is the median of the pairs' ratios (a shared VM drifts
# by 10-30% between minutes; a ratio within one pair is what that drift leaves alone); > 1: B is
# faster. Both binaries must train the same losses: the script compares their last lm loss.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
A=${1:?usage: tools/bench/step_ab.sh DTK_A [DTK_B] [--reps N] [--threads N]}
shift
B=build/bin/dtk
if (($#)) && [[ $1 != --* ]]; then B=$1; shift; fi
REPS=5
THREADS=$(nproc)
while (($#)); do
  case "$1" in
    --reps) REPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    *) echo "usage: tools/bench/step_ab.sh DTK_A [DTK_B] [--reps N] [--threads N]" >&2; exit 2 ;;
  esac
done
bench_start step_ab.sh
unset LD_PRELOAD  # dtk picks its allocator itself (tcmalloc by default)
for bin in "$A" "$B"; do [[ -x $bin ]] || { echo "step_ab.sh: $bin is not an executable" >&2; exit 2; }; done
echo "A: $A"
echo "B: $B"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
SHAPES=("gpt-tiny (2L, h 64, 4 heads, seq 64, batch 8)|2 64 4 64 8|30 5"
  "6L, h 384, 6 heads, seq 256, batch 8|6 384 6 256 8|6 2")

# step BIN TAG L H HEADS SEQ B STEPS WARMUP -> "tokens/s last-loss"
step() {
  local json=$tmp/$2.json
  "$1" train --config configs/gpt-tiny.pbtxt --dataset synthetic --threads "$THREADS" \
    --set model.num_layers=$3 --set model.hidden_size=$4 --set model.num_attention_heads=$5 \
    --set train.seq_length=$6 --set train.micro_batch_size=$7 --set train.global_batch_size=$7 \
    --set train.bench_steps=$8 --set train.perf_warmup_steps=$9 --set lr.lr_warmup_iters=0 \
    --set lr.lr_decay_style=constant --set logging.log_interval=1 --bench_out "$json" >"$tmp/$2.log" 2>&1 ||
    { echo "n/a n/a"; return; }
  local loss
  loss=$(grep -o 'lm loss: [0-9.E+-]*' "$tmp/$2.log" | tail -1 | awk '{print $3}')
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["tokens_per_iteration"] / (r["step_time_ms_median"] / 1e3), sys.argv[2])' "$json" "$loss"
}

printf '%-44s %10s %10s %7s  %s\n' "model" "A tok/s" "B tok/s" "B/A" "pairs (B/A)"
for i in "${!SHAPES[@]}"; do
  IFS='|' read -r name dims steps <<<"${SHAPES[$i]}"
  read -r L H NH S BATCH <<<"$dims"
  read -r STEPS WARM <<<"$steps"
  ra=() rb=() pairs=()
  for ((rep = 0; rep < REPS; rep++)); do
    if ((rep % 2 == 0)); then
      read -r a la <<<"$(step "$A" a$i$rep $L $H $NH $S $BATCH $STEPS $WARM)"
      read -r b lb <<<"$(step "$B" b$i$rep $L $H $NH $S $BATCH $STEPS $WARM)"
    else
      read -r b lb <<<"$(step "$B" b$i$rep $L $H $NH $S $BATCH $STEPS $WARM)"
      read -r a la <<<"$(step "$A" a$i$rep $L $H $NH $S $BATCH $STEPS $WARM)"
    fi
    [[ $a == n/a || $b == n/a ]] && { echo "step_ab.sh: a run failed (logs in $tmp)" >&2; trap - EXIT; exit 1; }
    [[ $la == "$lb" ]] || echo "step_ab.sh: $name: the last lm loss differs: A $la, B $lb" >&2
    ra+=("$a") rb+=("$b") pairs+=("$(calc "$b / $a")")
  done
  printf '%-44s %10.0f %10.0f %6.2fx  %s\n' "$name" "$(printf '%s\n' "${ra[@]}" | median)" \
    "$(printf '%s\n' "${rb[@]}" | median)" "$(printf '%s\n' "${pairs[@]}" | median)" "$(printf '%.2f ' "${pairs[@]}")"
done
