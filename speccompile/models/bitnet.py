"""BitNet b1.58 (transformers' `bitnet`): its config keys, its packed ternary weights and its 8-bit activations.

The release (microsoft/bitnet-b1.58-2B-4T: quantization_config quant_method "bitnet", linear_class "bitlinear",
offline) stores each projection of a layer as transformers' `BitLinear` (integrations/bitnet.py): `weight`, ternary
values {-1, 0, 1} plus 1 packed four per uint8 ([out / 4, in]: row r * (out / 4) + p of the weight is bits 2r, 2r + 1
of packed row p), and `weight_scale` [1]. Its forward quantizes the input per token (`act_quant`: scale = 127 /
max|x| (at least 1e-5), q = round(x * scale) clamped to [-128, 127]) and returns (q @ ternary.T) / (weight_scale *
scale). The view below shows each such weight as ternary / weight_scale (float32) under the plain name, so the
graphs multiply the round-tripped input q / scale by it: the same product, rounded in another order (row-local:
a row's result does not depend on the other rows of the pass). Without a quantization_config (a model saved
unquantized, transformers' `from_config`) the projections are plain Linear layers: sub-norms only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .weights import TensorInfo, WeightSource

PER_BYTE = 4  # ternary values per packed uint8
SCALE = "_scale"  # `X.weight_scale` beside a packed `X.weight`


def bitnet_fields(data: dict[str, Any], sub_norms: bool, source: str) -> dict[str, bool]:
    """ModelConfig's `sub_norms` and `act_quant` (a quantization_config of method "bitnet": BitLinear, offline,
    without its own RMSNorm; another linear class or mode is refused in one line)."""
    quant = data.get("quantization_config") if sub_norms else None
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "bitnet":
        return dict(sub_norms=sub_norms, act_quant=False)
    wanted = {"linear_class": "bitlinear", "quantization_mode": "offline", "use_rms_norm": False}
    for key, value in wanted.items():
        if quant.get(key, value) != value:
            raise UnsupportedError(f"{source}: bitnet with quantization_config.{key} {quant[key]!r} is not supported "
                                   f"(only {value!r}: the released checkpoints' BitLinear)")
    return dict(sub_norms=True, act_quant=True)


def unpack_ternary(packed: np.ndarray) -> np.ndarray:
    """uint8 [rows, ...] -> int8 [PER_BYTE * rows, ...] ternary values, transformers' `unpack_weights` order."""
    packed = np.asarray(packed, dtype=np.uint8)
    parts = [((packed >> (2 * i)) & 3).astype(np.int8) - 1 for i in range(PER_BYTE)]
    return np.concatenate(parts, axis=0)


class _Unpacked(WeightSource):
    """`inner` with each packed BitLinear weight shown as float32 ternary / weight_scale, its scales not shown."""

    def __init__(self, inner: WeightSource, packed: set[str]):
        self._inner, self._packed = inner, packed

    def info(self, name: str) -> TensorInfo:
        if name not in self._packed:
            return self._inner.info(name)
        rows, *rest = self._inner.shape(name)
        return TensorInfo((PER_BYTE * rows, *rest), np.dtype(np.float32))

    def read(self, name: str) -> np.ndarray:
        if name not in self._packed:
            return self._inner.read(name)
        scale = self._inner.read_float32(name + SCALE).reshape(())
        return unpack_ternary(self._inner.read(name)).astype(np.float32) / scale

    def names(self) -> list[str]:
        scales = {name + SCALE for name in self._packed}
        return [name for name in self._inner.names() if name not in scales]


def unpacked_view(source: WeightSource) -> WeightSource:
    """`source` with its packed BitLinear weights (uint8 `X.weight` beside `X.weight_scale`) shown unpacked."""
    names = set(source.names())
    packed = {n for n in names if n + SCALE in names and np.dtype(source.info(n).dtype) == np.uint8}
    return _Unpacked(source, packed) if packed else source


def act_quant(x):
    """transformers' per-token 8-bit round trip of a BitLinear input (`BitLinear.activation_quant`) in float32:
    round(x * scale) clamped to [-128, 127], divided by scale = 127 / max(max|x|, 1e-5) again (torch)."""
    import torch

    x32 = x.to(torch.float32)
    scale = 127.0 / x32.abs().amax(-1, keepdim=True).clamp(min=1e-5)
    return ((x32 * scale).round().clamp(-128, 127) / scale).to(x.dtype)
