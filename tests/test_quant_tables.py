"""Quantized embedding tables (`build --quantize-lm-head`): one stored table, read by the Gather and the tied lm_head."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_cli
from speccompile.accel.compat import check_tensorrt_compat
from speccompile.engines import numerics as nx
from speccompile.engines.qdq_targets import QuantOptions, activation_tensors, embedding_tables
from speccompile.engines.quantize import quantize_model, trt_fp4_dynamic_quantize_reference

V, H, T = 40, 128, 6
STORED = {"fp8": TensorProto.FLOAT8E4M3FN, "int4": TensorProto.INT4, "nvfp4": TensorProto.FLOAT4E2M1}


def _tied_model() -> onnx.ModelProto:
    """ids -> Gather(table) -> Mul(gamma) -> MatMul(W) -> Gemm(., table, transB=1) = logits (a tied lm_head)."""
    rng = np.random.default_rng(0)
    weights = {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "gamma": (1.0 + rng.random(H)).astype(np.float32),
        "layer.weight_t": (rng.standard_normal((H, H)) * 0.2).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["model.embed_tokens.weight", "ids"], ["e"], name="/embed_tokens/Gather"),
        helper.make_node("Mul", ["e", "gamma"], ["a"], name="/norm/Mul"),
        helper.make_node("MatMul", ["a", "layer.weight_t"], ["h"], name="/layer/MatMul"),
        helper.make_node("Gemm", ["h", "model.embed_tokens.weight"], ["logits"], name="/Gemm", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [T])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [T, V])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


IDS = np.array([3, 17, 3, 39, 0, 25], np.int64)


def _activations(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return dict(zip(["a", "h"], ReferenceEvaluator(model).run(["a", "h"], {"ids": IDS})))


def _table_dq(table: np.ndarray, scheme: str, block: int) -> np.ndarray:
    """Numpy reference of the stored table as every reader sees it."""
    if scheme == "fp8":
        q, s = nx.quantize_fp8_per_channel(table, axis=0)
        return q.astype(np.float32) * s[:, None]
    if scheme == "int4":
        q, s = nx.quantize_int4_blockwise(table.T, block)
        return nx.dequantize_int4_blockwise(q, s, block).T
    codes, s8, s2 = nx.nvfp4_quantize(table)
    return nx.nvfp4_dequantize(codes, s8, s2)


def test_embedding_tables_finds_the_tied_table_only():
    model = _tied_model()
    [table] = embedding_tables(model)
    assert table.name == "model.embed_tokens.weight" and table.head_input == "h"
    assert [g.name for g in table.gathers] == ["/embed_tokens/Gather"]
    assert activation_tensors(model, QuantOptions("fp8", exclude=())) == ["a"]  # tables off: no lm_head input
    assert activation_tensors(model, QuantOptions("fp8", exclude=(), tables=True, table_format="scheme")) == ["a", "h"]


@pytest.mark.parametrize("scheme", ["fp8", "int4", "nvfp4"])
def test_tied_table_stored_once_both_readers_share_its_dq(scheme):
    from onnx.reference import ReferenceEvaluator

    model = _tied_model()
    table = numpy_helper.to_array(model.graph.initializer[0]).copy()
    acts = _activations(model)
    amax = {k: float(np.abs(v).max()) for k, v in acts.items()}
    options = QuantOptions(scheme, exclude=(), tables=True, table_block=64, table_format="scheme")
    report = quantize_model(model, options, amax if scheme != "int4" else None)
    onnx.checker.check_model(model, full_check=True)
    assert report.tables == {"model.embed_tokens.weight": "gather+lm_head"}
    inits = {i.name: i for i in model.graph.initializer}
    assert "model.embed_tokens.weight" not in inits
    stored = [i for i in inits.values() if i.name.startswith("model.embed_tokens.weight") and i.data_type == STORED[scheme]]
    assert len(stored) == 1 and list(stored[0].dims) == [V, H]  # one table, [V, H], quantized
    by_out = {o: n for n in model.graph.node for o in n.output}
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert gather.input[0] == gemm.input[1]  # the same DequantizeLinear output
    dq = by_out[gather.input[0]]
    assert dq.op_type == "DequantizeLinear" and dq.input[0] == stored[0].name
    attrs = {a.name: a.i for a in dq.attribute}
    assert attrs == {"fp8": {"axis": 0}, "int4": {"axis": 1, "block_size": 64}, "nvfp4": {"axis": -1, "block_size": 16}}[scheme]
    if scheme != "int4":  # the lm_head input is quantized like every quantized MatMul input
        assert by_out[gemm.input[0]].op_type == "DequantizeLinear"
    compat = check_tensorrt_compat(model)
    assert compat.ok, compat.errors

    # numbers: the graph (onnx.reference, the TRT op's reference for nvfp4) against numpy, table included
    ev = ReferenceEvaluator(model, new_ops=[trt_fp4_dynamic_quantize_reference()])
    got, a, h = ev.run(["logits", "a", "h"], {"ids": IDS})
    table_q = _table_dq(table, scheme, 64)
    np.testing.assert_allclose(a, table_q[IDS] * numpy_helper.to_array(inits["gamma"]), rtol=1e-6)  # the Gather's rows
    if scheme == "fp8":
        hq = nx.fp8_fake_quant(h, nx.fp8_activation_scale(amax["h"]))
    elif scheme == "nvfp4":
        c, s8, s2 = nx.nvfp4_quantize(h, nx.nvfp4_global_scale(amax["h"]))
        hq = nx.nvfp4_dequantize(c, s8, s2)
    else:
        hq = h
    np.testing.assert_allclose(got, hq @ table_q.T, rtol=1e-5, atol=1e-5 * np.abs(got).max())  # the lm_head
    # and the quantized table is close to the fp32 one (the readers see a quantized copy, not garbage)
    assert np.abs(table_q - table).max() < 0.3 * np.abs(table).max()


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_tied_table_runs_in_onnx_runtime(scheme):
    import onnxruntime as ort

    model = _tied_model()
    acts = _activations(model)
    amax = {k: float(np.abs(v).max()) for k, v in acts.items()}
    reference = numpy_helper.to_array(model.graph.initializer[0])[IDS]
    quantize_model(model, QuantOptions(scheme, exclude=(), tables=True, table_block=64, table_format="scheme"), amax if scheme == "fp8" else None)
    model.graph.output.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.disable_quant_qdq", "1")  # as the runtime opens quantized graphs
    logits, e = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(["logits", "e"], {"ids": IDS})
    assert logits.shape == (T, V) and np.isfinite(logits).all()
    assert np.abs(e - reference).max() < 0.2 * np.abs(reference).max()


def test_tables_off_or_excluded_leave_the_table_fp32():
    for options in (QuantOptions("int4", exclude=()), QuantOptions("int4", exclude=("*embed_tokens*",), tables=True, table_format="scheme")):
        model = _tied_model()
        report = quantize_model(model, options)
        assert not report.tables
        inits = {i.name: i for i in model.graph.initializer}
        assert inits["model.embed_tokens.weight"].data_type == TensorProto.FLOAT


def test_build_quantize_lm_head_on_the_tiny_export(tiny_artifact, tmp_path):
    """The CLI flag on an untied model: lm_head quantized as a MatMul, the embedding table (Gather only) stored INT4."""
    from speccompile.manifest import read_manifest
    from speccompile.runtime.artifact import open_artifact

    out = tmp_path / "int4-head"
    result = run_cli("build", str(tiny_artifact), "--int4", "--onnx-only", "--quantize-lm-head", "--table-format", "scheme", "--table-block", "64",
                     "--calib-samples", "2", "--calib-max-tokens", "32", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = read_manifest(out, verify_files=True).precision["target"]
    assert record["tables"] == {"model.embed_tokens.weight": "gather"} and record["excluded"] == []
    model = onnx.load(str(out / "target.onnx"), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    assert "lm_head.weight_t" not in inits and "model.embed_tokens.weight" not in inits
    assert read_manifest(out, verify_files=False).precision["tensorrt_compat"]["target"]["ok"]
    art = open_artifact(out)
    cache = art.target.new_cache()
    ids = np.array([5, 9, 20, 31], np.int64)
    logits = art.target.run(ids, np.arange(4), cache.attention_mask(np.tril(np.ones((4, 4), bool))), cache).logits
    assert np.isfinite(logits).all()
    shutil.rmtree(out)


def test_compat_check_refuses_a_quantized_table_read_without_its_dequantize():
    """Negative control for the check above: an INT4 table that the Gather reads directly is not TensorRT's pattern."""
    model = _tied_model()
    quantize_model(model, QuantOptions("int4", exclude=(), tables=True, table_block=64, table_format="scheme"))
    assert check_tensorrt_compat(model).ok
    stored = next(i.name for i in model.graph.initializer if i.data_type == TensorProto.INT4 and i.name.startswith("model.embed"))
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    gather.input[0] = stored
    report = check_tensorrt_compat(model)
    assert not report.ok and any(stored in e and "int4" in e for e in report.errors)


