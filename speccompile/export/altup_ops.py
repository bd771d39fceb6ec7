"""Gemma 3n's AltUp streams, LAuReL and the MLP gate's Gaussian top-k as ONNX nodes, for every graph builder
(contract, fused CPU / GPU): what models/altup.py computes, operator for operator.

The streams are one tensor [n, b, q, hidden] (stream 0 the active one); the layer's attention and MLP see the
active stream's prediction [b, q, hidden] as any layer's input. Every node reads its own row only (the streams of a
token, their norms and means, per-row MatMuls), so a row computes the same bits in any pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from onnx import TensorProto

from ..models.feed_forward import sparsity_multiplier
from ..models.soft_tokens import SOFT_TABLE
from ..models.config import ModelConfig
from .activations import activation
from .moe_ops import Emitter
from .recipes import altup_recipes, np_dtype


@dataclass
class LayerParts:
    """What a builder gives `altup_layer` of layer i: `attend(h)` its attention output (o_proj included) on the normed
    active stream, `mlp(h)` its MLP, `norm(role, h)` its norm of that role, `weight(role)` its initializer of a role."""

    attend: Callable[[str], str]
    mlp: Callable[[str], str]
    norm: Callable[[str, str], str]
    weight: Callable[[str], str]


def _stream(em: Emitter, streams: str, k: int) -> str:
    return em.one("Gather", [streams, em.const(f"altup.stream.{k}", k)], axis=0)


def active_stream(em: Emitter, streams: str) -> str:
    """Stream 0 [b, q, hidden] (an EAGLE-3 tap's hidden state)."""
    return _stream(em, streams, 0)


def soft_tokens(em: Emitter, cfg: ModelConfig, x: str) -> str:
    """The scaled embeddings `x` with the wrapper's image / audio tokens (input_ids >= soft_token_offset) taken from
    their table (models/soft_tokens.py)."""
    offset = em.const("soft.offset", cfg.soft_token_offset)
    rows = em.one("Max", [em.one("Sub", ["input_ids", offset]), em.const("soft.zero", 0)])
    rows = em.one("Gather", [em.weight(SOFT_TABLE, altup_recipes(cfg, em.dtype)[SOFT_TABLE]), rows])
    soft = em.one("Unsqueeze", [em.one("GreaterOrEqual", ["input_ids", offset]), em.const("altup.last", [-1])])
    return em.one("Where", [soft, rows, x])


def _rms(em: Emitter, x: str) -> str:
    square = em.one("Mul", [x, x])
    return em.one("Sqrt", [em.one("ReduceMean", [square, em.const("altup.axis", [-1])], keepdims=1)])


def _rescaled(em: Emitter, p: str, target: str) -> str:
    """p * target / sqrt(max(mean(p ** 2), 1e-5))."""
    mean = em.one("ReduceMean", [em.one("Mul", [p, p]), em.const("altup.axis", [-1])], keepdims=1)
    floor = em.const("altup.floor", 1e-5, np_dtype(em.dtype))
    return em.one("Div", [em.one("Mul", [p, target]), em.one("Sqrt", [em.one("Max", [mean, floor])])])


def _stacked(em: Emitter, parts: list[str]) -> str:
    axis = em.const("altup.axis0", [0])
    return em.one("Concat", [em.one("Unsqueeze", [p, axis]) for p in parts], axis=0)


def _projected(em: Emitter, cfg: ModelConfig, kind: str, k: int, x: str) -> str:
    name = f"model.{kind}.{k}.weight_t"
    return em.one("MatMul", [x, em.weight(name, altup_recipes(cfg, em.dtype)[name])])


def altup_streams(em: Emitter, cfg: ModelConfig, x: str) -> str:
    """The streams [n, b, q, hidden] of the scaled embeddings `x`."""
    target = _rms(em, x)
    return _stacked(em, [x, *(_rescaled(em, _projected(em, cfg, "altup_projections", k, x), target)
                              for k in range(cfg.altup_inputs - 1))])


def altup_merge(em: Emitter, cfg: ModelConfig, streams: str) -> str:
    """The streams' mean [b, q, hidden], each past the first projected back and rescaled to the first's rms."""
    first = _stream(em, streams, 0)
    target = _rms(em, first)
    parts = [first, *(_rescaled(em, _projected(em, cfg, "altup_unembed_projections", k, _stream(em, streams, k + 1)), target)
                      for k in range(cfg.altup_inputs - 1))]
    return em.one("ReduceMean", [_stacked(em, parts), em.const("altup.axis0", [0])], keepdims=0)


def _modalities(em: Emitter, cfg: ModelConfig, x: str, parts: LayerParts, router: str) -> str:
    """tanh(router(router_norm(x) / hidden)) [b, q, n], the tanh in float32."""
    scaled = em.one("Mul", [parts.norm("altup_router_norm", x), em.const("altup.router_scale", 1.0 / cfg.hidden_size, np_dtype(em.dtype))])
    routed = em.one("MatMul", [scaled, router])
    if em.elem == TensorProto.FLOAT:
        return em.one("Tanh", [routed])
    return em.one("Cast", [em.one("Tanh", [em.one("Cast", [routed], to=TensorProto.FLOAT)])], to=em.elem)


def _predict(em: Emitter, cfg: ModelConfig, streams: str, parts: LayerParts, router: str) -> str:
    """pred_j = s_j + sum_k C[j, k] s_k, C the prediction coefficients of the active stream's modalities."""
    n = cfg.altup_inputs
    coefs = em.one("MatMul", [_modalities(em, cfg, _stream(em, streams, 0), parts, router), parts.weight("altup_predict")])
    coefs = em.one("Transpose", [em.one("Reshape", [coefs, em.const(f"altup.coefs.{n}", [0, 0, n, n])])], perm=[0, 1, 3, 2])
    mixed = em.one("MatMul", [em.one("Transpose", [streams], perm=[1, 2, 3, 0]), coefs])
    return em.one("Add", [em.one("Transpose", [mixed], perm=[3, 0, 1, 2]), streams])


def _correct(em: Emitter, cfg: ModelConfig, predictions: str, active: str, out: str, parts: LayerParts,
             router: str) -> str:
    """pred_j + (out - pred_0) * (corr(modalities(out)) + 1)[j]."""
    coefs = em.one("MatMul", [_modalities(em, cfg, out, parts, router), parts.weight("altup_correct")])
    coefs = em.one("Add", [coefs, em.const("altup.one", 1.0, np_dtype(em.dtype))])
    coefs = em.one("Unsqueeze", [em.one("Transpose", [coefs], perm=[2, 0, 1]), em.const("altup.last", [-1])])
    return em.one("Add", [em.one("Mul", [em.one("Sub", [out, active]), coefs]), predictions])


def altup_layer(em: Emitter, cfg: ModelConfig, i: int, streams: str, parts: LayerParts, per_layer: str) -> str:
    """Layer i on the streams (models/altup.py `altup_layer`): predict, the layer on the active prediction with LAuReL,
    correct, the per-layer input block on the scaled active stream added to the others."""
    router = parts.weight("altup_router")
    predictions = _predict(em, cfg, streams, parts, router)
    active = _stream(em, predictions, 0)
    h = parts.norm("input_norm", active)
    laurel = em.one("MatMul", [em.one("MatMul", [h, parts.weight("laurel_left")]), parts.weight("laurel_right")])
    laurel = em.one("Add", [h, parts.norm("laurel_norm", laurel)])
    x = em.one("Add", [em.one("Add", [active, parts.norm("post_attn_norm", parts.attend(h))]), laurel])
    x = em.one("Div", [x, em.const("altup.sqrt2", math.sqrt(2), np_dtype(em.dtype))])
    x = em.one("Add", [x, parts.norm("post_mlp_norm", parts.mlp(parts.norm("post_norm", x)))])
    corrected = _correct(em, cfg, predictions, active, x, parts, router)
    if cfg.altup_inputs == 1:  # no stream past the first to add the per-layer input block to
        return corrected
    first = em.one("Mul", [_stream(em, corrected, 0), parts.weight("altup_scale")])
    mine = em.one("Gather", [per_layer, em.const(f"ple.layer.{i}", i)], axis=2)
    gated = em.one("Mul", [activation(em, cfg.mlp_act, em.one("MatMul", [first, parts.weight("ple_gate")])), mine])
    added = parts.norm("ple_norm", em.one("MatMul", [gated, parts.weight("ple_proj")]))
    head = em.one("Slice", [corrected, em.const("altup.zero", [0]), em.const("altup.one_i", [1]), em.const("altup.axis0", [0])])
    rest = em.one("Slice", [corrected, em.const("altup.one_i", [1]), em.const(f"altup.end.{cfg.altup_inputs}", [cfg.altup_inputs]),
                            em.const("altup.axis0", [0])])
    return em.one("Concat", [head, em.one("Add", [rest, added])], axis=0)


def gaussian_topk(em: Emitter, x: str, sparsity: float) -> str:
    """relu(x - (mean + std * Phi^-1(sparsity))) over the last axis (the population's std), per row."""
    axis = em.const("altup.axis", [-1])
    mean = em.one("ReduceMean", [x, axis], keepdims=1)
    centered = em.one("Sub", [x, mean])
    std = em.one("Sqrt", [em.one("ReduceMean", [em.one("Mul", [centered, centered]), axis], keepdims=1)])
    multiplier = np.asarray(sparsity_multiplier(sparsity), dtype=np.float32).astype(np_dtype(em.dtype))
    cutoff = em.one("Add", [mean, em.one("Mul", [std, em.const(f"altup.topk.{sparsity!r}", multiplier, np_dtype(em.dtype))])])
    return em.one("Relu", [em.one("Sub", [x, cutoff])])
