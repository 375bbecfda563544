#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and a torch 2.11.0+cu130 wheel but none of
# qpipe's build dependencies. Two halves:
#
#   tools/gpu_check.sh pack     here, after tools/setup.sh: stripped binaries, the shared
#                               libraries they need beyond LibTorch, and a small random Llama,
#                               into .gpu/
#   tools/gpu_check.sh run      on the GPU machine, from the repository root with .gpu/ beside
#                               it: NCCL collectives, CUDA tensors through quant and eval,
#                               CPU-vs-CUDA agreement, timings; prints a table (docs/gpu.md)
#
# TORCH_LIB (default: the torch of `python3`) names LibTorch's folder on the GPU machine.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
pack_dir=.gpu

pack() {
  local build=${QPIPE_BUILD:-build}
  [[ -x $build/bin/qpipe_gpu_dist_check ]] || { echo "gpu_check: $build has no CUDA targets" >&2; exit 2; }
  rm -rf "$pack_dir" && mkdir -p "$pack_dir/bin" "$pack_dir/lib/qpipe/plugins" "$pack_dir/lib/sys"
  cp "$build/bin/qpipe" "$build/bin/qpipe_gpu_dist_check" "$pack_dir/bin/"
  cp "$build"/lib/libqpipe_*.so "$pack_dir/lib/"
  cp "$build"/lib/qpipe/plugins/*.so "$pack_dir/lib/qpipe/plugins/"
  strip --strip-debug "$pack_dir"/bin/* "$pack_dir"/lib/*.so "$pack_dir"/lib/qpipe/plugins/*.so
  # Debian's libraries that the GPU machine's image lacks (glibc and libstdc++ it has).
  ldd "$build/bin/qpipe" "$build/lib/libqpipe_core.so" | awk '$3 ~ /^\/(usr\/)?lib\/x86_64-linux-gnu\// {print $3}' |
    grep -Ev '/lib(c|m|dl|rt|pthread|util|gcc_s|stdc\+\+)\.so' | sort -u | xargs -r cp -L -t "$pack_dir/lib/sys"
  cp .cache/models/smollm2-135m/tokenizer.json .cache/models/smollm2-135m/tokenizer_config.json "$pack_dir/"
  .venv-test/bin/python - "$pack_dir/tiny-llama" <<'PY'
import shutil, sys, torch, transformers
out = sys.argv[1]
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                  tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
                                  bos_token_id=1, eos_token_id=2)
transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{out}/../{name}", f"{out}/{name}")
PY
  du -sh "$pack_dir"
}

run() {
  local torch_lib=${TORCH_LIB:-$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__) + "/lib")')}
  export LD_LIBRARY_PATH="$torch_lib:$root/$pack_dir/lib:$root/$pack_dir/lib/sys${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export QPIPE_HOME=$root OMP_WAIT_POLICY=passive
  local qpipe=$pack_dir/bin/qpipe work=/tmp/qpipe-gpu-work log=${OUT:-/tmp}/gpu_check.log
  rm -rf "$work" && mkdir -p "$work"
  : >"$log"
  declare -a rows
  row() { rows+=("$(printf '%-44s %-8s %s' "$1" "$2" "$3")"); }
  timed() {  # name, command...: runs it, logs it, records pass/fail and seconds
    local name=$1 start end status=PASS
    shift
    start=$(date +%s%N)
    { echo "== $name: $*"; "$@"; } >>"$log" 2>&1 || status=FAIL
    end=$(date +%s%N)
    row "$name" "$status" "$(((end - start) / 1000000)) ms"
  }

  nvidia-smi -L | tee -a "$log"
  timed "NCCL collectives (1 rank, cuda:0)" env RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 \
    "$pack_dir/bin/qpipe_gpu_dist_check"
  local model=$pack_dir/tiny-llama data=data/eval.jsonl
  for practice in w8a8 w8a8_static; do
    for device in cpu cuda:0; do
      timed "quant $practice on $device (tiny Llama)" "$qpipe" quant --model_path "$model" --config_path "configs/default/$practice.yaml" \
        --device "$device" --calib_samples 16 --seq_len 256 --save_path "$work/$practice-${device%%:*}"
    done
    timed "compare $practice cpu vs cuda (tol 1e-2)" "$qpipe" compare "$work/$practice-cpu" "$work/$practice-cuda" \
      --tolerance 1e-2
  done
  for device in cpu cuda:0; do
    timed "eval float on $device" "$qpipe" eval --model_path "$model" --data "$data" --device "$device" \
      --max_samples 20 --output_json "$work/eval-float-${device%%:*}.json"
    timed "eval w8a8_static on $device" "$qpipe" eval --model_path "$work/w8a8_static-cuda" --data "$data" \
      --device "$device" --max_samples 20 --output_json "$work/eval-static-${device%%:*}.json"
  done
  # A real-size layer: Qwen3-1.7B's shape, 12 layers, made here with the machine's own torch.
  mkdir -p .cache/models/smollm2-135m && cp "$pack_dir"/tokenizer*.json .cache/models/smollm2-135m/
  timed "make synthetic Qwen3 (12 layers, 1.3 GB)" python3 tools/bench/make_synthetic_qwen3.py \
    --out "$work/qwen3-12l" --num_layers 12
  for practice in w8a8 w8a8_static; do
    timed "quant $practice cuda:0, Qwen3 12l, 128x512" "$qpipe" quant --model_path "$work/qwen3-12l" \
      --config_path "configs/default/$practice.yaml" --device cuda:0 --save_path "$work/qwen3-$practice"
  done

  printf '\n%-44s %-8s %s\n' check result time
  printf '%s\n' "${rows[@]}"
  echo "perplexity (float, w8a8_static):"
  grep -h perplexity "$work"/eval-*.json 2>/dev/null || true
  rm -rf "$work"
}

case ${1:-} in
  pack) pack ;;
  run) run ;;
  *) echo "usage: tools/gpu_check.sh pack|run" >&2; exit 2 ;;
esac
