#!/usr/bin/env bash
# The latency of qpipe's process group between two ranks of this host, through the shared-memory
# channel and over Gloo and the TCPStore (QPIPE_DIST_SHM=0), side by side (docs/multirank.md):
# a 16-byte gather back to back and after 2 ms of work on each rank (a scheduler's outcomes
# between waves), a store claim, and an exchange of 2.4 MB a rank (a smoothing search's float
# product). tools/bench/dts_simulate.py --latency_ms takes the gather's figure.
#   tools/bench/channel_latency.sh
# Environment: BENCH (build/bin/qpipe_bench_channel_latency).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bench=${BENCH:-$root/build/bin/qpipe_bench_channel_latency}
[[ -x $bench ]] || { echo "no $bench; build qpipe first (tools/setup.sh) or set BENCH" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run() {  # $1: QPIPE_DIST_SHM; rank 0's lines in $work/$1
  local port=$((20000 + RANDOM % 20000)) pids=()
  for rank in 0 1; do
    QPIPE_DIST_SHM=$1 RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
      "$bench" >"$work/$1.$rank" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || { cat "$work/$1".*; exit 1; }; done
  cp "$work/$1.0" "$work/$1"
}
run 1
run 0
field() { awk -v n="$2" -v f="$3" '$1 == n { print $f }' "$work/$1"; }
echo "qpipe's process group, 2 ranks on $(nproc) cores, $(date -u +%F); shared memory in use: $(field 1 shared_memory 2)"
echo
echo "| measurement | shared memory: median ms | p90 ms | mean ms | Gloo and store: median ms | p90 ms | mean ms |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for name in gather_back_to_back gather_after_2ms_work claim exchange_2.4MB; do
  echo "| $name | $(field 1 $name 2) | $(field 1 $name 3) | $(field 1 $name 4) | $(field 0 $name 2) | $(field 0 $name 3) | $(field 0 $name 4) |"
done
echo "| exchange GB/s (median) | $(field 1 exchange_GBps 2) | | | $(field 0 exchange_GBps 2) | | |"
