"""Config keys of the layer description that a family's entry names (models/architectures.py): the family's own key
names and defaults (MiniCPM's multipliers), the multipliers (embedding, attention, residual and logit scales) and the
KV heads (GPT-BigCode's `multi_query`)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import UnsupportedError
from .architectures import HF_ACTS, Family
from .llama4 import llama4_keys
from .rope_keys import rope_params


def family_keys(data: dict[str, Any], fam: Family) -> dict[str, Any]:
    """config.json's keys as the table reads them: the family's own names renamed (`config_keys`; the standard name
    wins where both are given), its defaults where config.json has none (`config_defaults`), MiniCPM's keys rewritten."""
    own = {std: data[own] for own, std in fam.config_keys.items() if data.get(own) is not None}
    data = {**fam.config_defaults, **own, **{k: v for k, v in data.items() if v is not None or k not in own}}
    if fam.altup and isinstance(data.get("intermediate_size"), list):  # Gemma 3n: a width per layer (models/altup_keys.py)
        data = {**data, "intermediate_size": max(data["intermediate_size"]), "layer_intermediate_sizes": data["intermediate_size"]}
    return minicpm_keys(data) if fam.minicpm else llama4_keys(data) if fam.attn_scale == "llama4_nope" else data


def minicpm_keys(data: dict[str, Any]) -> dict[str, Any]:
    """MiniCPM3's keys as Granite's multipliers, with transformers' MiniCPM3Config defaults where config.json has none:
    the embeddings times scale_emb (12), each residual branch times scale_depth / sqrt(num_hidden_layers) (1.4; null:
    1), the final hidden state divided by hidden_size / dim_model_base (256; null: hidden_size); v_head_dim
    hidden_size // num_attention_heads where unset, rope on halves (apply_rotary_pos_emb), a tied head by default."""
    hidden, depth, base = int(data["hidden_size"]), data.get("scale_depth", 1.4), data.get("dim_model_base", 256)
    return {"tie_word_embeddings": True, **data, "embedding_multiplier": float(data.get("scale_emb", 12)),
            "residual_multiplier": 1.0 if depth is None else float(depth) / math.sqrt(int(data["num_hidden_layers"])),
            "logits_scaling": 1.0 if base is None else hidden / float(base), "rope_interleave": False,
            "v_head_dim": data.get("v_head_dim") or hidden // int(data["num_attention_heads"])}


def multipliers(data: dict[str, Any], fam: Family, hidden: int, head_dim: int) -> dict[str, float]:
    """embed_scale, attn_scale, residual_scale and logit_scale of the family's config keys; Llama 4's query scaling
    (`query_scale_beta` / `query_scale_length`: rope_parameters' llama_4_scaling_beta, original_max_position_embeddings)."""
    out: dict[str, float] = {}
    rope = rope_params(data)[0] if fam.attn_scale == "llama4" else {}
    if rope.get("llama_4_scaling_beta"):  # the scores' scale stays head_dim ** -0.5
        out.update(query_scale_beta=float(rope["llama_4_scaling_beta"]), query_scale_length=int(rope["original_max_position_embeddings"]))
    if fam.embed_scale.startswith("sqrt_hidden"):  # "sqrt_hidden:key": only where the config's key is true (AFMoE's mup_enabled)
        key = fam.embed_scale.partition(":")[2]
        if not key or data.get(key):
            out["embed_scale"] = math.sqrt(hidden)
    elif fam.embed_scale:
        out["embed_scale"] = float(data.get(fam.embed_scale, 1.0))
    if fam.attn_scale == "query_pre_attn_scalar":
        out["attn_scale"] = float(data.get("query_pre_attn_scalar") or head_dim) ** -0.5
    elif fam.attn_scale == "unit":  # q/k norms alone scale the scores (Gemma 4)
        out["attn_scale"] = 1.0
    elif fam.attn_scale and not fam.attn_scale.startswith("llama4"):  # llama4_nope: models/llama4.py
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


def placement(data: dict[str, Any], fam: Family) -> str:
    """The family's placement, or its `parallel_key`'s choice: pre (false) or the family's placement (true; parallel where pre),
    or the one a family's key reader chose (`_placement`: models/falcon.py)."""
    if "_placement" in data:
        return str(data["_placement"])
    if not fam.parallel_key or data.get(fam.parallel_key) is None:
        return fam.placement
    return (fam.placement if fam.placement != "pre" else "parallel") if data[fam.parallel_key] else "pre"


def layer_types_of(data: dict[str, Any], fam: Family, layers: int) -> tuple[list[str], int]:
    """Per-layer attention kinds and the window (no sliding layers: [], 0)."""
    window = data.get("sliding_window")
    if not window or (fam.sliding_key and not data.get(fam.sliding_key)):
        return [], 0
    types = list(data.get("layer_types") or ["sliding_attention"] * layers)
    if "sliding_attention" not in types:
        return [], 0
    return types, int(window)


def nope_layers_of(data: dict[str, Any], fam: Family, types: list[str], layers: int) -> list[int]:
    if fam.learned_positions:  # positions come from the embedding table: no layer ropes
        return list(range(layers))
    flags = data.get("no_rope_layers")  # SmolLM3: 1 = rope, 0 = no rope
    if flags:
        return [i for i, f in enumerate(flags[:layers]) if not f]
    if fam.global_nope and types:
        return [i for i, t in enumerate(types) if t != "sliding_attention"]
    return []


def mlp_act_of(data: dict[str, Any], fam: Family, arch: str, source: str) -> str:
    """The family's activation, or the one its `act_key` names (transformers' names, `HF_ACTS`)."""
    if not fam.act_key or data.get(fam.act_key) is None:
        return fam.mlp_act
    act = HF_ACTS.get(str(data[fam.act_key]))
    if act is None:
        raise UnsupportedError(f"{source}: {arch} with {fam.act_key} {data[fam.act_key]!r} is not supported "
                               f"(supported: {', '.join(sorted(HF_ACTS))})")
    return act


def biases_of(data: dict[str, Any], fam: Family, arch: str, source: str) -> dict[str, bool]:
    """attention_bias (q/k/v), o_proj_bias and mlp_bias from the family's `bias_keys` (else its defaults); a
    use_bias / mlp_bias key the family does not read, or one of its `refused_keys`, is refused."""
    refused = [key for key in fam.refused_keys if data.get(key)]
    refused += [f"{key} {data[key]!r}" for key, want in fam.refused_unless.items()
                if data.get(key) is not None and data[key] != (data.get(want) if isinstance(want, str) else want)]
    if refused:
        raise UnsupportedError(f"{source}: {arch} with {refused[0]} is not supported")
    keys = fam.bias_keys
    for key in ("use_bias", "mlp_bias"):
        if data.get(key) and key not in keys.values():
            raise UnsupportedError(f"{source}: {arch} with {key} is not supported (biases this family does not have)")
    qkv = data.get(keys["qkv"], fam.attention_bias) if "qkv" in keys else data.get("attention_bias", data.get("use_bias", fam.attention_bias))
    return dict(attention_bias=bool(qkv), o_proj_bias=bool(data.get(keys["o"], fam.o_bias)) if "o" in keys else fam.o_bias,
                mlp_bias=bool(data.get(keys["mlp"], fam.mlp_bias)) if "mlp" in keys else fam.mlp_bias)
