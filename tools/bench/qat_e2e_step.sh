#!/usr/bin/env bash
# End2end QAT: seconds per training step (the whole model, one 512-token sample: the teacher's
# forward with the quantizers bypassed, the student's forward and backward, CAKLD + LM loss,
# clipping, AdamW; FP8 static, LSQ, relative scales) and peak RSS, qpipe against the same
# training written in PyTorch + transformers (tools/bench/qat_e2e_step_torch.py), same threads, in
# one run. qpipe's step time is the difference of two runs (max_steps 2 and 6) over the extra
# steps, so its start-up, calibration, evaluation and save do not count; RSS is each process's peak.
#   tools/bench/qat_e2e_step.sh [MODEL_DIR] [THREADS]        needs tools/setup.sh --test
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
threads=${2:-2}
qpipe=${QPIPE:-$root/build/bin/qpipe}
work=$root/.cache/bench/qat_e2e_step
mkdir -p "$work"

run_qpipe() {  # steps -> "seconds peak_kib"
  cat > "$work/qat-$1.yaml" <<YAML
apiversion: modelslim_v1
spec:
  process:
    - type: learnable_scale_qat
      training_mode: end2end
      qconfig:
        act: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
      plugin_config: {quant_config: {learnable: {act_scale: True, weight_scale: True}}}
      loss_type: cakld
      ste: lsq
      learning_rate: 1.0e-2
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
qpipe_step=$(python3 -c 'import sys; a, b = map(float, sys.argv[1:]); print(f"{(b - a) / 4:.4f}")' "$short_s" "$long_s")
qpipe_rss=$(( long_kib / 1024 ))
read -r torch_step torch_rss < <(cd "$root/tools/bench" && OMP_NUM_THREADS="$threads" \
  "$root/.venv-test/bin/python" qat_e2e_step_torch.py "$model" 8 "$threads" 2>/dev/null)
speedup=$(python3 -c 'import sys; q, t = map(float, sys.argv[1:]); print(f"{t / q:.2f}")' "$qpipe_step" "$torch_step")
printf '| %-28s | %14s | %13s |\n' "tool ($threads threads)" "s / step" "peak RSS MiB"
printf '| %-28s | %14s | %13s |\n' "---" "---:" "---:"
printf '| %-28s | %14s | %13s |\n' "qpipe learnable_scale_qat" "$qpipe_step" "$qpipe_rss"
printf '| %-28s | %14s | %13s |\n' "PyTorch + transformers" "$torch_step" "$torch_rss"
echo "qpipe per-step speedup: ${speedup}x"
