#!/usr/bin/env bash
# The main job, as far as it goes today: set up when needed, validate every pipeline of the
# practice library (configs/), and measure SmolLM2-135M's perplexity on the default eval set.
# (Quantizing it, and the perplexity after, arrive with `qpipe quant`.)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
tools/setup.sh
qpipe=build/bin/qpipe

echo
echo "== qpipe plugins"
"$qpipe" plugins

shopt -s nullglob
practices=(configs/*.yaml configs/*/*.yaml)
echo
echo "== validating ${#practices[@]} practice pipelines in configs/"
for config in "${practices[@]}"; do "$qpipe" check --config_path "$config" >/dev/null && echo "ok    $config"; done

echo
echo "== SmolLM2-135M-Instruct perplexity on data/eval.jsonl (seq_len 512, fp32)"
"$qpipe" eval --model_path .cache/models/smollm2-135m --data data/eval.jsonl --seq_len 512
echo "model: .cache/models/smollm2-135m"
