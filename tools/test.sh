#!/usr/bin/env bash
# Sets up (when needed), builds, and runs the whole test suite through ctest.
#   tools/test.sh                 every test
#   tools/test.sh -L unit         only tests labelled unit (labels: unit, integration)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh" --test
echo "[test] running ctest"
ctest --test-dir "$root/build" --output-on-failure -j"$(nproc)" "$@"
