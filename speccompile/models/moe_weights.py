"""gpt-oss' fused expert tensors shown per expert, under the names every consumer reads (models/moe_config.py).

transformers saves gpt-oss' experts as `mlp.experts.gate_up_proj` [experts, hidden, 2 * inter] (gate and up
columns interleaved: gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias` [experts, 2 * inter], `down_proj`
[experts, inter, hidden] and `down_proj_bias` [experts, hidden]. `PerExpertSource` presents them as
`mlp.experts.{e}.gate_proj.weight` [inter, hidden] (a Linear's [out, in]), `up_proj`, `down_proj` and their
biases, read a slice at a time from the memory-mapped tensors; every other tensor passes through.
"""

from __future__ import annotations

import re

import numpy as np

from .weights import TensorInfo, WeightSource

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$")
_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


class PerExpertSource(WeightSource):
    """`inner` with its fused expert tensors split per expert (views of them, nothing is read up front)."""

    def __init__(self, inner: WeightSource):
        self._inner = inner
        self._virtual: dict[str, tuple[str, int, int | None, bool]] = {}  # name -> (fused, expert, half, bias)
        self._names: list[str] = []
        for name in inner.names():
            match = _FUSED.match(name)
            if match is None:
                self._names.append(name)
                continue
            prefix, kind, bias = match.group(1), match.group(2), bool(match.group(3))
            for e in range(inner.shape(name)[0]):
                for proj, (fused, half) in _PARTS.items():
                    if fused == kind:
                        virtual = f"{prefix}{e}.{proj}.{'bias' if bias else 'weight'}"
                        self._virtual[virtual] = (name, e, half, bias)
                        self._names.append(virtual)

    def info(self, name: str) -> TensorInfo:
        if name not in self._virtual:
            return self._inner.info(name)
        fused, _, half, bias = self._virtual[name]
        shape = self._inner.shape(fused)[1:]
        if half is not None:
            shape = (*shape[:-1], shape[-1] // 2)
        return TensorInfo(shape if bias else tuple(reversed(shape)), self._inner.info(fused).dtype)

    def read(self, name: str) -> np.ndarray:
        if name not in self._virtual:
            return self._inner.read(name)
        fused, e, half, bias = self._virtual[name]
        part = self._inner.read(fused)[e]
        if half is not None:
            part = part[..., half::2]
        return np.ascontiguousarray(part if bias else part.T)

    def names(self) -> list[str]:
        return list(self._names)


def per_expert(source: WeightSource, where: str = "") -> WeightSource:
    """`source`, with fused gpt-oss expert tensors split per expert when it has any. UnsupportedError for the
    MXFP4 experts (`*_blocks` / `*_scales`) of the published gpt-oss checkpoints."""
    from ..errors import UnsupportedError

    if any(n.endswith(".mlp.experts.gate_up_proj_blocks") for n in source.names()):
        raise UnsupportedError(f"{where}: MXFP4 expert weights (gate_up_proj_blocks) are not supported; save the model "
                               "dequantized to bf16 first (transformers: Mxfp4Config(dequantize=True), save_pretrained)")
    return PerExpertSource(source) if any(_FUSED.match(n) for n in source.names()) else source
