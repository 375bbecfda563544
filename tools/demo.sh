#!/usr/bin/env bash
# The main job end to end: set up when needed, list the plugins, validate every pipeline of the
# practice library (configs/), quantize SmolLM2-135M-Instruct with the default w8a8 practice, and
# measure perplexity on data/eval.jsonl before (float model) and after (quantized checkpoint) with
# the same settings.
#
#   tools/demo.sh                 checkpoint in .cache/demo/smollm2-135m-w8a8 (replaced on each run)
#   QPIPE_DEMO_OUT=DIR tools/demo.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
tools/setup.sh
qpipe=build/bin/qpipe
model=.cache/models/smollm2-135m
out=${QPIPE_DEMO_OUT:-.cache/demo/smollm2-135m-w8a8}
quant_type=w8a8
eval_data=data/eval.jsonl
seq_len=512

echo
echo "== qpipe plugins"
"$qpipe" plugins

shopt -s nullglob
practices=(configs/*.yaml configs/*/*.yaml)
echo
echo "== validating ${#practices[@]} practice pipelines in configs/"
for config in "${practices[@]}"; do "$qpipe" check --config_path "$config" >/dev/null && echo "ok    $config"; done

# The checkpoint folder is the demo's own: replace one that an earlier demo wrote (it has a
# quant_report.json), refuse to touch anything else.
if [[ -e $out ]]; then
  if [[ -f $out/quant_report.json || -z $(ls -A "$out") ]]; then
    rm -rf "$out"
  else
    echo "demo: $out exists and was not written by qpipe quant; remove it or set QPIPE_DEMO_OUT" >&2
    exit 1
  fi
fi
mkdir -p "$(dirname "$out")"

echo
echo "== quantizing $model with --quant_type $quant_type into $out"
"$qpipe" quant --model_path "$model" --save_path "$out" --quant_type "$quant_type"

# Prints eval's result and leaves the perplexity in $ppl.
evaluate() {
  local result
  result=$("$qpipe" eval --model_path "$1" --data "$eval_data" --seq_len "$seq_len")
  echo "$result"
  ppl=$(sed -n 's/^perplexity: //p' <<<"$result")
}

echo
echo "== perplexity before: float model $model on $eval_data (seq_len $seq_len)"
evaluate "$model"
ppl_float=$ppl

echo
echo "== perplexity after: $quant_type checkpoint $out on $eval_data (seq_len $seq_len)"
evaluate "$out"
ppl_quant=$ppl

echo
echo "== SmolLM2-135M-Instruct on $eval_data, seq_len $seq_len"
printf '%-22s %10s\n' "model" "perplexity"
printf '%-22s %10.4f\n' "float32" "$ppl_float" "$quant_type" "$ppl_quant"
awk -v f="$ppl_float" -v q="$ppl_quant" 'BEGIN { printf "change: %+.2f%%\n", 100 * (q - f) / f }'
echo "quantized checkpoint: $(cd "$out" && pwd) (report: quant_report.json)"
