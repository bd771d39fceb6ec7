"""llama.cpp's `gemma4` GGUF metadata as the config.json keys the architecture table reads (models/attention_keys.py).

llama.cpp's converter (its Gemma4Model) writes the full-attention layers' head width as `attention.key_length` and
the sliding layers' as `attention.key_length_swa`; the kv heads per layer as an `attention.head_count_kv` array (a
single value where every layer has the same); the sliding layers as an `attention.sliding_window_pattern` flag array;
KV sharing as `attention.shared_kv_layers` (the last that many layers); the MLP widths as a `feed_forward_length`
array where the shared layers' MLP is double-wide; the per-layer embeddings' width as
`embedding_length_per_layer_input` (their table: `per_layer_token_embd`); the full layers' proportional rope as a
`rope_freqs` tensor over the whole head, factor 1 for the turning frequencies and 1e30 for the rest (read back as
transformers' proportional rope, whose rest are 0); the sliding layers' rope base as `rope.freq_base_swa`. A full
layer whose file has `attn_k` but no `attn_v` takes its keys as values (attention_k_eq_v). Its norm gains are stored
as transformers keeps them (no 1 + weight). What llama.cpp would compute otherwise is refused naming the key.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from .weight_names import LLAMA_GGUF

# llama.cpp's names of a Gemma 2 / 3 layer's tensors, and of a Gemma 4 layer's (models/architectures.py)
GEMMA_GGUF = {**LLAMA_GGUF, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}
GEMMA4_GGUF = {**GEMMA_GGUF, "layer_output_scale": "layer_scalar", "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
               "post_norm": "post_per_layer_input_norm", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
               "post_ffw_norm_1": "post_feedforward_layernorm_1", "post_ffw_norm_2": "post_feedforward_layernorm_2",
               # the MoE block as transformers stores it (fused experts, router scales: models/moe_weights.py shows them
               # per expert); a key with its suffix names one tensor, a bare name a tensor without `.weight`
               "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
               "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
               "ffn_down_exps.weight": "experts.down_proj"}

_FREQ_OFF = 1e29  # a rope_freqs factor at least this large switches its frequency off (the converter writes 1e30)


def gemma4_keys(meta: dict[str, Any], p: str, tensors: dict[str, tuple[int, ...]], factors: list[float] | None,
                source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the metadata with the sliding layers' scalars where `_gguf_config_json` reads one, the config.json keys of
    Gemma 4's per-layer shapes, KV sharing, per-layer embeddings and rope) of a `gemma4` file; `tensors`: its tensor
    names with their shapes."""
    layers = int(meta[p + "block_count"])
    slides = [bool(s) for s in meta.get(p + "attention.sliding_window_pattern") or [False] * layers][:layers]
    full_dim, swa_dim = int(meta[p + "attention.key_length"]), int(meta.get(p + "attention.key_length_swa") or meta[p + "attention.key_length"])
    for key, want in (("attention.value_length", full_dim), ("attention.value_length_swa", swa_dim), ("rope.dimension_count", full_dim),
                      ("rope.dimension_count_swa", swa_dim)):
        if meta.get(p + key) is not None and int(meta[p + key]) != want:
            raise UnsupportedError(f"{source}: GGUF gemma4 with {p}{key} {meta[p + key]} is not supported ({want}: the head width)")
    kv = _per_layer(meta.get(p + "attention.head_count_kv") or meta[p + "attention.head_count"], layers, p + "attention.head_count_kv", source)
    ffn = _per_layer(meta[p + "feed_forward_length"], layers, p + "feed_forward_length", source)
    shared = int(meta.get(p + "attention.shared_kv_layers") or 0)
    base = next((i for i, s in enumerate(slides) if s), 0)
    scalars = {p + "attention.key_length": swa_dim, p + "attention.head_count_kv": kv[base], p + "feed_forward_length": ffn[0],
               p + "rope.dimension_count": swa_dim}
    keys: dict[str, Any] = dict(
        global_head_dim=full_dim, num_kv_shared_layers=shared, use_double_wide_mlp=ffn != [ffn[0]] * layers,
        per_layer_config={str(i): {"head_dim": full_dim, "num_key_value_heads": kv[i]} for i in range(layers) if not slides[i]},
        attention_k_eq_v=_k_eq_v(tensors, slides, layers - shared, source),
        hidden_size_per_layer_input=int(meta.get(p + "embedding_length_per_layer_input") or 0),
        rope_parameters={"full_attention": {"rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)), **_full_rope(factors, full_dim, source)},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": float(meta.get(p + "rope.freq_base_swa") or meta.get(p + "rope.freq_base", 10000.0))}})
    if meta.get(p + "expert_count"):  # the MoE block (26B-A4B)
        keys.update(enable_moe_block=True, num_experts=int(meta[p + "expert_count"]), top_k_experts=int(meta[p + "expert_used_count"]),
                    moe_intermediate_size=int(meta[p + "expert_feed_forward_length"]))
    if keys["hidden_size_per_layer_input"]:
        keys["vocab_size_per_layer_input"] = tensors["per_layer_token_embd.weight"][0]
    if keys["use_double_wide_mlp"] and ffn != [ffn[0] * (2 if i >= layers - shared else 1) for i in range(layers)]:
        raise UnsupportedError(f"{source}: GGUF gemma4 with {p}feed_forward_length {ffn} is not supported "
                               "(one width, doubled on the shared layers only)")
    return {**meta, **scalars}, keys


def _per_layer(value: Any, layers: int, key: str, source: str) -> list[int]:
    """A per-layer metadata value (an array, or one value for every layer) as a list of ints."""
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * layers
    if len(values) < layers:
        raise UnsupportedError(f"{source}: GGUF {key} {value!r} is not supported (one value per layer)")
    return values[:layers]


def _k_eq_v(tensors: dict[str, tuple[int, ...]], slides: list[bool], computed: int, source: str) -> bool:
    """Whether the full-attention layers that compute keys (the first `computed`) take them as values: each has
    `attn_k` and no `attn_v`; a file where some do and some don't is refused."""
    full = [i for i in range(computed) if not slides[i]]
    without = [i for i in full if f"blk.{i}.attn_v.weight" not in tensors]
    if without and without != full:
        raise UnsupportedError(f"{source}: GGUF gemma4 with blk.{without[0]}.attn_v missing on some full-attention layers only "
                               "is not supported")
    return bool(without)


def _full_rope(factors: list[float] | None, head_dim: int, source: str) -> dict[str, Any]:
    """The full-attention layers' rope of a `rope_freqs` tensor: the converter's proportional rope (factor 1 on the
    first frequencies, 1e30 on the rest) as transformers' `proportional` with its partial_rotary_factor; none: the
    whole head turns."""
    if factors is None:
        return {"rope_type": "default"}
    turning = next((i for i, f in enumerate(factors) if f != 1.0), len(factors))
    if len(factors) != head_dim // 2 or any(f < _FREQ_OFF for f in factors[turning:]):
        raise UnsupportedError(f"{source}: GGUF gemma4 with a rope_freqs tensor other than 1 then 1e30 per frequency "
                               f"({len(factors)} of them) is not supported")
    return {"rope_type": "proportional", "partial_rotary_factor": 2 * turning / head_dim}
