"""Weights already on a block grid (GGUF Q4_0 / Q4_1 / Q8_0, GPTQ-style groups) are stored on it, exactly."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from speccompile.engines.qdq_targets import OFFSET_SUFFIXES, QuantOptions
from speccompile.engines.quantize import quantize_model
from speccompile.engines.source_grid import find_int4_grid, find_int8_table_grid, source_grids

from conftest import export_as_gguf, make_tiny_hf_model, run_cli


def _gguf_roundtrip(w_nk: np.ndarray, kind: str) -> np.ndarray:
    """W [N, K] through a gguf quantization type and back (blocks along K, as llama.cpp stores a linear weight)."""
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.dequantize(gguf.quants.quantize(w_nk, qtype), qtype).reshape(w_nk.shape).astype(np.float32)


def _with_offsets(grid) -> np.ndarray:
    return grid.weight + np.repeat(grid.offset, grid.block, axis=0) if grid.offset is not None else grid.weight


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
def test_gguf_4bit_weights_are_read_back_exactly(kind):
    """Q4_1 (w = d q + m) and Q4_0 (w = d (q - 8), d of either sign: half its blocks need an offset with positive
    scales) come back exactly, as INT4 codes in [-8, 7] plus per-block offsets."""
    rng = np.random.default_rng(0)
    w = _gguf_roundtrip(rng.standard_normal((48, 256)).astype(np.float32), kind).T  # [K, N]
    grid = find_int4_grid(w)
    assert grid is not None and grid.block == 32 and (grid.scale > 0).all()
    codes = np.rint(grid.weight / np.repeat(grid.scale, 32, axis=0))
    assert codes.min() >= -8 and codes.max() <= 7
    assert np.abs(_with_offsets(grid) - w).max() <= 1e-6 * np.abs(w).max()


def test_gguf_q4_k_weights_are_read_back_exactly():
    """Q4_K (super-blocks of 256: eight sub-blocks of 32 with 6-bit scales and mins, w = d sc q - dmin m): random
    blocks with sane fp16 super-scales, decoded by the gguf package (it has no Q4_K encoder), come back exactly."""
    rng = np.random.default_rng(6)
    rows, k = 48, 512
    raw = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)  # d, dmin (fp16), 12 bytes of scales, 128 of codes
    for offset in (0, 2):
        raw[:, :, offset:offset + 2] = rng.uniform(0.001, 0.01, (rows, k // 256)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    w = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K).reshape(rows, k).T.astype(np.float32)
    grid = find_int4_grid(w)
    assert grid is not None and grid.block == 32 and grid.offset is not None
    assert np.abs(_with_offsets(grid) - w).max() <= 1e-6 * np.abs(w).max()


def _k_quant_weight(rng, kind: str, rows: int, k: int) -> np.ndarray:
    """W [K, N] decoded from random super-blocks of 256 with sane fp16 steps (the gguf package has no K-quant
    encoder): Q6_K (210 bytes: low and high bits, 16 int8 scales of 16 values, d last; w = d sc (q - 32)) or Q5_K
    (176 bytes: d and dmin first, 6-bit scales and mins of 32 values, codes 0..31; w = d sc q - dmin m)."""
    size, steps = {"Q6_K": (210, (208,)), "Q5_K": (176, (0, 2))}[kind]
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    for at in steps:
        raw[:, :, at:at + 2] = rng.uniform(0.0005, 0.002, (rows, k // 256)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(rows, k).T.astype(np.float32)


def test_an_int8_build_reads_every_symmetric_gguf_grid_back_exactly(monkeypatch):
    """The 8-bit grids an INT8 build stores a GGUF weight on: Q8_0 (step = largest magnitude / 127), Q5_0 (codes
    -16..15), Q4_0 (-8..7) and Q6_K (-32..31 on blocks of 16), the last three found as a common step of the values;
    grids with block offsets (Q4_1, Q5_1, Q5_K) and float weights on none (an INT8 build requantizes them)."""
    from speccompile.engines import source_grid
    from speccompile.engines.source_grid import find_int8_grid

    monkeypatch.setattr(source_grid, "CHUNK_VALUES", 1000)  # a few columns a chunk: the pieces must join exactly
    rng = np.random.default_rng(11)
    weights = {kind: _gguf_roundtrip(rng.standard_normal((48, 256)).astype(np.float32), kind).T
               for kind in ("Q8_0", "Q5_0", "Q4_0", "Q5_1", "Q4_1")}
    weights.update({kind: _k_quant_weight(rng, kind, 48, 512) for kind in ("Q6_K", "Q5_K")})
    expected = {"Q8_0": 32, "Q5_0": 32, "Q4_0": 32, "Q6_K": 16, "Q5_1": None, "Q4_1": None, "Q5_K": None}
    for kind, w in weights.items():
        grid = find_int8_grid(w)
        assert (grid and grid.block) == expected[kind], kind
        if grid is not None:  # the file's numbers, as 8-bit codes
            assert np.array_equal(grid.weight, w), kind
            assert np.abs(np.rint(grid.weight / np.repeat(grid.scale, grid.block, axis=0))).max() <= 127, kind
    assert find_int8_grid(rng.standard_normal((256, 48)).astype(np.float32)) is None
    q6_k = weights["Q6_K"]  # off its grid by a little: on none
    assert find_int8_grid(q6_k + 1e-4 * rng.standard_normal(q6_k.shape).astype(np.float32)) is None


def test_float16_weights_on_a_grid_within_their_rounding():
    """A float16 export rounds d q + m to float16: the grid is still found, and reproduces the values within it."""
    rng = np.random.default_rng(4)
    w = _gguf_roundtrip(rng.standard_normal((48, 256)).astype(np.float32), "Q4_1").T
    grid = find_int4_grid(w.astype(np.float16))
    assert grid is not None and grid.block == 32
    assert np.abs(_with_offsets(grid) - w).max() <= 1e-3 * np.abs(w).max()
    assert find_int4_grid(rng.standard_normal((256, 48)).astype(np.float16)) is None


def test_grids_whose_codes_do_not_span_sixteen_levels():
    """Q4_K-style sub-blocks (w = d q - m with q rarely reaching 0 or 15, m not a multiple of d): the step comes from
    the smallest gap between values, and the weight is still exact."""
    rng = np.random.default_rng(5)
    step = np.repeat(rng.uniform(0.01, 0.05, (4, 24)), 32, axis=0)
    offset = np.repeat(rng.uniform(-0.3, 0.0, (4, 24)), 32, axis=0)
    w = (rng.integers(2, 13, (128, 24)) * step + offset).astype(np.float32)
    grid = find_int4_grid(w)
    assert grid is not None and grid.block == 32 and grid.offset is not None
    assert np.abs(_with_offsets(grid) - w).max() <= 1e-6 * np.abs(w).max()


def test_gptq_style_groups_and_non_grids():
    """Integer zero points in groups of 128 are found at 128 (not at 64, which they also fit), with offsets unless
    every code is already in [-8, 7]; ordinary floats, or a grid with one value nudged by a tenth of a step, are
    not grids."""
    rng = np.random.default_rng(1)
    step = rng.uniform(0.01, 0.05, (2, 40))
    codes = rng.integers(0, 16, (256, 40))
    for zero, offset in ((rng.integers(0, 16, (2, 40)), True), (np.full((2, 40), 8), False)):
        w = ((codes - np.repeat(zero, 128, axis=0)) * np.repeat(step, 128, axis=0)).astype(np.float32)
        grid = find_int4_grid(w)
        assert grid is not None and grid.block == 128 and (grid.offset is not None) == offset
        assert np.abs(_with_offsets(grid) - w).max() <= 1e-6 * np.abs(w).max()
    assert find_int4_grid(rng.standard_normal((256, 40)).astype(np.float32)) is None
    nudged = w.copy()
    nudged[5, 7] += 0.1 * step[0, 7]
    assert find_int4_grid(nudged) is None


def test_q8_0_table_grid():
    rng = np.random.default_rng(2)
    table = _gguf_roundtrip(rng.standard_normal((96, 64)).astype(np.float32), "Q8_0")  # [V, H], blocks along H
    grid = find_int8_table_grid(table)
    assert grid is not None and grid.block == 32 and grid.scale.shape == (2, 96)
    assert np.abs(grid.weight.T - table).max() <= 1e-6 * np.abs(table).max()
    assert find_int8_table_grid(rng.standard_normal((96, 64)).astype(np.float32)) is None


def _two_matmuls(w1: np.ndarray, w2: np.ndarray) -> onnx.ModelProto:
    k, n = w1.shape
    nodes = [helper.make_node("MatMul", ["x", "a.weight_t"], ["h"]), helper.make_node("MatMul", ["h", "b.weight_t"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, w2.shape[1]])],
                              [numpy_helper.from_array(w1, "a.weight_t"), numpy_helper.from_array(w2, "b.weight_t")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")  # as the runtime: no MatMulNBits int8 activations
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_offset_branch_keeps_the_function():
    """The Q/DQ pass stores a Q4_1 weight as INT4 codes + a float16 offset branch (never quantized, its block-sum
    matrix shared by weights of the same K) and the graph computes what the fp32 graph computed."""
    rng = np.random.default_rng(3)
    w1 = _gguf_roundtrip(rng.standard_normal((64, 64)).astype(np.float32), "Q4_1").T
    w2 = _gguf_roundtrip(rng.standard_normal((32, 64)).astype(np.float32), "Q4_1").T
    model = _two_matmuls(w1, w2)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    expected = _run(model, x)
    options = QuantOptions("int4", exclude=())
    grids = source_grids(model, options)
    assert set(grids) == {"a.weight_t", "b.weight_t"}
    report = quantize_model(model, options, weight_grid=grids)
    assert report.offsets == 2 and report.blocks == {"a.weight_t": 32, "b.weight_t": 32}
    branch = [i.name for i in model.graph.initializer if i.name.endswith(OFFSET_SUFFIXES)]
    assert sum(name.endswith(OFFSET_SUFFIXES[0]) for name in branch) == 1 and len(branch) == 3
    assert all(i.data_type == TensorProto.INT4 for i in model.graph.initializer if i.name.endswith("_int4"))
    got = _run(model, x)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    plain = _two_matmuls(w1, w2)  # the same weights quantized afresh move
    quantize_model(plain, options)
    assert np.abs(_run(plain, x) - expected).max() > 1e-3 * np.abs(expected).max()


def test_a_tensorrt_build_keeps_only_the_grids_tensorrt_takes():
    """Block 64 stays on its grid in a TensorRT build, block 32 is quantized afresh there (and the build says so);
    an ONNX-only build keeps both."""
    from speccompile.engines.quantize_graph import tensorrt_grids

    rng = np.random.default_rng(7)
    w32 = _gguf_roundtrip(rng.standard_normal((64, 64)).astype(np.float32), "Q4_1").T
    codes, step = rng.integers(-8, 8, (64, 32)), np.repeat(rng.uniform(0.01, 0.05, (1, 32)), 64, axis=0)
    model = _two_matmuls(w32, (codes * step).astype(np.float32))
    options = QuantOptions("int4", exclude=())
    grids = source_grids(model, options)
    assert {w: g.block for w, g in grids.items()} == {"a.weight_t": 32, "b.weight_t": 64}
    blocks = {w: g.block for w, g in grids.items()}
    said = []
    assert tensorrt_grids(blocks, model, options, False, said.append) == {"b.weight_t": 64}
    assert "INT4 blocks of 32" in said[0] and "quantized again" in said[0]
    assert tensorrt_grids(blocks, model, options, True, said.append) == blocks


@pytest.fixture(scope="module")
def q4_1_gguf_export(tmp_path_factory):
    """A tiny tied-embedding model written as a GGUF file like SmolLM2's (Q4_1 weights, Q8_0 table), exported."""
    root = tmp_path_factory.mktemp("gguf_grid")
    yield export_as_gguf(root, make_tiny_hf_model(root / "hf", tie_word_embeddings=True), quant="Q4_1", table_quant="Q8_0")
    shutil.rmtree(root, ignore_errors=True)


