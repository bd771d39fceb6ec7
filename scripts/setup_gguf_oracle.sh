#!/usr/bin/env bash
# The oracle of tests/test_gguf_llamacpp.py: llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, its
# `conversion` package and its own gguf-py), as vendored in the llama-cpp-python 0.3.36 sdist, extracted alone
# (no build), plus a venv for running it: the project's venv seen through a .pth file, with sentencepiece added
# (the converter's Llama / Qwen paths import it even for a BPE tokenizer). About a minute (a 60 MB download).
#   scripts/setup_gguf_oracle.sh [DIR]       (default /tmp/gguf-oracle; run with the project's python on PATH or PYTHON=)
#   SPECCOMPILE_LLAMACPP_CONVERTER=DIR/convert_hf_to_gguf.py SPECCOMPILE_LLAMACPP_PYTHON=DIR/venv/bin/python \
#     pytest tests/test_gguf_llamacpp.py
set -euo pipefail
DIR="${1:-/tmp/gguf-oracle}"
PYTHON="${PYTHON:-python3}"
VERSION=0.3.36
mkdir -p "$DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
tar xzf "$TMP/llama_cpp_python-$VERSION.tar.gz" -C "$TMP" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
  "llama_cpp_python-$VERSION/vendor/llama.cpp/conversion" "llama_cpp_python-$VERSION/vendor/llama.cpp/gguf-py"
cp -r "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp/"{convert_hf_to_gguf.py,conversion,gguf-py} "$DIR/"
"$PYTHON" -m venv "$DIR/venv"
"$PYTHON" -c "import site; print(site.getsitepackages()[0])" > "$("$DIR/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/project-venv.pth"
"$DIR/venv/bin/pip" install -q sentencepiece
PYTHONPATH="$DIR/gguf-py" "$DIR/venv/bin/python" "$DIR/convert_hf_to_gguf.py" --help > /dev/null
echo "export SPECCOMPILE_LLAMACPP_CONVERTER=$DIR/convert_hf_to_gguf.py SPECCOMPILE_LLAMACPP_PYTHON=$DIR/venv/bin/python"
