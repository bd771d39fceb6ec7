"""Kimi Delta Attention's nodes for the contract and the fused CPU graph (Kimi Linear; models/kda.py is the torch
reference, op for op; models/kda_config.py the shapes and names).

The cache contract is the gated delta net's (export/linear_ops.py): `past_state.{i}.conv` [b, conv_dim, kernel - 1],
`past_state.{i}.recurrent` [b, heads, head_dim, head_dim] and the pending rows `past_state.{i}.rows` [b, pending,
conv_dim + heads + heads * head_dim] (each row's conv input, b, and the forget gate's f_b(f_a(x)) before dt_bias); one
Scan folds the pending rows into the states, a second runs the pass's rows, the same token step in both. An all-zero
row (the runtime's first) leaves zero states zero: its conv input is zero, so are its key and value.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..models.config import ModelConfig
from .graph_builder import INT64_MAX, GraphBuilder
from .moe_ops import Emitter


def kda_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """KDA layer i's output [b, q, hidden] of its normed input `h` (models.kda.KimiDeltaAttention); writes
    present_state.{i}.conv / .recurrent (the states after the pending rows) and present_state.{i}.rows (the pass's)."""
    hy, c = cfg.hybrid, em.const
    heads, dim = hy.num_v_heads, hy.k_dim
    mixed = em.one("MatMul", [h, role("kda_qkv")])
    low = hy.key_dim if hy.full_gates else dim  # Bailing: f_proj | g_proj | b_proj, no up projections
    f_a, g_a, beta_in = em.op("Split", [em.one("MatMul", [h, role("kda_down")]), c("kda.down_full" if hy.full_gates else "kda.down", [low, low, heads])], 3, axis=-1)
    forget = f_a if hy.full_gates else em.one("MatMul", [f_a, role("kda_f_up")])
    em.op("Concat", [mixed, beta_in, forget], [f"present_state.{i}.rows"], axis=-1)
    weights = [em.one("Reshape", [role("kda_conv"), c("kda.kernel", [hy.conv_dim, hy.conv_kernel])]),
               em.one("Reshape", [role("kda_a_log"), c("kda.a_log", [heads, 1])]),
               em.one("Reshape", [role("kda_dt_bias"), c("kda.dt_bias", [heads, dim])])]  # scan states: a body reads no outer value
    states = [f"present_state.{i}.conv", f"present_state.{i}.recurrent"]
    pending = em.op("Split", [f"past_state.{i}.rows", c("kda.rows", [hy.conv_dim, heads, hy.key_dim])], 3, axis=-1)
    _scan(em, cfg, i, "fold", [f"past_state.{i}.conv", f"past_state.{i}.recurrent"], weights, pending, states)
    rows = _scan(em, cfg, i, "rows", states, weights, [mixed, beta_in, forget])  # [b, q, heads, dim]: their readout
    # the gated RMSNorm of each head's readout, times sigmoid(g_b(g_a(x)))
    square = em.one("ReduceMean", [em.one("Pow", [rows, c("kda.two", 2.0, np.float32)]), c("kda.last", [-1])], keepdims=1)
    root = em.one("Sqrt", [em.one("Add", [square, c("kda.eps", cfg.rms_norm_eps, np.float32)])])
    wide = em.one("Mul", [rows, em.one("Div", [c("kda.one", 1.0, np.float32), root])])
    gate = em.one("Reshape", [g_a if hy.full_gates else em.one("MatMul", [g_a, role("kda_g_up")]), c("kda.heads", [0, 0, heads, dim])])
    normed = em.one("Mul", [em.one("Mul", [role("kda_norm"), wide]), em.one("Sigmoid", [gate])])
    return em.one("MatMul", [em.one("Reshape", [normed, c("kda.flat", [0, 0, hy.value_dim])]), role("kda_out")])


def _scan(em: Emitter, cfg: ModelConfig, i: int, tag: str, states: list[str], weights: list[str], rows: list[str],
          outputs: list[str] | None = None) -> str:
    """A Scan of the token step over `rows` (conv input, b, forget: [b, n, ...], n >= 1) from `states`; its final
    states named `outputs` (else internal); returns the rows' readouts [b, n, heads, dim]."""
    names = [*(outputs or [f"kda.{i}.{tag}.conv", f"kda.{i}.{tag}.recurrent"]),
             *(f"kda.{i}.{tag}.{n}" for n in ("kernel", "a_log", "dt_bias", "readout"))]
    return em.op("Scan", [*states, *weights, *rows], names, body=_step_body(cfg, i, em.elem, tag), num_scan_inputs=3,
                 scan_input_axes=[1, 1, 1], scan_output_axes=[1])[5]


def _step_body(cfg: ModelConfig, i: int, elem: int, tag: str) -> onnx.GraphProto:
    """The scans' body, one token (models.kda.KimiDeltaAttention.step). Inputs: the conv state [b, C, K-1], the
    recurrent state [b, H, D, D], the kernel [C, K], A_log [H, 1], dt_bias [H, D] (passed through), the row's conv
    input [b, C], b [b, H] and forget [b, H * D]; outputs: those five, then the row's readout [b, H, D]."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/kda/{tag}", GraphBuilder()
    C, H, D = hy.conv_dim, hy.num_v_heads, hy.k_dim
    shapes = {"conv_in": ["batch", C, hy.conv_kernel - 1], "recurrent_in": ["batch", H, D, D], "kernel": [C, hy.conv_kernel],
              "A_log": [H, 1], "dt_bias": [H, D], "mixed": ["batch", C], "b": ["batch", H], "forget": ["batch", H * D]}
    names = [f"{s}/{n}" for n in shapes]
    conv_in, rec_in, kernel, a_log, dt_bias, mixed, beta_in, forget = names

    def one(op: str, inputs: list[str], **attrs) -> str:
        return b.one(s, op, inputs, **attrs)

    def silu(x: str) -> str:
        return one("Mul", [x, one("Sigmoid", [x])])

    window = one("Concat", [conv_in, one("Unsqueeze", [mixed, b.const(s, [-1])])], axis=-1)  # [b, C, K]
    conv = silu(one("ReduceSum", [one("Mul", [window, kernel]), b.const(s, [-1])], keepdims=0))
    conv_out = one("Slice", [window, b.const(s, [1]), b.const(s, [INT64_MAX]), b.const(s, [2]), b.const(s, [1])])
    heads = b.const(s, [0, H, D])
    query, key, val = (one("Reshape", [t, heads]) for t in b.op(s, "Split", [conv, b.const(s, [H * D] * 3)], 3, axis=-1))
    query, key = one("Div", [l2norm_nodes(b, s, query), b.const(s, math.sqrt(D), "float32")]), l2norm_nodes(b, s, key)
    if hy.gate_bound:  # Bailing's safe gate: gate_bound * sigmoid(exp(A_log) * (forget + dt_bias))
        gate = one("Add", [one("Reshape", [forget, heads]), dt_bias])
        g = one("Mul", [b.const(s, hy.gate_bound, "float32"), one("Sigmoid", [one("Mul", [one("Exp", [a_log]), gate])])])
    else:
        gate = one("Softplus", [one("Add", [one("Reshape", [forget, heads]), dt_bias])])
        g = one("Mul", [one("Neg", [one("Exp", [a_log])]), gate])  # [b, H, D]: the decay per key channel
    state = one("Mul", [rec_in, one("Unsqueeze", [one("Exp", [g]), b.const(s, [-1])])])
    k_col = one("Unsqueeze", [key, b.const(s, [-1])])
    memory = one("ReduceSum", [one("Mul", [state, k_col]), b.const(s, [-2])], keepdims=0)
    delta = one("Mul", [one("Sub", [val, memory]), one("Unsqueeze", [one("Sigmoid", [beta_in]), b.const(s, [-1])])])
    state = one("Add", [state, one("Mul", [k_col, one("Unsqueeze", [delta, b.const(s, [-2])])])])
    out = one("ReduceSum", [one("Mul", [state, one("Unsqueeze", [query, b.const(s, [-1])])]), b.const(s, [-2])], keepdims=0)
    passed = [one("Identity", [t]) for t in (kernel, a_log, dt_bias)]
    inputs = [helper.make_tensor_value_info(n, elem, shape) for n, shape in zip(names, shapes.values())]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in (conv_out, state, *passed, out)]
    return helper.make_graph(b.nodes, f"kda_{tag}_{i}", inputs, outputs)


def l2norm_nodes(b: GraphBuilder, s: str, x: str) -> str:
    """x / sqrt(sum x^2 + 1e-6) over the last axis (models.linear_attention.l2norm; the gated delta net's too)."""
    total = b.one(s, "ReduceSum", [b.one(s, "Mul", [x, x]), b.const(s, [-1])], keepdims=1)
    return b.one(s, "Mul", [x, b.one(s, "Div", [b.const(s, 1.0, "float32"), b.one(s, "Sqrt", [b.one(s, "Add", [total, b.const(s, 1e-6, "float32")])])])])
