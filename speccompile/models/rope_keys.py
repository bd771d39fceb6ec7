"""A config.json's rope keys: transformers 5's `rope_parameters` (maybe one per layer type) or the older
`rope_theta` / `rope_scaling` ones, read into the rope scaling `ModelConfig` keeps (models/rope.py computes it); and
gpt-oss' and Ministral 3's yarn rope from llama.cpp's GGUF metadata, as those keys."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError

# factors: a GGUF's `rope_freqs`; ntk_alpha: Hunyuan's "dynamic" with a fixed alpha (static frequencies)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope", "factors", "ntk_alpha", "proportional")


def check_rope_scaling(scaling: dict[str, Any] | None, source: str, alpha: bool = False) -> dict[str, Any] | None:
    """The rope scaling a ModelConfig keeps (None: default rope), or UnsupportedError naming `source`. `alpha`: the
    family reads type "dynamic" with an `alpha` as ntk_alpha (Hunyuan; without one it stays dynamic, refused)."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if alpha and rope_type == "dynamic" and scaling.get("alpha"):
        return {"rope_type": "ntk_alpha", "alpha": float(scaling["alpha"])}
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"{source}: rope_scaling type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return None
    dropped = ("type", "rope_theta") if rope_type == "proportional" else ("type", "rope_theta", "partial_rotary_factor")
    out = {k: v for k, v in dict(scaling, rope_type=rope_type).items() if k not in dropped}
    if "short_mscale" in out or "long_mscale" in out:  # Phi-MoE's cos/sin factors: one for every position, or refused
        short, long = out.pop("short_mscale", None), out.pop("long_mscale", None)
        if short != long:
            raise UnsupportedError(f"{source}: rope_scaling short_mscale {short} != long_mscale {long} is not supported "
                                   "(transformers picks one by the sequence's length)")
        out["attention_factor"] = float(short)
    return out


def rope_params(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope parameters: transformers 5's `rope_parameters` (maybe one per layer type) or the
    older `rope_theta` / `rope_scaling` keys."""
    params = data.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        return full, params.get("sliding_attention") or {}
    merged = dict(data.get("rope_scaling") or {}, **params)
    for key, old in (("rope_theta", "rope_theta"), ("rope_theta", "rotary_emb_base"), ("partial_rotary_factor", "rotary_pct")):
        if old in data:  # GPT-NeoX's older keys: rotary_emb_base, rotary_pct
            merged.setdefault(key, data[old])
    kind = merged.get("rope_type", merged.get("type"))
    if kind in ("llama3", "yarn", "longrope") and data.get("original_max_position_embeddings"):
        merged["original_max_position_embeddings"] = data["original_max_position_embeddings"]  # Phi-3: top-level wins
    return merged, {}


def gpt_oss_gguf_keys(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """gpt-oss' yarn rope from llama.cpp's metadata (its sliding layers: models/gguf_layer_keys.py, period 2). Unless the
    file names them, llama.cpp takes yarn's betas 32 / 1. The correction range is not rounded (`truncate` false,
    as gpt-oss' own config.json and reference code have it); one rope base for every layer."""
    local_base = meta.get(p + "rope.freq_base_swa")
    if local_base is not None and float(local_base) != float(meta.get(p + "rope.freq_base", 10000.0)):
        raise UnsupportedError(f"{source}: GGUF gpt-oss with {p}rope.freq_base_swa {local_base!r} is not supported (one rope base)")
    rope = {"rope_type": "yarn", "factor": float(meta.get(p + "rope.scaling.factor") or 1.0),
            "beta_fast": float(meta.get(p + "rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(meta.get(p + "rope.scaling.yarn_beta_slow") or 1.0), "truncate": False}
    if meta.get(p + "rope.scaling.original_context_length"):
        rope["original_max_position_embeddings"] = int(meta[p + "rope.scaling.original_context_length"])
    return {"rope_scaling": rope} if meta.get(p + "rope.scaling.type") == "yarn" else {}


def ministral3_gguf_keys(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """Ministral 3's yarn rope and query scaling from llama.cpp's `mistral3` metadata: yarn's betas (32 / 1 unless
    named), `rope.scaling.yarn_log_multiplier` as mscale_all_dim (mscale 1), `attention.temperature_scale` as
    llama_4_scaling_beta, whose length is the yarn original length (llama.cpp's n_ctx_orig_yarn)."""
    if meta.get(p + "rope.scaling.type") != "yarn":
        if meta.get(p + "attention.temperature_scale"):
            raise UnsupportedError(f"{source}: GGUF mistral3 with {p}attention.temperature_scale but no yarn rope is not supported")
        return {}
    rope = {"rope_type": "yarn", "factor": float(meta[p + "rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta[p + "rope.scaling.original_context_length"]),
            "beta_fast": float(meta.get(p + "rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(meta.get(p + "rope.scaling.yarn_beta_slow") or 1.0), "mscale": 1.0,
            "mscale_all_dim": float(meta.get(p + "rope.scaling.yarn_log_multiplier") or 0.0)}
    if meta.get(p + "attention.temperature_scale"):
        rope["llama_4_scaling_beta"] = float(meta[p + "attention.temperature_scale"])
    return {"rope_scaling": rope}


def layer_rope_bases(data: dict[str, Any], types: list[str], rope_theta: float, source: str) -> dict[str, Any]:
    """Granite SWA's `layer_rope_theta` (a rope base per layer, 0: no rope) as the table's rope per layer: the full
    layers' one base (the global table), the sliding layers' one base (the local table), the NoPE layers; {} without
    the key. Other patterns, or a second base with rope scaling (the local table has none), are refused."""
    thetas = data.get("layer_rope_theta")
    if not thetas:
        return {}
    sliding = [bool(types) and t == "sliding_attention" for t in types] or [False] * len(thetas)
    full = {float(t) for t, s in zip(thetas, sliding) if t and not s}
    local = {float(t) for t, s in zip(thetas, sliding) if t and s}
    base = full.pop() if len(full) == 1 else rope_theta
    local_base = local.pop() if len(local) == 1 else base
    if full or local or (local_base != base and check_rope_scaling(rope_params(data)[0], source)):
        raise UnsupportedError(f"{source}: layer_rope_theta {thetas} is not supported (one base for the full-attention "
                               "layers, one for the sliding ones, 0 for none; a second base without rope scaling)")
    return dict(rope_theta=base, rope_local_theta=0.0 if local_base == base else local_base,
                nope_layers=[i for i, t in enumerate(thetas) if not t])
