"""A Mamba-2 layer's nodes (Granite 4.0-H) for the contract and the fused CPU graph (models/mamba2.py is the torch
reference, op for op; export/linear_ops.py dispatches here and writes the gated delta net).

The layer reads its states `past_state.{i}.conv` [b, conv_dim, kernel - 1] and `past_state.{i}.recurrent` [b, heads,
d_state, head_dim] as of some committed token and the accepted rows after it not yet folded in, `past_state.{i}.rows`
[b, pending, conv_dim + heads + 1] (each row's conv input xBC, its dt before softplus, and 1). One `Scan` folds those
rows into the states (`present_state.{i}.conv` / `.recurrent`), a second runs the pass's rows from there (the conv
window, SiLU, the decay, the outer product, the readout: elementwise ops and reductions, no MatMul), so a row's
readout and states are the same bits in every pass. The trailing 1 tells a row from the runtime's first pending row,
all zeros (runtime/state_cache.py): its dt is multiplied by it, so that row leaves the zero states as they are although
the conv bias makes its x and B nonzero. The gated group norm (Falcon-H1: none, or the norm before the gate:
`HybridConfig.gate_norm`) and out_proj run on the pass's readouts. Falcon-H1 runs this layer beside attention
(export/linear_ops.py `parallel_mixer`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..models.config import ModelConfig
from ..models.linear_config import HybridConfig
from .graph_builder import INT64_MAX, GraphBuilder
from .moe_ops import Emitter


def mamba2_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """Mamba-2 layer i's output [b, q, hidden] of its normed input `h` (models.mamba2.Mamba2)."""
    hy, c = cfg.hybrid, em.const
    z, xbc, dt = em.op("Split", [em.one("MatMul", [h, role("ssm_in")]), c("mamba2.z_xbc_dt", [hy.value_dim, hy.conv_dim, hy.num_v_heads])],
                       3, axis=-1)
    rows_shape = em.one("Concat", [em.one("Shape", [dt], end=2), c("mamba2.one_col", [1])], axis=0)
    flag = em.one("Expand", [c("mamba2.one", [[[1.0]]], np.float32), rows_shape])  # [b, q, 1]: a pass's rows are real
    em.op("Concat", [xbc, dt, flag], [f"present_state.{i}.rows"], axis=-1)
    weights = [em.one("Reshape", [role("ssm_conv"), c("mamba2.kernel", [hy.conv_dim, hy.conv_kernel])]),
               *([role("ssm_conv_bias")] if hy.conv_bias else []), role("ssm_a_log"), role("ssm_dt_bias"), role("ssm_d")]
    states = [f"present_state.{i}.conv", f"present_state.{i}.recurrent"]
    pending = em.op("Split", [f"past_state.{i}.rows", c("mamba2.rows", [hy.conv_dim, hy.num_v_heads, 1])], 3, axis=-1)
    _scan(em, cfg, i, "fold", [f"past_state.{i}.conv", f"past_state.{i}.recurrent"], weights, pending, states)
    y = _scan(em, cfg, i, "rows", states, weights, [xbc, dt, flag])  # [b, q, heads, head_dim]
    y = em.one("Reshape", [y, c("mamba2.inner", [0, 0, hy.value_dim])])

    def gate() -> str:  # SiLU(z), written where each form uses it
        return em.one("Mul", [z, em.one("Sigmoid", [z])])

    if hy.gate_norm == "none":  # Falcon-H1 without mamba_rms_norm: y * SiLU(z)
        return em.one("MatMul", [em.one("Mul", [y, gate()]), role("ssm_out")])
    gated = y if hy.gate_norm == "before_gate" else em.one("Mul", [y, gate()])
    parts = em.one("Reshape", [gated, c("mamba2.groups", [0, 0, hy.num_k_heads, hy.value_dim // hy.num_k_heads])])
    square = em.one("ReduceMean", [em.one("Pow", [parts, c("mamba2.two", 2.0, np.float32)]), c("mamba2.last", [-1])], keepdims=1)
    root = em.one("Sqrt", [em.one("Add", [square, c("mamba2.eps", cfg.rms_norm_eps, np.float32)])])
    normed = em.one("Mul", [parts, em.one("Div", [c("mamba2.unit", 1.0, np.float32), root])])
    normed = em.one("Mul", [role("ssm_norm"), em.one("Reshape", [normed, c("mamba2.inner", [0, 0, hy.value_dim])])])
    normed = em.one("Mul", [normed, gate()]) if hy.gate_norm == "before_gate" else normed  # Falcon-H1's norm_before_gate
    return em.one("MatMul", [normed, role("ssm_out")])


def _scan(em: Emitter, cfg: ModelConfig, i: int, tag: str, states: list[str], weights: list[str], rows: list[str],
          outputs: list[str] | None = None) -> str:
    """A Scan of the token step over `rows` (xBC, dt, the flag: [b, n, ...], n >= 1) from `states`; its final states
    named `outputs` (else internal), the weights passed through; returns the rows' readouts [b, n, heads, head_dim]."""
    names = [*(outputs or [f"mamba2.{i}.{tag}.conv", f"mamba2.{i}.{tag}.recurrent"]),
             *(f"mamba2.{i}.{tag}.weight{k}" for k in range(len(weights))), f"mamba2.{i}.{tag}.readout"]
    return em.op("Scan", [*states, *weights, *rows], names, body=_body(cfg, i, em.elem, tag), num_scan_inputs=3,
                 scan_input_axes=[1, 1, 1], scan_output_axes=[1])[-1]


def _body(cfg: ModelConfig, i: int, elem: int, tag: str) -> onnx.GraphProto:
    """One token (models.mamba2.Mamba2.step), the same nodes in both scans (`tag` names them apart). Inputs: the conv
    state [b, C, K-1], the SSM state [b, H, N, P], the kernel [C, K] (the conv bias [C]), A_log, dt_bias, D [H]
    (passed through), the row's xBC [b, C], dt [b, H] and flag [b, 1]; outputs: the states, the weights, the readout."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/mamba/{tag}", GraphBuilder()
    C, H = hy.conv_dim, hy.num_v_heads
    shapes = {"conv_in": ["batch", C, hy.conv_kernel - 1], "ssm_in": ["batch", H, hy.k_dim, hy.v_dim], "kernel": [C, hy.conv_kernel],
              **({"conv_bias": [C]} if hy.conv_bias else {}), "A_log": [H], "dt_bias": [H], "D": [H],
              "xbc": ["batch", C], "dt": ["batch", H], "flag": ["batch", 1]}
    n = {key: f"{s}/{key}" for key in shapes}
    conv, conv_out = conv_step(b, s, n, n["xbc"], hy.conv_bias)
    x, b_in, c_in = b.op(s, "Split", [conv, b.const(s, [hy.value_dim, hy.key_dim, hy.key_dim])], 3, axis=-1)
    b_in, c_in = (_per_head(b, s, hy, t) for t in (b_in, c_in))
    x = b.one(s, "Reshape", [x, b.const(s, [0, H, hy.v_dim])])
    dt = b.one(s, "Mul", [b.one(s, "Softplus", [b.one(s, "Add", [n["dt"], n["dt_bias"]])]), n["flag"]])  # [b, H]
    decay = b.one(s, "Exp", [b.one(s, "Mul", [dt, b.one(s, "Neg", [b.one(s, "Exp", [n["A_log"]])])])])
    decay, dt = (b.one(s, "Unsqueeze", [t, b.const(s, [-1, -2])]) for t in (decay, dt))  # [b, H, 1, 1]
    update = b.one(s, "Mul", [b.one(s, "Mul", [dt, b.one(s, "Unsqueeze", [b_in, b.const(s, [-1])])]),
                              b.one(s, "Unsqueeze", [x, b.const(s, [-2])])])  # (dt B) x^T [b, H, N, P]
    state = b.one(s, "Add", [b.one(s, "Mul", [n["ssm_in"], decay]), update])
    read = b.one(s, "ReduceSum", [b.one(s, "Mul", [state, b.one(s, "Unsqueeze", [c_in, b.const(s, [-1])])]), b.const(s, [-2])], keepdims=0)
    y = b.one(s, "Add", [read, b.one(s, "Mul", [x, b.one(s, "Unsqueeze", [n["D"], b.const(s, [-1])])])])
    weights = [n[k] for k in shapes if k in ("kernel", "conv_bias", "A_log", "dt_bias", "D")]
    outputs = [conv_out, state, *(b.one(s, "Identity", [w]) for w in weights), y]
    inputs = [helper.make_tensor_value_info(n[k], elem, shape) for k, shape in shapes.items()]
    return helper.make_graph(b.nodes, f"mamba2_{tag}_{i}", inputs, [helper.make_tensor_value_info(o, elem, None) for o in outputs])


def conv_step(b: GraphBuilder, s: str, n: dict[str, str], row: str, bias: bool) -> tuple[str, str]:
    """A Mamba layer's causal conv on one token: the conv state `n["conv_in"]` [b, C, K-1] and the row's input `row`
    [b, C] through the kernel `n["kernel"]` [C, K] (and the bias `n["conv_bias"]`), SiLU; returns it and the conv state
    after the row."""
    window = b.one(s, "Concat", [n["conv_in"], b.one(s, "Unsqueeze", [row, b.const(s, [-1])])], axis=-1)  # [b, C, K]
    conv = b.one(s, "ReduceSum", [b.one(s, "Mul", [window, n["kernel"]]), b.const(s, [-1])], keepdims=0)
    conv = b.one(s, "Add", [conv, n["conv_bias"]]) if bias else conv
    conv = b.one(s, "Mul", [conv, b.one(s, "Sigmoid", [conv])])
    return conv, b.one(s, "Slice", [window, b.const(s, [1]), b.const(s, [INT64_MAX]), b.const(s, [2]), b.const(s, [1])])


def _per_head(b: GraphBuilder, s: str, hy: HybridConfig, t: str) -> str:
    """B or C [b, groups * N] -> [b, heads, N], each group serving heads / groups consecutive heads."""
    grouped = b.one(s, "Reshape", [t, b.const(s, [0, hy.num_k_heads, hy.k_dim])])
    per = hy.num_v_heads // hy.num_k_heads
    if per == 1:
        return grouped
    wide = b.one(s, "Expand", [b.one(s, "Unsqueeze", [grouped, b.const(s, [2])]), b.const(s, [1, 1, per, 1])])
    return b.one(s, "Reshape", [wide, b.const(s, [0, hy.num_v_heads, hy.k_dim])])
