"""Llama 4's query scaling (Ministral 3) as ONNX nodes, for every graph builder (contract, fused CPU / GPU): what
models/rotary.py `query_scale` computes, operator for operator.

    scale = 1 + beta * log(1 + floor(float(position_ids) / length))     float32, once per pass, in the model dtype

Each query row is multiplied by its position's scale after rope and the q norms (the contract graph), or after the
norms and before GroupQueryAttention's rope (the fused graphs: a per-position scalar commutes with rope).
"""

from __future__ import annotations

from onnx import TensorProto

from ..models.config import ModelConfig
from .moe_ops import Emitter


def query_scale(em: Emitter, cfg: ModelConfig, positions: str, axes: list[int]) -> str:
    """The scale of `positions` (int64 [b, q]) with size-1 axes `axes` added (the query layout's), in the model dtype."""
    floats = em.one("Cast", [positions], to=TensorProto.FLOAT)
    ratio = em.one("Div", [floats, em.const("query_scale.length", float(cfg.query_scale_length), "float32")])
    one = em.const("query_scale.one", 1.0, "float32")
    log = em.one("Log", [em.one("Add", [em.one("Floor", [ratio]), one])])
    scale = em.one("Add", [em.one("Mul", [log, em.const("query_scale.beta", cfg.query_scale_beta, "float32")]), one])
    return em.one("Cast", [em.one("Unsqueeze", [scale, em.const(f"query_scale.axes{len(axes)}", axes)])], to=em.elem)
