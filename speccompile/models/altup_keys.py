"""Gemma 3n's config.json keys (Gemma3nTextConfig) as ModelConfig fields: AltUp's streams, LAuReL's rank, the
activation sparsity per layer, KV sharing, the MLP width per layer and the per-layer embeddings; what the graphs do
not build (another active stream, an uncorrected active stream) is refused."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from .attention_keys import kv_sharing


def altup_keys(data: dict[str, Any], types: list[str], layers: int, source: str) -> dict[str, Any]:
    """The ModelConfig fields of Gemma 3n's keys, transformers' defaults where config.json has none."""
    for key, want in (("altup_active_idx", 0), ("altup_correct_scale", True)):
        if data.get(key, want) != want:
            raise UnsupportedError(f"{source}: gemma3n with {key} {data[key]!r} is not supported (only {want!r})")
    sparsity = data.get("activation_sparsity_pattern")
    if sparsity is None:  # transformers: the first 10 layers at 0.95 when there are more than 10
        sparsity = [0.95] * 10 + [0.0] * (layers - 10) if layers > 10 else [0.0] * layers
    sparsity = [float(sparsity)] * layers if isinstance(sparsity, (int, float)) else [float(s) for s in sparsity]
    if len(sparsity) != layers or any(not 0.0 <= s < 1.0 for s in sparsity):
        raise UnsupportedError(f"{source}: gemma3n activation_sparsity_pattern {sparsity!r} is not supported "
                               f"(one value in [0, 1) per layer)")
    widths = [int(w) for w in data.get("layer_intermediate_sizes") or []]
    if widths and len(widths) != layers:
        raise UnsupportedError(f"{source}: gemma3n intermediate_size has {len(widths)} values for {layers} layers")
    ple = int(data.get("hidden_size_per_layer_input", 256) or 0)
    inputs = int(data.get("altup_num_inputs", 4))
    if inputs < 1:
        raise UnsupportedError(f"{source}: gemma3n altup_num_inputs {inputs} is not supported")
    return dict(altup_inputs=inputs, laurel_rank=int(data.get("laurel_rank", 64)),
                activation_sparsity=sparsity if any(sparsity) else [], kv_sources=kv_sharing(data, types, layers, source),
                layer_intermediate_sizes=widths if len(set(widths)) > 1 else [], per_layer_input_size=ple,
                per_layer_vocab_size=int(data.get("vocab_size_per_layer_input", 262_144)) if ple else 0,
                soft_token_offset=int(data.get("soft_token_offset") or 0))  # set by the gemma3n wrapper (models/multimodal.py)