def test_compat_warns_on_int4_blocks_tensorrt_does_not_take():
    model = _tied_model()
    quantize_model(model, QuantOptions("int4", exclude=(), int4_block=32, tables=True, table_block=64, table_format="scheme"))
    report = check_tensorrt_compat(model)
    assert report.ok  # ONNX Runtime runs it; TensorRT's INT4 block quantization takes 64 and 128 only
    assert [w for w in report.warnings if "INT4 block_size 32" in w] and not [w for w in report.warnings if "block_size 64" in w]


@pytest.mark.parametrize("scheme", ["fp8", "int4", "nvfp4"])
def test_int8_table_format_is_weight_only_per_row(scheme):
    from onnx.reference import ReferenceEvaluator

    model = _tied_model()
    table = numpy_helper.to_array(model.graph.initializer[0]).copy()
    options = QuantOptions(scheme, exclude=(), tables=True, table_format="int8")
    assert activation_tensors(model, options) == ([] if scheme == "int4" else ["a"])  # no lm_head input range needed
    amax = {k: float(np.abs(v).max()) for k, v in _activations(model).items()}
    report = quantize_model(model, options, amax if scheme != "int4" else None)
    onnx.checker.check_model(model, full_check=True)
    assert report.tables == {"model.embed_tokens.weight": "gather+lm_head"}
    [stored] = [i for i in model.graph.initializer if i.name.startswith("model.embed_tokens.weight") and i.data_type == TensorProto.INT8]
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    assert gather.input[0] == gemm.input[1] and gemm.input[0] == "h"  # weight-only: the lm_head input is not quantized
    assert check_tensorrt_compat(model).ok
    q, s = nx.quantize_int8_per_row(table)
    np.testing.assert_array_equal(numpy_helper.to_array(stored), q)
    got, h = ReferenceEvaluator(model, new_ops=[trt_fp4_dynamic_quantize_reference()]).run(["logits", "h"], {"ids": IDS})
    np.testing.assert_allclose(got, h @ (q.astype(np.float32) * s[:, None]).T, rtol=1e-5, atol=1e-5 * np.abs(got).max())


