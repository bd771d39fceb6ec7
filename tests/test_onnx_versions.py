"""Every graph speccompile writes carries the lowest IR version / opsets it needs (onnxruntime 1.20 loads them)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from speccompile.onnx_versions import MIN_ORT, ORT_LIMITS, lowest_ir_version, pin_versions, required_onnxruntime

from test_heads_helpers import shared_target, write_checkpoint

OLDEST = ORT_LIMITS[MIN_ORT]


def _stamp(path: Path) -> tuple[int, dict[str, int], tuple[int, int] | None]:
    model = onnx.load(str(path), load_external_data=False)
    return model.ir_version, {op.domain: op.version for op in model.opset_import}, required_onnxruntime(model)


def _relu(ir: int, opset: int, extra_init: onnx.TensorProto | None = None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y], [extra_init] if extra_init else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir
    return model


def test_pin_lowers_to_what_the_operators_need():
    model = pin_versions(_relu(14, 25))
    assert model.opset_import[0].version == 14  # Relu-14 is the version opset 25 resolves to
    assert model.ir_version == 7  # opset 14 first shipped with IR 7 (onnx 1.9)
    onnx.checker.check_model(model)


def test_pin_keeps_what_a_dtype_needs():
    int4 = helper.make_tensor("w", TensorProto.INT4, [2], [1, 2])
    assert lowest_ir_version(_relu(14, 21, int4)) == 10
    if hasattr(TensorProto, "FLOAT4E2M1"):
        fp4 = helper.make_tensor("w", TensorProto.FLOAT4E2M1, [2], [1.0, 2.0])
        assert lowest_ir_version(_relu(14, 23, fp4)) == 11


def test_required_onnxruntime_reads_the_table():
    assert required_onnxruntime(pin_versions(_relu(14, 21))) == MIN_ORT
    too_new = _relu(11, 21)
    assert required_onnxruntime(too_new) is None  # IR 11: no onnxruntime in the table loads it


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_artifact, tiny_artifact_with_draft) -> dict[str, Path]:
    """Every kind of graph the project writes: contract, fused, draft model, a head (+ int8 variant), fp8/int4/nvfp4 builds."""
    from speccompile.engines.build import BuildOptions, build_artifact
    from speccompile.export.pipeline import ExportOptions, export_artifact

    graphs = {
        "contract": tiny_artifact / "target.onnx",
        "fused": tiny_artifact / "target.ort.onnx",
        "draft-model": tiny_artifact_with_draft / "draft.onnx",
        "draft-model fused": tiny_artifact_with_draft / "draft.ort.onnx",
    }
    root = tmp_path_factory.mktemp("versions")
    ckpt = write_checkpoint(root / "ckpt", "eagle3")
    heads = root / "heads"
    export_artifact(str(shared_target(tmp_path_factory)), heads, ExportOptions(drafter=f"eagle3:{ckpt}", max_context=64))
    graphs["head"], graphs["head int8"] = heads / "eagle3.onnx", heads / "eagle3.ort.onnx"
    for scheme in ("fp8", "int4", "nvfp4"):
        build_artifact(tiny_artifact, root / scheme, BuildOptions(precision=scheme, onnx_only=True, calib_samples=2, calib_max_tokens=32))
        graphs[scheme] = root / scheme / "target.onnx"
    return graphs


@pytest.mark.parametrize("kind", ["contract", "draft-model", "head", "fp8", "int4"])
def test_graphs_load_in_the_oldest_onnxruntime(written, kind):
    ir, opsets, required = _stamp(written[kind])
    assert ir <= OLDEST.max_ir_version and opsets[""] <= OLDEST.max_opset, (ir, opsets)
    assert required == MIN_ORT


@pytest.mark.parametrize("kind", ["fused", "draft-model fused", "head int8"])
def test_cpu_variants_need_exactly_their_contrib_features(written, kind):
    """The CPU variants are IR <= 10 / opset <= 21 like the rest; only GroupQueryAttention's position_ids and
    attention_bias (fused graphs) or 8-bit MatMulNBits (int8 head) need onnxruntime 1.22, which the
    manifest records (the runtime then uses the contract graph on an older onnxruntime)."""
    from speccompile.manifest import read_manifest

    FUSED_MIN_ORT = "1.22"
    ir, opsets, required = _stamp(written[kind])
    assert ir <= OLDEST.max_ir_version and opsets[""] <= OLDEST.max_opset, (ir, opsets)
    assert required == tuple(int(p) for p in FUSED_MIN_ORT.split("."))
    spec = next(s for s in read_manifest(written[kind].parent).graphs.values() if s.file == written[kind].name)
    assert spec.extra["min_onnxruntime"] == FUSED_MIN_ORT


def test_nvfp4_carries_exactly_what_fp4_needs(written):
    """NVFP4 is TensorRT-only: FLOAT4E2M1 in DequantizeLinear needs opset 23 and IR 11, and not more."""
    ir, opsets, _ = _stamp(written["nvfp4"])
    assert (ir, opsets[""], opsets["trt"]) == (11, 23, 1)


OLD_ORT_PYTHON = os.environ.get("SPECCOMPILE_OLD_ORT_PYTHON")  # a python with onnxruntime 1.20 installed


@pytest.mark.skipif(not OLD_ORT_PYTHON, reason="set SPECCOMPILE_OLD_ORT_PYTHON to a python with onnxruntime 1.20 installed")
def test_an_old_onnxruntime_really_loads_them(written):
    """The table's claim checked against a real onnxruntime 1.20 (the pyproject lower bound)."""
    paths = [str(written[k]) for k in ("contract", "draft-model", "head", "int4")]
    script = (
        "import sys, onnxruntime as ort\n"
        "assert ort.__version__.startswith('1.20'), ort.__version__\n"
        "opts = ort.SessionOptions()\n"
        "if sys.argv[1] == 'basic':\n"
        "    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC\n"
        "for p in sys.argv[2:]:\n"
        "    ort.InferenceSession(p, opts, providers=['CPUExecutionProvider'])\n"
    )
    done = subprocess.run([OLD_ORT_PYTHON, "-c", script, "all", *paths], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # fp8: its versions load; at ORT_ENABLE_ALL onnxruntime 1.20-1.22's optimizer fuses the fp8 Q/DQ into a
    # MatMulIntegerToFloat that rejects float8 (an onnxruntime bug, not a version stamp)
    fp8 = subprocess.run([OLD_ORT_PYTHON, "-c", script, "basic", str(written["fp8"])], capture_output=True, text=True, timeout=300)
    assert fp8.returncode == 0, fp8.stderr[-2000:]
    fused = subprocess.run([OLD_ORT_PYTHON, "-c", script, "all", str(written["fused"])], capture_output=True, text=True, timeout=300)
    assert fused.returncode != 0 and "GroupQueryAttention" in fused.stderr  # what min_onnxruntime 1.22 is for
    int8 = subprocess.run([OLD_ORT_PYTHON, "-c", script, "all", str(written["head int8"])], capture_output=True, text=True, timeout=300)
    assert int8.returncode != 0 and "MatMulNBits" in int8.stderr


def test_runtime_falls_back_to_the_contract_graph_on_an_old_onnxruntime(tiny_artifact, monkeypatch):
    import speccompile.onnx_versions as versions
    from speccompile.runtime.artifact import open_artifact

    assert open_artifact(tiny_artifact, threads=1).target.spec.file == "target.ort.onnx"
    monkeypatch.setattr(versions, "installed_onnxruntime", lambda: (1, 20))
    assert open_artifact(tiny_artifact, threads=1).target.spec.file == "target.onnx"


def test_no_fused_graph_written_by_an_old_onnxruntime(tiny_model_dir, tmp_path, monkeypatch):
    import speccompile.onnx_versions as versions
    from speccompile.export.pipeline import ExportOptions, export_artifact

    monkeypatch.setattr(versions, "installed_onnxruntime", lambda: (1, 21))
    notes: list[str] = []
    export_artifact(str(tiny_model_dir), tmp_path / "a", ExportOptions(max_context=32), notes.append)
    assert not (tmp_path / "a" / "target.ort.onnx").exists()
    assert any("onnxruntime >= 1.22" in n for n in notes)
