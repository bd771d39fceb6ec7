"""Hybrid linear attention's nodes for the contract graph (export/contract_graph.py): a gated delta net layer, and
gated attention's output gate (models/linear_attention.py is the torch reference, op for op).

A linear layer reads its committed states `past_state.{i}.conv` [b, conv_dim, kernel - 1] and
`past_state.{i}.recurrent` [b, value heads, key_head_dim, value_head_dim] and runs the pass's rows through one
`Scan` over the row axis: every row is one iteration of the same body on the same shapes (the conv window, SiLU,
l2norms, the decay, the delta rule, the readout: elementwise ops and reductions, no MatMul), so a row's output and
states are the same bits in a one-row pass (plain decoding) and in a verify pass. The scan's per-row states are the
outputs `present_state.{i}.conv` [b, q, ...] and `present_state.{i}.recurrent` [b, q, ...]: the runtime commits
the states of the last accepted row (runtime/state_cache.py).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..models.config import ModelConfig
from .graph_builder import INT64_MAX, GraphBuilder, value
from .moe_ops import Emitter


def state_values(cfg: ModelConfig, i: int, elem: int, past: bool) -> list[onnx.ValueInfoProto]:
    """Linear layer i's state inputs (`past`) or per-row state outputs, as graph values."""
    h = cfg.hybrid
    rows = [] if past else ["q_len"]
    return [value(f"{'past' if past else 'present'}_state.{i}.conv", elem, ["batch", *rows, *h.conv_state_shape()]),
            value(f"{'past' if past else 'present'}_state.{i}.recurrent", elem, ["batch", *rows, *h.recurrent_state_shape()])]


def output_gate(em: Emitter, q: str, heads: int, dim: int) -> tuple[str, str]:
    """Gated attention's doubled query rows [b, q, heads * 2 * dim] (per head: q, then gate) -> q [b, q, heads * dim]
    and the gate of that shape (models.linear_attention.split_output_gate)."""
    both = em.one("Reshape", [q, em.const("gate.heads", [0, 0, heads, 2 * dim])])
    q, gate = em.op("Split", [both, em.const("gate.split", [dim, dim])], 2, axis=-1)
    flat = em.const("gate.flat", [0, 0, heads * dim])
    return em.one("Reshape", [q, flat]), em.one("Reshape", [gate, flat])


def _silu(em: Emitter, x: str) -> str:
    return em.one("Mul", [x, em.one("Sigmoid", [x])])


def linear_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """Linear layer i's output [b, q, hidden] of its normed input `h` (models.linear_attention.GatedDeltaNet), in
    the contract and the fused CPU graph alike (`em`: the builder's node writer); writes present_state.{i}.conv /
    .recurrent. `role(name)`: the layer's initializer of that role."""
    hy, c = cfg.hybrid, em.const
    proj = em.one("MatMul", [h, role("lin_qkvz")])
    mixed, z = em.op("Split", [proj, c("linear.qkv_z", [hy.conv_dim, hy.value_dim])], 2, axis=-1)
    beta_in, a = em.op("Split", [em.one("MatMul", [h, role("lin_ba")]), c("linear.b_a", [hy.num_v_heads] * 2)], 2, axis=-1)
    kernel = em.one("Reshape", [role("lin_conv"), c("linear.kernel", [hy.conv_dim, hy.conv_kernel])])
    carried = [f"linear.{i}.scan_{n}" for n in ("conv", "recurrent", "kernel", "a_log", "dt_bias", "rows")]
    outs = em.op("Scan", [f"past_state.{i}.conv", f"past_state.{i}.recurrent", kernel, role("lin_a_log"), role("lin_dt_bias"),
                          mixed, beta_in, a],  # the weights ride as states: the body reads no outer value (the build
                 [*carried, f"present_state.{i}.conv", f"present_state.{i}.recurrent"],  # passes' segments see every input)
                 body=_step_body(cfg, i, em.elem), num_scan_inputs=3, scan_input_axes=[1, 1, 1], scan_output_axes=[1, 1, 1])
    rows = outs[5]  # [b, q, heads, v_dim]: the gated RMSNorm of each head's readout, times SiLU(z)
    square = em.one("ReduceMean", [em.one("Pow", [rows, c("linear.two", 2.0, np.float32)]), c("linear.last", [-1])], keepdims=1)
    root = em.one("Sqrt", [em.one("Add", [square, c("linear.eps", cfg.rms_norm_eps, np.float32)])])
    wide = em.one("Mul", [rows, em.one("Div", [c("linear.one", 1.0, np.float32), root])])
    gate = _silu(em, em.one("Reshape", [z, c("linear.z_heads", [0, 0, hy.num_v_heads, hy.v_dim])]))
    normed = em.one("Mul", [em.one("Mul", [role("lin_norm"), wide]), gate])
    flat = em.one("Reshape", [normed, c("linear.value_rows", [0, 0, hy.value_dim])])
    return em.one("MatMul", [flat, role("lin_out")])


def _silu_b(b: GraphBuilder, s: str, x: str) -> str:
    return b.one(s, "Mul", [x, b.one(s, "Sigmoid", [x])])


