#!/usr/bin/env bash
# Perplexity of SmolLM2 quantized with and without outlier smoothing (docs/smoothing.md), and of
# llm-compressor's SmoothQuant + the same static W8A8 scheme as a peer row; prints the table of
# docs/quality.md. Needs tools/setup.sh --test (.venv-test, and .venv-bench for the peer row).
#   tools/bench/smoothing_quality.sh [MODEL_DIR] [SAMPLES] [SEQ_LEN]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
samples=${2:-32}
seq=${3:-512}
qpipe=${QPIPE:-$root/build/bin/qpipe}
work=$root/.cache/bench/smoothing_quality
configs=$root/configs/default
mkdir -p "$work"

# A pipeline: `smoothing` (a spec.process entry, or empty) before the linear_quant step of `base`.
pipeline() {
  local name=$1 base=$2 smoothing=$3
  python3 - "$base" "$smoothing" >"$work/$name.yaml" <<'EOF'
import sys
base, smoothing = open(sys.argv[1]).read(), sys.argv[2]
head, tail = base.split("    - type: linear_quant", 1)
lines = [l for l in head.splitlines(keepends=True) if not l.lstrip().startswith("- {type:")]
print("".join(lines) + (f"    - {smoothing}\n" if smoothing else "") + "    - type: linear_quant" + tail, end="")
EOF
  echo "$work/$name.yaml"
}

perplexity() {  # perplexity of checkpoint $1
  "$qpipe" eval --model_path "$1" --data "$root/data/eval.jsonl" --seq_len "$seq" 2>/dev/null |
    sed -n 's/^perplexity: //p'
}

rows=()
float=$(perplexity "$model")
rows+=("| float model | | $float | |")
add() {  # name, pipeline file, smoothing description
  local name=$1 config=$2 what=$3 out=$work/$1 start elapsed ppl
  rm -rf "$out"
  start=$(date +%s.%N)
  "$qpipe" quant --model_path "$model" --save_path "$out" --config_path "$config" \
    --calib_samples "$samples" --seq_len "$seq" >"$work/$name.log" 2>&1 || { tail -n 5 "$work/$name.log" >&2; exit 1; }
  elapsed=$(echo "$(date +%s.%N) - $start" | bc -l)
  ppl=$(perplexity "$out")
  rows+=("$(printf '| %s | %s | %s | %+.2f %% (%.0f s) |' "$name" "$what" "$ppl" \
    "$(echo "($ppl / $float - 1) * 100" | bc -l)" "$elapsed")")
  echo "[quality] $name: $ppl" >&2
}

static=$configs/w8a8_static.yaml
dynamic=$configs/w8a8.yaml
add w8a8_static "$static" "none"
for alpha in 0.25 0.5 0.75; do
  add "w8a8_static + smooth_quant α $alpha" "$(pipeline sq$alpha "$static" "{type: smooth_quant, alpha: $alpha}")" \
    "smooth_quant, norm-linear"
done
add "w8a8_static + iter_smooth" "$(pipeline iter_static "$static" "{type: iter_smooth}")" "iter_smooth, all four types"
# The norm biases of the asymmetric mode have no place in compressed-tensors: ascendv1_saver.
asymmetric=$(pipeline iter_asym_static "$static" "{type: iter_smooth, symmetric: False}")
sed -i 's/{type: compressed_tensors, part_file_size: 4}/{type: ascendv1_saver}/' "$asymmetric"
add "w8a8_static + iter_smooth symmetric: False" "$asymmetric" "iter_smooth, norm-linear centred (ascendv1)"
add "w8a8_static + flex_smooth_quant" "$configs/w8a8_static_flex_smooth.yaml" "flex_smooth_quant, all four types"
add "w8a8 dynamic" "$dynamic" "none"
add "w8a8 dynamic + iter_smooth" "$configs/w8a8_iter_smooth.yaml" "iter_smooth, all four types"
add "w4a8 (SSZ)" "$configs/w4a8.yaml" "none"
add "w4a8 (SSZ) + flex_awq_ssz" "$configs/w4a8_flex_awq.yaml" "flex_awq_ssz, all four types"

[[ -x $root/.venv-bench/bin/python ]] || { echo "no .venv-bench: run tools/setup.sh --test" >&2; exit 1; }
{
  ids=$work/ids-$samples-$seq.json
  "$root/.venv-test/bin/python" "$root/tools/bench/vs_llmcompressor.py" ids "$model" "$root/data/calib.jsonl" \
    "$samples" "$seq" "$ids" >/dev/null
  rm -rf "$work/llmc"
  PYTHONWARNINGS=ignore "$root/.venv-bench/bin/python" "$root/tools/bench/vs_llmcompressor.py" quantize "$model" \
    "$work/llmc" sq_w8a8_static "$ids" >"$work/llmc.log" 2>&1 || { tail -n 5 "$work/llmc.log" >&2; exit 1; }
  ppl=$(perplexity "$work/llmc")
  rows+=("$(printf '| llm-compressor SmoothQuant α 0.5 + w8a8_static (peer) | SmoothQuantModifier, default mappings | %s | %+.2f %% |' \
    "$ppl" "$(echo "($ppl / $float - 1) * 100" | bc -l)")")
}

echo
echo "$(basename "$model"), calibration $samples x $seq tokens of data/calib.jsonl, eval data/eval.jsonl seq $seq, $(date -I)"
echo
echo "| pipeline | smoothing | perplexity | vs float (quant wall) |"
echo "| --- | --- | ---: | ---: |"
printf '%s\n' "${rows[@]}"
