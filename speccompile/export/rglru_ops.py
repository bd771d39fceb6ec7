"""A RecurrentGemma recurrent block's nodes (RG-LRU) for the contract and the fused CPU graph (models/rglru.py is the
torch reference, op for op; export/linear_ops.py dispatches here).

The block reads its states `past_state.{i}.conv` [b, width, kernel - 1] and `past_state.{i}.recurrent` [b, width] as
of some committed token and the accepted rows after it not yet folded in, `past_state.{i}.rows` [b, pending, width
+ 2] (each row's conv input x and its flags keep | reset: reset 1 at position 0, keep 1 after it, both 0 on the
runtime's first pending row, which therefore leaves the zero states as they are). One `Scan` folds those rows into
the states (`present_state.{i}.conv` / `.recurrent`), a second runs the pass's rows from there: the conv window and
its bias, the block-diagonal input and recurrence gates, a = exp(-8 r softplus(a_param)), the update a (1 - reset)
state + x i (keep sqrt(1 - a^2) + reset), each row on its own, so a row's states are the same bits in every pass.
The GELU-tanh gate of linear_y and linear_out run on the pass's states.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..models.config import ModelConfig
from .activations import activation
from .graph_builder import INT64_MAX, GraphBuilder
from .mamba1_ops import state_scans
from .moe_ops import Emitter

# the weights the scan body reads (passed through as scan states: a body reads no outer value), by role
_WEIGHTS = ("lru_conv_bias", "lru_a", "lru_in_gate", "lru_in_gate_bias", "lru_a_gate", "lru_a_gate_bias")


def rglru_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """RecurrentGemma recurrent block i's output [b, q, hidden] of its normed input `h` (models.rglru.RgLru)."""
    hy, c = cfg.hybrid, em.const
    y = activation(em, "gelu_tanh", em.one("Add", [em.one("MatMul", [h, role("lru_y")]), role("lru_y_bias")]))
    x_in = em.one("Add", [em.one("MatMul", [h, role("lru_x")]), role("lru_x_bias")])
    zero = em.one("Equal", ["position_ids", c("rglru.zero", 0)])
    reset = em.one("Unsqueeze", [em.one("Cast", [zero], to=em.elem), c("rglru.last", [-1])])  # [b, q, 1]
    flags = em.one("Concat", [em.one("Sub", [c("rglru.one", 1.0, np.float32), reset]), reset], axis=-1)
    em.op("Concat", [x_in, flags], [f"present_state.{i}.rows"], axis=-1)
    weights = [em.one("Reshape", [role("lru_conv"), c("rglru.kernel", [hy.width, hy.conv_kernel])]), *(role(r) for r in _WEIGHTS)]
    pending = em.op("Split", [f"past_state.{i}.rows", c("rglru.rows", [hy.width, 2])], 2, axis=-1)
    out = state_scans(em, i, "rglru", lambda tag: _body(cfg, i, em.elem, tag), weights, pending, [x_in, flags])  # [b, q, width]
    return em.one("Add", [em.one("MatMul", [em.one("Mul", [out, y]), role("lru_out")]), role("lru_out_bias")])


def _body(cfg: ModelConfig, i: int, elem: int, tag: str) -> onnx.GraphProto:
    """One token (models.rglru.RgLru.step), the same nodes in both scans (export/mamba1_ops.py `state_scans`; `tag` names them apart). Inputs: the conv
    state [b, C, K-1], the state [b, C], the weights (passed through), the row's x [b, C] and flags [b, 2]; outputs:
    the states, the weights, the row's state [b, C]."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/rglru/{tag}", GraphBuilder()
    C, H, K = hy.width, hy.num_v_heads, hy.conv_kernel
    shapes = {"conv_in": ["batch", C, K - 1], "state_in": ["batch", C], "kernel": [C, K], "conv_bias": [C], "a_param": [C],
              "in_gate": [H, C // H, C // H], "in_gate_bias": [H, C // H], "a_gate": [H, C // H, C // H],
              "a_gate_bias": [H, C // H], "x": ["batch", C], "flags": ["batch", 2]}
    n = {key: f"{s}/{key}" for key in shapes}
    window = b.one(s, "Concat", [n["conv_in"], b.one(s, "Unsqueeze", [n["x"], b.const(s, [-1])])], axis=-1)  # [b, C, K]
    x = b.one(s, "Add", [b.one(s, "ReduceSum", [b.one(s, "Mul", [window, n["kernel"]]), b.const(s, [-1])], keepdims=0), n["conv_bias"]])
    blocks = b.one(s, "Reshape", [x, b.const(s, [0, H, 1, C // H])])
    gate_i, gate_r = (b.one(s, "Sigmoid", [b.one(s, "Reshape", [b.one(s, "Add", [
        b.one(s, "Squeeze", [b.one(s, "MatMul", [blocks, n[w]]), b.const(s, [2])]), n[f"{w}_bias"]]), b.const(s, [0, C])])])
        for w in ("in_gate", "a_gate"))
    log_a = b.one(s, "Mul", [b.one(s, "Mul", [b.const(s, -8.0, np.float32), gate_r]), b.one(s, "Softplus", [n["a_param"]])])
    keep, reset = b.op(s, "Split", [n["flags"], b.const(s, [1, 1])], 2, axis=-1)
    root = b.one(s, "Sqrt", [b.one(s, "Sub", [b.const(s, 1.0, np.float32), b.one(s, "Exp", [b.one(s, "Mul", [b.const(s, 2.0, np.float32), log_a])])])])
    factor = b.one(s, "Add", [b.one(s, "Mul", [keep, root]), reset])
    decay = b.one(s, "Mul", [b.one(s, "Exp", [log_a]), b.one(s, "Sub", [b.const(s, 1.0, np.float32), reset])])
    state = b.one(s, "Add", [b.one(s, "Mul", [decay, n["state_in"]]), b.one(s, "Mul", [b.one(s, "Mul", [x, gate_i]), factor])])
    conv_out = b.one(s, "Slice", [window, b.const(s, [1]), b.const(s, [INT64_MAX]), b.const(s, [2]), b.const(s, [1])])
    weights = [n[k] for k in shapes if k not in ("conv_in", "state_in", "x", "flags")]
    outputs = [conv_out, state, *(b.one(s, "Identity", [w]) for w in weights), b.one(s, "Identity", [state])]
    inputs = [helper.make_tensor_value_info(n[k], elem, shape) for k, shape in shapes.items()]
    return helper.make_graph(b.nodes, f"rglru_{tag}_{i}", inputs, [helper.make_tensor_value_info(o, elem, None) for o in outputs])
