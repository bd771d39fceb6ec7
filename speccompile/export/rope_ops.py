"""Rotary position embedding as ONNX nodes (the contract graph's; the fused graphs rope inside GroupQueryAttention)."""

from __future__ import annotations

from ..models.config import ModelConfig
from .graph_builder import INT64_MAX, GraphBuilder


def rope(b: GraphBuilder, scope: str, x: str, cos: str, sin: str, cfg: ModelConfig) -> str:
    """x * cos + rotate(x) * sin over the first rope_dim dims (the rest pass through); rotate(x) = [-x2, x1] of
    the halves, or of each (x0, x1) pair when interleaved (constant slice bounds)."""
    rot, axis, step = cfg.rope_dim, b.const(scope, [3]), b.const(scope, [1])
    part = x if rot == cfg.head_dim else b.one(scope, "Slice", [x, b.const(scope, [0]), b.const(scope, [rot]), axis, step])
    if cfg.rope_interleaved:
        pairs = b.one(scope, "Reshape", [part, b.const(scope, [0, 0, 0, -1, 2])])
        even, odd = b.op(scope, "Split", [pairs, b.const(scope, [1, 1])], 2, axis=-1)
        rotated = b.one(scope, "Reshape", [b.one(scope, "Concat", [b.one(scope, "Neg", [odd]), even], axis=-1),
                                           b.const(scope, [0, 0, 0, rot])])
    else:
        half = rot // 2
        upper = b.one(scope, "Slice", [part, b.const(scope, [half]), b.const(scope, [INT64_MAX]), axis, step])
        lower = b.one(scope, "Slice", [part, b.const(scope, [0]), b.const(scope, [half]), axis, step])
        rotated = b.one(scope, "Concat", [b.one(scope, "Neg", [upper]), lower], axis=-1)
    out = b.one(scope, "Add", [b.one(scope, "Mul", [part, cos]), b.one(scope, "Mul", [rotated, sin])])
    if rot == cfg.head_dim:
        return out
    rest = b.one(scope, "Slice", [x, b.const(scope, [rot]), b.const(scope, [INT64_MAX]), axis, step])
    return b.one(scope, "Concat", [out, rest], axis=-1)
