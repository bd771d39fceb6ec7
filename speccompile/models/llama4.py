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
  up) and [experts, inter, hidden]: shown per expert as [out, in] Linears (`Llama4Weights`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from .hf_layouts import _Ones
from .weights import TensorInfo, WeightSource

if TYPE_CHECKING:
    from .config import ModelConfig

_FUSED = re.compile(r"^(model\.layers\.\d+\.feed_forward\.experts\.)(gate_up_proj|down_proj)$")


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


def llama4_weights(source: WeightSource, config: "ModelConfig") -> WeightSource:
    """`source` with the fused experts per expert and the rope layers' q / k norm gains of ones."""
    source = Llama4Weights(source) if any(_FUSED.match(n) for n in source.names()) else source
    if not config.qk_norm:
        return source
    ones = {f"model.layers.{i}.self_attn.{t}_norm.weight": (config.head_dim,) for i in range(config.num_hidden_layers)
            if i not in config.nope_layers for t in "qk"}
    return _Ones(source, ones, source.info("model.embed_tokens.weight").dtype)


class Llama4Weights(WeightSource):
    """`inner` with the fused experts shown as `feed_forward.experts.{e}.{gate,up,down}_proj.weight` [out, in]."""

    def __init__(self, inner: WeightSource):
        self._inner = inner
        self._virtual: dict[str, tuple[str, int, int | None]] = {}  # name -> (stored, expert, half)
        self._names: list[str] = []
        for name in inner.names():
            match = _FUSED.match(name)
            if match is None:
                self._names.append(name)
                continue
            fused = match.group(2) == "gate_up_proj"
            for e in range(inner.shape(name)[0]):
                for half, proj in enumerate(("gate_proj", "up_proj") if fused else ("down_proj",)):
                    virtual = f"{match.group(1)}{e}.{proj}.weight"
                    self._virtual[virtual] = (name, e, half if fused else None)
                    self._names.append(virtual)

    def info(self, name: str) -> TensorInfo:
        if name not in self._virtual:
            return self._inner.info(name)
        stored, _, half = self._virtual[name]
        rows, cols = self._inner.shape(stored)[1:]  # [in, out]
        return TensorInfo((cols if half is None else cols // 2, rows), self._inner.info(stored).dtype)

    def read(self, name: str) -> np.ndarray:
        if name not in self._virtual:
            return self._inner.read(name)
        stored, expert, half = self._virtual[name]
        tensor = self._inner.read(stored)[expert]
        if half is not None:
            inter = tensor.shape[1] // 2
            tensor = tensor[:, half * inter:(half + 1) * inter]
        return np.ascontiguousarray(tensor.T)

    def names(self) -> list[str]:
        return list(self._names)
