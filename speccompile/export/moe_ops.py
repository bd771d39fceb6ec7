"""The mixture-of-experts block as ONNX nodes, for every graph builder (contract, fused CPU, slotted).

What ONNX Runtime offers: `com.microsoft` MoE and QMoE (CPU kernels in the installed onnxruntime 1.32) take the
router logits and all experts' weights and route inside. They are not row-exact: a row's output depends on how
many rows of the pass chose the same expert (measured: up to ~1e-6 between a row alone and the same row in a
pass of 7), so a verify pass would not reproduce plain decoding bit for bit. The block is
therefore decomposed into standard operators, sparse by expert:

    routing   Softmax + TopK (+ renormalise), or TopK + Softmax (gpt-oss), or DeepSeek-V3's group-limited sigmoid
              routing (`_group_route`), or Phi-MoE's sparsemixer (`_sparsemixer`), or Gemma 4's (Softmax + TopK of the
              input's scale-free norm, renormalised, times per-expert scales), in float32, per row; each row's choices then
              ordered by expert index
    dispatch  once per layer: the pass's (row, choice) pairs sorted by expert (TopK, ties by pair: rows ascending),
              their rows gathered, and cut by each expert's count (one Split with E outputs)
    expert e  its SwiGLU MLP on its piece only (two MatMuls with 2-D weights): five nodes, an unchosen expert's on
              zero rows; an ungated expert (Nemotron-H: `expert_gated` False) MatMul, its activation, MatMul
    combine   the pieces concatenated, times their routing weights (Llama 4: the rows times them before their expert), put back in (row, choice) order, and each row's
              choices summed in expert-index order
    shared    + sigmoid(x @ shared_expert_gate) * shared_expert(x) (Qwen2-MoE), or + shared_experts(x) (DeepSeek-V3)
    beside    Gemma 4: the layer's dense MLP and the block side by side, each output normed, summed (`beside_dense`)

Each row's routing reads that row alone, and its expert outputs come from weight MatMuls whose rows ONNX Runtime
computes alike whatever the number of rows (the premise of the dense layers too: export/fused_ops.py,
OneRowPadding), summed in a fixed order from zero: a row gets the same bits in any pass. Every expert weight is
a plain 2-D MatMul weight, so the quantized builds pack them like the dense layers' (engines/cpu_graph.py);
routers stay in float (engines/qdq_targets.py DEFAULT_EXCLUDE). Compute is the active experts' only.
"""

from __future__ import annotations

import re

from typing import Callable

import numpy as np
from onnx import TensorProto, numpy_helper

from ..models.config import ModelConfig
from ..models.moe_config import MoeConfig
from .activations import activation
from .emitter import Emitter
from .recipes import Recipe, np_dtype

ROUTER = "mlp.router"  # graph names of a layer's router: never quantized (qdq_targets.DEFAULT_EXCLUDE)
SHARED_GATE = "mlp.shared_expert_gate"


def reads_rows(weight: str) -> bool:
    """Whether graph weight `weight` is a MoE block's (router, expert, shared expert): its MatMul reads the pass's
    rows as one matrix [rows, hidden], where a dense layer's reads [batch, rows, hidden]."""
    return re.search(r"\.mlp\.(experts\.\d+|shared_expert|shared_expert_gate|router)\.", weight) is not None


