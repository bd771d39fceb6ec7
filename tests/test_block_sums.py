"""engines/block_sums.py: the offset branch's x E as a ReduceSum over blocks, the same sums, other MatMuls untouched."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from speccompile.engines.block_sums import reduce_block_sums
from speccompile.engines.quantize import block_sum_matrix


class _Inits:
    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        self.inits = {name: numpy_helper.from_array(a, name) for name, a in arrays.items()}

    def array(self, name: str) -> np.ndarray:
        return self.arrays[name]


def _run(nodes, inits: dict[str, TensorProto], x: np.ndarray) -> np.ndarray:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], list(inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_block_sum_matmuls_become_reductions_with_the_same_sums():
    source = _Inits({"E": block_sum_matrix(64, 32).astype(np.float16), "W": np.ones((64, 2), np.float32)})
    nodes = [helper.make_node("Cast", ["E"], ["E32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "E32"], ["s"], name="sums"),
             helper.make_node("MatMul", ["x", "W"], ["w"], name="other"),  # not a block-sum matrix: kept
             helper.make_node("Concat", ["s", "w"], ["y"], axis=-1)]
    new_tensors: dict[str, TensorProto] = {}
    rewritten = reduce_block_sums(nodes, source, new_tensors)
    assert [n.op_type for n in rewritten] == ["Reshape", "ReduceSum", "MatMul", "Concat"]  # the unread Cast dropped
    x = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)
    y = _run(rewritten, {**source.inits, **new_tensors}, x)
    expected = np.concatenate([x.reshape(2, 3, 2, 32).sum(-1), x.sum(-1, keepdims=True).repeat(2, -1)], -1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    for rows in (1, 2):  # a row's sums are the same bits whatever the rows beside it
        np.testing.assert_array_equal(_run(rewritten, {**source.inits, **new_tensors}, x[:1, :rows])[0], y[0, :rows])


def test_a_matrix_that_is_not_a_block_indicator_is_left_alone():
    e = block_sum_matrix(64, 32)
    e[3, 0] = 2.0
    source = _Inits({"E": e})
    nodes = [helper.make_node("MatMul", ["x", "E"], ["y"])]
    assert [n.op_type for n in reduce_block_sums(nodes, source, {})] == ["MatMul"]
