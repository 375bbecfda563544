#!/usr/bin/env bash
# Per-rank memory of QAT on 1 and 2 ranks (docs/benchmarks.md): SmolLM2, FP8 static, blockwise and
# end2end, 4 samples of 256 tokens, 2 steps. Every process of the run is sampled every 0.2 s from
# /proc: RssAnon (private: activations, autograd's tensors, converted weights), RssFile (mapped
# checkpoint pages, shared through the page cache by the ranks of one machine) and Pss (RSS with
# each shared page divided among the processes that map it). Each column is the process's peak.
#   tools/bench/qat_memory.sh [MODEL_DIR]        needs tools/setup.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
qpipe=${QPIPE:-$root/build/bin/qpipe}
work=$root/.cache/bench/qat_memory
mkdir -p "$work"

pipeline() {  # mode -> a pipeline file
  cat > "$work/$1.yaml" <<YAML
apiversion: modelslim_v1
spec:
  process:
    - type: learnable_scale_qat
      training_mode: $1
      qconfig:
        act: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
      learning_rate: 1.0e-3
      per_device_train_batch_size: 4
      max_steps: 2
  save:
    - {type: compressed_tensors}
YAML
  echo "$work/$1.yaml"
}

echo "$(basename "$model") ($(du -sh "$model"/*.safetensors | cut -f1 | paste -sd+) of safetensors), $(nproc) cores," \
  "$(date -u +%F), load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '| mode | ranks | process | peak RssAnon MiB | peak RssFile MiB | peak Pss MiB | peak RSS MiB |\n'
printf '| --- | ---: | --- | ---: | ---: | ---: | ---: |\n'
for mode in ${QAT_MEMORY_MODES:-blockwise end2end}; do
  config=$(pipeline "$mode")
  for devices in cpu:0 cpu:0,1; do
    rm -rf "$work/out" "$work/out".qat_*
    "$root/.venv/bin/python" - "$mode" "$devices" "$qpipe" --log_level warn quant --model_path "$model" \
      --save_path "$work/out" --config_path "$config" --calib_samples 4 --seq_len 256 --device "$devices" \
      --threads_per_rank 1 <<'PY'
import os, subprocess, sys, time

mode, devices, command = sys.argv[1], sys.argv[2], sys.argv[3:]
ranks = devices.count(",") + 1
run = subprocess.Popen(command, stdout=subprocess.DEVNULL)

def tree(pid):
    pids, frontier = [pid], [pid]
    while frontier:
        found = []
        for p in frontier:
            try:
                with open(f"/proc/{p}/task/{p}/children") as f:
                    found += [int(c) for c in f.read().split()]
            except OSError:
                pass
        pids += found
        frontier = found
    return pids

def kib(path, key):
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0

peaks = {}  # pid -> [anon, file, pss, rss] in KiB
while run.poll() is None:
    for pid in tree(run.pid):
        try:
            sample = [kib(f"/proc/{pid}/status", "RssAnon"), kib(f"/proc/{pid}/status", "RssFile"),
                      kib(f"/proc/{pid}/smaps_rollup", "Pss"), kib(f"/proc/{pid}/status", "VmRSS")]
        except OSError:
            continue
        peak = peaks.setdefault(pid, [0, 0, 0, 0])
        peaks[pid] = [max(a, b) for a, b in zip(peak, sample)]
    time.sleep(0.2)
if run.returncode != 0:
    sys.exit(f"qpipe failed ({run.returncode})")
# With several ranks, `qpipe` launches one process per rank and waits for them.
children = sorted(p for p in peaks if p != run.pid)
names = {run.pid: "launcher", **{pid: f"rank {i}" for i, pid in enumerate(children)}} if children else {run.pid: "rank 0"}
for pid in [run.pid] + children:
    anon, file, pss, rss = (v // 1024 for v in peaks[pid])
    print(f"| {mode} | {ranks} | {names[pid]} | {anon} | {file} | {pss} | {rss} |")
PY
  done
done
rm -rf "$work/out" "$work/out".qat_*
