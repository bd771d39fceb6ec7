"""benchmarks/modelopt_compare.py's repair of Q/DQ pairs with a non-finite scale (no ModelOpt needed), and the
TensorRT check's refusal of such scales."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from conftest import load_benchmark


def _fp8_zero(name: str) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, [], [0.0])


def _graph(mask_scale: float) -> onnx.ModelProto:
    """y = DQ(Q(mask, mask_scale)) + DQ(Q(x, 0.5)): the shape of ModelOpt's FP8 mask Add (the x scale a Constant node)."""
    nodes = [
        helper.make_node("Constant", [], ["x_scale"], value=numpy_helper.from_array(np.array(0.5, np.float32))),
        helper.make_node("QuantizeLinear", ["mask", "mask_scale", "mask_zero"], ["mask_q"]),
        helper.make_node("DequantizeLinear", ["mask_q", "mask_scale", "mask_zero"], ["mask_dq"]),
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        helper.make_node("Add", ["x_dq", "mask_dq"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(mask_scale, np.float32), "mask_scale"), _fp8_zero("mask_zero"), _fp8_zero("x_zero")]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "mask")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]


FEEDS = {"x": np.array([[1.0, -2.0, 3.5], [0.25, 7.0, -0.5]], np.float32),
         "mask": np.array([[0.0, np.finfo(np.float32).min, 0.0], [0.0, 0.0, np.finfo(np.float32).min]], np.float32)}


def test_an_inf_scale_makes_nan_and_dropping_its_pair_keeps_the_tensor_in_fp32():
    script = load_benchmark("modelopt_compare")
    model = _graph(np.inf)
    assert np.isnan(_run(model, FEEDS)).all()  # Q gives 0, DequantizeLinear 0 x inf: NaN, whatever the input
    assert script.drop_nonfinite_qdq(model) == ["mask"]
    assert [n.op_type for n in model.graph.node].count("QuantizeLinear") == 1  # the finite pair stays
    assert sorted(i.name for i in model.graph.initializer) == ["x_zero"]  # no orphan FP8 zero point left behind
    expected = _run(_graph(1.0), {"x": FEEDS["x"], "mask": np.zeros_like(FEEDS["mask"])}) + FEEDS["mask"]
    np.testing.assert_array_equal(_run(model, FEEDS), expected)


def test_finite_scales_and_pairs_feeding_graph_outputs_are_left_alone():
    script = load_benchmark("modelopt_compare")
    model = _graph(1.0)
    assert script.drop_nonfinite_qdq(model) == [] and len(model.graph.node) == 6
    exposed = _graph(np.nan)
    exposed.graph.output.append(helper.make_tensor_value_info("mask_dq", TensorProto.FLOAT, [2, 3]))
    assert script.drop_nonfinite_qdq(exposed) == [] and len(exposed.graph.node) == 6


def test_tensorrt_check_refuses_a_scale_that_is_not_finite_and_positive_and_passes_the_repaired_graph():
    from speccompile.accel.compat import check_tensorrt_compat

    script = load_benchmark("modelopt_compare")
    for value in (np.inf, np.nan, 0.0, -1.0):
        report = check_tensorrt_compat(_graph(value))
        assert [e for e in report.errors if e.startswith("Q/DQ scale mask_scale:")], (value, report.errors)
    model = _graph(np.inf)
    script.drop_nonfinite_qdq(model)
    assert check_tensorrt_compat(model).ok and check_tensorrt_compat(_graph(1.0)).ok
