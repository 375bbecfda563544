#!/usr/bin/env bash
# Build-time benchmark: a clean build with and without ccache, and rebuilds after touching one
# file of each kind. Prints a table; run after tools/setup.sh. Leaves build/ fully built.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
[[ -f build/build.ninja ]] || { echo "run tools/setup.sh first" >&2; exit 1; }

timed_build() { /usr/bin/time -f %e ninja -C build -j"$(nproc)" 2>&1 >/dev/null | tail -n 1; }

rows=()
ninja -C build clean >/dev/null
rows+=("clean build, ccache off|$(CCACHE_DISABLE=1 timed_build)")
ninja -C build clean >/dev/null
rows+=("clean build, ccache warm|$(timed_build)")
for file in core/base/src/schema.cpp tools/qpipe/cmd_check.cpp tests/unit/test_schema.cpp core/sdk/include/qpipe/processor.h; do
  touch "$file"
  rows+=("touch $file|$(CCACHE_DISABLE=1 timed_build)")
done

printf '| %-45s | %9s |\n' "step ($(nproc) cores, ninja)" "seconds"
printf '| %-45s | %9s |\n' "---" "---:"
for row in "${rows[@]}"; do printf '| %-45s | %9s |\n' "${row%%|*}" "${row##*|}"; done
