#!/usr/bin/env bash
# The oracle environment of tests/test_speculators_oracle.py: vLLM's `speculators` library (its pins differ from
# ours: transformers <= 5.19) in a venv of its own, on the CPU build of torch (torch pinned in the same install so
# that torchvision / torchaudio resolve to its versions rather than pulling a CUDA torch).
#   scripts/setup_oracles.sh [VENV]          (default /tmp/spec-venv)
#   SPECCOMPILE_SPECULATORS_PYTHON=VENV/bin/python pytest tests/test_speculators_oracle.py
set -euo pipefail
VENV="${1:-/tmp/spec-venv}"
TORCH="${SPECCOMPILE_ORACLE_TORCH:-torch==2.13.0}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$TORCH"
"$VENV/bin/pip" install -q "$TORCH" "speculators==0.9.0"
"$VENV/bin/python" -c "import speculators, torch; print('speculators', speculators.__version__, 'torch', torch.__version__)"
echo "export SPECCOMPILE_SPECULATORS_PYTHON=$VENV/bin/python"
