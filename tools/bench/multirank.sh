#!/usr/bin/env bash
# Multi-rank speed of `qpipe quant` (issue 5): W8A8 static on SmolLM2-135M, SAMPLES x SEQ_LEN
# tokens, as 1 rank x 1 thread, 1 rank x 2 threads and 2 ranks x 1 thread on this host. Prints
# wall time, the runner's time, the calibration forward (processor time less sync time), the
# per-layer syncs (collectives, bytes, ms; rank 0's quant_report.json) and the speed-ups.
#   tools/bench/multirank.sh
# Environment: QPIPE (build/bin/qpipe), MODEL (.cache/models/smollm2-135m), SAMPLES (256),
#   SEQ_LEN (512), CONFIG (configs/default/w8a8_static.yaml), RUNS ("1x1 1x2 2x1": ranks x threads).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
qpipe=${QPIPE:-$root/build/bin/qpipe}
model=${MODEL:-$root/.cache/models/smollm2-135m}
samples=${SAMPLES:-256}
seq=${SEQ_LEN:-512}
config=${CONFIG:-$root/configs/default/w8a8_static.yaml}
runs=${RUNS:-1x1 1x2 2x1}
work=$root/.cache/bench/multirank
[[ -x $qpipe ]] || { echo "no $qpipe; build qpipe first (tools/setup.sh) or set QPIPE" >&2; exit 1; }
mkdir -p "$work"
rm -f "$work/summary.tsv"
export OMP_WAIT_POLICY=passive

echo "qpipe quant, $(basename "$config"), $(basename "$model"), $samples x $seq tokens, $(nproc) cores, $(date -u +%F)"
printf '%-8s %-9s %-9s %-10s %-9s %-10s %-12s %s\n' run wall_s runner_s forward_s sync_s syncs/layer bytes/layer ms/sync
for run in $runs; do
  ranks=${run%x*}
  threads=${run#*x}
  devices=cpu:0
  for ((i = 1; i < ranks; ++i)); do devices+=",$i"; done
  out=$work/out-$run
  rm -rf "$out"
  start=$(date +%s%N)
  "$qpipe" --log_level warn quant --model_path "$model" --config_path "$config" --device "$devices" \
    --threads_per_rank "$threads" --calib_samples "$samples" --seq_len "$seq" --save_path "$out" >"$work/$run.log" 2>&1 \
    || { tail -n 20 "$work/$run.log" >&2; exit 1; }
  wall_ms=$((($(date +%s%N) - start) / 1000000))
  python3 - "$out/quant_report.json" "$run" "$wall_ms" <<'PY' | tee -a "$work/summary.tsv"
import json, sys
report = json.load(open(sys.argv[1]))
layers = report["layers"]
runner = report["total_seconds"]
processors = sum(sum(layer["processor_seconds"]) for layer in layers)
sync = [layer.get("sync", {"collectives": 0, "bytes": 0, "seconds": 0.0}) for layer in layers]
sync_s = sum(s["seconds"] for s in sync)
calls = sum(s["collectives"] for s in sync)
print(f"{sys.argv[2]:<8} {int(sys.argv[3]) / 1000:<9.1f} {runner:<9.1f} {processors - sync_s:<10.1f} {sync_s:<9.2f} "
      f"{calls / len(layers):<10.1f} {sum(s['bytes'] for s in sync) / len(layers):<12.0f} "
      f"{1000 * sync_s / calls if calls else 0:.3f}")
PY
done
python3 - "$work/summary.tsv" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    rows[f[0]] = {"wall": float(f[1]), "forward": float(f[3])}
if "1x1" in rows and "2x1" in rows:
    print(f"2 ranks x 1 thread over 1 rank x 1 thread: wall {rows['1x1']['wall'] / rows['2x1']['wall']:.2f}x, "
          f"calibration forward {rows['1x1']['forward'] / rows['2x1']['forward']:.2f}x")
if "1x2" in rows and "2x1" in rows:
    print(f"2 ranks x 1 thread over 1 rank x 2 threads: wall {rows['1x2']['wall'] / rows['2x1']['wall']:.2f}x")
PY
rm -f "$work/summary.tsv"
