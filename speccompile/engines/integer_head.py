"""An lm_head stored INT8 per output row, run as an integer matrix product on the CPU: exact in any pass by construction.

A table stored `--table-format int8-row` (INT8 per row, a GGUF's Q8_0 table requantized) has one scale per vocabulary
entry: logits[r, v] = s_v x[r] . c_v. With each activation row quantized to int8 by its own largest magnitude
(a_r = round(x[r] 127 / max|x[r]|) + 128, unsigned with zero point 128), the dot products are int32 sums that ONNX
Runtime's MatMulInteger computes exactly, whatever its blocking, threads or number of rows; what follows is
elementwise. A row's logits are therefore the same bits in a
verify pass of any size as alone: the row exactness MatMulNBits gets from its kernel at accuracy level 4 and
blocks of 32 (docs/cpu.md), here from integer arithmetic itself.

Why: MatMulNBits computes an M-row pass of a wide head about row by row (Gemma 3's 262144 x 640 head: 9 rows cost
about twice one), while the integer product reads the weight once for all rows, and a per-row table carries one
scale per row instead of one per 32 codes (Gemma 3: 168 MB against 189 MB read a token). The activation's int8
step is one scale per row instead of one per 32 inputs, which costs accuracy on some models (docs/cpu.md): the build
uses it only when asked (`--table-format int8-row`).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

PREFIX = "integer_head"
# the constants every integer head shares: ReduceMax's axis, the int8 range, the unsigned offset, the floor that
# keeps an all-zero row (the fused graph's padding row after a norm of zeros) at codes 128 instead of 0 / 0
CONSTANTS = {"axis": np.array([-1], np.int64), "range": np.array(127.0, np.float32), "offset": np.array(128.0, np.float32),
             "zero_point": np.array(128, np.uint8), "floor": np.array(1e-30, np.float32)}


def constant_name(key: str) -> str:
    return f"{PREFIX}/{key}"


def constant_tensors() -> list[TensorProto]:
    """The shared small constants the integer heads read (inline initializers)."""
    return [numpy_helper.from_array(value, constant_name(key)) for key, value in CONSTANTS.items()]


def weight_arrays(codes_rows: np.ndarray, scale_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B int8 [K, N], column scales float32 [N]) for MatMulInteger from signed codes [N, K] and per-row scales [N]."""
    return np.ascontiguousarray(np.asarray(codes_rows, np.int8).T), np.ascontiguousarray(np.asarray(scale_rows, np.float32).reshape(-1))


def integer_head_nodes(x: str, weight: str, column_scales: str, out: str, name: str) -> list:
    """Nodes computing `out` [..., N] = x [..., K] through the int8 weight `weight` [K, N] and its `column_scales`."""
    c = constant_name
    t = f"{name}/"
    return [
        helper.make_node("Abs", [x], [t + "abs"], name=t + "Abs"),
        helper.make_node("ReduceMax", [t + "abs", c("axis")], [t + "max"], name=t + "ReduceMax", keepdims=1),
        helper.make_node("Max", [t + "max", c("floor")], [t + "max_floored"], name=t + "Max"),
        helper.make_node("Div", [t + "max_floored", c("range")], [t + "step"], name=t + "Step"),
        helper.make_node("Div", [x, t + "step"], [t + "scaled"], name=t + "Scale"),
        helper.make_node("Round", [t + "scaled"], [t + "rounded"], name=t + "Round"),
        helper.make_node("Add", [t + "rounded", c("offset")], [t + "shifted"], name=t + "Shift"),
        helper.make_node("Cast", [t + "shifted"], [t + "codes"], name=t + "Codes", to=TensorProto.UINT8),
        helper.make_node("MatMulInteger", [t + "codes", weight, c("zero_point")], [t + "sums"], name=t + "MatMulInteger"),
        helper.make_node("Cast", [t + "sums"], [t + "sums_float"], name=t + "Float", to=TensorProto.FLOAT),
        helper.make_node("Mul", [t + "sums_float", column_scales], [t + "columns"], name=t + "Columns"),
        helper.make_node("Mul", [t + "columns", t + "step"], [out], name=t + "Rows"),
    ]


def reference_logits(x: np.ndarray, codes_rows: np.ndarray, scale_rows: np.ndarray) -> np.ndarray:
    """What the nodes compute, in numpy (for tests): the same rounding, integer sums, and float products in order."""
    step = np.maximum(np.abs(x).max(axis=-1, keepdims=True), np.float32(1e-30)) / np.float32(127.0)
    codes = (np.rint(x / step)).astype(np.int32)
    sums = codes @ np.asarray(codes_rows, np.int32).T
    return (sums.astype(np.float32) * np.asarray(scale_rows, np.float32).reshape(-1)) * step