def moe_names(config: ModelConfig, layer: int, dtype: str) -> dict[str, Recipe]:
    """Graph initializer name -> recipe, for layer `layer`'s MoE block (the names every graph uses)."""
    moe = config.moe
    p, q = f"layers.{layer}.", moe.prefix(layer)
    names = {f"{p}{ROUTER}.weight_t": Recipe((f"{q}{moe.router}.weight",), True, dtype)}
    if moe.router_bias:
        names[f"{p}{ROUTER}.bias"] = Recipe((f"{q}{moe.router}.bias",), False, dtype)
    if moe.score_bias:  # float32 whatever the export dtype: the routing is float32
        names[f"{p}{ROUTER}.score_bias"] = Recipe((f"{q}{moe.router}.e_score_correction_bias",), False, "fp32")
    if moe.routing == "normed_softmax_topk":  # Gemma 4: the router input's gain; the per-expert scales in float32
        names[f"{p}{ROUTER}.scale"] = Recipe((f"{q}{moe.router}.scale",), False, dtype)
        names[f"{p}{ROUTER}.per_expert_scale"] = Recipe((f"{q}{moe.router}.per_expert_scale",), False, "fp32")
    for e in range(moe.num_experts):
        src, x = moe.expert_sources(layer, e), f"{p}mlp.experts.{e}"
        names[f"{x}.weight_t"] = Recipe((src["gate"], src["up"]) if moe.expert_gated else (src["up"],), True, dtype)
        names[f"{x}.down_proj.weight_t"] = Recipe((src["down"],), True, dtype)
        if moe.expert_bias:
            names[f"{x}.bias"] = Recipe((src["gate_bias"], src["up_bias"]) if moe.expert_gated else (src["up_bias"],), False, dtype)
            names[f"{x}.down_proj.bias"] = Recipe((src["down_bias"],), False, dtype)
    if moe.shared_expert_size:
        s = f"{q}{moe.shared_name}."
        names[f"{p}mlp.shared_expert.weight_t"] = Recipe(tuple(s + f"{x}.weight" for x in moe.shared_projections()[:-1]), True, dtype)
        names[f"{p}mlp.shared_expert.down_proj.weight_t"] = Recipe((s + "down_proj.weight",), True, dtype)
        if moe.shared_gated:
            names[f"{p}{SHARED_GATE}.weight_t"] = Recipe((f"{q}shared_expert_gate.weight",), True, dtype)
    return names


def moe_block(em: Emitter, config: ModelConfig, layer: int, h: str, output: str | None = None,
              expert_h: str | None = None) -> str:
    """Layer `layer`'s MoE block on `h` [..., hidden] (any leading axes); returns its output, same shape.
    `expert_h`: the experts' input where it is not the router's (Gemma 4: their own norm of the residual)."""
    moe, hidden = config.moe.at_layer(layer), config.hidden_size  # Bailing: the layer's SwiGLU limits
    names = moe_names(config, layer, em.dtype)
    w = {name: em.weight(name, recipe) for name, recipe in names.items()}
    p = f"layers.{layer}."
    x = em.one("Reshape", [h, em.const("moe.rows_shape", [-1, hidden])])
    values, index = _route(em, moe, x, w, p, hidden)
    if expert_h is not None:
        x = em.one("Reshape", [expert_h, em.const("moe.rows_shape", [-1, hidden])])
    index, choice = em.op("TopK", [index, em.const("moe.top_k", [moe.top_k])], 2, axis=-1, largest=0, sorted=1)
    values = em.one("GatherElements", [values, choice], axis=-1)  # each row's choices by expert index
    experts = em.one("Reshape", [index, em.const("moe.flat", [-1])])  # [pairs]: pair = row * top_k + choice
    pairs = em.one("Shape", [experts])
    order = em.op("TopK", [experts, pairs], 2, axis=0, largest=0, sorted=1)[1]  # by expert, then by pair
    x_sorted = em.one("Gather", [x, em.one("Div", [order, em.const("moe.top_k", [moe.top_k])])], axis=0)
    counts = em.one("ReduceSum", [em.one("Cast", [em.one("Equal", [
        em.one("Unsqueeze", [experts, em.const("moe.zero", [0])]),
        em.const(f"moe.expert_column.{moe.num_experts}", np.arange(moe.num_experts).reshape(-1, 1))])], to=TensorProto.INT64),
        em.const("moe.one", [1])], keepdims=0)  # [experts]: pairs per expert
    if moe.scale_input:  # Llama 4: each pair's row times its weight before its expert
        x_sorted = em.one("Mul", [x_sorted, _pair_weights(em, values, order)])
    pieces = em.op("Split", [x_sorted, counts], moe.num_experts, axis=0)
    outs = [_expert(em, moe, piece, w, f"{p}mlp.experts.{e}", moe.expert_size, moe.expert_bias) for e, piece in enumerate(pieces)]
    y = em.one("Concat", outs, axis=0)  # [pairs, hidden], sorted by expert
    y = y if moe.scale_input else em.one("Mul", [y, _pair_weights(em, values, order)])
    unsort = em.op("TopK", [order, pairs], 2, axis=0, largest=0, sorted=1)[1]
    y = em.one("Reshape", [em.one("Gather", [y, unsort], axis=0), em.const("moe.choices_shape", [-1, moe.top_k, hidden])])
    parts = em.op("Split", [y], moe.top_k, axis=1, num_outputs=moe.top_k) if moe.top_k > 1 else [y]
    total = parts[0]
    for part in parts[1:]:  # in expert-index order, as a row alone
        total = em.one("Add", [total, part])
    total = em.one("Reshape", [total, em.const("moe.rows_shape", [-1, hidden])])
    if moe.shared_expert_size:
        plain = MoeConfig(1, 1, moe.shared_expert_size, clip=moe.shared_clip) if moe.expert_gated else \
            MoeConfig(1, 1, moe.shared_expert_size, act=moe.act, expert_gated=False)
        shared = _expert(em, plain, x, w, f"{p}mlp.shared_expert", moe.shared_expert_size, False)
        if moe.shared_gated:
            shared = em.one("Mul", [em.one("Sigmoid", [em.one("MatMul", [x, w[f"{p}{SHARED_GATE}.weight_t"]])]), shared])
        total = em.one("Add", [total, shared])
        if moe.shared_average:
            total = em.one("Div", [total, em.const("moe.two_of_average", 2.0, np_dtype(em.dtype))])
    return em.op("Reshape", [total, em.one("Shape", [h])], [output] if output else 1)[0]


