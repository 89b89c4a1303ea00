#!/usr/bin/env bash
# Activation memory per rank against the paper's formulas (Korthikanti et al. 2022, "Reducing
# Activation Recomputation in Large Transformer Models"; docs/benchmarks.md), gpt:
#   for TP 1, 2, 4 x sequence parallelism off/on x recompute none, selective (core attention),
#   selective+mlp (recompute_modules=core_attn,mlp), full,
#   measured: the memory report's "activations per micro-batch" (what one micro-batch's forward
#             left allocated, the allocator's count) of a 4-layer model minus that of a 2-layer
#             model, over 2: one layer's stored activations, without the embedding and the output
#             layer;
#   paper:    s b h (10 + 24/t + 5as/(ht)) bytes per layer in 16-bit (x2 in fp32, what this CPU run
#             uses), s b h/t (34 + 5as/h) with sequence parallelism, without the 5as/h term under
#             selective recompute, 16 s b h / t less with the MLP recomputed too (dense_h_to_4h's
#             and GELU's outputs), 2 s b h (/ t with sequence parallelism) under full recompute.
#
#   and under context parallelism (CP 2, each exchange) against DTK's estimate (below).
#
#   [S=128] tools/bench/activation_memory.sh [--model gpt|llama] [--only tp|cp]
# Needs a build (tools/build.sh); runs up to 4 processes (TP 4) over loopback.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/bench/common.sh
MODEL=gpt ONLY=""
while (($#)); do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --only) ONLY=$2; [[ $ONLY == tp || $ONLY == cp ]] || { echo "--only takes tp or cp" >&2; exit 2; }; shift 2 ;;
    *) echo "usage: tools/bench/activation_memory.sh [--model gpt|llama] [--only tp|cp]" >&2; exit 2 ;;
  esac
done
bench_start activation_memory.sh
S=${S:-128} B=4 H=256 A=8
echo "model $MODEL, s $S, b $B, h $H, a $A, fp32, no dropout; MB per layer per micro-batch"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
measure() {  # tp sp recompute layers [cp exchange] -> MB
  local launch="" cp=${5:-1} comm=${6:-a2a}
  (($1 * cp > 1)) && launch="launch --nproc_per_node $(($1 * cp))"
  $DTK $launch train --config configs/$MODEL-tiny.pbtxt --dataset synthetic --threads 1 \
    --set model.num_layers=$4 --set model.hidden_size=$H --set model.num_attention_heads=$A \
    --set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=$S \
    --set train.micro_batch_size=$B --set train.global_batch_size=$B --set train.train_iters=1 --set lr.lr_warmup_iters=0 \
    --set model.hidden_dropout=0 --set model.attention_dropout=0 --set logging.log_interval=1 \
    --set eval.eval_interval=0 --set model.recompute_activations=${3%+mlp} \
    $([[ $3 == *+mlp ]] && echo "--set model.recompute_modules=core_attn,mlp") \
    --set distributed.tensor_model_parallel_size=$1 --set distributed.sequence_parallel=$2 \
    --set distributed.context_parallel_size=$cp --set distributed.cp_comm_type=$comm \
    $([[ $MODEL == llama ]] && echo "--set model.num_query_groups=$A --set model.ffn_hidden_size=$((4 * H))") \
    >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; exit 1; }
  grep -o 'activations per micro-batch: [0-9.]*' "$TMP/out" | head -1 | awk '{print $4}'
}
tp_table() {
echo
echo "| TP | sequence parallel | recompute | measured | paper (fp32) | measured / paper |"
echo "|---|---|---|---|---|---|"
for tp in 1 2 4; do
  for sp in false true; do
    [[ $tp == 1 && $sp == true ]] && continue
    for rc in none selective selective+mlp full; do
      four=$(measure $tp $sp $rc 4)
      two=$(measure $tp $sp $rc 2)
      measured=$(calc "($four - $two) / 2")
      t=$tp
      split=$([[ $sp == true ]] && echo 1 || echo 0)
      sbh=$(calc "$S * $B * $H")
      case $rc in
        none) per=$(calc "$split ? $sbh / $t * (34 + 5 * $A * $S / $H) : $sbh * (10 + 24 / $t + 5 * $A * $S / ($H * $t))") ;;
        selective) per=$(calc "$split ? 34 * $sbh / $t : $sbh * (10 + 24 / $t)") ;;
        selective+mlp) per=$(calc "$split ? 18 * $sbh / $t : $sbh * (10 + 8 / $t)") ;;
        full) per=$(calc "$split ? 2 * $sbh / $t : 2 * $sbh") ;;
      esac
      paper=$(calc "$per * 2 / 1048576")  # 16-bit bytes -> fp32 MB
      printf "| %s | %s | %s | %.2f | %.2f | %.2f |\n" "$tp" "$sp" "$rc" "$measured" "$paper" "$(calc "$measured / $paper")"
    done
  done
done
}
# Context parallelism, TP 1: the estimate before the first step (dtk/core/memory/memory_estimate.hpp)
# per rank, 1 / cp of one process's layer: a2a keeps whole sequences of 1 / cp of the heads (the
# scores 5 a s / h of them); all_gather its queries' two chunks over the keys up to each chunk's
# end, (2 cp + 1) / (4 cp) of a2a's scores, and those keys and values, 2 (2 cp + 1) s b h / cp
# in 16-bit (grouped-query attention's per-chunk copies) less the share's own 4 s b h / cp counted
# in the 34 (none of either under selective recompute).
cp_table() {
echo
echo "| CP | exchange | recompute | measured | estimate (fp32) | measured / estimate |"
echo "|---|---|---|---|---|---|"
local cp=2
for comm in a2a all_gather; do
  for rc in none selective; do
    four=$(measure 1 false $rc 4 $cp $comm)
    two=$(measure 1 false $rc 2 $cp $comm)
    measured=$(calc "($four - $two) / 2")
    sbh=$(calc "$S / $cp * $B * $H")
    [[ $rc == none ]] && scores=$(calc "5 * $A * $S / $H") || scores=0
    gathered=0
    if [[ $comm == all_gather ]]; then
      scores=$(calc "$scores * (2 * $cp + 1) / (4 * $cp)")
      [[ $rc == none ]] && gathered=$(calc "2 * (2 * $cp - 1)")
    fi
    estimate=$(calc "$sbh * (34 + $scores + $gathered) * 2 / 1048576")
    printf "| %s | %s | %s | %.2f | %.2f | %.2f |\n" "$cp" "$comm" "$rc" "$measured" "$estimate" \
      "$(calc "$measured / $estimate")"
  done
done
}
[[ $ONLY == cp ]] || tp_table
[[ $ONLY == tp ]] || cp_table
