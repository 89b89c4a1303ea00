#!/usr/bin/env bash
# ON THE GPU MACHINE (issue 14's benchmark, docs/benchmarks.md "GPU"): GPT-2 small (124M,
# configs/gpt2-small.pbtxt), seq 1024, bf16, no dropout, one GPU: `dtk train` in bench mode at the
# largest micro-batch that fits (tried from --batches, largest first), next to its peer in the same
# call, a nanoGPT-style PyTorch model of the same shape (tools/bench/gpu_peer.py), eager and with
# torch.compile, at the same micro-batch. Prints tokens/s, TFLOP/s and MFU against --peak_tflops
# (989: H100 SXM dense bf16), FLOPs counted the same way for both.
#
# --model llama: the Llama row instead (issue 33): a Llama of about GPT-2 small's size, 12 layers,
# hidden 768, 12 heads, 4 key/value groups, SwiGLU 2048, vocabulary 32000, rotary, RMSNorm,
# untied output (configs/llama-tiny.pbtxt with the overrides below, synthetic tokens), next to
# gpu_peer.py --arch llama, eager and compiled.
#
# --profile DIR: afterwards, two more steps of each profiled: dtk's logging.profile_steps table
# (top ops and kernels) and the compiled peer's torch.profiler table, side by side in the output,
# the Chrome traces in DIR (dtk/rank0.json, peer.json).
#
#   tools/bench/gpu_gpt2.sh [--model gpt|llama] [--dtk build-gpu/bin/dtk] [--batches "32 16 8"] [--steps 30]
#                           [--peak_tflops 989] [--profile DIR] [--variant "LABEL|--set k=v ..."]...
#
# --variant: after the main row, dtk again at the same micro-batch with extra settings (e.g.
# "ops cross entropy|--set model.cross_entropy_impl=ops"): one change's effect, in the same call.
set -euo pipefail
cd "$(dirname "$0")/../.."
DTK=build-gpu/bin/dtk
BATCHES="32 24 16 8"
STEPS=30
PEAK=989
PROFILE=""
MODEL=gpt
VARIANTS=()
while (($#)); do
  case "$1" in
    --variant) VARIANTS+=("$2"); shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --profile) PROFILE=$2; shift 2 ;;
    --dtk) DTK=$2; shift 2 ;;
    --batches) BATCHES=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --peak_tflops) PEAK=$2; shift 2 ;;
    *) echo "usage: tools/bench/gpu_gpt2.sh [--model gpt|llama] [--dtk BIN] [--batches \"32 16 8\"] [--steps N] [--peak_tflops T] [--profile DIR] [--variant \"LABEL|ARGS\"]..." >&2; exit 2 ;;
  esac
done
case $MODEL in
  gpt)
    RUN=(--config configs/gpt2-small.pbtxt)
    PEER_ARCH=(--arch gpt)
    WHAT="GPT-2 124M" ;;
  llama)
    RUN=(--config configs/llama-tiny.pbtxt --dataset synthetic --set dataset.vocab_size=32000
      --set model.vocab_size=32000 --set model.num_layers=12 --set model.hidden_size=768
      --set model.num_attention_heads=12 --set model.num_query_groups=4 --set model.ffn_hidden_size=2048
      --set train.seq_length=1024 --set eval.eval_iters=0)
    PEER_ARCH=(--arch llama)
    WHAT="Llama 12x768 (GQA 12/4, SwiGLU 2048, vocab 32000)" ;;
  *) echo "gpu_gpt2.sh: --model is gpt or llama, not '$MODEL'" >&2; exit 2 ;;
esac
[[ -x $DTK ]] || { echo "gpu_gpt2.sh: no dtk at $DTK (build it: tools/gpu_check.sh)" >&2; exit 2; }
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo unknown)
echo "gpu_gpt2.sh: $GPU; $WHAT, seq 1024, bf16, no dropout; $STEPS timed steps after 10"
# dtk on the GPU in bf16 without dropout at micro-batch $1 (the global batch too), then $2.. .
dtk_run() {
  local b=$1
  shift
  "$DTK" train "${RUN[@]}" --set train.device=cuda --set train.params_dtype=bf16 \
    --set model.hidden_dropout=0 --set model.attention_dropout=0 \
    --set train.micro_batch_size="$b" --set train.global_batch_size="$b" --set train.skip_memory_check=true "$@"
}
# Bench mode at micro-batch $1 into the JSON $2, with further settings $3.. .
dtk_bench() {
  local b=$1 json=$2
  shift 2
  dtk_run "$b" --set train.bench_steps="$STEPS" --set train.perf_warmup_steps=10 --set logging.peak_tflops="$PEAK" \
    "$@" --bench_out "$json"
}
# One row from a bench JSON ($1) under the label $2.
dtk_row() {
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"  {sys.argv[2]}: {r['tokens_per_second']:>9.0f} tokens/s {r['tflops_per_device']:>6.1f} TFLOP/s  "
      f"MFU {100 * r['mfu']:5.1f}%  peak {r['tensor_max_allocated_bytes'] / 2**30:5.1f} GiB (step {r['step_time_ms_median']:.1f} ms)")
