"""Streaming export: the built contract graph is the traced one, past 2 GiB it runs like transformers, its memory is
bounded by the largest tensor, refusals come before the work, and verified weights are not re-read at every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.manifest import read_manifest

from conftest import load_benchmark, make_tiny_hf_model, run_cli_here, write_char_tokenizer

DELIBERATE = {"ConstantOfShape", "Expand", "Identity", "Constant"}  # what the tracer added and the builder leaves out


def _trace(folder: Path, path: Path, hidden: str = "none", dtype: str = "fp32") -> None:
    """The contract graph as the exporter used to write it: the torch reference decoder traced by TorchScript."""
    import torch

    from speccompile.export.onnx_export import export_module, torch_dtype
    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    loaded = load_model(str(folder))
    decoder = build_decoder(loaded.config, loaded.weights, hidden).to(torch_dtype(dtype)).eval()
    cfg = decoder.config
    batch, q, past = 2, 5, 3
    ids = torch.randint(0, cfg.vocab_size, (batch, q))
    pos = torch.arange(past, past + q).unsqueeze(0).expand(batch, -1).contiguous()
    kv = [torch.zeros(batch, cfg.num_key_value_heads, past, cfg.head_dim, dtype=torch_dtype(dtype)) for _ in range(2 * cfg.num_hidden_layers)]
    seq = {0: "batch", 1: "q_len"}
    export_module(decoder, (ids, pos, causal_mask(q, past, batch).contiguous()), kv, [seq, seq, {0: "batch", 1: "q_len", 2: "total_len"}],
                  decoder.input_names, decoder.output_names, {"logits": seq, "hidden_states": seq, "aux_hidden_states": seq}, path)


def _nodes(model: onnx.ModelProto) -> set[tuple[str, str]]:
    return {(n.op_type, n.name) for n in model.graph.node if n.op_type not in DELIBERATE}


def _interface(model: onnx.ModelProto) -> list:
    return [(v.name, v.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in [*model.graph.input, *model.graph.output]]


def _feeds(session: ort.InferenceSession, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 90, (1, 5)).astype(np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(3, 8, dtype=np.int64)[None]
        elif i.name == "attention_mask":
            feeds[i.name] = np.tril(np.ones((5, 8), bool), k=3)[None]
        else:
            shape = [1 if d == "batch" else 3 if d == "past_len" else d for d in i.shape]
            feeds[i.name] = rng.standard_normal(shape).astype(np.float16 if "float16" in i.type else np.float32)
    return feeds


@pytest.mark.parametrize("arch,overrides,hidden,dtype", [
    ("llama", {}, "eagle3", "fp32"),
    ("llama", {"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 4, "tie_word_embeddings": True}, "final", "fp32"),
    ("qwen2", {}, "none", "fp16"),
    ("qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "none", "fp32"),
], ids=["gqa-eagle3", "mha-tied-final", "qwen2-fp16", "qwen3-linear-rope"])
def test_built_graph_is_the_traced_graph(tmp_path, arch, overrides, hidden, dtype):
    """Node names and operators, interface and outputs (bitwise, ONNX Runtime CPU) of the built contract graph equal
    those of the torch decoder traced as the exporter used to: the build passes downstream see the same graph."""
    folder = make_tiny_hf_model(tmp_path / "m", arch=arch, layers=4, **overrides)
    _trace(folder, tmp_path / "traced.onnx", hidden, dtype)
    export_artifact(str(folder), tmp_path / "art", ExportOptions(max_context=64, hidden_states=hidden, dtype=dtype, fused_cpu_graph=False))
    traced, built = (onnx.load(str(p), load_external_data=False) for p in (tmp_path / "traced.onnx", tmp_path / "art" / "target.onnx"))
    assert _nodes(built) == _nodes(traced)
    assert _interface(built) == _interface(traced)
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (tmp_path / "traced.onnx", tmp_path / "art" / "target.onnx")]
    feeds = _feeds(sessions[0])
    for a, b in zip(*(s.run(None, feeds) for s in sessions)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.all(a == 0) for a in sessions[1].run(None, feeds))


def _large_vocabulary_model(folder: Path, vocab: int):
    """One layer, hidden 64, a tied table of `vocab` rows: bf16 on disk, over 2 GiB in float32; two shards."""
    import transformers

    scale = load_benchmark("scale")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    scale.write_random_checkpoint(config, folder, shard_bytes=256 << 20)
    write_char_tokenizer(folder)
    return folder


def test_export_past_2gib_runs_like_transformers(tmp_path):
    """A model whose float32 weights pass protobuf's 2 GiB exports (the table streamed, never in a proto) and its
    contract graph's logits in ONNX Runtime equal transformers' (float32 reference) on the same tokens."""
    import gc

    import torch
    import transformers

    vocab = (1 << 23) + (1 << 16)  # x 64 x 4 bytes = 2.16 GB
    folder = _large_vocabulary_model(tmp_path / "big", vocab)
    assert len(list(folder.glob("*.safetensors"))) == 2
    ids = np.array([[5, 70000, 8_000_000, 42, 1 << 22, 7]])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits[0].numpy()
    del reference
    gc.collect()
    out = tmp_path / "art"
    export_artifact(str(folder), out, ExportOptions(max_context=64, batch_slots=0))
    assert (out / "target.onnx.data").stat().st_size > 2**31 and (out / "target.onnx").stat().st_size < 1 << 20
    fused = onnx.load(str(out / "target.ort.onnx"), load_external_data=False)
    table = next(t for t in fused.graph.initializer if t.name == "model.embed_tokens.weight")
    assert {e.key: e.value for e in table.external_data}["location"] == "target.onnx.data"  # shared, not copied
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")  # the weights stay mapped: small test memory
    session = ort.InferenceSession(str(out / "target.onnx"), options, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "position_ids": np.arange(6)[None], "attention_mask": np.tril(np.ones((6, 6), bool))[None],
             **{f"past_key_values.0.{k}": np.zeros((1, 2, 0, 16), np.float32) for k in ("key", "value")}}
    logits = session.run(["logits"], feeds)[0][0]
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    assert (np.argmax(logits, -1) == np.argmax(expected, -1)).all()


PEAK_RSS = """
import resource, sys
from pathlib import Path
from speccompile.export.pipeline import ExportOptions, export_artifact
export_artifact(sys.argv[1], Path(sys.argv[2]), ExportOptions(max_context=64, batch_slots=0))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _peak_export_rss(folder: Path, out: Path) -> int:
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, str(folder), str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


