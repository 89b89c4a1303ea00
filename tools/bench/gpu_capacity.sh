#!/usr/bin/env bash
# ON THE GPU MACHINE (issue 38's GPU rows; tools/gpu_check.sh --capacity runs it after the build):
# the largest GPT that trains on one GPU with ddp and with ZeRO stage 3 + CPU offload of the
# optimizer and the parameters (built partitioned: strategy.zero_init), and the tokens/s of each.
#
# The GPU is made smaller by train.memory_limit_mb (LibTorch's caching allocator capped at
# --budget_mb): the lent machine has less host memory (128 GiB) than its GPU (141 GB), so without
# a budget offload could hold no more than ddp, while DeepSpeed's claim ("10x the model on the
# same GPU") is about a GPU smaller than the host. Every row: seq 1024, micro-batch 1, bf16,
# vocabulary 50304, full recomputation (both strategies, so activations bound neither), synthetic
# tokens, cpu_adam for the offloaded rows. Sizes are GPT-3's (Brown et al., table 2.1), tried from
# small to large until one fails; a size whose offloaded state (18 bytes a parameter: fp32 master,
# Adam's two moments, the fp32 gradient partition, the bf16 host copy) would not fit 85% of the
# host's available memory is not tried. Then, at ddp's largest size: stage 3 + CPU offload, and
# the optimizer state on disk (offload_optimizer=nvme in --nvme_dir) with dd's rate of that disk.
#
#   tools/bench/gpu_capacity.sh [--dtk build-gpu/bin/dtk] [--budget_mb 4096] [--steps 4] [--max_seconds 330]
#                               [--log_dir DIR] [--nvme_dir DIR] [--device cuda] [--sizes "L:H:A ..."]
#                               [--seq 1024] [--vocab 50304]
# --max_seconds: every run ends by then (a device call may run 600 s); a ladder cut short says so
# and its largest is then a lower bound, a row not run says so. Each ladder says why it stopped.
# --log_dir: where the log of each run that failed is kept. Exit status 1 when a run failed (not
# for the budget's refusal, which is what the ladders look for, nor for the time).
# --device cpu --budget_mb 256 --sizes "2:64:4 2:128:4 4:256:8" --seq 64 --vocab 512: the same
# script on a CPU (the budget is then DTK's own device accounting), to check it in a minute.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS=0
DTK=build-gpu/bin/dtk
LOG_DIR=""
BUDGET=4096
STEPS=4
DEVICE=cuda
SEQ=1024
VOCAB=50304
NVME_DIR=""
MAX_SECONDS=330
# layers:hidden:heads, GPT-3's 125M, 350M, 760M, 1.3B, 2.7B, 6.7B and 13B.
SIZES="12:768:12 24:1024:16 24:1536:16 24:2048:16 32:2560:32 32:4096:32 40:5120:40"
while (($#)); do
  case "$1" in
    --dtk) DTK=$2; shift 2 ;;
    --budget_mb) BUDGET=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --sizes) SIZES=$2; shift 2 ;;
    --seq) SEQ=$2; shift 2 ;;
    --vocab) VOCAB=$2; shift 2 ;;
    --nvme_dir) NVME_DIR=$2; shift 2 ;;
    --max_seconds) MAX_SECONDS=$2; shift 2 ;;
    --log_dir) LOG_DIR=$2; shift 2 ;;
    *) echo "usage: tools/bench/gpu_capacity.sh [--dtk BIN] [--budget_mb MB] [--steps N] [--max_seconds S] [--log_dir DIR] [--nvme_dir DIR] [--device D] [--sizes \"L:H:A ...\"] [--seq S] [--vocab V]" >&2; exit 2 ;;
  esac
done
[[ -x $DTK ]] || { echo "gpu_capacity.sh: no dtk at $DTK (build it: tools/gpu_check.sh)" >&2; exit 2; }
[[ $MAX_SECONDS =~ ^-?[0-9]+$ ]] || { echo "gpu_capacity.sh: --max_seconds takes whole seconds, not '$MAX_SECONDS'" >&2; exit 2; }
((STEPS >= 2)) || { echo "gpu_capacity.sh: --steps must be at least 2 (the first is left out)" >&2; exit 2; }
WORK=$(mktemp -d)
[[ -n $NVME_DIR ]] || NVME_DIR=$WORK/nvme
mkdir -p "$NVME_DIR"
trap 'rm -rf "$WORK" "$NVME_DIR"/dtk-* "$NVME_DIR/dd.bin"' EXIT
HOST_AVAILABLE_MB=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
echo "gpu_capacity.sh: ${GPU:-no GPU} ($DEVICE), device budget $BUDGET MiB (train.memory_limit_mb), host memory available" \
  "$HOST_AVAILABLE_MB MiB; GPT, seq $SEQ, micro-batch 1, bf16, vocab $VOCAB, full recomputation; $STEPS steps, the first left out"