PY
}
BATCH=""
for b in $BATCHES; do
  if dtk_bench "$b" "$OUT/dtk.json" >"$OUT/dtk-$b.log" 2>&1; then
    BATCH=$b
    break
  fi
  echo "  micro-batch $b: $(grep -m1 -iE 'error|out of memory' "$OUT/dtk-$b.log" | cut -c1-160)"
done
[[ -n $BATCH ]] || { echo "gpu_gpt2.sh: dtk ran at no micro-batch of '$BATCHES'" >&2; tail -5 "$OUT"/dtk-*.log >&2; exit 1; }
dtk_row "$OUT/dtk.json" "$(printf 'dtk            micro-batch %3s' "$BATCH")"
# Each --variant: dtk again with extra settings at the same micro-batch (a change's effect, same call).
for v in "${VARIANTS[@]}"; do
  label=${v%%|*}
  read -r -a extra <<<"${v#*|}"
  if dtk_bench "$BATCH" "$OUT/variant.json" "${extra[@]}" >"$OUT/variant.log" 2>&1; then
    dtk_row "$OUT/variant.json" "$(printf 'dtk, %-24s' "$label")"
    # A setting that fell back says so (e.g. train.cuda_graphs when the step could not be recorded).
    grep -m1 "dtk: warning:" "$OUT/variant.log" | cut -c1-240 | sed 's/^/    /' || true
  else
    echo "  dtk, $label: failed: $(grep -m1 -iE 'error' "$OUT/variant.log" | cut -c1-200)"
  fi
done
PEERS_OK=1
for mode in "" --compile; do
  if python3 tools/bench/gpu_peer.py "${PEER_ARCH[@]}" --batch "$BATCH" --steps "$STEPS" --warmup 10 --peak_tflops "$PEAK" $mode \
      >"$OUT/peer.json" 2>"$OUT/peer.log"; then
    python3 - "$OUT/peer.json" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
peak = f"  peak {r['peak_memory_gib']:5.1f} GiB" if r.get('peak_memory_gib') is not None else ""
print(f"  {r['peer']:<28}: {r['tokens_per_second']:>9.0f} tokens/s {r['tflops']:>6.1f} TFLOP/s  MFU {100 * r['mfu']:5.1f}%{peak} "
      f"(step {r['step_ms']:.1f} ms)")
PY
  else
    echo "  peer ${mode:-eager}: failed: $(tail -1 "$OUT/peer.log" | cut -c1-160)"
    PEERS_OK=0
  fi
done
((PEERS_OK)) || { echo "gpu_gpt2.sh: a peer failed (above): no comparison" >&2; exit 1; }
if [[ -n $PROFILE ]]; then
  mkdir -p "$PROFILE"
  echo "== dtk, micro-batch $BATCH: logging.profile_steps (iterations 12-13)"
  dtk_run "$BATCH" --set train.train_iters=13 --set eval.eval_interval=0 --set eval.eval_iters=0 \
    --set logging.profile_steps=12-13 --set logging.profile_dir="$PROFILE/dtk" 2>&1 |
    sed -n '/ profile of iterations/,/^ \[/p' | grep -v '^ \[' || echo "  dtk profile failed"
  echo "== the compiled peer, micro-batch $BATCH: torch.profiler"
  python3 tools/bench/gpu_peer.py "${PEER_ARCH[@]}" --batch "$BATCH" --steps 2 --warmup 10 --peak_tflops "$PEAK" --compile \
    --profile "$PROFILE" 2>&1 >/dev/null | grep -v "^W[0-9]" | head -60 || echo "  peer profile failed"
fi
