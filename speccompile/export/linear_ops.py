"""Hybrid linear attention's nodes for the contract and the fused CPU graph (export/contract_graph.py,
export/fused_layers.py): a gated delta net layer, and gated attention's output gate (models/linear_attention.py is the
torch reference, op for op).

A linear layer reads its states `past_state.{i}.conv` [b, conv_dim, kernel - 1] and `past_state.{i}.recurrent`
[b, value heads, key_head_dim, value_head_dim] as of some committed token, and the accepted rows after it not yet
folded in, `past_state.{i}.rows` [b, pending, conv_dim + 2 heads] (each row's conv input, b and a). One `Scan` folds
those rows into the states (`present_state.{i}.conv` / `.recurrent`), a second runs the pass's rows from there; both
iterate the same token step on the same shapes (the conv window, SiLU, l2norms, the decay, the delta rule, the
readout: elementwise ops and reductions, no MatMul), so a row's readout and states are the same bits in a one-row
pass (plain decoding), in a verify pass and when folded in the next pass. The pass's rows' inputs are the output
`present_state.{i}.rows` [b, q, ...]: the runtime keeps the accepted ones as the next pending rows
(runtime/state_cache.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np
import onnx
from onnx import helper

from ..models.config import ModelConfig
from .graph_builder import INT64_MAX, GraphBuilder, value
from .moe_ops import Emitter
from .mamba1_ops import mamba1_layer
from .rglru_ops import rglru_layer
from .mamba2_ops import mamba2_layer
from .short_conv_ops import short_conv_layer
from .kda_ops import kda_layer, l2norm_nodes
from .lightning_ops import lightning_layer

if TYPE_CHECKING:
    from .drafter_types import DrafterRequest


def state_values(cfg: ModelConfig, i: int, elem: int, past: bool) -> list[onnx.ValueInfoProto]:
    """Linear layer i's cache inputs (`past`: the states, the pending rows) or outputs (the states after the pending
    rows, the pass's rows), as graph values."""
    h, kind = cfg.hybrid, "past" if past else "present"
    shapes = {"conv": ["batch", *h.conv_state_shape()], "recurrent": ["batch", *h.recurrent_state_shape()],
              "rows": ["batch", "pending" if past else "q_len", h.row_width()]}
    return [value(f"{kind}_state.{i}.{state}", elem, shapes[state]) for state in h.state_kinds()]


def present_names(cfg: ModelConfig, i: int) -> list[str]:
    """Layer i's cache outputs: a recurrent layer's states and rows, else its key and value rows (and, a parallel
    mixer beside its attention: Falcon-H1, its states and rows after them)."""
    states = [f"present_state.{i}.{kind}" for kind in cfg.hybrid.state_kinds()] if cfg.hybrid is not None else []
    if cfg.linear(i):
        return states
    return [f"present.{i}.key", f"present.{i}.value", *(states if cfg.parallel_mixer(i) else [])]


def parallel_mixer(em: Emitter, cfg: ModelConfig, i: int, h: str, attn: str, role: Callable[[str], str]) -> str:
    """Layer i's attention output `attn`, plus (Falcon-H1: `ModelConfig.parallel_mixer`) its Mamba-2 mixer's output of
    the same normed input `h`, whose states and rows are outputs of the graph (`present_names`); no node otherwise."""
    return em.one("Add", [attn, mamba2_layer(em, cfg, i, h, role)]) if cfg.parallel_mixer(i) else attn


def output_gate(em: Emitter, q: str, heads: int, dim: int, gate_dim: int) -> tuple[str, str]:
    """Gated attention's query rows [b, q, heads * (dim + gate_dim)] (per head: q, then gate; gate_dim dim, or 1: LFM3)
    -> q [b, q, heads * dim] and the gate: [b, q, heads * dim], or [b, q, heads, 1] (models.linear_attention.split_output_gate)."""
    both = em.one("Reshape", [q, em.const("gate.heads", [0, 0, heads, dim + gate_dim])])
    q, gate = em.op("Split", [both, em.const("gate.split", [dim, gate_dim])], 2, axis=-1)
    flat = em.const("gate.flat", [0, 0, heads * dim])
    return em.one("Reshape", [q, flat]), gate if gate_dim != dim else em.one("Reshape", [gate, flat])


