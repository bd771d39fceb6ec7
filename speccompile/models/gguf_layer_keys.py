"""llama.cpp's per-layer metadata (sliding layers, their rope base, fixed NoPE layers, a family's scale / softcap keys)
as the config.json keys the architecture table reads."""

from __future__ import annotations

import numbers
from typing import Any

from ..errors import UnsupportedError
from .architectures import Family


def gguf_layer_keys(meta: dict[str, Any], p: str, fam: Family, arch: str, data: dict[str, Any],
                     source: str) -> dict[str, Any]:
    """The config.json keys of llama.cpp's per-layer metadata: sliding layers (`attention.sliding_window` with
    `attention.sliding_window_pattern`: a period, layer i slides iff i % period < period - 1, or one flag per layer;
    absent: the family's `gguf_swa_period`), the sliding layers' rope base (`rope.freq_base_swa`), llama.cpp's fixed
    NoPE layers and the family's scale / softcap keys (`Family.gguf_keys`)."""
    layers, out = data["num_hidden_layers"], {key: meta[p + k] for k, key in fam.gguf_keys.items() if p + k in meta}
    if fam.attn_scale == "query_pre_attn_scalar":
        out["query_pre_attn_scalar"] = data["head_dim"]  # llama.cpp scales by head_dim ** -0.5
    if fam.gguf_nope_period:
        out["no_rope_layers"] = [int((i + 1) % fam.gguf_nope_period != 0) for i in range(layers)]
    window = int(meta.get(p + "attention.sliding_window") or 0)
    pattern = meta.get(p + "attention.sliding_window_pattern", fam.gguf_swa_period)
    if not window:
        return out
    if pattern is None:
        raise UnsupportedError(f"{source}: a GGUF {arch} with {p}attention.sliding_window is not supported "
                               "(llama.cpp reads no layer pattern for it; export its safetensors)")
    if isinstance(pattern, list) and len(pattern) >= layers:
        slides = [bool(flag) for flag in pattern[:layers]]
    elif isinstance(pattern, numbers.Integral) and not isinstance(pattern, bool) and pattern >= 0:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise UnsupportedError(f"{source}: {p}attention.sliding_window_pattern {pattern!r} is not supported")
    out.update(sliding_window=window, use_sliding_window=True,
               layer_types=["sliding_attention" if s else "full_attention" for s in slides])
    local = float(meta.get(p + "rope.freq_base_swa") or fam.gguf_local_base or data["rope_theta"])
    if local != data["rope_theta"]:  # the scaling stays with the full-attention layers (Gemma 3)
        out["rope_parameters"] = {"full_attention": {"rope_theta": data["rope_theta"], **data.pop("rope_scaling", {})},
                                  "sliding_attention": {"rope_theta": local}}
    return out
