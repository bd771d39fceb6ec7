"""Llama 4's text decoder (`llama4_text`; Scout / Maverick's `llama4` wrapper's text_config): its config keys read as the
table's layer description and its checkpoint shown under the names every consumer reads.

* chunked attention: config.json's "chunked_attention" layers (the rope layers, `attention_chunk_size` C) are sliding
  layers whose window is their chunk (`ModelConfig.window_chunks`): a query at position p sees the keys of positions
  p - p % C .. p only (models/chunks.py, export/chunk_ops.py);
* NoPE layers (`no_rope_layers`: 0 = no rope) take the query temperature (`attn_temperature_tuning`): q times
  1 + attn_scale log(1 + floor((position + 1) / floor_scale)), Ministral 3's query scale with an offset of 1
  (`query_scale_offset`) on those layers only (`nope_temperature`);
* the rope layers' q / k (`use_qk_norm`) are RMS-normed per head after rope without a gain: per-head q / k norms after
  rope (`qk_norm_after_rope`) with gains of ones shown here, on the rope layers only (`nope_temperature` again);
* rope on interleaved pairs (transformers' complex multiplication): `rope_interleaved`;
* MoE layers (`moe_layers`, else every `interleave_moe_layer_step`-th): top k router logits, their sigmoids scaling the
  expert *input* (`MoeConfig.scale_input`), an ungated shared expert of intermediate_size; dense layers
  intermediate_size_mlp wide. transformers stores the experts fused, [experts, hidden, 2 * inter] (gate columns, then
  up) and [experts, inter, hidden]: shown per expert as [out, in] Linears (models/llama4_weights.py).
"""

from __future__ import annotations

from typing import Any


def llama4_keys(data: dict[str, Any]) -> dict[str, Any]:
    """config.json's keys as the table reads them: chunked layers as sliding ones of window attention_chunk_size, the
    dense width intermediate_size_mlp, the experts' intermediate_size."""
    chunk = data.get("attention_chunk_size")
    types = data.get("layer_types") or []
    out = {**data, "intermediate_size": data.get("intermediate_size_mlp", data["intermediate_size"]),
           "moe_intermediate_size": data["intermediate_size"]}
    if chunk and "chunked_attention" in types:
        out.update(sliding_window=int(chunk), layer_types=["sliding_attention" if t == "chunked_attention" else t for t in types])
    else:
        out.update(sliding_window=None)
    return out


def llama4_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of Llama 4's attention: chunks, the NoPE layers' temperature, the rope layers' q/k norms."""
    tuned = bool(data.get("attn_temperature_tuning", True))
    return dict(window_chunks=True, nope_temperature=True, qk_norm=bool(data.get("use_qk_norm", True)), qk_norm_after_rope=True,
                query_scale_beta=float(data.get("attn_scale", 0.1)) if tuned else 0.0,
                query_scale_length=int(data.get("floor_scale", 8192)), query_scale_offset=1)
