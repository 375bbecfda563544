#!/usr/bin/env bash
# `qpipe eval` tokens/s on the float model and on its W8A8 (dynamic), FP8 (dynamic) and W4A16
# (groups of 64) checkpoints, and transformers scoring the same windows of the float model, in one run. Prints a
# table; needs tools/setup.sh --test (built qpipe, SmolLM2, .venv-test). W4A16 runs twice: as qpipe
# eval runs it (bf16x3 GEMMs where the CPU has AMX, grouped bf16 ones on AMD Zen 5, grouped int8
# ones on Zen 4), and with QPIPE_WEIGHT_ONLY_FP32=1.
#   tools/bench/eval_throughput.sh [MODEL_DIR] [TEXTS]
# TEXTS: how many texts of data/eval.jsonl to score (default 40: about 12 windows of 512).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
texts=${2:-40}
seq=512
qpipe=${QPIPE:-$root/build/bin/qpipe}
data=$root/data/eval.jsonl
work=$root/.cache/bench/eval_throughput
mkdir -p "$work"

declare -A checkpoints=([float]=$model)
declare -A configs=([w8a8]=$root/configs/default/w8a8.yaml [w8a8_fp8]=$root/configs/default/w8a8_fp8_dynamic.yaml
  [w4a16]=$root/tools/bench/w4a16_g64.yaml)
for practice in w8a8 w8a8_fp8 w4a16; do
  out=$work/$practice
  if [[ ! -f $out/config.json ]]; then
    "$qpipe" quant --model_path "$model" --save_path "$out" --config_path "${configs[$practice]}" --device cpu \
      --log_level warn >/dev/null
  fi
  checkpoints[$practice]=$out
done

rows=()
checkpoints[w4a16_fp32]=${checkpoints[w4a16]}
for name in float w8a8 w8a8_fp8 w4a16 w4a16_fp32; do
  fp32=0
  [[ $name == *_fp32 ]] && fp32=1
  QPIPE_WEIGHT_ONLY_FP32=$fp32 "$qpipe" eval --model_path "${checkpoints[$name]}" --data "$data" --seq_len $seq --max_samples "$texts" \
    --output_json "$work/$name.json" --log_level warn >/dev/null
  rows+=("$(python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("| qpipe | %s | %d | %.2f | %.1f | %.6f |" % (sys.argv[2], r["tokens"], r["seconds"], r["tokens_per_second"], r["perplexity"]))' \
    "$work/$name.json" "$name")")
done

# transformers on the float model: the same windows (every text joined with "\n\n", encoded once,
# consecutive whole windows of 512, as qpipe eval), each window's forward and cross-entropy timed.
rows+=("$(PYTHONWARNINGS=ignore "$root/.venv-test/bin/python" - "$model" "$data" "$texts" $seq 2>/dev/null <<'PY'
import json, math, sys, time
import torch, transformers as tf
from tokenizers import Tokenizer
model, data, texts, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines = [json.loads(l)["text"] for l in open(data, encoding="utf-8") if l.strip()][:texts]
ids = Tokenizer.from_file(model + "/tokenizer.json").encode("\n\n".join(lines), add_special_tokens=False).ids
windows = [ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq)]  # whole windows, as qpipe eval
lm = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
nll, tokens = 0.0, 0
with torch.inference_mode():
    start = time.perf_counter()
    for w in windows:
        x = torch.tensor([w])
        logits = lm(x).logits[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits.double(), x[0, 1:], reduction="sum").item()
        tokens += len(w) - 1
    seconds = time.perf_counter() - start
print("| transformers %s | float | %d | %.2f | %.1f | %.6f |" % (tf.__version__, tokens, seconds, tokens / seconds,
                                                                 math.exp(nll / tokens)))
PY
)")

echo
echo "$(basename "$model"), $texts texts of $(basename "$data"), seq $seq, $(nproc) cores, $(date -I), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf '| tool | checkpoint | tokens | seconds | tokens/s | perplexity |\n'
printf '| --- | --- | ---: | ---: | ---: | ---: |\n'
printf '%s\n' "${rows[@]}"
