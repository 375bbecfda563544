#!/usr/bin/env bash
# Quantizes one model with 1, 2 and 3 ranks and compares the checkpoints tensor by tensor: the
# multi-rank result must be the 1-rank result (docs/multirank.md).
#
#   tools/check_equivalence.sh --model_path .cache/models/smollm2-135m --quant_type w8a8 [qpipe quant options]
#   QPIPE_RANKS="1 2 4" QPIPE_TOLERANCE=1e-6 tools/check_equivalence.sh ...
#
# Every argument goes to `qpipe quant` (give no --save_path or --device: this script sets them).
# Exits non-zero when a checkpoint differs from the 1-rank one beyond QPIPE_TOLERANCE (default 0:
# byte-identical).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
qpipe=${QPIPE_BINARY:-$root/build/bin/qpipe}
ranks=(${QPIPE_RANKS:-1 2 3})
tolerance=${QPIPE_TOLERANCE:-0}
for arg in "$@"; do
  case $arg in
    --save_path* | --device*) echo "check_equivalence: $arg is set by the script" >&2; exit 2 ;;
  esac
done
[[ -x $qpipe ]] || { echo "check_equivalence: $qpipe not built (run tools/setup.sh)" >&2; exit 2; }
[[ ${ranks[0]} == 1 ]] || { echo "check_equivalence: QPIPE_RANKS must start with 1" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/qpipe-equivalence.XXXXXX")
trap 'rm -rf "$work"' EXIT

devices() {  # cpu:0,1,...,n-1
  local list="cpu:0" i
  for ((i = 1; i < $1; ++i)); do list+=",$i"; done
  echo "$list"
}

declare -A seconds
for n in "${ranks[@]}"; do
  start=$(date +%s%N)
  "$qpipe" quant "$@" --device "$(devices "$n")" --save_path "$work/ranks$n" >"$work/ranks$n.log" 2>&1 \
    || { tail -n 20 "$work/ranks$n.log" >&2; echo "check_equivalence: the $n-rank run failed" >&2; exit 1; }
  ms=$((($(date +%s%N) - start) / 1000000))
  seconds[$n]=$((ms / 1000)).$(printf '%03d' $((ms % 1000)))
done

status=0
printf '%-8s %-10s %s\n' ranks seconds "compared with 1 rank"
printf '%-8s %-10s %s\n' 1 "${seconds[1]}" "(reference)"
for n in "${ranks[@]:1}"; do
  if "$qpipe" compare "$work/ranks1" "$work/ranks$n" --tolerance "$tolerance" >"$work/compare$n.txt" 2>&1; then
    verdict=$(grep -m1 'tensors:' "$work/compare$n.txt")
  else
    verdict="DIFFERENT: $(grep -m1 'tensors:' "$work/compare$n.txt" || tail -n 1 "$work/compare$n.txt")"
    cat "$work/compare$n.txt" >&2
    status=1
  fi
  printf '%-8s %-10s %s\n' "$n" "${seconds[$n]}" "$verdict"
done
exit $status
