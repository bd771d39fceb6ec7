"""Rotary position embedding frequencies (torch-free): the one computation the torch reference decoder and
the ONNX graph builders share, so both hold the same float32 constants by construction."""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim / 2] as float32, with llama3 / linear rope_scaling applied (in float64)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
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
        inv_freq = np.where(is_medium, smoothed, inv_freq)
    return inv_freq.astype(np.float32)


def rounded_inv_freq(config: ModelConfig, np_dtype) -> np.ndarray:
    """The frequencies as a decoder in `np_dtype` holds them: `Decoder.to(dtype)` rounds its inv_freq buffer to the
    model dtype, and the positions multiply the rounded values in float32."""
    return rope_inv_freq(config).astype(np_dtype).astype(np.float32)
