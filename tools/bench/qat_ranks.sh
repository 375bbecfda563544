#!/usr/bin/env bash
# Data-parallel QAT: seconds per training step and peak RSS of 1 rank × 1 thread against
# 2 ranks × 1 thread (docs/benchmarks.md). Blockwise FP8 static QAT of SmolLM2 (per-tensor weights
# and inputs, LSQ), 4 samples of 256 tokens per step (per_device_train_batch_size 4), so each of
# two ranks takes 2. The step time is the difference of two runs (max_steps 2 and 6 per layer)
# over the extra steps, so start-up, calibration and save do not count; RSS is the largest
# process's peak (a rank's, with 2).
#   tools/bench/qat_ranks.sh [MODEL_DIR]        needs tools/setup.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
qpipe=${QPIPE:-$root/build/bin/qpipe}
work=$root/.cache/bench/qat_ranks
mkdir -p "$work"
layers=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$model/config.json")

run() {  # devices steps -> "seconds peak_kib"
  cat > "$work/qat-$2.yaml" <<YAML
apiversion: modelslim_v1
spec:
  process:
    - type: learnable_scale_qat
      qconfig:
        act: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
        weight: {dtype: fp8_e4m3, scope: per_tensor, symmetric: True, method: minmax}
      plugin_config: {quant_config: {learnable: {act_scale: True, weight_scale: True}}}
      ste: lsq
      learning_rate: 1.0e-2
      per_device_train_batch_size: 4
      max_steps: $2
  save:
    - {type: compressed_tensors}
YAML
  rm -rf "$work/out" "$work/out".qat_*
  /usr/bin/time -f "%e %M" -o "$work/time" "$qpipe" --log_level warn quant --model_path "$model" \
    --save_path "$work/out" --config_path "$work/qat-$2.yaml" --calib_samples 4 --seq_len 256 \
    --device "$1" --threads_per_rank 1 > /dev/null
  rm -rf "$work/out" "$work/out".qat_*
  cat "$work/time"
}

printf '| %-22s | %10s | %13s |\n' "ranks × threads" "s / step" "peak RSS MiB"
printf '| %-22s | %10s | %13s |\n' "---" "---:" "---:"
declare -A step
for devices in cpu:0 cpu:0,1; do
  read -r short_s _ < <(run "$devices" 2)
  read -r long_s long_kib < <(run "$devices" 6)
  step[$devices]=$(python3 -c 'import sys; a, b, n = map(float, sys.argv[1:]); print(f"{(b - a) / (n * 4):.4f}")' \
    "$short_s" "$long_s" "$layers")
  ranks=$(( $(tr -cd ',' <<< "$devices" | wc -c) + 1 ))
  printf '| %-22s | %10s | %13s |\n' "$ranks × 1" "${step[$devices]}" "$(( long_kib / 1024 ))"
done
python3 -c 'import sys; a, b = map(float, sys.argv[1:]); print(f"2 ranks: {a / b:.2f}x the steps per second of 1")' \
  "${step[cpu:0]}" "${step[cpu:0,1]}"