def _logits(path, ids: np.ndarray) -> np.ndarray:
    """The contract graph's logits (a build's packed CPU graph rounds activations to int8: tests/test_cpu_graph.py)."""
    from speccompile.runtime.artifact import open_artifact

    target = open_artifact(path, threads=1, drafter="none", fused=False).target
    cache = target.new_cache()
    return target.run(ids, np.arange(len(ids)), cache.attention_mask(np.tril(np.ones((len(ids), len(ids)), bool))), cache).logits


def test_int4_build_of_a_q4_1_gguf_keeps_the_model(q4_1_gguf_export, tmp_path):
    """`build --int4 --quantize-lm-head` of a Q4_1 / Q8_0 GGUF export: every weight and the table stored on their
    own grids, no calibration and nothing for `--qad-steps` to train, logits equal to the export's;
    `--no-source-grid` quantizes afresh and moves them."""
    ids = np.array([5, 9, 20, 31, 7, 12, 40, 3, 22, 17, 8, 61], dtype=np.int64)
    reference = _logits(q4_1_gguf_export, ids)
    exact, fresh = tmp_path / "exact", tmp_path / "fresh"
    flags = ["--int4", "--quantize-lm-head", "--onnx-only", "--calib-samples", "3", "--calib-max-tokens", "64"]
    result = run_cli("build", str(q4_1_gguf_export), *flags, "--qad-steps", "3", "--out", str(exact))
    assert result.returncode == 0, result.stderr
    assert "QAD: nothing to train" in result.stdout + result.stderr  # every weight is exact on its grid
    assert "stored above 4 bits" not in result.stdout + result.stderr  # (a 4-bit file: nothing requantized)
    assert json.loads((q4_1_gguf_export / "manifest.json").read_text())["model"]["stored_types"] == {"Q4_1": 14}  # 2 layers x q, k, v, o, gate, up, down
    record = json.loads((exact / "manifest.json").read_text())["precision"]
    target = record["target"]
    assert target["source_grid"] == {"weights": 9, "blocks": [32], "with_offset": 8}  # 8 MatMuls + the table
    assert "calibration" not in target and "methods" not in target and target["runs_on"] == ["ort-cpu"]
    warnings = record["tensorrt_compat"]["target"]["warnings"]
    assert record["tensorrt_compat"]["target"]["ok"] and any("INT4 block_size 32" in w for w in warnings)
    assert any("blocked INT8 (block_size 32)" in w for w in warnings)  # the Q8_0 table
    got = _logits(exact, ids)
    assert np.array_equal(got.argmax(-1), reference.argmax(-1))
    assert np.abs(got - reference).max() <= 1e-4 * np.abs(reference).max()
    result = run_cli("build", str(q4_1_gguf_export), *flags, "--no-source-grid", "--out", str(fresh))
    assert result.returncode == 0, result.stderr
    assert "source_grid" not in json.loads((fresh / "manifest.json").read_text())["precision"]["target"]
    assert np.abs(_logits(fresh, ids) - reference).max() > 1e-2 * np.abs(reference).max()
    ran = run_cli("run", str(exact), "--prompt", "the cat", "--max-tokens", "8", "--raw", "--threads", "1")
    assert ran.returncode == 0, ran.stderr
    refused = run_cli("run", str(exact), "--prompt", "the cat", "--backend", "tensorrt")  # block 32: not TensorRT's
    assert refused.returncode == 2 and "runs on ort-cpu" in refused.stderr and "Traceback" not in refused.stderr


