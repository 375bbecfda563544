#!/usr/bin/env bash
# Sets up (when needed), builds, and runs the whole test suite through ctest.
#   tools/test.sh                 every test
#   tools/test.sh -L unit         only tests labelled unit (labels: unit, oracle, integration)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh" --test
echo "[test] running ctest"
# ctest runs nproc tests at once, each with nproc OpenMP threads: with libgomp's default
# spin-waiting, a thread whose partner is descheduled spins at barriers, and runs slow down
# several-fold. Passive waiting yields the core instead.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
ctest --test-dir "$root/build" --output-on-failure -j"$(nproc)" "$@"
