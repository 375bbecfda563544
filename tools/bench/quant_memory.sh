#!/usr/bin/env bash
# Peak memory of `qpipe quant` on synthetic Qwen3 checkpoints (tools/bench/make_synthetic_qwen3.py:
# 40 layers = 4.43 GB bf16, and a 12-layer variant), for the data-free default (w8a8) and the
# static practice (a calibration forward per layer), against the bound of issue 4:
#   peak RSS <= 3 x one decoder layer in the compute dtype + calibration hidden states + 500 MB
# Peak RSS is /usr/bin/time's; RssAnon and RssFile (mapped checkpoint pages) are sampled from
# /proc/PID/status every 0.5 s. Prints tables; needs tools/setup.sh --test.
#   tools/bench/quant_memory.sh
# Environment: QPIPE (default build/bin/qpipe), SAMPLES (16), SEQ_LEN (256), LAYERS ("12 40"),
#   PRACTICES ("dynamic static"), COMPUTE_DTYPE (bytes per element of the compute dtype: 4, as
#   qpipe quant computes in fp32, tools/qpipe/cmd_quant.cpp).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
qpipe=${QPIPE:-$root/build/bin/qpipe}
samples=${SAMPLES:-16}
seq=${SEQ_LEN:-256}
layer_counts=${LAYERS:-12 40}
practices=${PRACTICES:-dynamic static}
work=$root/.cache/bench/quant_memory
[[ -x $qpipe ]] || { echo "no $qpipe; build qpipe first (tools/setup.sh) or set QPIPE" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "/usr/bin/time is missing: apt-get install time" >&2; exit 1; }
mkdir -p "$work"

# The static practice: int8 per-channel weights, per-tensor asymmetric int8 activations (minmax).
static_config=${STATIC_CONFIG:-$root/configs/default/w8a8_static.yaml}

# Every 0.5 s: VmRSS / RssAnon / RssFile (KiB) of the child of PID $1, and the bytes in the
# saver's partial folder $3 (layers are written there one by one), into $2.
sample_rss() {
  local parent=$1 csv=$2 partial=$3 start pid="" bytes
  start=$(date +%s.%N)
  echo "t_s,rss_kib,anon_kib,file_kib,saved_bytes" >"$csv"
  while kill -0 "$parent" 2>/dev/null; do
    [[ -n $pid ]] || pid=$(pgrep -P "$parent" | head -n 1 || true)
    if [[ -n $pid && -r /proc/$pid/status ]]; then
      bytes=$(du -sb "$partial" 2>/dev/null | cut -f1 || true)
      awk -v t="$(echo "$(date +%s.%N) - $start" | bc)" -v b="${bytes:-0}" \
        '/^VmRSS:/{r=$2} /^RssAnon:/{a=$2} /^RssFile:/{f=$2} END{if (r) printf "%.1f,%d,%d,%d,%d\n", t, r, a, f, b}' \
        "/proc/$pid/status" >>"$csv" 2>/dev/null || true
    fi
    sleep 0.5
  done
}

results=$work/results.jsonl
: >"$results"
for layers in $layer_counts; do
  model=$root/.cache/bench/qwen3-synthetic-${layers}l
  [[ -f $model/model.safetensors.index.json ]] ||
    "$root/.venv-test/bin/python" "$root/tools/bench/make_synthetic_qwen3.py" --num_layers "$layers" >&2
  for practice in $practices; do
    args=(--quant_type w8a8)
    if [[ $practice == static ]]; then
      args=(--config_path "$static_config")
    fi
    run=$work/${layers}l-$practice
    rm -rf "$run.out"
    echo "[bench] $layers layers, $practice" >&2
    /usr/bin/time -v -o "$run.time" "$qpipe" quant --model_path "$model" --save_path "$run.out" "${args[@]}" \
      --calib_data "$root/data/calib.jsonl" --calib_samples "$samples" --seq_len "$seq" --device cpu \
      --log_level debug >"$run.log" 2>&1 &
    parent=$!
    sample_rss "$parent" "$run.csv" "$work/.$(basename "$run").out.qpipe-partial" &
    sampler=$!
    status=0
    wait "$parent" || status=$?
    wait "$sampler" || true
    if ((status != 0)); then
      tail -n 20 "$run.log" >&2
      echo "[bench] qpipe quant failed ($status); log: $run.log" >&2
      exit 1
    fi
    echo "$layers $practice $model $run" >>"$results"
  done
done

# The tables: peak against the bound, and RSS over the run (does it grow with layers?).
python3 - "$results" "$samples" "$seq" "${COMPUTE_DTYPE:-}" <<'PY'
import csv, json, re, struct, sys
results, samples, seq, dtype_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
MiB = 2**20

def layer0_bytes(folder):
    """Bytes of the tensors of model.layers.0 in a safetensors folder (from the headers)."""
    total = 0
    for shard in sorted(p for p in __import__("pathlib").Path(folder).glob("*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                     if k.startswith("model.layers.0."))
    return total

rows, series = [], []
for line in open(results):
    layers, practice, model, run = line.split()
    cfg = json.load(open(f"{model}/config.json"))
    timev = open(f"{run}.time").read()
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timev).group(1)) * 1024
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", timev).group(1)
    width = int(dtype_bytes or 4)
    layer = layer0_bytes(model) // 2 * width
    acts = samples * seq * cfg["hidden_size"] * width if practice == "static" else 0
    bound = 3 * layer + acts + 500 * 10**6
    with open(f"{run}.csv") as f:
        points = [(float(r["t_s"]), int(r["rss_kib"]) * 1024, int(r["anon_kib"]) * 1024, int(r["file_kib"]) * 1024,
                   int(r["saved_bytes"])) for r in csv.DictReader(f)]
    top_anon = max(p[2] for p in points)
    top_file = max(p[3] for p in points)
    rows.append(f"| {layers} | {practice} | {wall} | {peak / MiB:,.0f} | {top_anon / MiB:,.0f} | {top_file / MiB:,.0f} "
                f"| {layer / MiB:,.0f} ({width} B) | {acts / MiB:,.0f} | {bound / MiB:,.0f} | "
                f"{'yes' if peak <= bound else '**no**'} |")
    # Layers written so far = bytes in the saver's partial folder / bytes of one saved layer (the
    # non-layer tensors are written last).
    saved_layer = layer0_bytes(f"{run}.out")
    n = int(layers)
    cells = []
    for k in (1, 4, n // 2, n):
        p = next((p for p in points if p[4] >= k * saved_layer), None)
        cells.append(f"{p[2] / MiB:,.0f} / {p[3] / MiB:,.0f}" if p else "–")
    p = max(points, key=lambda p: p[1])
    cells.append(f"{p[2] / MiB:,.0f} / {p[3] / MiB:,.0f} at {p[0]:.0f} s of {points[-1][0]:.0f} s")
    series.append(f"| {layers} | {practice} | " + " | ".join(cells) + " |")

print(f"\nqpipe quant, calibration {samples} samples x {seq} tokens (static), peak RSS from /usr/bin/time -v\n")
print("| layers | practice | wall | peak RSS MiB | max RssAnon MiB | max RssFile MiB | one layer MiB (compute dtype) "
      "| calib. hidden MiB | bound MiB | within |")
print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
print("\n".join(rows))
print("\nRssAnon / RssFile (MiB) when the saver has written k layers (sampled every 0.5 s), and at the peak\n")
print("| layers | practice | k = 1 | k = 4 | k = n/2 | k = n | at peak VmRSS |")
print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
print("\n".join(series))
PY