RUN="train --config configs/gpt-tiny.pbtxt --dataset synthetic --set train.device=$DEVICE --set train.params_dtype=bf16
  --set model.vocab_size=$VOCAB --set dataset.vocab_size=$VOCAB --set train.seq_length=$SEQ
  --set model.hidden_dropout=0 --set model.attention_dropout=0 --set model.recompute_activations=full
  --set train.micro_batch_size=1 --set train.global_batch_size=1 --set train.train_iters=$STEPS
  --set logging.log_interval=1 --set eval.eval_iters=0 --set eval.eval_interval=0 --set lr.lr_warmup_iters=0
  --set train.skip_memory_check=true"
DDP="--strategy ddp"
# Gradient and gather buckets of 2M elements, at most 8M parameters gathered at once (a 2.7B
# layer's MLP weight is 26M: one module at a time then).
OFFLOAD="--strategy zero --set strategy.stage=3 --set strategy.offload_optimizer=cpu --set strategy.offload_param=cpu
  --optimizer cpu_adam --set strategy.reduce_bucket_size=2000000 --set strategy.allgather_bucket_size=2000000
  --set strategy.stage3_max_live_parameters=8000000 --set strategy.stage3_prefetch_bucket_size=2000000"
NVME=${OFFLOAD/offload_optimizer=cpu/offload_optimizer=nvme --set strategy.nvme_path=$NVME_DIR}

parameters() {  # L:H:A -> the GPT's parameters (12 L H^2 + 13 L H, embeddings, final norm)
  local l h
  IFS=: read -r l h _ <<<"$1"
  echo $((12 * l * h * h + 13 * l * h + (VOCAB + SEQ) * h + 2 * h))
}
# One training run at size $1 with the strategy's arguments $2 (one string), bounded by what is
# left of --max_seconds and by 300 s; the log in $WORK/run.log. Then KIND says how it ended: ok,
# budget (out of device memory), time (cut short by --max_seconds, or not started with under 10 s
# left), killed (SIGKILL before its time: the kernel's OOM killer, i.e. the host's memory), error
# (anything else, a hang at 300 s included; its log kept in --log_dir); WHY says it in words.
FAILURES=0
train_at() {
  local l h a code=0 limit=$((MAX_SECONDS - SECONDS)) began=$SECONDS
  IFS=: read -r l h a <<<"$1"
  ((limit > 300)) && limit=300
  if ((limit < 10)); then
    KIND=time WHY="not run: --max_seconds $MAX_SECONDS reached"
    return
  fi
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" "$DTK" $RUN --set model.num_layers="$l" --set model.hidden_size="$h" \
    --set model.num_attention_heads="$a" $2 >"$WORK/run.log" 2>&1 || code=$?
  local took=$((SECONDS - began))
  if ((code == 0)); then
    KIND=ok WHY=""
  elif ((code == 124 || (code == 137 && took >= limit))) && ((limit < 300)); then
    KIND=time WHY="cut short after $took s: --max_seconds $MAX_SECONDS reached"
  elif ((code == 137)); then
    KIND=killed WHY="killed (SIGKILL) after $took s: the kernel's OOM killer? (the host's memory)"
  elif ((code < 124)) && grep -qiE "out of memory|device memory budget" "$WORK/run.log"; then
    KIND=budget WHY="out of device memory"
  else
    KIND=error
    WHY=$( (grep -m1 "dtk: error" "$WORK/run.log" || { echo "exit $code after $took s:"; tail -3 "$WORK/run.log"; }) |
      tr '\n' ' ' | cut -c1-240)
    ((code == 124)) && WHY="no end after 300 s (a hang?): $WHY"
    FAILURES=$((FAILURES + 1))
    if [[ -n $LOG_DIR ]]; then
      cp "$WORK/run.log" "$LOG_DIR/capacity-${1//:/-}-$(echo "$2" | grep -o "strategy [a-z]*" | head -1 | tr ' ' '-').log" 2>/dev/null || true
    fi
  fi
}
# The median over iterations 2.. of the log line's field $1 in the last run.
field_median() {
  { grep -o "$1: [0-9.]*" "$WORK/run.log" || true; } | grep -o "[0-9.]*$" | tail -n +2 | sort -g |
    awk '{a[NR]=$1} END {if (NR) print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}' || true
}
# The memory report's last figure $1 in the last run.
report_figure() { { grep -o "| $1: [0-9.]*" "$WORK/run.log" || true; } | tail -1 | grep -o "[0-9.]*$" || true; }
# The row of the last run: size, parameters, tokens/s and step ms (medians of iterations 2..), the
# memory report's device and host peaks.
row() {
  local name=$1 size=$2 tok ms dev host
  tok=$(field_median "tokens per second")
  ms=$(field_median "elapsed time per iteration (ms)")
  dev=$(report_figure "max allocated")
  host=$(report_figure "host max allocated")
  printf '%-44s %-11s %8.1f M %10s %10s %12s %12s\n' "$name" "$size" "$(awk "BEGIN {print $(parameters "$size") / 1e6}")" \
    "${tok:--}" "${ms:--}" "${dev:--}" "${host:--}"
}
header() { printf '%-44s %-11s %10s %10s %10s %12s %12s\n' "$1" "L:H:A" "params" "tokens/s" "step ms" "device MB" "host MB"; }
# The largest size of SIZES (after $3, when given: a size known to fit) that trains with the
# arguments $2; prints its row and sets LARGEST (empty when none trains) and STOP: why no larger
# size counts ("budget": the next one ran out of device memory, so LARGEST is the largest;
# otherwise LARGEST is a lower bound: the host's memory, the time, the end of --sizes, a failure).
largest() {
  local name=$1 args=$2 after=${3:-} size best="" need_mb skipping=0 tried=0
  [[ -n $after ]] && skipping=1
  STOP="the end of --sizes"
  for size in $SIZES; do
    if ((skipping)); then
      [[ $size == "$after" ]] && skipping=0
      continue
    fi
    if ((SECONDS + 30 > MAX_SECONDS)); then
      STOP="the time (--max_seconds $MAX_SECONDS; $size not tried)"
      break
    fi
    if [[ $args == *offload_param* ]]; then
      need_mb=$(($(parameters "$size") * 18 / 1048576))
      if ((need_mb > HOST_AVAILABLE_MB * 85 / 100)); then
        STOP="the host's memory ($size needs about $need_mb MiB, more than 85% of the $HOST_AVAILABLE_MB available)"
        break
      fi
    fi
    train_at "$size" "$args"
    tried=$((tried + 1))
    case $KIND in
      ok) best=$size && cp "$WORK/run.log" "$WORK/best.log" ;;
      budget) STOP=budget && break ;;
      *) STOP="$size: $WHY" && break ;;
    esac
  done
  LARGEST=$best
  if [[ -n $best ]]; then
    cp "$WORK/best.log" "$WORK/run.log"
    row "$name" "$best"
  elif ((tried)); then
    printf '%-44s %s\n' "$name" "no size${after:+ after $after} trains"
  else
    printf '%-44s %s\n' "$name" "no size${after:+ after $after} tried"
  fi
  [[ $STOP == budget ]] || echo "  ($name: stopped by $STOP: a lower bound)"
}

