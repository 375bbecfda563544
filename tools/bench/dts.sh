#!/usr/bin/env bash
# The distributed task scheduler's speed-up (docs/scheduler.md): each practice as 1 rank x 1
# thread and 2 ranks x 1 thread on this host, SmolLM2-135M. Prints the whole run's wall time, the
# sub-task phase (the scheduler's run()s: on 1 rank Σ their wall time, on 2 ranks rank 0's Σ wall
# time, from quant_report.json's dts:<scheduler>:wall_seconds; where the 2-rank run split its
# layers, the layer wave's wall time), both speed-ups, and whether the 2-rank checkpoint
# is the 1-rank one byte for byte (qpipe compare).
#   tools/bench/dts.sh
# Environment: QPIPE (build/bin/qpipe), MODEL (.cache/models/smollm2-135m), SAMPLES (32),
#   SEQ_LEN (512), CONFIGS (the practices below), IDLE (0: seconds the machine idles before each
#   timed run, after the last output is removed; on a VM with a balloon a run straight after
#   another writes its checkpoint much faster than one after a few seconds' idle,
#   docs/benchmarks.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
qpipe=${QPIPE:-$root/build/bin/qpipe}
model=${MODEL:-$root/.cache/models/smollm2-135m}
samples=${SAMPLES:-32}
seq=${SEQ_LEN:-512}
idle=${IDLE:-0}
configs=${CONFIGS:-"$root/configs/default/w4a8_flex_awq.yaml $root/configs/default/w8a8_static_flex_smooth.yaml $root/configs/default/w4a8.yaml $root/configs/default/w8a8.yaml $root/tools/bench/w4a16_g64.yaml"}
work=$root/.cache/bench/dts
[[ -x $qpipe ]] || { echo "no $qpipe; build qpipe first (tools/setup.sh) or set QPIPE" >&2; exit 1; }
mkdir -p "$work"
export OMP_WAIT_POLICY=passive

# Of report $1: the sub-task phase (Σ of every scheduler's wall seconds over the layers; where the
# layers were split, the layer wave's, dts:runner:wall_seconds, which holds the others), then the
# layer phase (Σ of the decoder layers' seconds; split: the layer wave's).
phases() {
  python3 - "$1" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
tasks, layers, runner = 0.0, 0.0, None
for layer in report["layers"]:
    if layer["name"].startswith("model.layers."):
        layers += layer["seconds"]
    for module, values in layer.get("values", {}).items():
        runner = values.get("dts:runner:wall_seconds", runner)
        tasks += sum(v for k, v in values.items() if k.startswith("dts:") and k.endswith(":wall_seconds"))
print(f"{runner if runner is not None else tasks:.2f} {runner if runner is not None else layers:.2f}")
PY
}

echo "qpipe quant, $(basename "$model"), $samples x $seq tokens, $(nproc) cores, 1x1 against 2x1 (ranks x threads), $idle s idle before each run, $(date -u +%F)"
echo
echo "| practice | wall 1x1 s | wall 2x1 s | whole | sub-tasks 1x1 s | sub-tasks 2x1 s | sub-tasks | layers 1x1 s | layers 2x1 s | layers | checkpoint |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
for config in $configs; do
  name=$(basename "$config" .yaml)
  declare -A wall=() sub=() lay=()
  for run in 1x1 2x1; do
    devices=cpu:0
    [[ $run == 2x1 ]] && devices=cpu:0,1
    out=$work/$name-$run
    rm -rf "$out"
    sleep "$idle"
    start=$(date +%s%N)
    "$qpipe" quant --model_path "$model" --config_path "$config" --device "$devices" --threads_per_rank 1 \
      --calib_samples "$samples" --seq_len "$seq" --save_path "$out" >"$work/$name-$run.log" 2>&1 \
      || { tail -n 20 "$work/$name-$run.log" >&2; exit 1; }
    wall[$run]=$(echo "scale=2; ($(date +%s%N) - $start) / 1000000000" | bc -l)
    read -r sub[$run] lay[$run] < <(phases "$out/quant_report.json")
  done
  verdict=$("$qpipe" compare "$work/$name-1x1" "$work/$name-2x1" 2>&1 | tail -n 1)
  [[ $verdict == *" 0 different"* && $verdict == *" 0 within"* ]] && same=byte-identical || same="DIFFERS: $verdict"
  printf '| %s | %s | %s | %.2fx | %s | %s | %.2fx | %s | %s | %.2fx | %s |\n' "$name" "${wall[1x1]}" "${wall[2x1]}" \
    "$(echo "${wall[1x1]} / ${wall[2x1]}" | bc -l)" "${sub[1x1]}" "${sub[2x1]}" \
    "$(echo "${sub[1x1]} / (${sub[2x1]} + 0.0001)" | bc -l)" "${lay[1x1]}" "${lay[2x1]}" \
    "$(echo "${lay[1x1]} / (${lay[2x1]} + 0.0001)" | bc -l)" "$same"
done
