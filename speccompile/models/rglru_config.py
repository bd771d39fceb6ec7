"""RecurrentGemma (Griffin, transformers' `recurrent_gemma`): its config.json read as ModelConfig fields and its
recurrent block's weight names in models/linear_config.py (models/rglru.py is the torch reference, docs/DESIGN.md "Hybrid linear attention").

block_types repeats over the layers (transformers' `layers_block_type`): "recurrent" layers are RG-LRU blocks
(HybridConfig kind "rglru": `width` lru_width channels in `num_v_heads` gate blocks, conv1d_width taps with a bias),
"attention" layers local attention over attention_window_size keys (head_dim hidden / heads, rope on
partial_rotary_factor of it); Gemma's (1 + w) RMSNorms, sqrt(hidden) embedding scale (transformers rounds it to
bfloat16), final logit soft-capping (logits_soft_cap), MLP width intermediate_size / 2.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .linear_config import HybridConfig

_ACTS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def rglru_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a RecurrentGemma config.json (transformers' defaults where a key is absent); an activation
    other than tanh GELU, lru_width not a multiple of num_attention_heads, rope other than default and attention
    biases refused (every block may be recurrent)."""
    hidden, heads = int(data.get("hidden_size", 2560)), int(data.get("num_attention_heads", 10))
    act = str(data.get("hidden_activation") or "gelu_pytorch_tanh")
    if act not in _ACTS:
        raise UnsupportedError(f"{source}: hidden_activation {act!r} is not supported in a RecurrentGemma model (tanh GELU only)")
    if data.get("attention_bias"):
        raise UnsupportedError(f"{source}: attention_bias true (q / k / v biases) is not supported in a RecurrentGemma model")
    rope = dict(data.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedError(f"{source}: rope_type {rope['rope_type']!r} is not supported in a RecurrentGemma model (default only)")
    width = int(data.get("lru_width") or hidden)
    if width % heads:
        raise UnsupportedError(f"{source}: lru_width {width} not a multiple of num_attention_heads {heads} is not supported")
    types = list(data.get("block_types") or ("recurrent", "recurrent", "attention"))
    other = sorted(set(types) - {"recurrent", "attention"})
    if other:
        raise UnsupportedError(f"{source}: block_types {other[0]!r} is not supported in a RecurrentGemma model")
    linear = [t == "recurrent" for t in (types * layers)[:layers]]  # every block may be recurrent (Hawk)
    head_dim = int(data.get("head_dim") or hidden // heads)  # transformers sets hidden / heads, unless given
    factor = float(rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 0.5)))
    return dict(hybrid=HybridConfig(linear=linear, kind="rglru", width=width, num_v_heads=heads,
                                    conv_kernel=int(data.get("conv1d_width") or 4), conv_bias=True),
                head_dim=head_dim, rotary_dim=int(head_dim * factor), sliding_window=int(data.get("attention_window_size") or 2048),
                layer_types=["sliding_attention"] * layers,
                final_softcap=float(data.get("logits_soft_cap") or 30.0), intermediate_size=int(data["intermediate_size"]) // 2,
                embed_scale=bfloat16(hidden ** 0.5), o_proj_bias=True)


def bfloat16(value: float) -> float:
    """`value` rounded to bfloat16 as torch rounds a float32 (to nearest, ties to even), as a float (no torch: config
    reading runs on a runtime-only install)."""
    bits = int(np.array(value, dtype=np.float32).view(np.uint32))
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(rounded, dtype=np.uint32).view(np.float32))
