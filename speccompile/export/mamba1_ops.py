"""A Mamba-1 layer's nodes (Jamba) for the contract and the fused CPU graph (models/mamba1.py is the torch reference,
op for op; export/linear_ops.py dispatches here).

The layer reads its states `past_state.{i}.conv` [b, inner, kernel - 1] and `past_state.{i}.recurrent` [b, inner,
d_state] as of some committed token and the accepted rows after it not yet folded in, `past_state.{i}.rows` [b,
pending, inner + 1] (each row's conv input x and 1). One `Scan` folds those rows into the states
(`present_state.{i}.conv` / `.recurrent`), a second runs the pass's rows from there: the conv window, SiLU, x_proj
-> dt | B | C and their RMS norms (`HybridConfig.mixer_norms`: Falcon-Mamba's without gains, Mamba's none), dt_proj and softplus, the decay, the update, the readout, each row on its own
([b, inner] x [inner, ...] MatMuls of the same shapes in every scan), so a row's readout and states are the same bits
in every pass. dt is multiplied by the row's trailing 1, so that the runtime's first pending row, all zeros, leaves
the zero states as they are (the conv bias makes its x, B and C nonzero; its dt is 0: exp(0) = 1, a zero update).
The gate SiLU(z) and out_proj run on the pass's readouts.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..models.config import ModelConfig
from .graph_builder import GraphBuilder
from .mamba2_ops import conv_step
from .moe_ops import Emitter

# the weights the scan body reads (passed through as scan states: a body reads no outer value), by role
_WEIGHTS = ("ssm_conv_bias", "ssm_x", "ssm_dt_norm", "ssm_b_norm", "ssm_c_norm", "ssm_dt", "ssm_dt_proj_bias", "ssm_a_log", "ssm_d")


def mamba1_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """Mamba-1 layer i's output [b, q, hidden] of its normed input `h` (models.mamba1.Mamba1)."""
    hy, c = cfg.hybrid, em.const
    x_in, z = em.op("Split", [em.one("MatMul", [h, role("ssm_in")]), c("mamba1.x_z", [hy.width, hy.width])], 2, axis=-1)
    rows_shape = em.one("Concat", [em.one("Shape", [x_in], end=2), c("mamba1.one_col", [1])], axis=0)
    flag = em.one("Expand", [c("mamba1.one", [[[1.0]]], np.float32), rows_shape])  # [b, q, 1]: a pass's rows are real
    em.op("Concat", [x_in, flag], [f"present_state.{i}.rows"], axis=-1)
    weights = [em.one("Reshape", [role("ssm_conv"), c("mamba1.kernel", [hy.width, hy.conv_kernel])]),
               *(role(r) for r in _WEIGHTS if r in hy.roles())]
    pending = em.op("Split", [f"past_state.{i}.rows", c("mamba1.rows", [hy.width, 1])], 2, axis=-1)
    y = state_scans(em, i, "mamba1", lambda tag: _body(cfg, i, em.elem, tag), weights, pending, [x_in, flag])  # [b, q, inner]
    return em.one("MatMul", [em.one("Mul", [y, em.one("Mul", [z, em.one("Sigmoid", [z])])]), role("ssm_out")])


def state_scans(em: Emitter, i: int, prefix: str, body: Callable[[str], onnx.GraphProto], weights: list[str],
                pending: list[str], rows: list[str]) -> str:
    """Layer i's two Scans of the token step `body(tag)` (Mamba-1's, RecurrentGemma's: export/rglru_ops.py): the
    pending rows folded into the past conv / recurrent states, written as the present ones, then the pass's `rows`
    from there; returns the pass's readouts."""
    present = [f"present_state.{i}.conv", f"present_state.{i}.recurrent"]
    _scan(em, i, prefix, "fold", [f"past_state.{i}.conv", f"past_state.{i}.recurrent"], weights, pending, body, present)
    return _scan(em, i, prefix, "rows", present, weights, rows, body)


def _scan(em: Emitter, i: int, prefix: str, tag: str, states: list[str], weights: list[str], rows: list[str],
          body: Callable[[str], onnx.GraphProto], outputs: list[str] | None = None) -> str:
    """A Scan of the token step over `rows` (x, the flags: [b, n, ...], n >= 1) from `states`; its final states named
    `outputs` (else internal), the weights passed through; returns the rows' readouts [b, n, ...]."""
    names = [*(outputs or [f"{prefix}.{i}.{tag}.conv", f"{prefix}.{i}.{tag}.recurrent"]),
             *(f"{prefix}.{i}.{tag}.weight{k}" for k in range(len(weights))), f"{prefix}.{i}.{tag}.readout"]
    return em.op("Scan", [*states, *weights, *rows], names, body=body(tag), num_scan_inputs=2,
                 scan_input_axes=[1, 1], scan_output_axes=[1])[-1]


