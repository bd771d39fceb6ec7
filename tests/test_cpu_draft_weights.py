"""int8 / int4 ONNX Runtime CPU variants of drafter heads: graph, shared weights, numerics, selection, exactness."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from conftest import run_cli
from test_heads_helpers import shared_target, trained_head, write_checkpoint


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    return shared_target(tmp_path_factory)


def _export(target_dir, tmp_path, kind, ckpt, weights=None):
    from speccompile.export.pipeline import ExportOptions, export_artifact

    options = ExportOptions(drafter=f"{kind}:{ckpt}", max_context=256)
    if weights is not None:
        options.draft_cpu_weights = weights
    out = tmp_path / f"art_{kind}_{weights}"
    return out, export_artifact(str(target_dir), out, options)


def _random_feeds(session, past_len=5, q=3, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in session.get_inputs():
        shape = [q if d == "q_len" else past_len if d == "past_len" else past_len + q if d == "total_len" else 1 if isinstance(d, str) else d
                 for d in inp.shape]
        if inp.name == "input_ids":
            feeds[inp.name] = rng.integers(0, 90, shape).astype(np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(past_len, past_len + q, dtype=np.int64)[None]
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.tril(np.ones((q, past_len + q), dtype=bool), k=past_len)[None]
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("weights,tolerance", [("int8", 0.03), ("int4", 0.25)])
def test_eagle3_cpu_variant_is_quantized_shares_embeddings_and_stays_close(target_dir, tmp_path, tmp_path_factory, weights, tolerance):
    import onnxruntime as ort

    out, manifest = _export(target_dir, tmp_path, "eagle3", write_checkpoint(tmp_path / "ckpt", "eagle3"), weights)
    spec = manifest.graphs["eagle3-ort"]
    assert spec.file == "eagle3.ort.onnx" and spec.extra["weights"] == weights and spec.extra["variant_of"] == "eagle3.onnx"
    assert "eagle3.ort.onnx" in manifest.files
    model = onnx.load(str(out / "eagle3.ort.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    constant = {i.name for i in model.graph.initializer}
    assert ops["MatMulNBits"] >= 7, ops  # fc, q, k, v, o, gate/up, down, lm_head
    assert not [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in constant]
    bits = {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {int(weights[3:])}
    embed = next(i for i in model.graph.initializer if i.name.endswith("embed_tokens.weight"))
    assert {e.key: e.value for e in embed.external_data}["location"] == "eagle3.onnx.data"  # not copied

    sessions = [ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"]) for f in ("eagle3.onnx", "eagle3.ort.onnx")]
    feeds = _random_feeds(sessions[0])
    exact, quantized = (s.run(["logits"], feeds)[0] for s in sessions)
    rel = np.linalg.norm(quantized - exact) / np.linalg.norm(exact)
    assert 0 < rel < tolerance, rel


def test_runtime_uses_the_variant_on_cpu_and_the_contract_head_otherwise(target_dir, tmp_path, tmp_path_factory):
    from speccompile.runtime.artifact import open_artifact

    out, _ = _export(target_dir, tmp_path, "eagle", trained_head(tmp_path_factory, "eagle"))
    assert open_artifact(out, threads=1).session("eagle").spec.file == "eagle.ort.onnx"
    assert open_artifact(out, threads=1, fused=False).session("eagle").spec.file == "eagle.onnx"


def test_fp32_writes_no_variant_and_bad_value_is_rejected(target_dir, tmp_path):
    out, manifest = _export(target_dir, tmp_path, "mtp", write_checkpoint(tmp_path / "ckpt", "mtp"), "fp32")
    assert "mtp-ort" not in manifest.graphs and not (out / "mtp.ort.onnx").exists()
    result = run_cli("export", str(target_dir), "--out", str(tmp_path / "bad"), "--drafter",
                     f"mtp:{tmp_path / 'ckpt'}", "--draft-cpu-weights", "int3")
    assert result.returncode == 2 and "--draft-cpu-weights" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "bad").exists()


def test_medusa_int4_variant_greedy_equals_plain(target_dir, tmp_path, tmp_path_factory):
    from speccompile.runtime.session import Runner

    out, manifest = _export(target_dir, tmp_path, "medusa", trained_head(tmp_path_factory, "medusa"), "int4")
    assert manifest.graphs["medusa-ort"].extra["weights"] == "int4"
    runner = Runner(out, drafter="medusa", threads=1, adaptive=False)
    prompt = [1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41, 42]
    plain = runner.generate_ids(prompt, 24, drafter="none")
    spec = runner.generate_ids(prompt, 24)
    assert spec.tokens == plain.tokens and spec.stats.draft_steps > 0


def test_build_keeps_the_head_variant(target_dir, tmp_path, tmp_path_factory):
    """An ONNX-only build of the target leaves the head's weights alone: its int8 CPU variant stays."""
    from speccompile.manifest import read_manifest

    out, _ = _export(target_dir, tmp_path, "eagle", write_checkpoint(tmp_path / "ckpt", "eagle"))
    built = tmp_path / "built"
    result = run_cli("build", str(out), "--int4", "--onnx-only", "--out", str(built))
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(built)
    assert "eagle-ort" in manifest.graphs and manifest.files["eagle.ort.onnx"] == read_manifest(out).files["eagle.ort.onnx"]
    assert "eagle" in manifest.graphs and (built / "eagle.onnx.data").exists()
