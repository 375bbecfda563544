#!/usr/bin/env bash
# Tokenizer load time and encode throughput, qpipe against Python `tokenizers` (Tokenizer.from_file,
# then Tokenizer.encode per text, one thread) on the same tokenizer.json and texts. Prints a table;
# needs tools/setup.sh --test.
#   tools/bench/tokenizer_throughput.sh [MODEL_DIR] [DATA_FILE] [PASSES]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=${1:-$root/.cache/models/smollm2-135m}
data=${2:-$root/data/calib.jsonl}
passes=${3:-5}

read -r q_load q < <("$root/build/bin/qpipe_bench_tokenizer" "$model/tokenizer.json" "$data" "$passes" |
  sed 's/.*load_ms=\([0-9.]*\) .*tokens\/s=\([0-9]*\).*/\1 \2/')
read -r h_load h < <(RAYON_NUM_THREADS=1 "$root/.venv-test/bin/python" - "$model/tokenizer.json" "$data" "$passes" <<'PY'
import json, sys, time
from tokenizers import Tokenizer
start = time.perf_counter()
tokenizer = Tokenizer.from_file(sys.argv[1])
load_ms = (time.perf_counter() - start) * 1e3
texts = [json.loads(line)["text"] for line in open(sys.argv[2], encoding="utf-8") if line.strip()]
passes = int(sys.argv[3])
for text in texts:
    tokenizer.encode(text, add_special_tokens=False)
tokens, start = 0, time.perf_counter()
for _ in range(passes):
    for text in texts:
        tokens += len(tokenizer.encode(text, add_special_tokens=False).ids)
print(f"{load_ms:.1f} {tokens / (time.perf_counter() - start):.0f}")
PY
)
printf '| data | qpipe load ms | tokenizers load ms | qpipe tokens/s | tokenizers tokens/s | qpipe / tokenizers |\n'
printf '| --- | ---: | ---: | ---: | ---: | ---: |\n'
printf '| %s | %s | %s | %s | %s | %.1f |\n' "$(basename "$data")" "$q_load" "$h_load" "$q" "$h" "$(echo "$q / $h" | bc -l)"
