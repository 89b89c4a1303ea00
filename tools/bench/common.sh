# Sourced by the benchmark scripts in tools/bench (bash): the checks and settings every one shares.
#   bench_start NAME   checks the build, preloads Debian's tcmalloc when installed (the same
#                      allocator for every row) and prints the header line; sets DTK.
#   median             the median of the numbers on stdin, one per line.
#   calc EXPR          awk's value of an arithmetic expression (no bc on a bare Debian).
bench_start() {
  DTK=build/bin/dtk
  [[ -x $DTK ]] || { echo "$1: build first (tools/build.sh)" >&2; exit 1; }
  local tcmalloc
  tcmalloc=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
  [[ -n $tcmalloc ]] && export LD_PRELOAD=$tcmalloc
  echo "$1: $(nproc) cores, allocator: ${tcmalloc:-glibc malloc}, $(date -u +%F)"
}
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
calc() { awk "BEGIN { print $1 }"; }
