#!/usr/bin/env bash
# qpipe quant against llm-compressor's oneshot, same model, scheme and calibration token ids, on
# this machine's CPU in the same run. Prints a table; needs tools/setup.sh --test (built qpipe,
# SmolLM2, .venv-test, and .venv-bench with llm-compressor: it sees .venv's torch 2.11.0, the one
# LibTorch comes from, through a .pth file, so both sides run the same ATen kernels).
#   tools/bench/vs_llmcompressor.sh [MODEL_DIR] [SAMPLES] [SEQ_LEN]
# Environment: QPIPE (default build/bin/qpipe), RECIPES (default "dynamic static fp8_static w4a16"),
#   QPIPE_DEVICE (qpipe's --device, default cpu: one process with a thread per core; cpu:0,1 runs
#   two ranks of one thread each, splitting the calibration samples), QPIPE_ARGS (more options of
#   qpipe quant, e.g. "--probe_tokens 0": no error probe in the report, which llm-compressor has not).
#   dynamic     W8A8: int8 per-channel symmetric weights (minmax), dynamic per-token int8
#               activations, lm_head kept; data-free on both sides
#   static      the same weights, per-tensor asymmetric static int8 activations from the min/max
#               over every calibration token (configs/default/w8a8_static.yaml, msmodelslim's
#               default_w8a8): calibration forwards on both sides
#   smooth_static  SmoothQuant (α 0.5, llm-compressor's default mappings; qpipe's smooth_quant) before
#               the static scheme (configs/default/w8a8_static_smooth_quant.yaml)
#   flex_static qpipe's flex_smooth_quant (α/β searched per subgraph) before the static scheme
#               (configs/default/w8a8_static_flex_smooth.yaml), against llm-compressor's SmoothQuant
#   fp8_static  FP8 E4M3 per-tensor weights and static per-tensor activations
#               (configs/default/w8a8_fp8_static.yaml)
#   w4a16       int4 symmetric weights in groups of 64 (tools/bench/w4a16_g64.yaml: SmolLM2's
#               width 576 is no multiple of the practice's 128); data-free
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=$(realpath "${1:-$root/.cache/models/smollm2-135m}")
samples=${2:-128}
seq=${3:-512}
qpipe=${QPIPE:-$root/build/bin/qpipe}
recipes=${RECIPES:-dynamic static fp8_static w4a16}
read -r -a extra_args <<<"${QPIPE_ARGS:-}"
qpipe_label="qpipe${QPIPE_ARGS:+ $QPIPE_ARGS}"
data=$root/data/calib.jsonl
work=$root/.cache/bench/vs_llmcompressor
bench_py=$root/tools/bench/vs_llmcompressor.py

# 1. The llm-compressor virtualenv, made by tools/setup.sh --test (pinned; torch is .venv's 2.11.0).
venv=$root/.venv-bench
[[ -x $venv/bin/python ]] || { echo "no $venv: run tools/setup.sh --test" >&2; exit 1; }
[[ -x $qpipe ]] || { echo "no $qpipe; build qpipe first (tools/setup.sh) or set QPIPE" >&2; exit 1; }

mkdir -p "$work"
ids=$work/ids-$samples-$seq.json
echo "[bench] calibration: $("$root/.venv-test/bin/python" "$bench_py" ids "$model" "$data" "$samples" "$seq" "$ids")" >&2

# The static practice: int8 per-channel weights, per-tensor asymmetric int8 activations (minmax).
static_config=${STATIC_CONFIG:-$root/configs/default/w8a8_static.yaml}

# Runs a command under /usr/bin/time; prints "wall_s max_rss_kib cpu_s" (cpu: user + system).
timed() {
  local log=$1
  shift
  /usr/bin/time -f "%e %M %U %S" -o "$work/time.txt" "$@" >"$log" 2>&1 || {
    tail -n 20 "$log" >&2
    echo "[bench] failed: $* (log: $log)" >&2
    exit 1
  }
  awk '{printf "%s %s %.1f\n", $1, $2, $3 + $4}' "$work/time.txt"
}