def _pair_weights(em: Emitter, values: str, order: str) -> str:
    """The routing weights [pairs, 1] in the experts' (sorted) pair order."""
    return em.one("Unsqueeze", [em.one("Gather", [em.one("Reshape", [values, em.const("moe.flat", [-1])]), order], axis=0),
                                em.const("moe.last_axis", [-1])])


def _route(em: Emitter, moe: MoeConfig, x: str, w: dict[str, str], p: str, hidden: int) -> tuple[str, str]:
    """(routing weights in the graph dtype, int64 expert indices), both [rows, top_k]; computed in float32."""
    if moe.routing == "normed_softmax_topk":  # Gemma 4: the scale-free norm of the input, its gain, 1 / sqrt(hidden)
        x = em.one("Mul", [em.one("Mul", [_scale_free_norm(em, x, moe.router_eps), w[f"{p}{ROUTER}.scale"]]),
                           em.const("moe.router_root", hidden ** -0.5, np_dtype(em.dtype))])
    logits = em.one("MatMul", [x, w[f"{p}{ROUTER}.weight_t"]])
    if moe.router_bias:
        logits = em.one("Add", [logits, w[f"{p}{ROUTER}.bias"]])
    if em.elem != TensorProto.FLOAT:
        logits = em.one("Cast", [logits], to=TensorProto.FLOAT)
    k = em.const("moe.top_k", [moe.top_k])
    if moe.routing in ("sigmoid_group", "softmax_group"):
        values, index = _group_route(em, moe, logits, w.get(f"{p}{ROUTER}.score_bias"), k)
    elif moe.routing == "sparsemixer":
        values, index = _sparsemixer(em, moe, logits)
    elif moe.routing in ("topk_softmax", "topk_sigmoid"):
        values, index = em.op("TopK", [logits, k], 2, axis=-1)
        values = em.one("Softmax", [values], axis=-1) if moe.routing == "topk_softmax" else em.one("Sigmoid", [values])
    else:
        values, index = em.op("TopK", [em.one("Softmax", [logits], axis=-1), k], 2, axis=-1)
    if moe.norm_topk_prob and moe.routing in ("softmax_topk", "normed_softmax_topk", "topk_sigmoid"):  # renormalised to sum 1
        values = em.one("Div", [values, em.one("ReduceSum", [values, em.const("moe.last_axis", [-1])], keepdims=1)])
    if moe.routing == "normed_softmax_topk":
        values = em.one("Mul", [values, em.one("Gather", [w[f"{p}{ROUTER}.per_expert_scale"], index], axis=0)])
    if em.elem != TensorProto.FLOAT:
        values = em.one("Cast", [values], to=em.elem)
    return values, index


