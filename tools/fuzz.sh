#!/usr/bin/env bash
# Runs the parsers' fuzzer (tests/fuzz/fuzz_parsers.cpp) on every target for SECONDS each (default
# 60) and prints a table: executions, seconds, executions per second, findings. A crash, a hang or
# an escaped exception leaves its input under FINDINGS_DIR (default build/tests/fuzz-findings).
# Needs a build with tests (tools/setup.sh --test). Exit status 1 when any target found something.
#   tools/fuzz.sh [SECONDS] [TARGETS...]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${1:-60}
shift $(( $# > 0 ? 1 : 0 ))
targets=("${@:-}")
[ -n "${targets[0]}" ] || targets=(safetensors gguf tokenizer config yaml data)
fuzz=$root/build/bin/qpipe_fuzz
findings=${FINDINGS_DIR:-$root/build/tests/fuzz-findings}
mkdir -p "$findings"

echo "$seconds s per target, $(nproc) cores, $(date -u +%F), load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '| target | executions | seconds | per second | findings |\n| --- | ---: | ---: | ---: | ---: |\n'
status=0
for target in "${targets[@]}"; do
  line=$("$fuzz" "$target" "$seconds" "$root/tests/fuzz/corpus/$target" "$findings" 2>"$findings/$target.log")
  rc=$?
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $line"; }
  if [ $rc -ne 0 ] && [ -z "$line" ]; then
    printf '| %s | | | | crashed or hung: %s |\n' "$target" "$(tail -1 "$findings/$target.log")"
    status=1
    continue
  fi
  [ $rc -eq 0 ] || status=1
  printf '| %s | %s | %s | %s | %s |\n' "$target" "$(field executions)" "$(field seconds)" "$(field per_second)" \
    "$(field findings)"
done
exit $status