@pytest.mark.parametrize("scheme", ["fp8", "int4", "nvfp4"])
def test_fp16_table_format_is_the_table_in_float16_behind_a_cast(scheme):
    """`--table-format fp16`: one float16 copy of the tied table, Cast to the graph's float type, read by the Gather
    and the lm_head (its input unquantized); the logits are the lm_head's input times the float16-rounded table."""
    from onnx.reference import ReferenceEvaluator

    model = _tied_model()
    table = numpy_helper.to_array(model.graph.initializer[0]).copy()
    options = QuantOptions(scheme, exclude=(), tables=True, table_format="fp16")
    assert activation_tensors(model, options) == ([] if scheme == "int4" else ["a"])
    amax = {k: float(np.abs(v).max()) for k, v in _activations(model).items()}
    report = quantize_model(model, options, amax if scheme != "int4" else None)
    onnx.checker.check_model(model, full_check=True)
    assert report.tables == {"model.embed_tokens.weight": "gather+lm_head"}
    [stored] = [i for i in model.graph.initializer if i.name.startswith("model.embed_tokens.weight")]
    assert stored.data_type == TensorProto.FLOAT16
    cast = next(n for n in model.graph.node if n.op_type == "Cast")
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    assert cast.input[0] == stored.name and gather.input[0] == gemm.input[1] == cast.output[0] and gemm.input[0] == "h"
    assert check_tensorrt_compat(model).ok
    got, h = ReferenceEvaluator(model, new_ops=[trt_fp4_dynamic_quantize_reference()]).run(["logits", "h"], {"ids": IDS})
    np.testing.assert_allclose(got, h @ table.astype(np.float16).astype(np.float32).T, rtol=1e-5, atol=1e-5 * np.abs(got).max())
