#!/usr/bin/env bash
# Install PyTorch into the active Python (export and train-draft need it; the runtime never imports torch).
# The CPU build where the configured package index offers it (`torch==X+cpu`, as PyTorch's CPU wheel index and
# local CPU mirrors name it); otherwise `torch==X` from the same index, and say which build that was: on Linux
# x86_64 PyPI serves the CUDA build (several GB with ~20 nvidia-* packages). To get the CPU build from PyPI
# machines, add PyTorch's CPU wheel index to pip's configuration first (PIP_EXTRA_INDEX_URL, see the README).
#   TORCH_VERSION  the version to install (default 2.13.0)
#   PIP            the pip command (default: $PYTHON -m pip)
set -euo pipefail
PYTHON="${PYTHON:-python}"
PIP="${PIP:-$PYTHON -m pip}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

build() {
  "$PYTHON" -c 'import torch; print(torch.__version__, "CUDA " + torch.version.cuda if torch.version.cuda else "CPU", "build")' 2>/dev/null
}
installed="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [ "${installed%%+*}" = "$TORCH_VERSION" ]; then
  echo "torch $(build) is installed already"
  exit 0
fi
if $PIP install -q "torch==${TORCH_VERSION}+cpu" 2>/dev/null; then
  echo "installed torch $(build) from the configured package index"
else
  echo "note: the configured package index has no CPU build torch==${TORCH_VERSION}+cpu; installing torch==${TORCH_VERSION}" \
       "(on Linux x86_64 PyPI serves the CUDA build, several GB)" >&2
  $PIP install -q "torch==${TORCH_VERSION}"
  echo "installed torch $(build)"
fi