header "largest under the budget"
largest "ddp" "$DDP --set train.memory_limit_mb=$BUDGET"
DDP_LARGEST=$LARGEST DDP_STOP=$STOP
largest "zero stage 3, offload optimizer + param" "$OFFLOAD --set train.memory_limit_mb=$BUDGET" "$DDP_LARGEST"
if [[ -n $DDP_LARGEST && -n $LARGEST ]]; then
  ratio=$(awk "BEGIN {printf \"%.1f\", $(parameters "$LARGEST") / $(parameters "$DDP_LARGEST")}")
  if [[ $DDP_STOP != budget ]]; then
    echo "  stage 3 + offload holds ${ratio}x the parameters of ddp's largest run (not ddp's largest: its ladder stopped by $DDP_STOP)"
  elif [[ $STOP == budget ]]; then
    echo "  stage 3 + offload holds ${ratio}x ddp's parameters"
  else
    echo "  stage 3 + offload holds at least ${ratio}x ddp's parameters (its ladder stopped by $STOP)"
  fi
fi
if [[ -n $DDP_LARGEST ]]; then
  echo
  header "at ddp's largest size, the same budget"
  for r in "zero stage 3, offload optimizer + param|$OFFLOAD" "zero stage 3, optimizer on disk + param|$NVME"; do
    train_at "$DDP_LARGEST" "${r#*|} --set train.memory_limit_mb=$BUDGET"
    if [[ $KIND == ok ]]; then
      row "${r%%|*}" "$DDP_LARGEST"
    else
      printf '%-44s %s\n' "${r%%|*}" "$WHY"
    fi
  done
  # The disk's own rate for the optimizer state of that size (12 bytes a parameter written and read
  # once a step), sequentially with dd (O_DIRECT, 4 MiB blocks): the floor of the disk row's extra time.
  BLOCKS=$((($(parameters "$DDP_LARGEST") * 12 / 1048576 + 3) / 4))
  if ((SECONDS + 20 > MAX_SECONDS)); then
    echo "  the disk: not measured (--max_seconds $MAX_SECONDS)"
  elif w=$(timeout 60 dd if=/dev/zero of="$NVME_DIR/dd.bin" bs=4M count=$BLOCKS oflag=direct 2>&1 | tail -1) &&
    r=$(timeout 60 dd if="$NVME_DIR/dd.bin" of=/dev/null bs=4M iflag=direct 2>&1 | tail -1); then
    echo "  the disk ($(df -T "$NVME_DIR" | awk 'NR==2 {print $2 " on " $1}')), $((BLOCKS * 4)) MiB: write $w; read $r"
  else
    echo "  the disk: dd with O_DIRECT failed in $NVME_DIR"
  fi
fi
((FAILURES == 0)) || { echo "gpu_capacity.sh: $FAILURES run(s) failed (above)" >&2; exit 1; }
