#!/usr/bin/env bash
# cmake/torch_unused_deps.sh LIBTORCH_CPU [MORE_ROOTS...] — prints, one per line, the sonames of
# LibTorch's direct dependencies that nothing in LibTorch's dependency tree calls: those DTK
# replaces with empty stand-ins (cmake/DtkTorchStandins.cmake says why). MORE_ROOTS are other
# libraries the process loads (libtorch.so, libc10.so, a CUDA LibTorch's libtorch_cuda.so): their
# trees count as users too. Prints nothing for a LibTorch that links only what it uses, or that
# carries its own RUNPATH (the stand-ins are found through the executable's search path, which a
# library's RUNPATH overrides for its own dependencies).
#
# A dependency is unused when no object still loaded imports a symbol it defines or asks for one
# of its symbol versions. The objects still loaded depend on which dependencies are replaced, so
# the set is found by fixed point: start from every direct dependency of LibTorch's; drop any that
# a library still loaded uses, LibTorch first (Debian's oneDNN calls the OpenCL loader, which
# LibTorch links without calling); repeat until nothing changes. Symbols are compared
# without their versions, which can only keep more. What lies outside these trees (the dtk host's
# own libraries, plugins) is checked by ctest's `torch_standins_resolve_every_symbol`, which starts
# dtk with LD_BIND_NOW=1 and loads every plugin. Needs binutils (readelf, nm) and ldd.
set -euo pipefail
export LC_ALL=C
torch=$1
shift
[[ -f $torch ]] || { echo "torch_unused_deps: no such file: $torch" >&2; exit 1; }
readelf -d -W "$torch" | grep -qE '\((RUNPATH|RPATH)\)' && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# soname -> path for the roots' whole dependency closure, as the loader resolves it now.
declare -A path_of
roots=("$(basename "$torch")")
path_of[$(basename "$torch")]=$torch
for root in "$@"; do
  [[ -f $root ]] || continue
  roots+=("$(basename "$root")")
  path_of[$(basename "$root")]=$root
done
for root in "$torch" "$@"; do
  [[ -f $root ]] || continue
  while read -r name _ path _; do
    [[ $path == /* ]] && path_of[$name]=$path
  done < <(ldd "$root")
done

needed() { readelf -d -W "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
key() { echo "$work/$(basename "$1")"; }
# What $1 imports, exports and asks symbol versions of, one sorted file each. Run as a command of
# its own (not inside $(...), where a failing nm would go unnoticed and read as "imports nothing").
index() {
  local k; k=$(key "$1")
  [[ -f $k.exports ]] && return
  nm -D --undefined-only "$1" | awk '{print $NF}' | sed 's/@.*//' | sort -u >"$k.imports.tmp"
  readelf -V -W "$1" | sed -n 's/.*File: \([^ ]*\).*/\1/p' | sort -u >"$k.verneed.tmp"
  nm -D --defined-only "$1" | awk 'NF == 3 {print $3}' | sed 's/@.*//' | sort -u >"$k.exports.tmp"
  mv "$k.imports.tmp" "$k.imports"
  mv "$k.verneed.tmp" "$k.verneed"
  mv "$k.exports.tmp" "$k.exports"
}
# Whether the objects whose imports and asked versions are listed in $1 and $2 need $3.
needs() {
  [[ -n $(comm -12 "$1" "$(key "$3").exports" | head -1) ]] || grep -qxF "$(basename "$3")" "$2"
}

# The C and C++ runtimes are never replaced.
runtime='^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
declare -A stub
for dep in $(needed "$torch"); do
  [[ $dep =~ $runtime || -z ${path_of[$dep]:-} ]] && continue
  index "${path_of[$dep]}"
  stub[$dep]=1
done

changed=1
while ((changed)); do
  changed=0
  # The objects still loaded: the roots' closures, not entering a replaced dependency.
  declare -A seen=()
  queue=("${roots[@]}")
  while ((${#queue[@]})); do
    name=${queue[0]}
    queue=("${queue[@]:1}")
    [[ -n ${seen[$name]:-} || -n ${stub[$name]:-} || -z ${path_of[$name]:-} ]] && continue
    seen[$name]=1
    index "${path_of[$name]}"
    for dep in $(needed "${path_of[$name]}"); do queue+=("$dep"); done
  done
  for name in "${!seen[@]}"; do cat "$(key "${path_of[$name]}").imports"; done | sort -u >"$work/all.imports"
  for name in "${!seen[@]}"; do cat "$(key "${path_of[$name]}").verneed"; done | sort -u >"$work/all.verneed"
  for dep in "${!stub[@]}"; do
    if needs "$work/all.imports" "$work/all.verneed" "${path_of[$dep]}"; then
      unset "stub[$dep]"
      changed=1
    fi
  done
  unset seen
done
printf '%s\n' "${!stub[@]}" | sort | sed '/^$/d'
