"""Rotary position embedding frequencies (torch-free): the one computation the torch reference decoder and
the ONNX graph builders share, so both hold the same float32 constants by construction.

Rope kinds follow transformers' `rope_type`: default, linear, llama3, yarn, longrope and proportional (Gemma 4: a
zero frequency, an identity rotation, past the rotated fraction of the head), plus "factors": each frequency
divided by its factor, as llama.cpp applies a GGUF's `rope_freqs` tensor (its converter's llama3 scaling, precomputed),
and "ntk_alpha": Hunyuan's fixed-alpha NTK, the base times alpha ** (dim / (dim - 2)), static frequencies. Longrope holds two sets
of frequencies and picks one per row: a row at position p uses the long factors iff p >= original_max_position_embeddings
(`long_rope_start`), the short ones below; the attention factor is the same for both. transformers picks one set per
forward, long iff max(position_ids) + 1 > original_max_position_embeddings: the same rows for one-token decoding after a
prompt that fits the original length, but a longer prompt prefilled in one forward gets the long factors on every
row there (here its rows below the boundary keep the short ones). The per-row rule is the one a KV cache and exact
speculative verification allow: a position's rotation never depends on the other rows of its pass."""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig, kind: str = "global", long: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies [rope_dim / 2] as float32 of the layers using rotary table `kind` ("global" or
    "local": sliding layers with their own base, unscaled), with rope_scaling applied (in float64). `long`:
    longrope's long factors (the rows at and past `long_rope_start`)."""
    dim = config.rotary_dim or config.kind_head_dim(kind)
    base = config.rope_local_theta if kind == "local" else config.rope_theta
    scaling = (config.rope_scaling or {}) if kind == "global" else {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "ntk_alpha":  # transformers' dim here is head_dim (Hunyuan rotates whole heads)
        base = base * float(scaling["alpha"]) ** (config.head_dim / (config.head_dim - 2))
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq = _yarn(config, base, dim, scaling)
    elif rope_type == "proportional":  # Gemma 4: the first partial * dim / 2 frequencies over the whole head, the rest 0
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv_freq = np.concatenate([inv_freq[:angles], np.zeros(dim // 2 - angles)]) / float(scaling.get("factor", 1.0))
    elif rope_type == "factors":
        inv_freq = inv_freq / np.asarray(scaling["factors"], np.float64)
    elif rope_type == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        inv_freq = 1.0 / (np.asarray(factors, np.float32) * (base ** (np.arange(0, dim, 2) / dim)).astype(np.float32))
    return inv_freq.astype(np.float32)


def _llama3(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    inv_freq = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(is_medium, smoothed, inv_freq)


def _yarn(config: ModelConfig, base: float, dim: int, scaling: dict) -> np.ndarray:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (float32 as transformers)."""
    original = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (base ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def long_rope_start(config: ModelConfig, kind: str = "global", positions: int | None = None) -> int | None:
    """The first position whose rows use longrope's long factors (original_max_position_embeddings: transformers'
    seq_len = max(position_ids) + 1 > original), or None when no row does: every other rope type, local tables, and
    a graph whose `positions` (rows 0 .. positions - 1; None: unbounded) all lie below that position."""
    scaling = (config.rope_scaling or {}) if kind == "global" else {}
    if scaling.get("rope_type") != "longrope":
        return None
    start = int(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    return start if positions is None or positions > start else None


def rope_attention_factor(config: ModelConfig, kind: str = "global") -> float:
    """The factor transformers multiplies cos and sin by (yarn / longrope; 1 otherwise)."""
    scaling = (config.rope_scaling or {}) if kind == "global" else {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    if factor <= 1:
        return 1.0
    if rope_type == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _mscale(factor, mscale) / _mscale(factor, mscale_all)
    return _mscale(factor)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rounded_inv_freq(config: ModelConfig, np_dtype, kind: str = "global", long: bool = False) -> np.ndarray:
    """The frequencies as a decoder in `np_dtype` holds them: `Decoder.to(dtype)` rounds its inv_freq buffers to the
    model dtype, and the positions multiply the rounded values in float32."""
    return rope_inv_freq(config, kind, long).astype(np_dtype).astype(np.float32)