def _sparsemixer(em: Emitter, moe: MoeConfig, logits: str) -> tuple[str, str]:
    """Phi-MoE's sparsemixer of float32 logits [rows, experts] (models.moe._sparsemixer): twice, TopK 1 of the
    remaining logits, Softmax over those within 2 eps (relative) of it, the winner's share; the winner set to -inf."""
    scores, weights, indices = logits, [], []
    neg_inf = em.const("moe.neg_inf", -np.inf, np.float32)
    for _ in range(2):
        top, index = em.op("TopK", [scores, em.const("moe.one", [1])], 2, axis=-1)
        relative = em.one("Div", [em.one("Sub", [top, logits]), em.one("Max", [em.one("Abs", [logits]), top])])
        far = em.one("Greater", [relative, em.const("moe.jitter", 2 * moe.jitter_eps, np.float32)])
        share = em.one("Softmax", [em.one("Where", [far, neg_inf, scores])], axis=-1)
        weights.append(em.one("GatherElements", [share, index], axis=-1))
        indices.append(index)
        scores = em.one("ScatterElements", [scores, index, em.one("Expand", [neg_inf, em.one("Shape", [index])])], axis=-1)
    return em.one("Concat", weights, axis=-1), em.one("Concat", indices, axis=-1)


def _group_route(em: Emitter, moe: MoeConfig, logits: str, score_bias: str | None, k: str) -> tuple[str, str]:
    """DeepSeek's group-limited routing of float32 logits [rows, experts] (models.moe._group_route: V3's sigmoid, V2's
    softmax): (weights, indices); `k`: the top k constant."""
    sigmoid = moe.routing == "sigmoid_group"
    scores = em.one("Sigmoid", [logits]) if sigmoid else em.one("Softmax", [logits], axis=-1)
    choice = scores if score_bias is None else em.one("Add", [scores, score_bias])
    grouped = em.one("Reshape", [choice, em.const(f"moe.groups.{moe.n_group}", [0, moe.n_group, -1])])
    if sigmoid:
        top2 = em.op("TopK", [grouped, em.const("moe.two", [2])], 2, axis=-1)[0]
        group_scores = em.one("ReduceSum", [top2, em.const("moe.last_axis", [-1])], keepdims=0)  # [rows, groups]
    else:
        group_scores = em.one("ReduceMax", [grouped, em.const("moe.last_axis", [-1])], keepdims=0)
    groups = em.op("TopK", [group_scores, em.const("moe.topk_group", [moe.topk_group])], 2, axis=-1)[1]
    ones = em.one("Expand", [em.const("moe.one_f32", 1.0, np.float32), em.one("Shape", [groups])])
    keep = em.one("ScatterElements", [em.one("Mul", [group_scores, em.const("moe.zero_f32", 0.0, np.float32)]), groups, ones],
                  axis=-1)  # [rows, groups]: 1 for the chosen groups
    keep = em.one("Reshape", [em.one("Expand", [em.one("Unsqueeze", [keep, em.const("moe.last_axis", [-1])]),
                                                em.one("Shape", [grouped])]), em.one("Shape", [choice])])
    masked = em.one("Where", [em.one("Equal", [keep, em.const("moe.zero_f32", 0.0, np.float32)]),
                              em.const("moe.neg_inf", -np.inf, np.float32) if sigmoid else em.const("moe.zero_f32", 0.0, np.float32),
                              choice])
    index = em.op("TopK", [masked, k], 2, axis=-1)[1]
    values = em.one("GatherElements", [scores, index], axis=-1)
    if moe.norm_topk_prob:
        total = em.one("ReduceSum", [values, em.const("moe.last_axis", [-1])], keepdims=1)
        values = em.one("Div", [values, em.one("Add", [total, em.const("moe.tiny", moe.renorm_eps, np.float32)])])
    return em.one("Mul", [values, em.const("moe.routed_scale", moe.routed_scale, np.float32)]), index