def _step_body(cfg: ModelConfig, i: int, elem: int) -> onnx.GraphProto:
    """The scan's body: one token (models.linear_attention.GatedDeltaNet.step). Inputs: the conv state [b, C, K-1],
    the recurrent state [b, H, Dk, Dv], the conv kernel [C, K], A_log and dt_bias [H] (passed through), the row's
    conv input [b, C], b and a [b, H]; outputs: those five, then the row's readout [b, H, Dv] and copies of the two
    states (the scan's per-row outputs)."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/linear_attn/step", GraphBuilder()
    conv_in, rec_in, kernel, a_log, dt_bias, mixed, beta_in, a = (
        f"{s}/{n}" for n in ("conv_in", "recurrent_in", "kernel", "A_log", "dt_bias", "mixed", "b", "a"))
    window = b.one(s, "Concat", [conv_in, b.one(s, "Unsqueeze", [mixed, b.const(s, [-1])])], axis=-1)  # [b, C, K]
    conv = _silu_b(b, s, b.one(s, "ReduceSum", [b.one(s, "Mul", [window, kernel]), b.const(s, [-1])], keepdims=0))
    conv_out = b.one(s, "Slice", [window, b.const(s, [1]), b.const(s, [INT64_MAX]), b.const(s, [2]), b.const(s, [1])])
    query, key, val = b.op(s, "Split", [conv, b.const(s, [hy.key_dim, hy.key_dim, hy.value_dim])], 3, axis=-1)
    query, key = (_l2norm(b, s, b.one(s, "Reshape", [t, b.const(s, [0, hy.num_k_heads, hy.k_dim])])) for t in (query, key))
    groups = hy.num_v_heads // hy.num_k_heads
    if groups > 1:  # repeat_interleave: each key head serves `groups` consecutive value heads
        query, key = (b.one(s, "Reshape", [b.one(s, "Expand", [b.one(s, "Unsqueeze", [t, b.const(s, [2])]),
                                                               b.const(s, [1, 1, groups, 1])]), b.const(s, [0, hy.num_v_heads, hy.k_dim])])
                      for t in (query, key))
    query = b.one(s, "Div", [query, b.const(s, math.sqrt(hy.k_dim), "float32")])
    val = b.one(s, "Reshape", [val, b.const(s, [0, hy.num_v_heads, hy.v_dim])])
    beta = b.one(s, "Sigmoid", [beta_in])
    g = b.one(s, "Mul", [b.one(s, "Neg", [b.one(s, "Exp", [a_log])]), b.one(s, "Softplus", [b.one(s, "Add", [a, dt_bias])])])
    decay = b.one(s, "Unsqueeze", [b.one(s, "Exp", [g]), b.const(s, [-1, -2])])
    state = b.one(s, "Mul", [rec_in, decay])
    k_col = b.one(s, "Unsqueeze", [key, b.const(s, [-1])])
    memory = b.one(s, "ReduceSum", [b.one(s, "Mul", [state, k_col]), b.const(s, [-2])], keepdims=0)
    delta = b.one(s, "Mul", [b.one(s, "Sub", [val, memory]), b.one(s, "Unsqueeze", [beta, b.const(s, [-1])])])
    state = b.one(s, "Add", [state, b.one(s, "Mul", [k_col, b.one(s, "Unsqueeze", [delta, b.const(s, [-2])])])])
    q_col = b.one(s, "Unsqueeze", [query, b.const(s, [-1])])
    out = b.one(s, "ReduceSum", [b.one(s, "Mul", [state, q_col]), b.const(s, [-2])], keepdims=0)
    conv_copy, state_copy = b.one(s, "Identity", [conv_out]), b.one(s, "Identity", [state])
    passed = [b.one(s, "Identity", [t]) for t in (kernel, a_log, dt_bias)]
    C, H = hy.conv_dim, hy.num_v_heads
    shapes = {conv_in: ["batch", C, hy.conv_kernel - 1], rec_in: ["batch", H, hy.k_dim, hy.v_dim], kernel: [C, hy.conv_kernel],
              a_log: [H], dt_bias: [H], mixed: ["batch", C], beta_in: ["batch", H], a: ["batch", H]}
    inputs = [helper.make_tensor_value_info(n, elem, shape) for n, shape in shapes.items()]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in (conv_out, state, *passed, out, conv_copy, state_copy)]
    return helper.make_graph(b.nodes, f"linear_step_{i}", inputs, outputs)


def _l2norm(b: GraphBuilder, s: str, x: str) -> str:
    """x / sqrt(sum x^2 + 1e-6) over the last axis (models.linear_attention.l2norm)."""
    total = b.one(s, "ReduceSum", [b.one(s, "Mul", [x, x]), b.const(s, [-1])], keepdims=1)
    return b.one(s, "Mul", [x, b.one(s, "Div", [b.const(s, 1.0, "float32"), b.one(s, "Sqrt", [b.one(s, "Add", [total, b.const(s, 1e-6, "float32")])])])])


def check_hybrid_export(cfg: ModelConfig, dtype: str, drafter: str | None) -> None:
    """A hybrid target exports in fp32, drafting chains: the n-gram drafter or a draft model (no head on its states)."""
    from ..errors import InputError

    if dtype != "fp32":
        raise InputError(f"dtype {dtype}: hybrid linear attention ({cfg.architecture}) exports in fp32 only", "dtype")
    if drafter not in (None, "ngram", "draft-model"):
        raise InputError(f"drafter {drafter}: a hybrid linear-attention target ({cfg.architecture}) drafts chains with the "
                         "ngram drafter or a draft model (trees and heads on its hidden states are not supported)", "drafter")

