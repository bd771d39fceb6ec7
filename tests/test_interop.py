"""Heads we write load in other frameworks: TensorRT Edge-LLM's exporter takes an EAGLE-3 head from `save_head`
(the flat Hugging Face layout) and exports its weights unchanged.

Needs TensorRT Edge-LLM's exporter, installed apart from this project (its pins differ: transformers 5.14.1,
onnx 1.19.0): `python -m venv V && V/bin/pip install torch==2.13.0+cpu 'tensorrt-edgellm[export]'`, then
SPECCOMPILE_EDGELLM_EXPORT=V/bin/tensorrt-edgellm-export. Skipped without it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

EXPORTER = os.environ.get("SPECCOMPILE_EDGELLM_EXPORT", "")


@pytest.mark.skipif(not Path(EXPORTER).is_file(), reason="set SPECCOMPILE_EDGELLM_EXPORT to tensorrt-edgellm-export "
                                                       "(TensorRT Edge-LLM in a venv of its own)")
def test_tensorrt_edge_llm_exports_our_eagle3_head_unchanged(tmp_path, tmp_path_factory):
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from safetensors.numpy import load_file

    from speccompile.models.head_writers import new_head, save_head
    from speccompile.models.load import load_model
    from test_heads_helpers import shared_target

    model = load_model(str(shared_target(tmp_path_factory)))
    head = save_head(new_head("eagle3", model.config, model.weights, draft_vocab_size=32, seed=3), tmp_path / "head")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own packages, not this checkout's
    done = subprocess.run([EXPORTER, str(head), str(tmp_path / "out")], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    graph = onnx.load(str(tmp_path / "out" / "llm" / "model.onnx")).graph
    exported = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    ours = load_file(str(head / "model.safetensors"))
    for theirs, name in (("_model.fc.weight", "fc.weight"), ("_model.lm_head.weight", "lm_head.weight"),
                         ("_model.layers.0.self_attn.q_proj.weight", "midlayer.self_attn.q_proj.weight")):
        assert np.array_equal(exported[theirs], ours[name].astype(exported[theirs].dtype)), name
