#!/usr/bin/env bash
# The main job, as far as it goes today: set up when needed, list the plugins qpipe finds, and
# validate every pipeline of the practice library (configs/) plus the example plugin's pipeline.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
tools/setup.sh
qpipe=build/bin/qpipe

echo
echo "== qpipe plugins"
"$qpipe" plugins

shopt -s nullglob
practices=(configs/*.yaml configs/*/*.yaml)
echo
echo "== validating ${#practices[@]} practice pipelines in configs/"
failed=0
for config in "${practices[@]}"; do
  if "$qpipe" check --config_path "$config" >/dev/null; then echo "ok    $config"; else echo "FAIL  $config"; failed=1; fi
done

echo
echo "== the example plugin's pipeline (docs/plugins.md)"
"$qpipe" check --config_path tests/fixtures/pipelines/log_layers.yaml --plugin_dir build/tests/plugins/example
exit $failed
