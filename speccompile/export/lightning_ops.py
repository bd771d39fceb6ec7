"""A MiniMax-01 lightning attention layer's nodes for the contract and the fused CPU graph (models/lightning.py is the
torch reference, op for op; export/linear_ops.py dispatches here).

The layer reads its state `past_state.{i}.recurrent` [b, H, D, D] as of some committed token and the accepted rows
after it not yet folded in, `past_state.{i}.rows` [b, pending, 2 H D] (each row's SiLU'd k | v; the runtime's first
pending row, all zeros, decays a zero state to zero and adds 0). One `Scan` folds those rows into the state
(`present_state.{i}.recurrent`), a second runs the pass's rows from there: kv <- exp(-slope) kv + k^T v, out = q kv,
each row on its own, so a row's state is the same bits in every pass. The RMSNorm (eps 1e-6), the sigmoid output
gate and out_proj run on the pass's readouts.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..models.config import ModelConfig
from .emitter import Emitter
from .graph_builder import GraphBuilder


def lightning_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """Lightning attention layer i's output [b, q, hidden] of its normed input `h` (models.lightning.Lightning)."""
    hy, c = cfg.hybrid, em.const
    heads, dim = hy.num_v_heads, hy.v_dim
    qkv = em.one("MatMul", [h, role("lightning_qkv")])
    qkv = em.one("Reshape", [em.one("Mul", [qkv, em.one("Sigmoid", [qkv])]), c("lightning.heads", [0, 0, heads, 3 * dim])])
    query, key, value = em.op("Split", [qkv, c("lightning.qkv", [dim] * 3)], 3, axis=-1)  # each [b, q, H, D]
    flat = c("lightning.flat", [0, 0, heads * dim])
    em.op("Concat", [em.one("Reshape", [key, flat]), em.one("Reshape", [value, flat])], [f"present_state.{i}.rows"], axis=-1)
    from ..models.lightning import slope_rate  # transformers' torch arithmetic: imported when a graph is built, not
    # when `export` checks its options on an install without torch
    decay = np.exp(-slope_rate(heads, i, cfg.num_hidden_layers).numpy()).reshape(heads, 1, 1)
    decay = c(f"lightning.{i}.decay", decay, np.float32)  # a scan state: a body reads no outer value
    unflat = c("lightning.unflat", [0, 0, heads, dim])
    pending = [em.one("Reshape", [t, unflat]) for t in em.op("Split", [f"past_state.{i}.rows", c("lightning.rows", [heads * dim] * 2)], 2, axis=-1)]
    em.op("Scan", [f"past_state.{i}.recurrent", decay, *pending], [f"present_state.{i}.recurrent", f"lightning.{i}.fold.decay"],
          body=_step_body(cfg, i, em.elem, "fold"), num_scan_inputs=2, scan_input_axes=[1, 1])
    rows = em.op("Scan", [f"present_state.{i}.recurrent", decay, key, value, query],
                 [f"lightning.{i}.rows.recurrent", f"lightning.{i}.rows.decay", f"lightning.{i}.rows.readout"],
                 body=_step_body(cfg, i, em.elem, "rows"), num_scan_inputs=3, scan_input_axes=[1, 1, 1], scan_output_axes=[1])[-1]
    out = em.one("Reshape", [rows, flat])  # [b, q, H D]
    square = em.one("ReduceMean", [em.one("Mul", [out, out]), c("lightning.last", [-1])], keepdims=1)
    inverse = em.one("Div", [c("lightning.one", 1.0, np.float32), em.one("Sqrt", [em.one("Add", [square, c("lightning.eps", 1e-6, np.float32)])])])
    normed = em.one("Mul", [role("lightning_norm"), em.one("Mul", [out, inverse])])
    gated = em.one("Mul", [em.one("Sigmoid", [em.one("MatMul", [h, role("lightning_gate")])]), normed])
    return em.one("MatMul", [gated, role("lightning_out")])


def _step_body(cfg: ModelConfig, i: int, elem: int, tag: str) -> onnx.GraphProto:
    """The scans' body, one token (models.lightning.Lightning.step). Inputs: the state [b, H, D, D], the decay [H, 1, 1]
    (passed through), the row's k, v [b, H, D] (and, "rows": its q); outputs: those two, then ("rows") its readout
    [b, H, D]."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/lightning/{tag}", GraphBuilder()
    H, D = hy.num_v_heads, hy.v_dim
    shapes = {"state_in": ["batch", H, D, D], "decay": [H, 1, 1], "key": ["batch", H, D], "value": ["batch", H, D],
              **({"query": ["batch", H, D]} if tag == "rows" else {})}
    names = [f"{s}/{n}" for n in shapes]
    state_in, decay, key, value = names[:4]
    outer = b.one(s, "Mul", [b.one(s, "Unsqueeze", [key, b.const(s, [-1])]), b.one(s, "Unsqueeze", [value, b.const(s, [-2])])])
    state = b.one(s, "Add", [b.one(s, "Mul", [decay, state_in]), outer])
    outputs = [state, b.one(s, "Identity", [decay])]
    if tag == "rows":
        query = b.one(s, "Unsqueeze", [names[4], b.const(s, [-2])])
        outputs.append(b.one(s, "Squeeze", [b.one(s, "MatMul", [query, state]), b.const(s, [-2])]))
    inputs = [helper.make_tensor_value_info(n, elem, shape) for n, shape in zip(names, shapes.values())]
    return helper.make_graph(b.nodes, f"lightning_{tag}_{i}", inputs, [helper.make_tensor_value_info(n, elem, None) for n in outputs])
