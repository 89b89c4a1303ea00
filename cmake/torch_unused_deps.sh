#!/usr/bin/env bash
# cmake/torch_unused_deps.sh LIBTORCH_CPU — prints, one per line, the sonames of LibTorch's direct
# dependencies that no library of the process would call: those DTK replaces with empty stand-ins
# (cmake/DtkTorchStartup.cmake says why). Prints nothing for a LibTorch that links only what it uses.
#
# A dependency is unused when no object the process still loads imports a symbol it defines. The
# objects still loaded depend on which dependencies are replaced, so the set is found by fixed
# point: start from every direct dependency from which LibTorch imports nothing; drop any that a
# library still loaded imports from (Debian's oneDNN calls the OpenCL loader, which LibTorch links
# without calling); repeat until nothing changes. Symbols are compared without their versions,
# which can only keep more; so does a symbol version asked of a dependency. Needs binutils (readelf, nm) and ldd.
set -euo pipefail
torch=$1
[[ -f $torch ]] || { echo "torch_unused_deps: no such file: $torch" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# soname -> path for LibTorch's whole dependency closure, as the loader resolves it now.
declare -A path_of
while read -r name _ path _; do
  [[ $path == /* ]] && path_of[$name]=$path
done < <(ldd "$torch")
path_of[$(basename "$torch")]=$torch

needed() { readelf -d -W "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
key() { echo "$work/$(basename "$1")"; }
imports() {  # the file listing what $1 imports, made once
  local f; f=$(key "$1").imports
  [[ -f $f ]] || nm -D --undefined-only "$1" | awk '{print $NF}' | sed 's/@.*//' | sort -u >"$f"
  echo "$f"
}
exports() {
  local f; f=$(key "$1").exports
  [[ -f $f ]] || nm -D --defined-only "$1" | awk 'NF == 3 {print $3}' | sed 's/@.*//' | sort -u >"$f"
  echo "$f"
}
versions_asked() {  # the files whose symbol versions $1 asks for
  local f; f=$(key "$1").verneed
  [[ -f $f ]] || readelf -V -W "$1" | sed -n 's/.*File: \([^ ]*\).*/\1/p' | sort -u >"$f"
  echo "$f"
}
# Whether the objects listed in files $1 (imports) and $2 (versions asked) need $3: import a
# symbol it defines, or ask the loader for one of its symbol versions (the loader warns when a
# stand-in has none, as it would for oneDNN's OPENCL_1.0).
needs() {
  [[ -n $(comm -12 "$1" "$(exports "$3")" | head -1) ]] || grep -qxF "$(basename "$3")" "$2"
}

# The C and C++ runtimes are never replaced.
runtime='^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
declare -A stub
for dep in $(needed "$torch"); do
  [[ $dep =~ $runtime || -z ${path_of[$dep]:-} ]] && continue
  needs "$(imports "$torch")" "$(versions_asked "$torch")" "${path_of[$dep]}" || stub[$dep]=1
done

changed=1
while ((changed)); do
  changed=0
  # The objects still loaded: LibTorch's closure, not entering a replaced dependency.
  declare -A seen=()
  queue=("$(basename "$torch")")
  while ((${#queue[@]})); do
    name=${queue[0]}
    queue=("${queue[@]:1}")
    [[ -n ${seen[$name]:-} || -n ${stub[$name]:-} || -z ${path_of[$name]:-} ]] && continue
    seen[$name]=1
    for dep in $(needed "${path_of[$name]}"); do queue+=("$dep"); done
  done
  for name in "${!seen[@]}"; do cat "$(imports "${path_of[$name]}")"; done | sort -u >"$work/all.imports"
  for name in "${!seen[@]}"; do cat "$(versions_asked "${path_of[$name]}")"; done | sort -u >"$work/all.verneed"
  for dep in "${!stub[@]}"; do
    if needs "$work/all.imports" "$work/all.verneed" "${path_of[$dep]}"; then
      unset "stub[$dep]"
      changed=1
    fi
  done
  unset seen
done
printf '%s\n' "${!stub[@]}" | sort | sed '/^$/d'