def _body(cfg: ModelConfig, i: int, elem: int, tag: str) -> onnx.GraphProto:
    """One token (models.mamba1.Mamba1.step), the same nodes in both scans (`tag` names them apart). Inputs: the conv
    state [b, C, K-1], the SSM state [b, C, N], the weights (passed through), the row's x [b, C] and flag [b, 1];
    outputs: the states, the weights, the readout [b, C]."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/mamba/{tag}", GraphBuilder()
    C, N, R = hy.width, hy.k_dim, hy.dt_rank
    shapes = {"conv_in": ["batch", C, hy.conv_kernel - 1], "ssm_in": ["batch", C, N], "kernel": [C, hy.conv_kernel],
              **({"conv_bias": [C]} if hy.conv_bias else {}), "x_proj": [C, R + 2 * N],
              **({"dt_norm": [R], "b_norm": [N], "c_norm": [N]} if hy.mixer_norms == "gains" else {}),
              "dt_proj": [R, C], "dt_bias": [C], "A_log": [C, N], "D": [C], "x": ["batch", C], "flag": ["batch", 1]}
    n = {key: f"{s}/{key}" for key in shapes}
    eps = hy.norm_eps or cfg.rms_norm_eps
    x, conv_out = conv_step(b, s, n, n["x"], hy.conv_bias)
    dt, b_in, c_in = b.op(s, "Split", [b.one(s, "MatMul", [x, n["x_proj"]]), b.const(s, [R, N, N])], 3, axis=-1)
    if hy.mixer_norms != "none":
        dt, b_in, c_in = (_rms(b, s, t, n.get(g), eps) for t, g in ((dt, "dt_norm"), (b_in, "b_norm"), (c_in, "c_norm")))
    dt = b.one(s, "Add", [b.one(s, "MatMul", [dt, n["dt_proj"]]), n["dt_bias"]])
    dt = b.one(s, "Mul", [b.one(s, "Softplus", [dt]), n["flag"]])  # [b, C]
    decay = b.one(s, "Exp", [b.one(s, "Mul", [b.one(s, "Unsqueeze", [dt, b.const(s, [-1])]), b.one(s, "Neg", [b.one(s, "Exp", [n["A_log"]])])])])
    update = b.one(s, "Mul", [b.one(s, "Unsqueeze", [b.one(s, "Mul", [dt, x]), b.const(s, [-1])]),
                              b.one(s, "Unsqueeze", [b_in, b.const(s, [-2])])])  # (dt x) B^T [b, C, N]
    state = b.one(s, "Add", [b.one(s, "Mul", [n["ssm_in"], decay]), update])
    read = b.one(s, "ReduceSum", [b.one(s, "Mul", [state, b.one(s, "Unsqueeze", [c_in, b.const(s, [-2])])]), b.const(s, [-1])], keepdims=0)
    y = b.one(s, "Add", [read, b.one(s, "Mul", [x, n["D"]])])
    weights = [n[k] for k in shapes if k not in ("conv_in", "ssm_in", "x", "flag")]
    outputs = [conv_out, state, *(b.one(s, "Identity", [w]) for w in weights), y]
    inputs = [helper.make_tensor_value_info(n[k], elem, shape) for k, shape in shapes.items()]
    return helper.make_graph(b.nodes, f"mamba1_{tag}_{i}", inputs, [helper.make_tensor_value_info(o, elem, None) for o in outputs])


def _rms(b: GraphBuilder, s: str, t: str, gain: str | None, eps: float) -> str:
    """transformers' JambaRMSNorm of t over its last axis: t / sqrt(mean(t^2) + eps) times the gain (None: Falcon-Mamba's
    FalconMambaWeightlessRMSNorm, no gain)."""
    square = b.one(s, "ReduceMean", [b.one(s, "Pow", [t, b.const(s, 2.0, np.float32)]), b.const(s, [-1])], keepdims=1)
    root = b.one(s, "Sqrt", [b.one(s, "Add", [square, b.const(s, eps, np.float32)])])
    normed = b.one(s, "Mul", [t, b.one(s, "Div", [b.const(s, 1.0, np.float32), root])])
    return normed if gain is None else b.one(s, "Mul", [gain, normed])
