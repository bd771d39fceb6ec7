#!/bin/bash
# Wheels for ModelOpt's PyTorch quantization on the device machine (Python 3.12, no package index there), for
# `STEPS=modelopt bash scripts/gpu_check.sh`: writes .dev/modelopt.tar (~42 MB; carry it with the run).
# Torch, numpy, transformers and their dependencies come from the device image; these are what
# `import modelopt.torch.quantization` needs beyond them.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .dev && grep -qx ".dev/" .git/info/exclude 2>/dev/null || echo ".dev/" >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$work" \
  nvidia-modelopt==0.47.0 omegaconf antlr4-python3-runtime pulp pydantic pydantic-core annotated-types typing-inspection \
  nvidia-ml-py scipy rich markdown-it-py mdurl pygments ninja psutil
tar -cf .dev/modelopt.tar.tmp -C "$work" . && mv .dev/modelopt.tar.tmp .dev/modelopt.tar
ls -la .dev/modelopt.tar