def gated_qkv(em: Emitter, key: str, qkv: str, heads: int, kv_heads: int, dim: int, gate_dim: int) -> tuple[str, str, str, str]:
    """Gated attention's fused q/k/v rows (q and its gate) -> q, its gate, k, v (`key`: the split sizes' constant)."""
    q, k, v = em.op("Split", [qkv, em.const(key, [heads * (dim + gate_dim), kv_heads * dim, kv_heads * dim])], 3, axis=-1)
    return (*output_gate(em, q, heads, dim, gate_dim), k, v)


def gated(em: Emitter, out: str, gate: str, heads: int = 0) -> str:
    """The attention output times sigmoid(gate) (gated attention), or as it is (`gate` ""); `heads`: a gate of one
    value a head ([b, q, heads, 1], LFM3), each head's output [b, q, heads, dim] times its value."""
    if not gate:
        return out
    if not heads:
        return em.one("Mul", [out, em.one("Sigmoid", [gate])])
    per_head = em.one("Reshape", [out, em.const("gate.out_heads", [0, 0, heads, -1])])
    return em.one("Reshape", [em.one("Mul", [per_head, em.one("Sigmoid", [gate])]), em.const("gate.out_flat", [0, 0, -1])])


def linear_block(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> tuple[str, list[str]]:
    """`linear_layer` and the layer's outputs (its states and rows) in the place of the KV presents."""
    return linear_layer(em, cfg, i, h, role), present_names(cfg, i)


def parallel_block(em: Emitter, cfg: ModelConfig, i: int, h: str, attn: str, presents: list[str],
                   role: Callable[[str], str]) -> tuple[str, list[str]]:
    """`parallel_mixer` and the layer's outputs: its KV `presents`, then (Falcon-H1) the mixer's states and rows."""
    return parallel_mixer(em, cfg, i, h, attn, role), [*presents, *present_names(cfg, i)[2:]]


def _silu(em: Emitter, x: str) -> str:
    return em.one("Mul", [x, em.one("Sigmoid", [x])])


def linear_layer(em: Emitter, cfg: ModelConfig, i: int, h: str, role: Callable[[str], str]) -> str:
    """Linear layer i's output [b, q, hidden] of its normed input `h` (models.linear_attention.GatedDeltaNet), in
    the contract and the fused CPU graph alike (`em`: the builder's node writer). The first scan folds the pending
    rows (the last pass's accepted rows' conv input, b, a: `past_state.{i}.rows`) into the states, written as
    present_state.{i}.conv / .recurrent; the second runs the pass's rows from there, whose inputs are written as
    present_state.{i}.rows. `role(name)`: the layer's initializer of that role. A short conv (LFM2):
    export/short_conv_ops.py; a Mamba-2 layer (Granite 4.0-H): export/mamba2_ops.py; Mamba-1 (Jamba): export/mamba1_ops.py."""
    if cfg.hybrid.short_conv or cfg.hybrid.rglru or cfg.hybrid.lightning:  # RecurrentGemma, MiniMax-01: export/rglru_ops.py, lightning_ops.py
        return (short_conv_layer if cfg.hybrid.short_conv else rglru_layer if cfg.hybrid.rglru else lightning_layer)(em, cfg, i, h, role)
    if cfg.hybrid.mamba2 or cfg.hybrid.mamba1 or cfg.hybrid.kda:  # KDA (Kimi Linear): export/kda_ops.py
        return (mamba2_layer if cfg.hybrid.mamba2 else mamba1_layer if cfg.hybrid.mamba1 else kda_layer)(em, cfg, i, h, role)
    hy, c = cfg.hybrid, em.const
    proj = em.one("MatMul", [h, role("lin_qkvz")])
    mixed, z = em.op("Split", [proj, c("linear.qkv_z", [hy.conv_dim, hy.value_dim])], 2, axis=-1)
    beta_in, a = em.op("Split", [em.one("MatMul", [h, role("lin_ba")]), c("linear.b_a", [hy.num_v_heads] * 2)], 2, axis=-1)
    em.op("Concat", [mixed, beta_in, a], [f"present_state.{i}.rows"], axis=-1)
    weights = [em.one("Reshape", [role("lin_conv"), c("linear.kernel", [hy.conv_dim, hy.conv_kernel])]), role("lin_a_log"),
               role("lin_dt_bias")]  # they ride as scan states: a body reads no outer value (the build passes' segments)
    states = [f"present_state.{i}.conv", f"present_state.{i}.recurrent"]
    pending = em.op("Split", [f"past_state.{i}.rows", c("linear.rows", [hy.conv_dim, hy.num_v_heads, hy.num_v_heads])], 3, axis=-1)
    _scan(em, cfg, i, "fold", [f"past_state.{i}.conv", f"past_state.{i}.recurrent"], weights, pending, states)
    rows = _scan(em, cfg, i, "rows", states, weights, [mixed, beta_in, a])  # [b, q, heads, v_dim]: their readout
    # the gated RMSNorm of each head's readout, times SiLU(z)
    square = em.one("ReduceMean", [em.one("Pow", [rows, c("linear.two", 2.0, np.float32)]), c("linear.last", [-1])], keepdims=1)
    root = em.one("Sqrt", [em.one("Add", [square, c("linear.eps", hy.norm_eps or cfg.rms_norm_eps, np.float32)])])
    wide = em.one("Mul", [rows, em.one("Div", [c("linear.one", 1.0, np.float32), root])])
    gate = _silu(em, em.one("Reshape", [z, c("linear.z_heads", [0, 0, hy.num_v_heads, hy.v_dim])]))
    normed = em.one("Mul", [em.one("Mul", [role("lin_norm"), wide]), gate])
    flat = em.one("Reshape", [normed, c("linear.value_rows", [0, 0, hy.value_dim])])
    return em.one("MatMul", [flat, role("lin_out")])


def _scan(em: Emitter, cfg: ModelConfig, i: int, tag: str, states: list[str], weights: list[str], rows: list[str],
          outputs: list[str] | None = None) -> str:
    """A Scan of the token step (`_step_body`) over `rows` (conv input, b, a: [b, n, ...]; n >= 1: ONNX Runtime's Scan
    takes no empty sequence) from `states`; its final states named `outputs` (else internal); returns the rows'
    readouts [b, n, heads, v_dim]."""
    names = [*(outputs or [f"linear.{i}.{tag}.conv", f"linear.{i}.{tag}.recurrent"]),
             *(f"linear.{i}.{tag}.{n}" for n in ("kernel", "a_log", "dt_bias", "readout"))]
    return em.op("Scan", [*states, *weights, *rows], names, body=_step_body(cfg, i, em.elem, tag), num_scan_inputs=3,
                 scan_input_axes=[1, 1, 1], scan_output_axes=[1])[5]


def _silu_b(b: GraphBuilder, s: str, x: str) -> str:
    return b.one(s, "Mul", [x, b.one(s, "Sigmoid", [x])])


def _step_body(cfg: ModelConfig, i: int, elem: int, tag: str) -> onnx.GraphProto:
    """The scans' body: one token (models.linear_attention.GatedDeltaNet.step), the same nodes in both scans (`tag`
    names them apart). Inputs: the conv state
    [b, C, K-1], the recurrent state [b, H, Dk, Dv], the conv kernel [C, K], A_log and dt_bias [H] (passed through),
    the row's conv input [b, C], b and a [b, H]; outputs: those five, then the row's readout [b, H, Dv]."""
    hy, s, b = cfg.hybrid, f"/layers.{i}/linear_attn/{tag}", GraphBuilder()
    names = [f"{s}/{n}" for n in ("conv_in", "recurrent_in", "kernel", "A_log", "dt_bias", "mixed", "b", "a")]
    conv_out, state, out = _step_nodes(b, s, hy, *names)
    passed = [b.one(s, "Identity", [t]) for t in names[2:5]]
    return _body(b, f"linear_{tag}_{i}", hy, elem, names[:5], {names[5]: ["batch", hy.conv_dim], names[6]: ["batch", hy.num_v_heads],
                                                                   names[7]: ["batch", hy.num_v_heads]}, [conv_out, state, *passed, out])


def _body(b: GraphBuilder, name: str, hy, elem: int, states: list[str], rows: dict[str, list], outputs: list[str]) -> onnx.GraphProto:
    """A scan body graph: the five state inputs (conv, recurrent, kernel, A_log, dt_bias), the scan inputs `rows`
    (name -> shape) and `outputs`."""
    C, H = hy.conv_dim, hy.num_v_heads
    shapes = [["batch", C, hy.conv_kernel - 1], ["batch", H, hy.k_dim, hy.v_dim], [C, hy.conv_kernel], [H], [H]]
    inputs = [helper.make_tensor_value_info(n, elem, shape) for n, shape in [*zip(states, shapes), *rows.items()]]
    return helper.make_graph(b.nodes, name, inputs, [helper.make_tensor_value_info(n, elem, None) for n in outputs])


def _step_nodes(b: GraphBuilder, s: str, hy, conv_in: str, rec_in: str, kernel: str, a_log: str, dt_bias: str, mixed: str,
                beta_in: str, a: str) -> tuple[str, str, str]:
    """One token's nodes (transformers' causal_conv1d_update and torch_recurrent_gated_delta_rule): the conv state,
    the recurrent state after it and its readout."""
    window = b.one(s, "Concat", [conv_in, b.one(s, "Unsqueeze", [mixed, b.const(s, [-1])])], axis=-1)  # [b, C, K]
    conv = _silu_b(b, s, b.one(s, "ReduceSum", [b.one(s, "Mul", [window, kernel]), b.const(s, [-1])], keepdims=0))
    conv_out = b.one(s, "Slice", [window, b.const(s, [1]), b.const(s, [INT64_MAX]), b.const(s, [2]), b.const(s, [1])])
    query, key, val = b.op(s, "Split", [conv, b.const(s, [hy.key_dim, hy.key_dim, hy.value_dim])], 3, axis=-1)
    query, key = (l2norm_nodes(b, s, b.one(s, "Reshape", [t, b.const(s, [0, hy.num_k_heads, hy.k_dim])])) for t in (query, key))
    groups = hy.num_v_heads // hy.num_k_heads
    if groups > 1:  # repeat_interleave: each key head serves `groups` consecutive value heads
        query, key = (b.one(s, "Reshape", [b.one(s, "Expand", [b.one(s, "Unsqueeze", [t, b.const(s, [2])]),
                                                               b.const(s, [1, 1, groups, 1])]), b.const(s, [0, hy.num_v_heads, hy.k_dim])])
                      for t in (query, key))
    query = b.one(s, "Div", [query, b.const(s, math.sqrt(hy.k_dim), "float32")])
    val = b.one(s, "Reshape", [val, b.const(s, [0, hy.num_v_heads, hy.v_dim])])
    beta = b.one(s, "Sigmoid", [beta_in])
    if hy.beta_scale != 1.0:  # OLMo Hybrid's linear_allow_neg_eigval: beta in [0, 2]
        beta = b.one(s, "Mul", [beta, b.const(s, hy.beta_scale, "float32")])
    g = b.one(s, "Mul", [b.one(s, "Neg", [b.one(s, "Exp", [a_log])]), b.one(s, "Softplus", [b.one(s, "Add", [a, dt_bias])])])
    decay = b.one(s, "Unsqueeze", [b.one(s, "Exp", [g]), b.const(s, [-1, -2])])
    state = b.one(s, "Mul", [rec_in, decay])
    k_col = b.one(s, "Unsqueeze", [key, b.const(s, [-1])])
    memory = b.one(s, "ReduceSum", [b.one(s, "Mul", [state, k_col]), b.const(s, [-2])], keepdims=0)
    delta = b.one(s, "Mul", [b.one(s, "Sub", [val, memory]), b.one(s, "Unsqueeze", [beta, b.const(s, [-1])])])
    state = b.one(s, "Add", [state, b.one(s, "Mul", [k_col, b.one(s, "Unsqueeze", [delta, b.const(s, [-2])])])])
    q_col = b.one(s, "Unsqueeze", [query, b.const(s, [-1])])
    return conv_out, state, b.one(s, "ReduceSum", [b.one(s, "Mul", [state, q_col]), b.const(s, [-2])], keepdims=0)


def hybrid_drafter(cfg: ModelConfig, dtype: str, request: "DrafterRequest | None") -> "DrafterRequest | None":
    """What a hybrid target exports with: fp32, and any drafter as long as it drafts chains (its recurrent states
    cannot branch): a head without `--tree` gets `--tree chain`, a tree is refused in one line."""
    import dataclasses

    from ..draft_config import HEAD_KINDS, DraftConfig
    from ..errors import InputError

    if dtype != "fp32":
        raise InputError(f"dtype {dtype}: hybrid linear attention ({cfg.architecture}) exports in fp32 only", "dtype")
    if request is None:
        return None
    if request.kind in HEAD_KINDS and request.tree is None:
        request = dataclasses.replace(request, tree="chain")
    if not DraftConfig.parse(request.kind, request.tree, request.num_draft_tokens).is_chain:
        raise InputError(f"tree {request.tree}: a hybrid linear-attention target ({cfg.architecture}) verifies chains only "
                         "(its recurrent states cannot branch): draft with --tree chain", "tree")
    return request
