#!/usr/bin/env bash
# Builds tests/sdk/CMakeLists.txt against the qpipe build in $1 (its qpipeConfig.cmake), then
# loads the module with `qpipe plugins --plugin_dir`, checks a pipeline with it and runs that
# pipeline on SmolLM2 (tools/setup.sh downloads it).
#   out_of_tree_plugin.sh BUILD_DIR SOURCE_DIR WORK_DIR
set -euo pipefail
build=$1 source=$2 work=$3
rm -rf "$work"
cmake -S "$source/tests/sdk" -B "$work" -G Ninja -Dqpipe_DIR="$build" \
  -DPLUGIN_SOURCE="$source/tests/fixtures/plugins/log_layers.cpp" >"$work.configure.log" 2>&1 \
  || { cat "$work.configure.log"; exit 1; }
cmake --build "$work" >"$work.build.log" 2>&1 || { cat "$work.build.log"; exit 1; }
test -f "$work/plugins/liblog_layers.so" || { echo "no $work/plugins/liblog_layers.so"; ls -R "$work"; exit 1; }
listing=$("$build/bin/qpipe" plugins --plugin_dir "$work/plugins")
grep -q "log_layers .* $work/plugins/liblog_layers.so" <<<"$listing" \
  || { echo "qpipe plugins did not load it from $work/plugins:"; echo "$listing"; exit 1; }
grep -q "rejected" <<<"$listing" && { echo "a library was rejected:"; echo "$listing"; exit 1; }
"$build/bin/qpipe" check --config_path "$source/tests/fixtures/pipelines/log_layers.yaml" \
  --plugin_dir "$work/plugins" >"$work.check.log" 2>&1 || { cat "$work.check.log"; exit 1; }
rm -rf "$work.quantized"
"$build/bin/qpipe" quant --model_path "$source/.cache/models/smollm2-135m" --plugin_dir "$work/plugins" \
  --config_path "$source/tests/fixtures/pipelines/log_layers.yaml" --save_path "$work.quantized" \
  >"$work.quant.log" 2>&1 || { cat "$work.quant.log"; exit 1; }
grep -q "first model.layers.1: 0 calibration samples" "$work.quant.log" && ! grep -q "first model.layers.2:" "$work.quant.log" \
  || { echo "the plugin did not log the layers its patterns select:"; grep "calibration samples" "$work.quant.log"; exit 1; }
echo "built, loaded, checked and ran $work/plugins/liblog_layers.so"
