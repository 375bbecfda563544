#!/usr/bin/env bash
# Memory of end2end QAT's distillation loss at a large vocabulary (docs/benchmarks.md): the loss on
# whole logits against the loss applying the lm_head a chunk at a time, each in a fresh process,
# on a synthetic head (Qwen2's vocabulary of 151,936 and Qwen2.5-0.5B's hidden size by default).
# Needs a build with tests (tools/setup.sh --test).
#   tools/bench/distill_memory.sh [TOKENS] [HIDDEN] [VOCAB] [LOSSES...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tokens=${1:-2048}
hidden=${2:-896}
vocab=${3:-151936}
shift $(( $# < 3 ? $# : 3 ))
losses=("${@:-kl_top_1000}")
bench=$root/build/bin/qpipe_bench_distill

echo "$tokens tokens, hidden $hidden, vocab $vocab; one [tokens, vocab] fp32 tensor is" \
  "$(( tokens * vocab * 4 / 1048576 )) MiB; $(nproc) cores, $(date -u +%F), load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '| loss | logits | s | peak RSS MiB | above inputs and head MiB | loss | gradient sum |\n'
printf '| --- | --- | ---: | ---: | ---: | ---: | ---: |\n'
for loss in "${losses[@]}"; do
  for mode in whole chunked; do
    line=$("$bench" "$mode" "$tokens" "$hidden" "$vocab" "$loss")
    field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $line"; }
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$loss" "$mode" "$(field seconds)" "$(field peak_mib)" \
      "$(field above_inputs_mib)" "$(field loss)" "$(field grad_sum)"
  done
done
