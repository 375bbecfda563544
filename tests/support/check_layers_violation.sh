#!/usr/bin/env bash
# tools/check_layers.py must fail, naming the file, line and layers, on a tree whose base layer
# includes a host header.
set -euo pipefail
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/core/base/include/qpipe" "$root/core/host/include/qpipe/host" "$root/dist/include/qpipe/dist"
printf '#pragma once\n' >"$root/core/host/include/qpipe/host/runner.h"
printf '#pragma once\n#include "qpipe/host/runner.h"\n' >"$root/core/base/include/qpipe/error.h"
status=0
out=$(python3 "$(dirname "$0")/../../tools/check_layers.py" "$root") || status=$?
expected="core/base/include/qpipe/error.h:2: includes qpipe/host/runner.h of layer 'host'; core/base may include base only"
[[ $status == 1 ]] || { echo "expected exit 1, got $status: $out"; exit 1; }
[[ $out == "$expected"* ]] || { echo "unexpected output: $out"; exit 1; }
echo "check_layers names the violation"