rows=()
for recipe in $recipes; do
  case $recipe in
    dynamic) qpipe_args=(--quant_type w8a8) llmc_recipe=w8a8_dynamic ;;
    static) qpipe_args=(--config_path "$static_config") llmc_recipe=w8a8_static ;;
    smooth_static) qpipe_args=(--config_path "$root/configs/default/w8a8_static_smooth_quant.yaml") llmc_recipe=sq_w8a8_static ;;
    flex_static) qpipe_args=(--config_path "$root/configs/default/w8a8_static_flex_smooth.yaml") llmc_recipe=sq_w8a8_static ;;
    fp8_static) qpipe_args=(--config_path "$root/configs/default/w8a8_fp8_static.yaml") llmc_recipe=fp8_static ;;
    w4a16) qpipe_args=(--config_path "$root/tools/bench/w4a16_g64.yaml") llmc_recipe=w4a16 ;;
    *) echo "unknown recipe $recipe" >&2; exit 2 ;;
  esac

  out_l=$work/llmc-$recipe
  rm -rf "$out_l"
  read -r wall_l rss_l cpu_l < <(timed "$work/llmc-$recipe.log" env PYTHONWARNINGS=ignore "$venv/bin/python" "$bench_py" \
    quantize "$model" "$out_l" "$llmc_recipe" "$ids")
  timings=$(grep '^{"load_s"' "$work/llmc-$recipe.log")
  oneshot_l=$(echo "$timings" | python3 -c 'import json,sys; print("%.2f" % json.load(sys.stdin)["oneshot_s"])')
  save_l=$(echo "$timings" | python3 -c 'import json,sys; print("%.2f" % json.load(sys.stdin)["save_s"])')
  load_l=$(echo "$timings" | python3 -c 'import json,sys; print("%.2f" % json.load(sys.stdin)["load_s"])')

  out_q=$work/qpipe-$recipe
  rm -rf "$out_q"
  read -r wall_q rss_q cpu_q < <(timed "$work/qpipe-$recipe.log" "$qpipe" quant --model_path "$model" --save_path "$out_q" \
    "${qpipe_args[@]}" --calib_data "$data" --calib_samples "$samples" --seq_len "$seq" --device "${QPIPE_DEVICE:-cpu}" --log_level info \
    ${extra_args[@]+"${extra_args[@]}"})

  runner_q=$(python3 -c 'import json,sys; print("%.2f" % json.load(open(sys.argv[1]))["total_seconds"])' \
    "$out_q/quant_report.json")
  processors_q=$(python3 -c 'import json,sys; r = json.load(open(sys.argv[1]))
search = sum(v.get("search_seconds", 0) for l in r["layers"] for v in l.get("values", {}).values())
print("%.2f" % sum(sum(l["processor_seconds"]) for l in r["layers"]) + (", α/β search %.2f" % search if search else ""))' \
    "$out_q/quant_report.json")
  total_q=$(sed -n 's/^saved .* in \([0-9.]*\) s (report.*/\1/p' "$work/qpipe-$recipe.log")
  echo "[bench] $recipe: llm-compressor output vs qpipe output" >&2
  "$root/.venv-test/bin/python" "$bench_py" compare "$out_l" "$out_q" >&2 || echo "[bench] $recipe: outputs differ" >&2

  quant_l=$(echo "$load_l + $oneshot_l + $save_l" | bc -l)
  rows+=("$(printf '| %s | llm-compressor 0.14.0.1 | %.2f | load %s, oneshot %s, save %s | %.1f | %s | %d | | |' \
    "$recipe" "$quant_l" "$load_l" "$oneshot_l" "$save_l" "$wall_l" "$cpu_l" $((rss_l / 1024)))")
  rows+=("$(printf '| %s | %s | %.2f | runner %s (processors %s) | %.1f | %s | %d | %.2f | %.2f |' "$recipe" \
    "$qpipe_label" "$total_q" "$runner_q" "$processors_q" "$wall_q" "$cpu_q" $((rss_q / 1024)) \
    "$(echo "$quant_l / $total_q" | bc -l)" "$(echo "$wall_l / $wall_q" | bc -l)")")
done

echo
echo "$(basename "$model"), $samples samples x $seq tokens, $(nproc) cores, $(date -I), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf '| recipe | tool | load + quantize + save s | of which | process wall s | process CPU s | peak RSS MiB | speed-up, quantize + save | speed-up, process |\n'
printf '| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n'
printf '%s\n' "${rows[@]}"
