#!/usr/bin/env bash
# Install the CPU build of PyTorch into the active Python (export and train-draft need it; the runtime never
# imports torch). PyTorch publishes CPU-only wheels on its own index: use it when it answers. Otherwise fall back
# to the configured package index and say so: on Linux x86_64, PyPI's `torch` is the CUDA build (several GB
# with ~20 nvidia-* packages); elsewhere (macOS, aarch64 Linux, a local wheel mirror) it is a CPU build.
#   TORCH_VERSION    the version to install (default 2.13.0)
#   TORCH_CPU_INDEX  PyTorch's CPU wheel index (default https://download.pytorch.org/whl/cpu; empty: skip it)
set -euo pipefail
PYTHON="${PYTHON:-python}"
PIP="${PIP:-$PYTHON -m pip}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"

installed="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "${installed%%+*}" = "$TORCH_VERSION" ]; then
  echo "torch $installed is installed already"
  exit 0
fi
index_answers() {
  "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)' \
    "$1" >/dev/null 2>&1
}
if [ -n "$TORCH_CPU_INDEX" ] && index_answers "$TORCH_CPU_INDEX"; then
  echo "installing torch==$TORCH_VERSION (CPU build) from $TORCH_CPU_INDEX"
  $PIP install -q --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"
else
  echo "note: PyTorch's CPU index (${TORCH_CPU_INDEX:-skipped}) does not answer; installing torch==$TORCH_VERSION from the" \
       "configured package index (on Linux x86_64 PyPI serves the CUDA build, several GB)" >&2
  $PIP install -q "torch==$TORCH_VERSION"
fi
