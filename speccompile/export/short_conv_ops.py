"""A short-conv layer's nodes (LFM2) for the contract and the fused CPU graph (models/short_conv.py is the torch
reference, op for op; export/linear_ops.py dispatches here and writes the gated delta net).

The layer reads its conv state `past_state.{i}.conv` [b, C, kernel - 1] as of some committed token and the accepted
rows after it not yet folded in, `past_state.{i}.rows` [b, pending, C] (each row's conv input B * x). One `Scan`
folds those rows into the state (`present_state.{i}.conv`), a second runs the pass's rows from there (the conv
window times the kernel, summed: no MatMul); the pass's rows' conv inputs are `present_state.{i}.rows`, of which the
runtime keeps the accepted ones as the next pending rows (runtime/state_cache.py), as for a gated delta net.
"""

from __future__ import annotations

from typing import Callable

import onnx
from onnx import helper

from ..models.config import ModelConfig
from .graph_builder import INT64_MAX, GraphBuilder
from .moe_ops import Emitter


def short_conv_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """Short-conv layer i's output [b, q, hidden] of its normed input `h` (models.short_conv.ShortConv)."""
    hy, c = cfg.hybrid, em.const
    b_in, c_in, x_in = em.op("Split", [em.one("MatMul", [h, role("conv_in")]), c("short_conv.bcx", [hy.width] * 3)], 3, axis=-1)
    bx = em.op("Mul", [b_in, x_in], [f"present_state.{i}.rows"])[0]
    kernel = em.one("Reshape", [role("conv_kernel"), c("short_conv.kernel", [hy.width, hy.conv_kernel])])  # a scan state
    state = f"present_state.{i}.conv"
    _scan(em, cfg, i, "fold", f"past_state.{i}.conv", kernel, f"past_state.{i}.rows", [state, f"short_conv.{i}.fold.kernel"])
    rows = _scan(em, cfg, i, "rows", state, kernel, bx, [f"short_conv.{i}.rows.conv", f"short_conv.{i}.rows.kernel"])
    return em.one("MatMul", [em.one("Mul", [c_in, rows]), role("conv_out")])


def _scan(em: Emitter, cfg: ModelConfig, i: int, tag: str, state: str, kernel: str, rows: str, outputs: list[str]) -> str:
    """A Scan of the token step over `rows` [b, n, C] (n >= 1) from `state`; its final state named outputs[0];
    returns the rows' conv outputs [b, n, C]."""
    return em.op("Scan", [state, kernel, rows], [*outputs, f"short_conv.{i}.{tag}.out"], body=_body(cfg, i, em.elem, tag),
                 num_scan_inputs=1, scan_input_axes=[1], scan_output_axes=[1])[2]


def _body(cfg: ModelConfig, i: int, elem: int, tag: str) -> onnx.GraphProto:
    """One token (models.short_conv.ShortConv.step): the conv state [b, C, K-1], the kernel [C, K] (passed through)
    and the row's conv input [b, C] -> the state after it, the kernel, the row's conv output [b, C]."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/conv/{tag}", GraphBuilder()
    conv_in, kernel, bx = (f"{s}/{n}" for n in ("conv_in", "kernel", "bx"))
    window = b.one(s, "Concat", [conv_in, b.one(s, "Unsqueeze", [bx, b.const(s, [-1])])], axis=-1)  # [b, C, K]
    out = b.one(s, "ReduceSum", [b.one(s, "Mul", [window, kernel]), b.const(s, [-1])], keepdims=0)
    state = b.one(s, "Slice", [window, b.const(s, [1]), b.const(s, [INT64_MAX]), b.const(s, [2]), b.const(s, [1])])
    shapes = {conv_in: ["batch", hy.width, hy.conv_kernel - 1], kernel: [hy.width, hy.conv_kernel], bx: ["batch", hy.width]}
    inputs = [helper.make_tensor_value_info(n, elem, shape) for n, shape in shapes.items()]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in (state, b.one(s, "Identity", [kernel]), out)]
    return helper.make_graph(b.nodes, f"short_conv_{tag}_{i}", inputs, outputs)
