#!/usr/bin/env bash
# QAT: seconds per training step and peak RSS, qpipe against the same training written in
# PyTorch + transformers, same threads, in one run. FP8 static (per-tensor weights and inputs),
# LSQ, relative scales, one 512-token sample per step, gradient clipping, AdamW.
#   MODE=blockwise (default): one decoder layer, MSE to the float layer's output
#     (tools/bench/qat_step_torch.py); qpipe's RSS is the whole run's (every layer trained in
#     turn), PyTorch's is one layer trained with the whole model loaded.
#   MODE=end2end: the whole model, the teacher's forward with the quantizers bypassed, CAKLD + LM
#     loss (tools/bench/qat_e2e_step_torch.py); RSS is each process's peak.
# BF16=1 trains both under bf16 autocast (qpipe's bf16: True, torch.autocast).
# qpipe's step time is the difference of two runs (max_steps 2 and 6) over the extra steps, so its
# start-up, calibration, evaluation and save do not count.
#   [MODE=end2end] tools/bench/qat_step.sh [MODEL_DIR] [THREADS]        needs tools/setup.sh --test
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
threads=${2:-2}
qpipe=${QPIPE:-$root/build/bin/qpipe}
mode=${MODE:-blockwise}
bf16=${BF16:-0}
work=$root/.cache/bench/qat_step_$mode$([[ $bf16 == 1 ]] && echo _bf16 || true)
mkdir -p "$work"
case $mode in
  blockwise)  # each step trains one layer: the extra steps are 4 per layer
    units=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$model/config.json")
    extra=""; torch_script=qat_step_torch.py; torch_steps=12 ;;
  end2end)
    units=1; extra=$'      training_mode: end2end\n      loss_type: cakld'
    torch_script=qat_e2e_step_torch.py; torch_steps=8 ;;
  *) echo "MODE is blockwise or end2end, not $mode" >&2; exit 2 ;;
esac

run_qpipe() {  # steps -> "seconds peak_kib"
  cat > "$work/qat-$1.yaml" <<YAML
apiversion: modelslim_v1
spec:
  process:
    - type: learnable_scale_qat
$extra
      qconfig:
        act: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
      plugin_config: {quant_config: {learnable: {act_scale: True, weight_scale: True}}}
      ste: lsq
      learning_rate: 1.0e-2
      bf16: $([[ $bf16 == 1 ]] && echo True || echo False)
      max_steps: $1
  save:
    - {type: compressed_tensors}
YAML
  rm -rf "$work/out-$1" "$work/out-$1".qat_*
  /usr/bin/time -f "%e %M" -o "$work/time-$1" env OMP_NUM_THREADS="$threads" "$qpipe" --log_level warn quant \
    --model_path "$model" --save_path "$work/out-$1" --config_path "$work/qat-$1.yaml" \
    --calib_samples 1 --seq_len 512 > /dev/null
  rm -rf "$work/out-$1" "$work/out-$1".qat_*
  cat "$work/time-$1"
}

read -r short_s short_kib < <(run_qpipe 2)
read -r long_s long_kib < <(run_qpipe 6)
qpipe_step=$(python3 -c 'import sys; a, b, n = map(float, sys.argv[1:]); print(f"{(b - a) / (n * 4):.4f}")' \
  "$short_s" "$long_s" "$units")
qpipe_rss=$(( long_kib / 1024 ))
read -r torch_step torch_rss < <(cd "$root/tools/bench" && OMP_NUM_THREADS="$threads" BF16="$bf16" \
  "$root/.venv-test/bin/python" "$torch_script" "$model" "$torch_steps" "$threads" 2>/dev/null)
speedup=$(python3 -c 'import sys; q, t = map(float, sys.argv[1:]); print(f"{t / q:.2f}")' "$qpipe_step" "$torch_step")
printf '| %-28s | %14s | %13s |\n' "$mode$([[ $bf16 == 1 ]] && echo ", bf16" || true) ($threads threads)" "s / step" "peak RSS MiB"
printf '| %-28s | %14s | %13s |\n' "---" "---:" "---:"
printf '| %-28s | %14s | %13s |\n' "qpipe learnable_scale_qat" "$qpipe_step" "$qpipe_rss"
printf '| %-28s | %14s | %13s |\n' "PyTorch + transformers" "$torch_step" "$torch_rss"
echo "qpipe per-step speedup: ${speedup}x"
