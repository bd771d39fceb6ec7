"""Llama 4's query scaling (Ministral 3's, and Llama 4's NoPE layers' temperature) as ONNX nodes, for every graph builder
(contract, fused CPU / GPU): what models/rotary.py `query_scale` computes.

    scale = 1 + beta * log(1 + n),  n = floor((position_ids + offset) / length)     once per pass, in the model dtype

n is an integer division; the scale of each n is read from a table (float32, computed in float64 at export, n up to
(max_position_embeddings + offset) / length; later positions read its last row). No Log runs in the graph: ONNX
Runtime's vectorised Log rounds an element by where it sits in the tensor (its SIMD packets and scalar tail), so a
position's scale, and its logits, would differ between a one-row pass and a verify pass.

Each query row is multiplied by its position's scale after rope and the q norms (the contract graph), or after the
norms and before GroupQueryAttention's rope (the fused graphs: a per-position scalar commutes with rope).
"""

from __future__ import annotations

import numpy as np

from ..models.config import ModelConfig
from .moe_ops import Emitter


def scale_table(cfg: ModelConfig) -> np.ndarray:
    """The scale of each n = 0 .. (max_position_embeddings + offset) // length, float32."""
    n = np.arange((cfg.max_position_embeddings + cfg.query_scale_offset) // cfg.query_scale_length + 1, dtype=np.float64)
    return (1.0 + cfg.query_scale_beta * np.log1p(n)).astype(np.float32)


def query_scale(em: Emitter, cfg: ModelConfig, positions: str, axes: list[int]) -> str:
    """The scale of `positions` (int64 [b, q]) with size-1 axes `axes` added (the query layout's), in the model dtype."""
    if cfg.query_scale_offset:  # Llama 4's temperature: position + 1
        positions = em.one("Add", [positions, em.const("query_scale.offset", [cfg.query_scale_offset])])
    table = scale_table(cfg)
    n = em.one("Div", [positions, em.const("query_scale.length", [cfg.query_scale_length])])  # non-negative: floor
    n = em.one("Min", [n, em.const("query_scale.last", [len(table) - 1])])
    scale = em.one("Gather", [em.const("query_scale.table", table, np.float32), n], axis=0)
    return em.one("Cast", [em.one("Unsqueeze", [scale, em.const(f"query_scale.axes{len(axes)}", axes)])], to=em.elem)
