"""Config keys of the layer description that a family's entry names (models/architectures.py): the multipliers
(embedding, attention, residual and logit scales) and the KV heads (GPT-BigCode's `multi_query`)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import UnsupportedError
from .architectures import Family


def multipliers(data: dict[str, Any], fam: Family, hidden: int, head_dim: int) -> dict[str, float]:
    """embed_scale, attn_scale, residual_scale and logit_scale of the family's config keys."""
    out: dict[str, float] = {}
    if fam.embed_scale == "sqrt_hidden":
        out["embed_scale"] = math.sqrt(hidden)
    elif fam.embed_scale:
        out["embed_scale"] = float(data.get(fam.embed_scale, 1.0))
    if fam.attn_scale == "query_pre_attn_scalar":
        out["attn_scale"] = float(data.get("query_pre_attn_scalar") or head_dim) ** -0.5
    elif fam.attn_scale == "unit":  # q/k norms alone scale the scores (Gemma 4)
        out["attn_scale"] = 1.0
    elif fam.attn_scale:
        out["attn_scale"] = float(data[fam.attn_scale])
    if fam.residual_key:
        out["residual_scale"] = float(data.get(fam.residual_key, 1.0))
    if fam.logit_key.startswith("1/"):
        out["logit_scale"] = 1.0 / float(data.get(fam.logit_key[2:], 1.0))
    elif fam.logit_key:
        out["logit_scale"] = float(data.get(fam.logit_key, 1.0))
    return out


def kv_heads(data: dict[str, Any], fam: Family, heads: int, source: str) -> int:
    """The KV heads: the config's, or one where the family's `multi_query_key` is true (false: refused)."""
    if not fam.multi_query_key:
        return int(data.get("num_key_value_heads") or heads)
    if not data.get(fam.multi_query_key, True):
        raise UnsupportedError(f"{source}: {fam.multi_query_key} false is not supported (a fused qkv stored per head)")
    return 1
