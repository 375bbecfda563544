#!/usr/bin/env bash
# Data-free weight quantization throughput: GB/s of decoder-layer weights read by the processors
# of `qpipe quant` (the report's processor seconds) against this machine's memcpy bandwidth,
# measured in the same run, and the whole run of each practice. Prints a table.
#   tools/bench/weight_quant_throughput.sh [MODEL_DIR] [CONFIGS]
# CONFIGS: pipeline files relative to the repository (default: configs/default/w8a8.yaml,
# tools/bench/w4a16_g64.yaml, configs/default/w4a8.yaml, the last the SSZ search).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
configs=${2:-configs/default/w8a8.yaml tools/bench/w4a16_g64.yaml configs/default/w4a8.yaml}
qpipe=${QPIPE:-$root/build/bin/qpipe}
work=$root/.cache/bench/weight_quant
mkdir -p "$work"

# memcpy of 512 MiB, best of 5, single thread (numpy's copyto is a memcpy for contiguous arrays).
memcpy=$("$root/.venv-test/bin/python" - <<'PY'
import time, numpy as np
src = np.ones(512 << 20, dtype=np.uint8); dst = np.empty_like(src)
best = min((lambda t: (np.copyto(dst, src), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print(f"{src.nbytes / best / 1e9:.2f}")
PY
)

# The bytes the layer processors read: every Linear weight inside model.layers, in the checkpoint.
layer_bytes=$("$root/.venv-test/bin/python" - "$model" <<'PY'
import json, struct, sys
from pathlib import Path
total = 0
for f in Path(sys.argv[1]).glob("*.safetensors"):
    with open(f, "rb") as h:
        header = json.loads(h.read(struct.unpack("<Q", h.read(8))[0]))
    for name, t in header.items():
        if ".layers." in name and name.endswith("proj.weight"):
            total += t["data_offsets"][1] - t["data_offsets"][0]
print(total)
PY
)

rows=()
for config in $configs; do
  practice=$(basename "$config" .yaml)
  out=$work/$practice
  rm -rf "$out"
  /usr/bin/time -f "%e" -o "$work/time.txt" "$qpipe" quant --model_path "$model" --save_path "$out" \
    --config_path "$root/$config" --device cpu --log_level warn >/dev/null
  rows+=("$(python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
seconds = sum(sum(l["processor_seconds"]) for l in r["layers"])
gbs = int(sys.argv[3]) / seconds / 1e9
print("| %s | %.3f | %.2f | %.0f %% | %.2f | %s |" % (sys.argv[2], seconds, gbs, 100 * gbs / float(sys.argv[4]),
                                                 r["total_seconds"], open(sys.argv[5]).read().strip()))' \
    "$out/quant_report.json" "$practice" "$layer_bytes" "$memcpy" "$work/time.txt")")
done

echo
echo "$(basename "$model"): $layer_bytes bytes of layer weights; memcpy $memcpy GB/s; $(nproc) cores, $(date -I), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf '| practice | processors s | GB/s read | of memcpy | runner s | process wall s |\n'
printf '| --- | ---: | ---: | ---: | ---: | ---: |\n'
printf '%s\n' "${rows[@]}"
