#!/usr/bin/env bash
# Runs the parsers' fuzzer (tests/fuzz/fuzz_parsers.cpp) on every target for SECONDS each (default
# 60) and prints a table: executions, seconds, executions per second, findings. A crash, a hang,
# an escaped exception or a sanitizer report leaves its input under FINDINGS_DIR (default
# BUILD_DIR/tests/fuzz-findings).
#   tools/fuzz.sh [SECONDS] [TARGETS...]
# BUILD_DIR (default build) picks the build: build-asan for one configured with
# -DQPIPE_SANITIZE=address,undefined (CONTRIBUTING.md, Sanitizers); a sanitizer report, leaks
# included, ends the target's run as a finding. JOBS (default 1) targets run at once.
# Needs a build with tests (tools/setup.sh --test). Exit status 1 when any target found something.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${1:-60}
shift $(( $# > 0 ? 1 : 0 ))
targets=("${@:-}")
[ -n "${targets[0]}" ] || targets=(safetensors gguf tokenizer config yaml data)
build=$root/${BUILD_DIR:-build}
fuzz=$build/bin/qpipe_fuzz
findings=${FINDINGS_DIR:-$build/tests/fuzz-findings}
jobs=${JOBS:-1}
[ -x "$fuzz" ] || { echo "fuzz.sh: no $fuzz (build the tests first: tools/setup.sh --test)" >&2; exit 2; }
mkdir -p "$findings"
# Sanitizers stop at their first report with a nonzero status; UBSan's reports are fatal too.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

run() {
  local target=$1
  "$fuzz" "$target" "$seconds" "$root/tests/fuzz/corpus/$target" "$findings" >"$findings/$target.out" \
    2>"$findings/$target.log"
  echo $? >"$findings/$target.rc"
}

echo "$seconds s per target, $jobs at once, $(basename "$build"), $(nproc) cores, $(date -u +%F)," \
  "load $(cut -d' ' -f1-3 /proc/loadavg)"
running=0
for target in "${targets[@]}"; do
  run "$target" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

printf '| target | executions | seconds | per second | findings |\n| --- | ---: | ---: | ---: | ---: |\n'
status=0
for target in "${targets[@]}"; do
  line=$(cat "$findings/$target.out")
  rc=$(cat "$findings/$target.rc")
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $line"; }
  found=$(field findings)
  if [ "$rc" -ne 0 ]; then
    status=1
    # A crash or hang prints no summary line; a leak report comes after it, at exit.
    report=$(grep -m1 -E 'ERROR: (Address|Leak)Sanitizer|runtime error|^finding' "$findings/$target.log")
    found="${found:+$found; }${report:-exit status $rc} ($findings/$target.log)"
  fi
  printf '| %s | %s | %s | %s | %s |\n' "$target" "$(field executions)" "$(field seconds)" "$(field per_second)" \
    "$found"
done
exit $status
