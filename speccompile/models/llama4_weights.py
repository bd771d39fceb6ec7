"""Llama 4's checkpoint under the names every consumer reads (models/llama4.py): the fused experts per expert, the rope
layers' gainless q / k norms as gains of ones."""

from __future__ import annotations

import re

import numpy as np

from .config import ModelConfig
from .hf_layouts import _Ones
from .weights import TensorInfo, WeightSource

_FUSED = re.compile(r"^(model\.layers\.\d+\.feed_forward\.experts\.)(gate_up_proj|down_proj)$")


def llama4_weights(source: WeightSource, config: ModelConfig) -> WeightSource:
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
