"""The integer lm_head (engines/integer_head.py) on ONNX Runtime CPU: the numbers its docstring promises, bit for bit,
and a row's logits independent of the other rows of the pass."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from speccompile.engines.integer_head import constant_tensors, integer_head_nodes, reference_logits, weight_arrays

K, N = 96, 1000


def _session(codes_rows: np.ndarray, scale_rows: np.ndarray, threads: int) -> ort.InferenceSession:
    weight, column_scales = weight_arrays(codes_rows, scale_rows)
    nodes = integer_head_nodes("x", "w", "s", "logits", "head")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "r", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "r", N])],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(column_scales, "s"), *constant_tensors()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(-127, 128, (N, K)).astype(np.int8), (rng.random(N) * 0.02 + 1e-3).astype(np.float32)


def test_the_graph_computes_the_reference_bit_for_bit():
    codes, scales = _weights()
    x = np.random.default_rng(1).standard_normal((2, 7, K)).astype(np.float32) * 3
    got = _session(codes, scales, 2).run(None, {"x": x})[0]
    assert got.shape == (2, 7, N)
    assert np.array_equal(got, reference_logits(x, codes, scales))
    exact = x @ (codes.astype(np.float32) * scales[:, None]).T  # int8 activations: close to the float product, not equal
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max() and not np.array_equal(got, exact)


def test_a_rows_logits_do_not_depend_on_the_other_rows():
    """Every row of an M-row pass (M = 1..33, 1 and 2 threads) is the bits of the same row alone; an all-zero row
    (the fused graph's padding row after a norm of zeros) gives zeros, not NaN."""
    codes, scales = _weights(2)
    x = np.random.default_rng(3).standard_normal((1, 33, K)).astype(np.float32)
    x[0, 5] = 0.0
    for threads in (1, 2):
        session = _session(codes, scales, threads)
        alone = np.concatenate([session.run(None, {"x": x[:, i:i + 1]})[0] for i in range(x.shape[1])], axis=1)
        assert not np.isnan(alone).any() and not alone[0, 5].any()
        for rows in (1, 2, 3, 8, 9, 16, 33):
            assert np.array_equal(session.run(None, {"x": x[:, :rows]})[0], alone[:, :rows]), (threads, rows)