def test_export_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    """Peak RSS of an export (measured in a subprocess) exceeds that of a one-layer export of the same shapes by
    less than the pieces in flight and a few copies of the largest weight, although the model is ~4x larger."""
    import transformers

    from speccompile.export.recipes import CHUNK_BYTES
    from speccompile.weights_file import WeightsWriter

    scale = load_benchmark("scale")
    shapes = dict(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=256, torch_dtype="bfloat16")
    peaks = {}
    for layers in (1, 48):
        folder = scale.write_random_checkpoint(transformers.LlamaConfig(num_hidden_layers=layers, **shapes), tmp_path / f"m{layers}")
        write_char_tokenizer(folder)
        peaks[layers] = _peak_export_rss(folder, tmp_path / f"a{layers}")
    weights = (tmp_path / "a48" / "target.onnx.data").stat().st_size
    largest = 2 * 2048 * 512 * 4  # the gate/up MatMul weight in float32
    in_flight = (WeightsWriter.QUEUED + 2) * CHUNK_BYTES
    assert weights > 2 * (in_flight + 3 * largest)  # a model in memory would not fit under the bound
    assert peaks[48] - peaks[1] < in_flight + 3 * largest, (peaks, weights)


def test_not_enough_disk_space_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch, tiny_model_dir):
    from conftest import assert_refused_for_disk_space

    assert_refused_for_disk_space(capsys, monkeypatch, tmp_path / "art", "export", str(tiny_model_dir), "--max-context", "32768",
                                  free=10 << 20)


