#!/usr/bin/env bash
# Forward throughput, qpipe against transformers on the same machine in the same run: fp32, random
# ids, seq 512, batch 1 and 8, each measurement in a fresh process (allocator state from an
# earlier batch size skews the next). Prints a table; needs tools/setup.sh --test.
#   tools/bench/forward_throughput.sh [MODEL_DIR] [ITERATIONS]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=${1:-$root/.cache/models/smollm2-135m}
iterations=${2:-3}
seq=512

transformers_rate() {
  PYTHONWARNINGS=ignore "$root/.venv-test/bin/python" - "$model" $seq "$iterations" "$1" 2>/dev/null <<'PY'
import sys, time, torch, transformers as tf
model, seq, iterations, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lm = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
ids = torch.randint(0, lm.config.vocab_size, (batch, seq))
with torch.inference_mode():
    lm(ids)
    start = time.perf_counter()
    for _ in range(iterations):
        lm(ids)
    print(f"{batch * seq * iterations / (time.perf_counter() - start):.1f}")
PY
}
qpipe_rate() { "$root/build/bin/qpipe_bench_forward" "$model" $seq "$iterations" "$1" | sed 's/.*tokens\/s=//'; }

printf '| batch | seq | qpipe tokens/s | transformers tokens/s | qpipe / transformers |\n'
printf '| ---: | ---: | ---: | ---: | ---: |\n'
for batch in 1 8; do
  q=$(qpipe_rate $batch)
  h=$(transformers_rate $batch)
  printf '| %s | %s | %s | %s | %.2f |\n' $batch $seq "$q" "$h" "$(echo "$q / $h" | bc -l)"
done