def test_int4_build_of_a_float16_export_stays_on_the_grid(tmp_path):
    """A float16 export rounds the GGUF's values to float16: the grids are still found, and the INT4 build's logits
    stay within float16 rounding of the export's (same argmax)."""
    folder = make_tiny_hf_model(tmp_path / "hf", tie_word_embeddings=True)
    exported = export_as_gguf(tmp_path / "gguf", folder, dtype="fp16", quant="Q4_1", table_quant="Q8_0")
    built = tmp_path / "built"
    result = run_cli("build", str(exported), "--int4", "--quantize-lm-head", "--onnx-only", "--out", str(built))
    assert result.returncode == 0, result.stderr
    assert json.loads((built / "manifest.json").read_text())["precision"]["target"]["source_grid"]["weights"] == 9
    ids = np.array([5, 9, 20, 31, 7, 12, 40, 3], dtype=np.int64)
    reference, got = _logits(exported, ids).astype(np.float32), _logits(built, ids).astype(np.float32)
    assert np.array_equal(got.argmax(-1), reference.argmax(-1))
    assert np.abs(got - reference).max() <= 4e-3 * np.abs(reference).max()


def test_an_int4_build_of_a_finer_gguf_says_it_requantizes(tmp_path):
    """A GGUF whose layer weights are stored above 4 bits (Q8_0 here; Gemma 3 270M's "Q4_K_M" is mostly Q5_0 / Q6_K /
    Q8_0): the export records the stored types, `build --int4` says it takes them to 4 bits and names --int8, which
    keeps them (and says nothing)."""
    folder = make_tiny_hf_model(tmp_path / "hf", tie_word_embeddings=True)
    exported = export_as_gguf(tmp_path / "gguf", folder, quant="Q8_0")
    assert json.loads((exported / "manifest.json").read_text())["model"]["stored_types"] == {"Q8_0": 14}
    said = {}
    for precision in ("--int4", "--int8"):
        result = run_cli("build", str(exported), precision, "--onnx-only", "--out", str(tmp_path / precision.strip("-")))
        assert result.returncode == 0, result.stderr
        said[precision] = result.stdout + result.stderr
    assert "14 layer weights of the source are stored above 4 bits (14 Q8_0): --int4 takes them to 4 bits" in said["--int4"]
    assert "--int8 keeps them at 8 bits" in said["--int4"] and "stored above 4 bits" not in said["--int8"]


def test_the_bits_of_gguf_types():
    """`stored_bits` reads a GGUF type name's bits: floats and plain integers whole, block types by their digit."""
    from speccompile.models.gguf_types import stored_bits

    names = ["F32", "BF16", "I16", "I8", "Q8_0", "Q6_K", "Q5_0", "Q4_K", "Q4_0_4_4", "IQ4_XS", "IQ2_XXS", "TQ1_0", "MXFP4", "?"]
    assert [stored_bits(n) for n in names] == [32, 16, 16, 8, 8, 6, 5, 4, 4, 4, 2, 1, 4, None]
