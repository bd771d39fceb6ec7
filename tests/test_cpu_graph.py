"""The quantized fused CPU graph (engines/cpu_graph.py, engines/nbits.py): packed weights that are exactly the
build's codes, MatMulNBits / GatherBlockQuantized in place of the weight readers, the same function as the Q/DQ
contract graph. Exactness under speculative decoding is tested with every quantized CPU build in
tests/test_quantized_exact.py."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from speccompile.engines.build import BuildOptions, build_artifact
from speccompile.engines.cpu_graph import write_cpu_graphs
from speccompile.engines.nbits import NBitsWeight, reblock_rows, symmetric_rows, unpack_codes
from speccompile.errors import InputError
from speccompile.manifest import read_manifest, variant_name
from speccompile.runtime.artifact import open_artifact
from speccompile.weights_file import read_tensor

from conftest import export_as_gguf, make_tiny_hf_model


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("groups", [1, 2, 4])  # one scale per row, blocks of 64, blocks of 32 (K = 128)
def test_packed_rows_dequantize_to_the_codes_times_their_scales(bits, groups):
    rng = np.random.default_rng(bits + groups)
    n, k = 6, 128
    codes = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), size=(n, k))
    scales = rng.random((n, groups)).astype(np.float32)
    weight = symmetric_rows(codes, scales, bits, 32)
    assert weight.packed.shape == (n, k // 32, 32 * bits // 8) and weight.scales.shape == (n, k // 32)
    expected = codes.astype(np.float32) * np.repeat(scales, k // groups, axis=1)
    assert np.array_equal(weight.dequantize(), expected.T)  # NBitsWeight.dequantize is W [K, N]


def test_coarser_blocks_only_split_into_whole_blocks():
    assert reblock_rows(np.ones((2, 3), np.float32), 96, 32).shape == (2, 3)
    with pytest.raises(ValueError):
        reblock_rows(np.ones((2, 3), np.float32), 48, 32)  # blocks of 16 are not blocks of 32


@pytest.fixture(scope="module")
def int4_builds(tiny_artifact, tiny_model_dir, tmp_path_factory):
    """The tiny model built --int4 (blocks of 64 and 128: re-blocked to 32) and from a Q4_1 / Q8_0 GGUF of it
    (INT4 on its own grid with offset branches, the table blocked INT8)."""
    root = tmp_path_factory.mktemp("cpugraph")
    gguf = export_as_gguf(root / "gguf", tiny_model_dir, quant="Q4_1", table_quant="Q8_0")
    builds = {"int4": root / "int4", "source-grid": root / "grid"}
    build_artifact(tiny_artifact, builds["int4"], BuildOptions(precision="int4", onnx_only=True, calib_samples=2, calib_max_tokens=32))
    build_artifact(gguf, builds["source-grid"], BuildOptions(precision="int4", onnx_only=True, quantize_tables=True, exclude=()))
    yield builds
    shutil.rmtree(root, ignore_errors=True)


def _ops(path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("build", ["int4", "source-grid"])
def test_the_build_writes_and_the_runtime_opens_the_packed_graph(int4_builds, build):
    manifest = read_manifest(int4_builds[build])
    spec = manifest.graph(variant_name("target"))
    assert spec.extra["quantization"] == "int4" and spec.extra["cpu_kernels"]["block"] == 32
    ops = _ops(int4_builds[build] / spec.file)
    record = manifest.precision["target"]
    tied_heads = sum(kind == "gather+lm_head" for kind in record.get("tables", {}).values())
    assert ops["MatMulNBits"] == record["quantized_matmuls"] + tied_heads
    assert "DequantizeLinear" not in ops
    if build == "source-grid":  # every MatMul packed; their offsets (x E) O: a block-sum ReduceSum and a MatMul each
        offsets = record["source_grid"]["with_offset"]
        assert ops["GatherBlockQuantized"] == 1 and ops["MatMul"] == ops["ReduceSum"] == offsets
    else:  # the excluded lm_head stays an fp32 MatMul, the table an fp32 Gather
        assert ops["MatMul"] == len(record["excluded"]) == 1 and "GatherBlockQuantized" not in ops
    assert open_artifact(int4_builds[build], drafter="none").target.spec.file == spec.file


def _dq_weights(model: onnx.ModelProto, folder) -> list[np.ndarray]:
    """Every weight DequantizeLinear of the contract graph, dequantized as it computes it (float32 codes x scale;
    [K, N], or the table [V, H])."""
    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        init = inits[node.input[0]]
        shape = tuple(init.dims)
        raw = np.asarray(read_tensor(init, folder))
        if init.data_type == onnx.TensorProto.INT4:
            raw = ((unpack_codes(raw.reshape(-1), 4, int(np.prod(shape))).astype(np.int8) ^ 8) - 8).reshape(shape)
        scale = np.asarray(read_tensor(inits[node.input[1]], folder), np.float32)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
        if block:
            scale = np.repeat(scale, block, axis=axis)
        elif scale.ndim == 1:
            scale = np.expand_dims(scale, 1 - axis)
        out.append(raw.astype(np.float32) * scale)
    return out


def _nbits_weights(model: onnx.ModelProto, folder) -> list[np.ndarray]:
    """Every MatMulNBits weight of the packed graph as W [K, N] ((q - 2^(b-1)) s in float32), and every
    GatherBlockQuantized table as T^T [H, V]."""
    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type not in ("MatMulNBits", "GatherBlockQuantized"):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        data, scale_name = (node.input[1], node.input[2]) if node.op_type == "MatMulNBits" else (node.input[0], node.input[2])
        packed = np.asarray(read_tensor(inits[data], folder))
        scales = np.asarray(read_tensor(inits[scale_name], folder))
        n, blocks = scales.shape
        k = blocks * attrs["block_size"]
        packed = packed.reshape(n, blocks, -1)
        out.append(NBitsWeight(packed, scales, None, attrs["bits"], attrs["block_size"], k, n).dequantize())
    return out


@pytest.mark.parametrize("build", ["int4", "source-grid"])
def test_packed_weights_are_the_builds_codes(int4_builds, build):
    """Each packed weight is, value for value, one DequantizeLinear weight of the contract graph (transposed
    where the kernel reads rows: a table, a tied lm_head)."""
    folder = int4_builds[build]
    contract = _dq_weights(onnx.load(str(folder / "target.onnx"), load_external_data=False), folder)
    packed = _nbits_weights(onnx.load(str(folder / "target.ort.onnx"), load_external_data=False), folder)
    assert len(packed) >= len(contract) > 0
    keys = {(w.shape, w.tobytes()) for w in contract} | {(w.T.shape, w.T.tobytes()) for w in contract}
    for weight in packed:
        assert (weight.shape, weight.tobytes()) in keys


def _logits(path, ids: np.ndarray, fused: bool) -> np.ndarray:
    target = open_artifact(path, threads=2, drafter="none", fused=fused).target
    cache = target.new_cache()
    mask = np.tril(np.ones((len(ids), len(ids)), bool))
    return target.run(ids, np.arange(len(ids)), cache.attention_mask(mask), cache).logits


def _with_cpu_graph(build, tmp_path, accuracy_level: int):
    """A copy of `build` whose packed graph was rewritten at `accuracy_level`."""
    copy = tmp_path / "copy"
    shutil.copytree(build, copy)
    manifest = read_manifest(copy)
    src = manifest.model["built_from"]
    source = read_manifest(src)
    fused = {name: spec for name, spec in source.graphs.items() if name == variant_name("target")}
    specs, files = write_cpu_graphs(src, fused, source.graph("target"), copy, "int4", accuracy_level=accuracy_level)
    manifest.graphs.update(specs)
    manifest.record_files(copy, files)
    manifest.write(copy)
    return copy


@pytest.mark.parametrize("build", ["int4", "source-grid"])
def test_the_packed_graph_computes_the_contract_graphs_function(int4_builds, build, tmp_path):
    """At accuracy level 0 (fp32 arithmetic) the packed graph gives the contract graph's logits to float rounding;
    at the default level 4 (int8 activations per block of 32) to its activation rounding."""
    ids = np.array([5, 9, 20, 31, 7, 12, 40, 3, 22, 17], dtype=np.int64)
    contract = _logits(int4_builds[build], ids, fused=False)
    scale = float(np.abs(contract).max())
    level0 = _logits(_with_cpu_graph(int4_builds[build], tmp_path, 0), ids, fused=True)
    assert float(np.abs(level0 - contract).max()) < 1e-4 * scale
    level4 = _logits(int4_builds[build], ids, fused=True)
    assert 1e-6 * scale < float(np.abs(level4 - contract).max()) < 0.05 * scale


def test_int8_needs_onnx_only_and_takes_no_calibration_method(tiny_artifact, tmp_path, capsys):
    from conftest import run_cli_here

    code, _, err = run_cli_here(capsys, "build", str(tiny_artifact), "--int8", "--out", str(tmp_path / "a"))
    assert code == 2 and "--int8" in err and "--onnx-only" in err and "Traceback" not in err
    code, _, err = run_cli_here(capsys, "build", str(tiny_artifact), "--int8", "--onnx-only", "--low-rank", "8", "--out", str(tmp_path / "b"))
    assert code == 2 and "--int8" in err and "--low-rank" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_fused_weight_that_is_no_contract_weight_is_refused(int4_builds, tmp_path, monkeypatch):
    """A fused graph whose weights do not match the contract graph's (another exporter's layout) gets no packed
    graph rather than an fp32 one labelled INT4."""
    from speccompile.engines import cpu_graph
    from speccompile.errors import UnsupportedError

    matched = cpu_graph.match_weights

    def one_lost(fused, source):
        pairs = matched(fused, source)
        lost = next(name for name in pairs if name.endswith("down_proj.weight_t"))
        return {k: v for k, v in pairs.items() if k != lost}

    monkeypatch.setattr(cpu_graph, "match_weights", one_lost)
    with pytest.raises(UnsupportedError, match="none of the contract graph's weights"):
        _with_cpu_graph(int4_builds["int4"], tmp_path, 4)
    notes: list[str] = []
    src = read_manifest(int4_builds["int4"]).model["built_from"]
    source = read_manifest(src)
    fused = {variant_name("target"): source.graph(variant_name("target"))}
    copy = tmp_path / "again"
    shutil.copytree(int4_builds["int4"], copy)
    assert cpu_graph.quantized_cpu_graphs(src, fused, source.graph("target"), copy, "int4", notes.append) == ({}, [])
    assert any("no fused CPU graph" in n for n in notes)  # the build goes on with the contract graph


def test_a_packed_int4_build_gets_no_runs_as_fp32_warning(int4_builds, tmp_path, capsys):
    """The CLI warns that an INT4 target runs as fp32 on the CPU only where it has no packed CPU graph."""
    from speccompile.commands.generate import check_artifact_backend

    check_artifact_backend(int4_builds["source-grid"], "ort-cpu")
    assert "runs as fp32" not in capsys.readouterr().err
    bare = tmp_path / "bare"
    shutil.copytree(int4_builds["int4"], bare)
    manifest = read_manifest(bare)
    for name in [n for n, spec in manifest.graphs.items() if spec.extra.get("variant_of")]:
        del manifest.graphs[name]  # a build from before the packed graphs
    manifest.write(bare)
    check_artifact_backend(bare, "ort-cpu")
    assert "runs as fp32" in capsys.readouterr().err


def test_int8_block_must_be_32_or_64(tiny_artifact, tmp_path, capsys):
    """--int8-block takes the two blocks the packed graph runs row-exactly at 8 bits; another is refused (exit 2)."""
    from conftest import run_cli_here

    code, _, err = run_cli_here(capsys, "build", str(tiny_artifact), "--int8", "--onnx-only", "--int8-block", "128",
                                "--out", str(tmp_path / "a"))
    assert code == 2 and "--int8-block" in err and "Traceback" not in err
    with pytest.raises(InputError, match="--int8-block"):
        BuildOptions(precision="int8", onnx_only=True, int8_block=16).validate()



def test_the_tied_head_projects_straight_into_the_logits(tmp_path, monkeypatch):
    """A packed tied lm_head (a Q8_0 table, as Gemma 3's GGUF) reads the [batch, rows, K] rows and writes `logits`
    itself: no Reshape around it (engines/head_fold.py), so ONNX Runtime copies no rows x vocabulary floats after
    the projection; and its logits are the bits of the unfolded graph (the Reshapes kept) in a pass of several rows."""
    folder = make_tiny_hf_model(tmp_path / "hf", tie_word_embeddings=True)
    exported = export_as_gguf(tmp_path / "gguf", folder, quant="Q4_1", table_quant="Q8_0")
    built = tmp_path / "built"
    build_artifact(exported, built, BuildOptions(precision="int4", onnx_only=True, quantize_tables=True, exclude=()))
    graph = onnx.load(str(built / "target.ort.onnx"), load_external_data=False).graph
    producer = {out: node for node in graph.node for out in node.output}
    assert producer["logits"].op_type == "MatMulNBits"
    assert not any("lm_head.flat_shape" in node.input for node in graph.node)
    monkeypatch.setattr("speccompile.engines.cpu_graph.fold_head_reshapes", lambda nodes, outputs: nodes)
    unfolded = _with_cpu_graph(built, tmp_path, 4)
    kept = onnx.load(str(unfolded / "target.ort.onnx"), load_external_data=False).graph
    assert next(n for n in kept.node if "logits" in n.output).op_type == "Reshape"  # the control: really unfolded
    ids = np.array([5, 9, 20, 31, 7, 12, 40, 3, 22, 17], dtype=np.int64)
    assert np.array_equal(_logits(built, ids, fused=True), _logits(unfolded, ids, fused=True))


def test_a_row_table_runs_the_tied_head_as_an_integer_product(tmp_path, capsys):
    """`--table-format int8-row` requantizes a Q8_0 table per row; the tied lm_head then runs as MatMulInteger over
    per-row int8 activations (engines/integer_head.py) and writes `logits` itself, and a row's logits are the same
    bits in a pass of several rows as alone. Against the Q8_0 build (MatMulNBits), its logits are close, not equal."""
    from conftest import run_cli_here

    folder = make_tiny_hf_model(tmp_path / "hf", tie_word_embeddings=True)
    exported = export_as_gguf(tmp_path / "gguf", folder, quant="Q4_1", table_quant="Q8_0")
    built = {}
    for table_format in ("int8", "int8-row"):
        built[table_format] = tmp_path / table_format
        code, _, err = run_cli_here(capsys, "build", str(exported), "--int4", "--quantize-lm-head", "--table-format", table_format,
                                    "--onnx-only", "--out", str(built[table_format]))
        assert code == 0, err
    graph = onnx.load(str(built["int8-row"] / "target.ort.onnx"), load_external_data=False).graph
    producer = {out: node for node in graph.node for out in node.output}
    assert [n.op_type for n in graph.node].count("MatMulInteger") == 1
    assert producer["logits"].op_type == "Mul" and not any("lm_head.flat_shape" in n.input for n in graph.node)
    kernels = read_manifest(built["int8-row"]).graph(variant_name("target")).extra["cpu_kernels"]
    assert kernels["MatMulInteger"] == 1 and "MatMulInteger" not in read_manifest(built["int8"]).graph(variant_name("target")).extra["cpu_kernels"]
    ids = np.array([5, 9, 20, 31, 7, 12, 40, 3, 22, 17], dtype=np.int64)
    whole = _logits(built["int8-row"], ids, fused=True)
    for end in (1, 4):
        assert np.array_equal(_logits(built["int8-row"], ids[:end], fused=True), whole[:end])
    blocked = _logits(built["int8"], ids, fused=True)
    assert not np.array_equal(whole, blocked)
    assert np.abs(whole - blocked).max() < 0.05 * np.abs(blocked).max()
    code, _, err = run_cli_here(capsys, "build", str(exported), "--int4", "--table-format", "int9", "--onnx-only", "--out", str(tmp_path / "x"))
    assert code == 2 and "--table-format" in err and "Traceback" not in err


def test_a_build_writes_the_same_packed_graph_every_time(tiny_artifact, tmp_path):
    """Two builds of one export in processes with different string hashing write byte-identical packed CPU graphs
    (the initializers listed in the order the nodes read them, not a set's order)."""
    import os
    import subprocess
    import sys

    graphs = []
    for seed in ("1", "2"):
        out = tmp_path / f"b{seed}"
        done = subprocess.run([sys.executable, "-m", "speccompile.cli", "build", str(tiny_artifact), "--int4", "--onnx-only",
                               "--out", str(out)], capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONWARNINGS="ignore"))
        assert done.returncode == 0, done.stderr
        graphs.append((out / "target.ort.onnx").read_bytes())
    assert graphs[0] == graphs[1]


def test_a_table_flag_without_quantize_lm_head_is_refused(tiny_artifact, tmp_path, capsys):
    """--table-format / --table-block only shape a table --quantize-lm-head quantizes: alone they are refused in one
    line (exit 2) before anything is written, instead of building as if they were not given."""
    from conftest import run_cli_here

    for flags in (["--table-format", "int8-row"], ["--table-block", "128"]):
        out = tmp_path / flags[0].strip("-")
        code, _, err = run_cli_here(capsys, "build", str(tiny_artifact), "--int4", "--onnx-only", *flags, "--out", str(out))
        assert code == 2 and flags[0] in err and "--quantize-lm-head" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1 and not out.exists()
