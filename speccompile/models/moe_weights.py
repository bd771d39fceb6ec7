"""gpt-oss', Granite-MoE's and Gemma 4's fused expert tensors shown per expert, under the names every consumer reads
(models/moe_config.py); ERNIE 4.5 MoE's, K-EXAONE's and MiniMax-M2's score
bias under DeepSeek-V3's name (Sarvam-MoE's `gate.expert_bias` too), Hunyuan's router `gate.wg` as `gate` (`_VIEWS`).

transformers saves gpt-oss' experts as `mlp.experts.gate_up_proj` [experts, hidden, 2 * inter] (gate and up
columns interleaved: gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias` [experts, 2 * inter], `down_proj`
[experts, inter, hidden] and `down_proj_bias` [experts, hidden]; the published checkpoints store the two weights as
MXFP4 instead (`gate_up_proj_blocks` / `_scales` [experts, 2 * inter, hidden / 32, (16)], `down_proj_blocks` /
`_scales` [experts, hidden, inter / 32, (16)], models/mxfp4.py). `PerExpertSource` presents either as
`mlp.experts.{e}.gate_proj.weight` [inter, hidden] (a Linear's [out, in]), `up_proj`, `down_proj` and their
biases, read a slice at a time from the memory-mapped tensors (an MXFP4 weight dequantized one expert's rows at a
time, to float32); every other tensor passes through.

Qwen3-VL-MoE's text decoder keeps the same names with another layout (`ChunkedExpertSource`): transformers' module holds
`gate_up_proj` [experts, 2 * inter, hidden] (gate rows, then up rows) and `down_proj` [experts, hidden, inter], and saves
them so; the published checkpoints store them transposed ([experts, hidden, 2 * inter], [experts, inter, hidden]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedError
from . import mxfp4
from .weights import TensorInfo, WeightSource

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


@dataclass(frozen=True)
class _Part:
    """One expert's slice of a fused tensor: `half` 0 / 1 picks gate / up of gate_up_proj (None: all of it)."""

    fused: str  # the stored tensor (`..._blocks` for MXFP4)
    expert: int
    half: int | None
    bias: bool
    mxfp4: bool


