#!/usr/bin/env bash
# Perplexity of SmolLM2 with and without fa3_quant's attention quantization (docs/attention.md):
# each c8/f8 practice next to its base practice; prints the table of docs/quality.md.
#   tools/bench/kv_quality.sh [MODEL_DIR] [SAMPLES] [SEQ_LEN]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
samples=${2:-32}
seq=${3:-512}
qpipe=${QPIPE:-$root/build/bin/qpipe}
work=$root/.cache/bench/kv_quality
mkdir -p "$work"

perplexity() {  # perplexity of checkpoint $1
  "$qpipe" eval --model_path "$1" --data "$root/data/eval.jsonl" --seq_len "$seq" 2>/dev/null |
    sed -n 's/^perplexity: //p'
}

echo "$(basename "$model"), calibration $samples x $seq tokens of data/calib.jsonl, eval data/eval.jsonl seq $seq, $(date -I)"
echo
echo "| --quant_type | attention | perplexity | vs its base |"
echo "| --- | --- | ---: | ---: |"
for pair in "w8a8 w8a8c8 K,V_int8_per_KV_head" "w8a8 w8a8f8 Q,K,V_int8_per_head" "w8a8_fp8 w8a8c8_fp8 K,V_fp8_per_tensor" \
  "w4a8 w4a8c8 K,V_int8_per_KV_head"; do
  read -r base kv what <<<"$pair"
  for quant in "$base" "$kv"; do
    rm -rf "${work:?}/$quant"
    "$qpipe" quant --model_path "$model" --save_path "$work/$quant" --quant_type "$quant" \
      --calib_samples "$samples" --seq_len "$seq" >"$work/$quant.log" 2>&1 || { tail -n 5 "$work/$quant.log" >&2; exit 1; }
  done
  basePpl=$(perplexity "$work/$base")
  kvPpl=$(perplexity "$work/$kv")
  echo "| $base | float | $basePpl | |"
  printf '| %s | %s | %s | %+.2f %% |\n' "$kv" "${what//_/ }" "$kvPpl" "$(echo "($kvPpl / $basePpl - 1) * 100" | bc -l)"
done
