#!/usr/bin/env bash
# Pipeline-parallel benchmark (docs/benchmarks.md, issue 17): the bubble of the 1F1B schedule and
# of the interleaved one with v = 2 model chunks per rank, measured against the theory
# (p - 1) / v / (m + (p - 1) / v), for p = 2 (and 4 with --pp4) stages and m = 4, 8, 16
# micro-batches per iteration, next to the same model on one process (the peer: no bubble).
#
# Measured: the time stage 0 (rank 0) waited for activations and gradients per iteration (the
# log's "pipeline wait (ms)"), as a fraction of the iteration. 1F1B's stage 0 idles exactly the
# bubble when every stage computes equally fast and transfers are free; loopback transfers add
# a little (the interleaved schedule sends v times as many messages), and sharing this machine's
# cores between stages adds more.
#
#   tools/bench/pipeline.sh [--quick] [--pp4]
# Needs a build (tools/build.sh). One thread per rank. --pp4 runs 4 stages too: with fewer cores
# than stages the stages take turns on the cores, so its "bubble" is mostly that, not the schedule.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
QUICK=0
STAGES=(2)
while (($#)); do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --pp4) STAGES=(2 4); shift ;;
    *) echo "usage: tools/bench/pipeline.sh [--quick] [--pp4]" >&2; exit 2 ;;
  esac
done
bench_start pipeline.sh

ITERS=$((QUICK ? 6 : 12))
# 8 layers of width 256 on 128 tokens: enough compute per micro-batch that the transfers of its
# [1, 128, 256] activations are small beside it.
model() {
  echo "train --config configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.num_layers=8
    --set model.hidden_size=256 --set model.num_attention_heads=8 --set model.vocab_size=512
    --set dataset.vocab_size=512 --set train.seq_length=128 --set train.micro_batch_size=1
    --set train.global_batch_size=$1 --set train.train_iters=$ITERS --set logging.log_interval=2
    --set eval.eval_iters=0 --set eval.eval_interval=0 --set lr.lr_warmup_iters=1"
}
pct() { awk "BEGIN { printf \"%.1f%%\", 100 * ($1) }"; }
# The median over the log windows after the first (start-up).
field() { echo "$1" | grep -o "$2 [0-9.]*" | grep -o "[0-9.]*$" | tail -n +2 | median; }

printf "%-8s %-8s %-4s %-16s %-14s %-18s %-16s %s\n" "stages" "chunks" "m" "iteration (ms)" "one process" \
  "stage 0 waits (ms)" "measured bubble" "theory"
for p in "${STAGES[@]}"; do
  for m in 4 8 16; do
    one=$($DTK $(model $m) 2>&1) || { echo "one process, m=$m: failed"; echo "$one" | tail -3; exit 1; }
    for v in 1 2; do
      out=$($DTK launch --nproc_per_node $p $(model $m) --set distributed.pipeline_model_parallel_size=$p \
        --set distributed.virtual_pipeline_model_parallel_size=$v 2>&1) ||
        { echo "PP=$p, v=$v, m=$m: failed"; echo "$out" | tail -3; exit 1; }
      ms=$(field "$out" "elapsed time per iteration (ms):")
      wait_ms=$(field "$out" "pipeline wait (ms):")
      printf "%-8s %-8s %-4s %-16s %-14s %-18s %-16s %s\n" "$p" "$v" "$m" "$ms" \
        "$(field "$one" "elapsed time per iteration (ms):")" "$wait_ms" "$(pct "$wait_ms / $ms")" \
        "$(pct "($p - 1) / $v / ($m + ($p - 1) / $v)")"
    done
  done
done