def _expert(em: Emitter, moe: MoeConfig, x: str, w: dict[str, str], name: str, inter: int, bias: bool) -> str:
    """down(swiglu(x @ [gate | up])) (+ biases) of the expert whose initializers are `name`.*; ungated
    (`expert_gated` False): down(act(x @ up))."""
    both = em.one("MatMul", [x, w[f"{name}.weight_t"]])
    if bias:
        both = em.one("Add", [both, w[f"{name}.bias"]])
    if not moe.expert_gated:
        out = em.one("MatMul", [activation(em, moe.act, both), w[f"{name}.down_proj.weight_t"]])
        return em.one("Add", [out, w[f"{name}.down_proj.bias"]]) if bias else out
    gate, up = em.op("Split", [both, em.const(f"moe.split.{inter}", [inter, inter])], 2, axis=-1)
    if moe.swiglu_limit:
        limit = em.const("moe.limit", moe.swiglu_limit, np_dtype(em.dtype))
        gate = em.one("Min", [gate, limit])
        up = em.one("Clip", [up, em.const("moe.neg_limit", -moe.swiglu_limit, np_dtype(em.dtype)), limit])
        alpha = em.const("moe.alpha", moe.swiglu_alpha, np_dtype(em.dtype))
        glu = em.one("Mul", [gate, em.one("Sigmoid", [em.one("Mul", [gate, alpha])])])
        act = em.one("Mul", [em.one("Add", [up, em.const("moe.one_f", 1.0, np_dtype(em.dtype))]), glu])
    elif moe.act in ("gelu", "gelu_tanh"):  # Gemma 4's experts
        act = em.one("Mul", [em.one("Gelu", [gate], approximate="tanh" if moe.act == "gelu_tanh" else "none"), up])
    elif moe.clip:  # Bailing: min(SiLU(gate), limit) * clip(up, -limit, limit)
        glu = em.one("Min", [em.one("Mul", [gate, em.one("Sigmoid", [gate])]), em.const(f"moe.clip.{moe.clip}", moe.clip, np_dtype(em.dtype))])
        act = em.one("Mul", [glu, em.one("Clip", [up, em.const(f"moe.neg_clip.{moe.clip}", -moe.clip, np_dtype(em.dtype)),
                                                  em.const(f"moe.clip.{moe.clip}", moe.clip, np_dtype(em.dtype))])])
    else:
        act = em.one("Mul", [em.one("Mul", [gate, em.one("Sigmoid", [gate])]), up])
    out = em.one("MatMul", [act, w[f"{name}.down_proj.weight_t"]])
    if bias:
        out = em.one("Add", [out, w[f"{name}.down_proj.bias"]])
    return out


def _scale_free_norm(em: Emitter, x: str, eps: float) -> str:
    """x's RMS norm over the last axis without a gain, computed in float32, in the graph dtype."""
    wide = x if em.elem == TensorProto.FLOAT else em.one("Cast", [x], to=TensorProto.FLOAT)
    mean = em.one("ReduceMean", [em.one("Mul", [wide, wide]), em.const("moe.last_axis", [-1])], keepdims=1)
    root = em.one("Sqrt", [em.one("Add", [mean, em.const("moe.router_eps", eps, np.float32)])])
    normed = em.one("Div", [wide, root])
    return normed if em.elem == TensorProto.FLOAT else em.one("Cast", [normed], to=em.elem)


def beside_dense(em: Emitter, config: ModelConfig, layer: int, h: str, x: str, dense: Callable[[str], str],
                 norm: Callable[[str, str], str]) -> str:
    """Gemma 4's MoE layer: norm(dense_out_norm, dense(h)) + norm(moe_out_norm, experts(norm(moe_in_norm, x)) routed by x);
    `h`: the dense MLP's normed input, `x`: the residual stream; `dense`, `norm(role, t)`: the builder's MLP and norms."""
    experts = moe_block(em, config, layer, x, expert_h=norm("moe_in_norm", x))
    return em.one("Add", [norm("dense_out_norm", dense(h)), norm("moe_out_norm", experts)])