def test_fp16_artifact_that_does_not_fit_as_fp32_is_refused_on_ort_cpu(tmp_path, capsys, monkeypatch, tiny_model_dir):
    from speccompile.runtime import artifact

    export_artifact(str(tiny_model_dir), tmp_path / "fp16", ExportOptions(max_context=64, dtype="fp16"))
    monkeypatch.setattr(artifact, "_available_memory", lambda: 1000)
    code, _, err = run_cli_here(capsys, "run", str(tmp_path / "fp16"), "--prompt", "ab", "--raw", "--max-tokens", "2")
    assert code == 2 and "an fp16 artifact runs on ort-cpu as fp32" in err and "--dtype fp32" in err and "build --int4" in err, err
    monkeypatch.setattr(artifact, "_available_memory", lambda: 1 << 40)
    code, out, err = run_cli_here(capsys, "run", str(tmp_path / "fp16"), "--prompt", "ab", "--raw", "--max-tokens", "2")
    assert code == 0, err
    # its INT4 build has no packed CPU graph (the fused CPU graph is fp32 only): the Q/DQ graph, dequantized at load
    code, _, err = run_cli_here(capsys, "build", str(tmp_path / "fp16"), "--out", str(tmp_path / "int4"), "--int4", "--onnx-only",
                                "--no-awq", "--no-clip-search", "--no-gptq")
    assert code == 0, err
    monkeypatch.setattr(artifact, "_available_memory", lambda: 1000)
    code, _, err = run_cli_here(capsys, "run", str(tmp_path / "int4"), "--prompt", "ab", "--raw", "--max-tokens", "2")
    assert code == 2 and "this int4 build of an fp16 export runs on ort-cpu as fp32" in err and "--dtype fp32" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_verified_weights_are_not_read_again_until_they_change(tmp_path, monkeypatch, tiny_artifact):
    """A weights file hashed once (or while export wrote it) is trusted while its stat is unchanged; a write, a
    copy (new inode) or an edit back to the same size and bytes count is hashed again and a changed byte refused."""
    import shutil

    from speccompile import manifest as manifest_module
    from speccompile.errors import ArtifactError

    monkeypatch.setattr(manifest_module.VerifiedFiles, "MIN_SIZE", 0)
    art = shutil.copytree(tiny_artifact, tmp_path / "art")
    read_manifest(art)  # hashes everything (new inodes), remembers
    reads = []
    real = manifest_module.sha256_of
    monkeypatch.setattr(manifest_module, "sha256_of", lambda p, *a: reads.append(Path(p).name) or real(p, *a))
    read_manifest(art)
    assert reads == []
    data = art / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="target.onnx.data: sha256 does not match"):
        read_manifest(art)
    assert reads == ["target.onnx.data"]


def test_export_records_its_digests_as_verified(tmp_path, monkeypatch, tiny_model_dir):
    from speccompile import manifest as manifest_module

    monkeypatch.setattr(manifest_module.VerifiedFiles, "MIN_SIZE", 0)
    export_artifact(str(tiny_model_dir), tmp_path / "art", ExportOptions(max_context=64))
    reads = []
    real = manifest_module.sha256_of
    monkeypatch.setattr(manifest_module, "sha256_of", lambda p, *a: reads.append(Path(p).name) or real(p, *a))
    read_manifest(tmp_path / "art")
    written = {"target.onnx", "target.onnx.data", "target.ort.onnx", "target.ort.onnx.data", "target.ort-slots.onnx"}
    assert written <= set(json.loads((tmp_path / "art" / "manifest.json").read_text())["files"])
    assert not written & set(reads)  # hashed while written: not read again (the tokenizer files were copied)


@pytest.mark.parametrize("source,target", [("bfloat16", "float16"), ("bfloat16", "float32"), ("float32", "float16"),
                                           ("float32", "bfloat16"), ("float16", "float32"), ("float16", "bfloat16")])
def test_weight_conversion_rounds_like_numpy(source, target):
    """The export converts weights with torch's copy kernels; they round to nearest even like numpy / ml_dtypes
    (ties, subnormals, overflow to inf included)."""
    import ml_dtypes

    from speccompile.export.recipes import convert_into

    types = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    rng = np.random.default_rng(0)
    wide = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000),
                           [65504.0, 65520.0, 1e5, -1e5, 6e-8, 1e-40, 0.0, -0.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11]])
    with np.errstate(over="ignore"):  # 1e5 overflows float16: inf on both sides
        values = wide.astype(np.float32).astype(types[source]).reshape(10, -1)
        expected = values.astype(types[target])
    out = np.empty(values.shape, types[target])
    convert_into(out, values)
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))
