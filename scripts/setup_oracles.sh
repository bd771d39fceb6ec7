#!/usr/bin/env bash
# The oracle environment of tests/test_speculators_oracle.py: vLLM's `speculators` library (its pins differ from
# ours: transformers <= 5.19) in a venv of its own, on the CPU build of torch (pinned in the same install, else
# torchvision pulls a CUDA torch). speculators lists torchvision / torchaudio but its model classes do not use them,
# and their PyPI wheels (built for the CUDA torch) break transformers' imports on a CPU torch: they are removed.
# About 12 minutes on the shared 2-core development machine (1.5 minutes of CPU; the rest is downloading ~1.5 GB).
#   scripts/setup_oracles.sh [VENV]          (default /tmp/spec-venv)
#   SPECCOMPILE_SPECULATORS_PYTHON=VENV/bin/python pytest tests/test_speculators_oracle.py
set -euo pipefail
VENV="${1:-/tmp/spec-venv}"
TORCH="${SPECCOMPILE_ORACLE_TORCH:-torch==2.13.0}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH"
"$VENV/bin/pip" install -q "$TORCH" "speculators==0.9.0"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio
"$VENV/bin/python" -c "import torch; from importlib.metadata import version
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.mtp import MTPDraftModel
print('speculators', version('speculators'), 'torch', torch.__version__)"
echo "export SPECCOMPILE_SPECULATORS_PYTHON=$VENV/bin/python"
