#!/usr/bin/env bash
# Perplexity of float, PTQ and QAT checkpoints on held-out text (docs/quality.md):
# for each scheme, the PTQ pipeline (a practice's steps before learnable_scale_qat where it has
# them, else linear_quant with its qconfig and lm_head left in float, as QAT leaves it) and the QAT
# practice of configs/qat/, both calibrated on the same windows of
# data/calib.jsonl, then `qpipe eval` on data/eval.jsonl. Prints a table with the share of the
# PTQ gap to float that QAT recovers, and each run's time.
#   tools/bench/qat_quality.sh [MODEL_DIR] [SAMPLES] [SEQ_LEN]
# Environment: SCHEMES (default "fp8_static w8a8_static w4a16"; the end2end practices are
# fp8_static_e2e, w8a8_static_e2e and w4a16_e2e, FP8 static with an FP8 KV cache fp8_static_c8, NVFP4 W4A4
# nvfp4, W4AFP8 in groups of 64 w4afp8_g64), QPIPE (default build/bin/qpipe).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
samples=${2:-32}
seq=${3:-512}
qpipe=${QPIPE:-$root/build/bin/qpipe}
schemes=${SCHEMES:-fp8_static w8a8_static w4a16}
work=$root/.cache/bench/qat_quality
mkdir -p "$work"

practice() {
  case $1 in
    fp8_static) echo "$root/configs/qat/w8a8_fp8_static_qat.yaml" ;;
    w8a8_static) echo "$root/configs/qat/w8a8_static_qat.yaml" ;;
    w4a16) echo "$root/configs/qat/w4a16_qat.yaml" ;;
    fp8_static_e2e) echo "$root/configs/qat/w8a8_fp8_static_e2e_qat.yaml" ;;
    w8a8_static_e2e) echo "$root/configs/qat/w8a8_static_e2e_qat.yaml" ;;
    fp8_static_c8) echo "$root/configs/qat/w8a8c8_fp8_static_qat.yaml" ;;
    w4a16_e2e) echo "$root/configs/qat/w4a16_e2e_qat.yaml" ;;
    nvfp4) echo "$root/configs/qat/w4a4_nvfp4_qat.yaml" ;;
    # W4AFP8 in groups of 64: SmolLM2's width 576 is no multiple of the practice's (and vLLM's) 128.
    w4afp8_g64)
      sed 's/group_size: 128/group_size: 64/' "$root/configs/qat/w4a8_fp8_qat.yaml" > "$work/w4afp8_g64_qat.yaml"
      echo "$work/w4afp8_g64_qat.yaml" ;;
    *) echo "unknown scheme $1" >&2; exit 2 ;;
  esac
}

# The PTQ pipeline: the practice's steps before learnable_scale_qat, or its qconfig under linear_quant.
ptq_pipeline() {
  python3 - "$1" "$2" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
process = text[text.index("  process:\n") + len("  process:\n"):text.index("    - type: learnable_scale_qat")]
if not process:
    qconfig = re.search(r"(      qconfig:\n(?:        .*\n)+)", text).group(1)
    process = "    - type: linear_quant\n" + qconfig + '      exclude: ["lm_head"]\n'
open(sys.argv[2], "w").write("apiversion: modelslim_v1\nspec:\n  process:\n" + process +
                             "  save:\n    - {type: compressed_tensors, part_file_size: 4}\n")
PY
}

ppl() {
  "$qpipe" --log_level warn eval --model_path "$1" --data "$root/data/eval.jsonl" --seq_len 512 |
    sed -n 's/^perplexity: //p'
}

quant() {  # out pipeline -> seconds
  rm -rf "$1" "$1.qat_log.jsonl"
  local start=$SECONDS
  "$qpipe" --log_level warn quant --model_path "$model" --save_path "$1" --config_path "$2" \
    --calib_samples "$samples" --seq_len "$seq" > /dev/null
  echo $((SECONDS - start))
}

float=$(ppl "$model")
printf '| %-12s | %10s | %10s | %10s | %9s | %7s | %7s |\n' scheme float PTQ QAT recovered "PTQ s" "QAT s"
printf '| %-12s | %10s | %10s | %10s | %9s | %7s | %7s |\n' --- ---: ---: ---: ---: ---: ---:
for scheme in $schemes; do
  qat_yaml=$(practice "$scheme")
  ptq_pipeline "$qat_yaml" "$work/$scheme-ptq.yaml"
  ptq_s=$(quant "$work/$scheme-ptq" "$work/$scheme-ptq.yaml")
  ptq=$(ppl "$work/$scheme-ptq")
  qat_s=$(quant "$work/$scheme-qat" "$qat_yaml")
  qat=$(ppl "$work/$scheme-qat")
  recovered=$(python3 -c "import sys; f, p, q = map(float, sys.argv[1:]); print(f'{100 * (p - q) / (p - f):.0f} %')" \
    "$float" "$ptq" "$qat")
  printf '| %-12s | %10s | %10s | %10s | %9s | %7s | %7s |\n' "$scheme" "$float" "$ptq" "$qat" "$recovered" "$ptq_s" "$qat_s"
  rm -rf "$work/$scheme-ptq" "$work/$scheme-qat"
done
