"""config.json's attention keys beyond one GQA shape for every layer: multi-head latent attention (DeepSeek-V2/V3's
compressed cache) and per-layer head widths / kv heads (Gemma 4's full-attention layers, its KV sharing and per-layer
embeddings), as ModelConfig fields."""

from __future__ import annotations

import math
from typing import Any

from ..errors import UnsupportedError
from .rope_keys import rope_params


def latent_attention(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of multi-head latent attention (DeepSeek-V3): one cached vector per token of
    kv_lora_rank + qk_rope_head_dim values, read as one KV head; transformers' softmax scale (1 / sqrt(nope + rope),
    times yarn's mscale(factor, mscale_all_dim) squared); rope on the rope dims, interleaved unless
    `rope_interleave` is false."""
    if data.get("attention_bias"):
        raise UnsupportedError(f"{source}: multi-head latent attention with attention_bias is not supported")
    rank, rope, nope = int(data["kv_lora_rank"]), int(data["qk_rope_head_dim"]), int(data["qk_nope_head_dim"])
    scale = (nope + rope) ** -0.5
    scaling, _ = rope_params(data)
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None) and scaling.get("mscale_all_dim"):
        mscale = 0.1 * float(scaling["mscale_all_dim"]) * math.log(float(scaling["factor"])) + 1.0
        scale = scale * mscale * mscale if float(scaling["factor"]) > 1 else scale
    return dict(num_key_value_heads=1, head_dim=rank + rope, rotary_dim=rope, kv_lora_rank=rank,
                q_lora_rank=int(data.get("q_lora_rank") or 0), qk_nope_head_dim=nope, v_head_dim=int(data["v_head_dim"]),
                attn_scale=scale, rope_interleaved=bool(data.get("rope_interleave", True)))


def layer_shapes(data: dict[str, Any], types: list[str], layers: int, head_dim: int, source: str) -> dict[str, Any]:
    """Gemma 4's per-layer attention shapes: config.json's `per_layer_config` (layer -> head_dim /
    num_key_value_heads, as transformers writes it), else transformers' defaults: full-attention layers take
    global_head_dim (512) and, where attention_k_eq_v, num_global_key_value_heads. Also its other per-layer keys:
    KV sharing (`kv_sharing`; the shared layers' MLP twice as wide where use_double_wide_mlp) and the per-layer
    embeddings' width (hidden_size_per_layer_input; their table's rows: vocab_size_per_layer_input)."""
    kv_heads = int(data.get("num_key_value_heads") or data["num_attention_heads"])
    per_layer = data.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": int(data.get("global_head_dim") or 512)}
        if data.get("attention_k_eq_v") and data.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = int(data["num_global_key_value_heads"])
        per_layer = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(per_layer, dict) or any(set(v) - {"head_dim", "num_key_value_heads"} for v in per_layer.values()):
        raise UnsupportedError(f"{source}: per_layer_config {per_layer!r} is not supported (only head_dim / num_key_value_heads per layer)")
    layer = [per_layer.get(str(i), per_layer.get(i, {})) for i in range(layers)]
    shapes = dict(layer_head_dims=[int(c.get("head_dim", head_dim)) for c in layer],
                  layer_kv_heads=[int(c.get("num_key_value_heads", kv_heads)) for c in layer],
                  k_eq_v=bool(data.get("attention_k_eq_v")))
    sources = kv_sharing(data, types, layers, source)
    for i, j in enumerate(sources):
        if j >= 0 and (shapes["layer_head_dims"][i], shapes["layer_kv_heads"][i]) != (shapes["layer_head_dims"][j], shapes["layer_kv_heads"][j]):
            raise UnsupportedError(f"{source}: num_kv_shared_layers: layer {i} shares the keys of layer {j}, of another attention shape")
    inter = int(data["intermediate_size"])
    wide = [inter * (2 if j >= 0 else 1) for j in sources] if data.get("use_double_wide_mlp") and sources else []
    ple = int(data.get("hidden_size_per_layer_input") or 0)
    return dict(shapes, kv_sources=sources, layer_intermediate_sizes=wide, per_layer_input_size=ple,
                per_layer_vocab_size=int(data.get("vocab_size_per_layer_input") or 262_144) if ple else 0)


def kv_sharing(data: dict[str, Any], types: list[str], layers: int, source: str) -> list[int]:
    """Gemma 4's `num_kv_shared_layers`: the last that many layers compute no keys / values and take those of the last
    earlier layer of their own type (transformers' kv_sharing_modes); per layer that layer's index, or -1 ([]: none)."""
    shared = int(data.get("num_kv_shared_layers") or 0)
    if not shared:
        return []
    kinds, first = types or ["full_attention"] * layers, layers - shared
    producers = {kinds[i]: i for i in range(max(first, 0))}  # the last earlier layer of each type
    if first <= 0 or any(kinds[i] not in producers for i in range(first, layers)):
        raise UnsupportedError(f"{source}: num_kv_shared_layers {shared} is not supported "
                               "(a shared layer's type has no earlier layer computing its keys)")
    return [-1] * first + [producers[kinds[i]] for i in range(first, layers)]
