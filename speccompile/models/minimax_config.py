"""MiniMax-01 (transformers' `minimax`, MiniMax-Text-01): its config.json read as ModelConfig fields (models/lightning.py
is its lightning attention's torch reference, models/normed_residual.py its layers' residuals; docs/DESIGN.md
"Hybrid linear attention").

layer_types (transformers' default: even layers full_attention, odd ones linear_attention): "linear_attention" layers
are lightning attention (HybridConfig kind "lightning": num_attention_heads heads of head_dim, a state [head_dim,
head_dim] each), "full_attention" ones Mixtral's softmax attention; every layer Mixtral's MoE. The residual factors:
linear_attn_alpha_factor / _beta_factor after lightning attention, full_attn_* after softmax attention, mlp_* after
the MoE (alpha: the normed input's, beta: the block output's). block_size only groups transformers' prefill: the
recurrence is the same.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from .linear_config import HybridConfig

# transformers' decay buffers in a MiniMax checkpoint: derived from the config (models/lightning.py), not read
DECAY_BUFFERS = tuple(f"self_attn.{n}" for n in ("slope_rate", "query_decay", "key_decay", "diagonal_decay"))

_TYPES = ("full_attention", "linear_attention")


def minimax_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a MiniMax-01 config.json: `hybrid` and the per-layer `residual_factors` [attention alpha,
    attention beta, mlp alpha, mlp beta]. Refused in one line: an activation other than SiLU, a layer type other than
    full / linear attention."""
    if str(data.get("hidden_act", "silu")) != "silu":
        raise UnsupportedError(f"{source}: hidden_act {data['hidden_act']!r} is not supported in a MiniMax model (silu only)")
    types = list(data.get("layer_types") or [_TYPES[i % 2] for i in range(layers)])[:layers]
    other = sorted({str(t) for t in types} - set(_TYPES))
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in a MiniMax model")
    heads = int(data["num_attention_heads"])
    dim = int(data.get("head_dim") or int(data["hidden_size"]) // heads)

    def factor(key: str) -> float:
        return float(data.get(key, 1.0))

    factors = [[factor(f"{kind}_attn_alpha_factor"), factor(f"{kind}_attn_beta_factor"), factor("mlp_alpha_factor"), factor("mlp_beta_factor")]
               for kind in ("linear" if t == "linear_attention" else "full" for t in types)]
    theta = (data.get("rope_parameters") or {}).get("rope_theta", data.get("rope_theta", 1e6))  # transformers' default: 1e6
    return dict(hybrid=HybridConfig(linear=[t == "linear_attention" for t in types], kind="lightning", num_v_heads=heads, k_dim=dim, v_dim=dim),
                residual_factors=factors, rope_theta=float(theta))