class PerExpertSource(WeightSource):
    """`inner` with its fused expert tensors split per expert (views of them, nothing is read up front)."""

    def __init__(self, inner: WeightSource, where: str = ""):
        self._inner = inner
        self._virtual: dict[str, _Part] = {}
        self._names: list[str] = []
        for name in inner.names():
            match = _FUSED.match(name)
            if match is None:
                self._names.append(name)
                continue
            prefix, kind, suffix = match.group(1), match.group(2), match.group(3)
            if suffix == "_scales":
                continue  # read with its `_blocks`
            if suffix == "_blocks":
                self._check_mxfp4(prefix + kind, where)
            for e in range(inner.shape(name)[0]):
                for proj, (fused, half) in _PARTS.items():
                    if fused == kind:
                        virtual = f"{prefix}{e}.{proj}.{'bias' if suffix == '_bias' else 'weight'}"
                        self._virtual[virtual] = _Part(name, e, half, suffix == "_bias", suffix == "_blocks")
                        self._names.append(virtual)

    def _check_mxfp4(self, name: str, where: str) -> None:
        blocks = self._inner.info(f"{name}_blocks")
        scales = self._inner.info(f"{name}_scales") if f"{name}_scales" in self._inner else None
        mxfp4.check_pair(blocks.shape, blocks.dtype, None if scales is None else scales.shape,
                         None if scales is None else scales.dtype, name, where)

    def info(self, name: str) -> TensorInfo:
        if name not in self._virtual:
            return self._inner.info(name)
        part = self._virtual[name]
        if part.mxfp4:  # blocks [experts, rows, groups, 16]: a weight [rows (/ 2), groups * 32]
            _, rows, groups, width = self._inner.shape(part.fused)
            return TensorInfo((rows if part.half is None else rows // 2, groups * 2 * width), np.dtype(np.float32))
        shape = self._inner.shape(part.fused)[1:]
        if part.half is not None:
            shape = (*shape[:-1], shape[-1] // 2)
        return TensorInfo(shape if part.bias else tuple(reversed(shape)), self._inner.info(part.fused).dtype)

    def read(self, name: str) -> np.ndarray:
        if name not in self._virtual:
            return self._inner.read(name)
        part = self._virtual[name]
        if part.mxfp4:  # stored [out, in] already: the gate / up rows alone are dequantized
            rows = slice(None) if part.half is None else slice(part.half, None, 2)
            scales = part.fused[: -len("_blocks")] + "_scales"
            return mxfp4.dequantize_rows(self._inner.read(part.fused)[part.expert, rows],
                                         self._inner.read(scales)[part.expert, rows])
        tensor = self._inner.read(part.fused)[part.expert]
        if part.half is not None:
            tensor = tensor[..., part.half::2]
        return np.ascontiguousarray(tensor if part.bias else tensor.T)

    def names(self) -> list[str]:
        return list(self._names)


# Stored layer tensors (relative to `model.layers.{i}.`) -> the names they are shown as: `{e}` one per index of the
# leading axis, several names the stored rows split evenly among them, a bias shown 1-D. Granite-MoE's fused experts
# `block_sparse_moe.input_linear` [experts, 2 * inter, hidden] (gate rows, then up rows) and `output_linear`, its
# router `router.layer`, Granite-MoE-Shared's `shared_mlp`; ERNIE 4.5 MoE's score bias [1, experts]; Hunyuan's router `gate.wg`
_VIEWS = {
    "block_sparse_moe.input_linear.weight": ("block_sparse_moe.experts.{e}.gate_proj.weight", "block_sparse_moe.experts.{e}.up_proj.weight"),
    "block_sparse_moe.output_linear.weight": ("block_sparse_moe.experts.{e}.down_proj.weight",),
    "block_sparse_moe.router.layer.weight": ("block_sparse_moe.router.weight",),
    # Granite-MoE-SWA's checkpoints: transformers' own fused [experts, 2 x inter, hidden] / [experts, hidden, inter]
    "block_sparse_moe.experts.gate_up_proj": ("block_sparse_moe.experts.{e}.gate_proj.weight", "block_sparse_moe.experts.{e}.up_proj.weight"),
    "block_sparse_moe.experts.down_proj": ("block_sparse_moe.experts.{e}.down_proj.weight",),
    "shared_mlp.input_linear.weight": ("block_sparse_moe.shared_expert.gate_proj.weight", "block_sparse_moe.shared_expert.up_proj.weight"),
    "shared_mlp.output_linear.weight": ("block_sparse_moe.shared_expert.down_proj.weight",),
    "mlp.moe_statics.e_score_correction_bias": ("mlp.gate.e_score_correction_bias",),
    "mlp.e_score_correction_bias": ("mlp.gate.e_score_correction_bias",),  # K-EXAONE
    "block_sparse_moe.e_score_correction_bias": ("block_sparse_moe.gate.e_score_correction_bias",),  # MiniMax-M2
    "mlp.gate.wg.weight": ("mlp.gate.weight",),  # Hunyuan's router
    "mlp.gate.expert_bias": ("mlp.gate.e_score_correction_bias",),  # Sarvam-MoE / Param2-MoE (Ling's name)
    "mlp.expert_bias": ("mlp.gate.e_score_correction_bias",), "mlp.router.gate.weight": ("mlp.gate.weight",),  # Hy3
    "feed_forward.expert_bias": ("feed_forward.gate.e_score_correction_bias",),  # LFM2-MoE
    # Gemma 4's MoE block (its own `moe` in these names): fused experts as Granite-MoE-SWA's, the router and its scales
    "experts.gate_up_proj": ("moe.experts.{e}.gate_proj.weight", "moe.experts.{e}.up_proj.weight"),
    "experts.down_proj": ("moe.experts.{e}.down_proj.weight",), "router.proj.weight": ("moe.router.weight",),
    "router.scale": ("moe.router.scale",), "router.per_expert_scale": ("moe.router.per_expert_scale",),
}
_VIEWED = re.compile(r"^(model\.layers\.\d+\.)(" + "|".join(re.escape(k) for k in _VIEWS) + ")$")


class LayerViewSource(WeightSource):
    """`inner` with the `_VIEWS` tensors shown under the names every consumer reads (row slices of the stored
    [out, in] tensors, per expert where the name has `{e}`), nothing read up front."""

    def __init__(self, inner: WeightSource):
        self._inner = inner
        self._virtual: dict[str, tuple[str, int | None, int, int]] = {}  # name -> (stored, expert, part, parts)
        self._names: list[str] = []
        for name in inner.names():
            match = _VIEWED.match(name)
            if match is None:
                self._names.append(name)
                continue
            parts = _VIEWS[match.group(2)]
            for e in range(inner.shape(name)[0]) if "{e}" in parts[0] else [None]:
                for k, part in enumerate(parts):
                    virtual = match.group(1) + part.format(e=e)
                    self._virtual[virtual] = (name, e, k, len(parts))
                    self._names.append(virtual)

    def info(self, name: str) -> TensorInfo:
        if name not in self._virtual:
            return self._inner.info(name)
        stored, expert, _, parts = self._virtual[name]
        shape = self._inner.shape(stored)[0 if expert is None else 1:]
        shape = (shape[0] // parts, *shape[1:])
        return TensorInfo((int(np.prod(shape)),) if name.endswith("bias") else shape, self._inner.info(stored).dtype)

    def read(self, name: str) -> np.ndarray:
        if name not in self._virtual:
            return self._inner.read(name)
        stored, expert, k, parts = self._virtual[name]
        tensor = self._inner.read(stored)
        tensor = tensor if expert is None else tensor[expert]
        rows = tensor.shape[0] // parts
        return np.ascontiguousarray(tensor[k * rows:(k + 1) * rows]).reshape(self.info(name).shape)

    def names(self) -> list[str]:
        return list(self._names)


class ChunkedExpertSource(WeightSource):
    """`inner` with Qwen3-VL-MoE's fused experts (`mlp.experts.gate_up_proj`, `down_proj`) shown per expert as [out, in]
    Linears, read as transformers reads them: a tensor of its module's shape as is, else one of the published
    checkpoints' transposed shape transposed (a square one is thus read as is, as transformers does); another refused."""

    def __init__(self, inner: WeightSource, hidden: int, inter: int, where: str = "", fused: re.Pattern = _FUSED,
                 transposed: bool | None = None):
        """`fused`: the stored names (groups: prefix, tensor, suffix); `transposed`: stored transposed always (Llama 4's,
        whatever the shapes), never, or (None) where the shape says so."""
        self._inner, self._inter = inner, inter
        self._virtual: dict[str, tuple[str, int, int | None, bool]] = {}  # name -> (stored, expert, half, transposed)
        self._names: list[str] = []
        for name in inner.names():
            match = fused.match(name)
            if match is None or match.group(3):
                self._names.append(name)
                continue
            experts, gate_up = inner.shape(name)[0], match.group(2) == "gate_up_proj"
            module = (experts, 2 * inter, hidden) if gate_up else (experts, hidden, inter)
            shape = tuple(inner.shape(name))
            if shape not in (module, (experts, module[2], module[1])):
                raise UnsupportedError(f"{where}: {name} {list(shape)} is neither {list(module)} nor its transpose")
            for e in range(experts):
                for half, proj in enumerate(("gate_proj", "up_proj") if gate_up else ("down_proj",)):
                    virtual = f"{match.group(1)}{e}.{proj}.weight"
                    self._virtual[virtual] = (name, e, half if gate_up else None, shape != module if transposed is None else transposed)
                    self._names.append(virtual)

    def info(self, name: str) -> TensorInfo:
        if name not in self._virtual:
            return self._inner.info(name)
        stored, _, half, transposed = self._virtual[name]
        rows, cols = self._inner.shape(stored)[1:][::-1] if transposed else self._inner.shape(stored)[1:]
        return TensorInfo((rows if half is None else self._inter, cols), self._inner.info(stored).dtype)

    def read(self, name: str) -> np.ndarray:
        if name not in self._virtual:
            return self._inner.read(name)
        stored, expert, half, transposed = self._virtual[name]
        tensor = self._inner.read(stored)[expert]
        tensor = tensor.T if transposed else tensor
        return np.ascontiguousarray(tensor if half is None else tensor[half * self._inter:(half + 1) * self._inter])

    def names(self) -> list[str]:
        return list(self._names)


def per_expert(source: WeightSource, where: str = "") -> WeightSource:
    """`source`, with fused gpt-oss expert tensors (plain or MXFP4) split per expert, or the `_VIEWS` tensors
    (Granite-MoE, ERNIE 4.5 MoE, K-EXAONE, MiniMax-M2, Hunyuan, Gemma 4) renamed, when it has any; an InputError naming `where` for an MXFP4 `_blocks`
    tensor without its `_scales` or of the wrong shape / type."""
    if any(_VIEWED.match(n) for n in source.names()):
        return LayerViewSource(source)
    return PerExpertSource(source, where) if any(_FUSED.match(n) for n in source.names()) else source
