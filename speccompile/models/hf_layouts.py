"""A family's Hugging Face tensors shown under the names and row order every consumer reads.

The table's names are Llama's (`model.` prefix, q|k|v rows in a fused qkv); a family whose checkpoint differs
says how in its entry (models/architectures.py): `Family.prefix` (GPT-NeoX's `gpt_neox.` where Llama has
`model.`), `Family.layers_key` (EXAONE 3's `h` where Llama has `layers`), `Family.top_names` (names outside
the layers), `Family.qkv_per_head` (a fused qkv stored per head, [heads, 3, head_dim] rows: GPT-NeoX's `query_key_value`,
shown q|k|v) and `Family.weightless_norms` (OLMo 1's LayerNorms, nanochat's RMSNorms without a gain: gains of ones shown). Nothing is read up front.
"""

from __future__ import annotations

import numpy as np

from .architectures import Family
from .bitnet import unpacked_view
from .falcon import falcon_view
from .kda_config import kimi_view
from .bailing_config import bailing_view
from .linear_config import OLMO_HYBRID_JOINED, OLMO_HYBRID_RENAMES, HybridConfig
from .nemotron_h import blocks_view
from .weights import TensorInfo, WeightSource


class _PerTensor(WeightSource):
    """`inner` with the tensors in `chosen` shown otherwise: their shape by `_shape`, their data by `_array`."""

    def __init__(self, inner: WeightSource, chosen: set[str]):
        self._inner, self._chosen = inner, chosen

    def info(self, name: str) -> TensorInfo:
        info = self._inner.info(name)
        return TensorInfo(self._shape(info.shape), info.dtype) if name in self._chosen else info

    def read(self, name: str) -> np.ndarray:
        tensor = self._inner.read(name)
        return self._array(tensor) if name in self._chosen else tensor

    def names(self) -> list[str]:
        return self._inner.names()

    def _shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def _array(self, tensor: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class _QkvPerGroup(_PerTensor):
    """The fused qkv tensors chosen (weights [rows, in], biases) reordered from per-KV-group rows [groups, the group's
    queries | its key | its value, head_dim] (GPT-NeoX: a group per head; Falcon) to q | k | v rows."""

    def __init__(self, inner: WeightSource, fused: set[str], heads: int, groups: int):
        super().__init__(inner, fused)
        self._heads, self._groups = heads, groups

    def _array(self, tensor: np.ndarray) -> np.ndarray:
        per = self._heads // self._groups
        rows = tensor.reshape(self._groups, per + 2, -1, *tensor.shape[1:])
        parts = (rows[:, :per], rows[:, per], rows[:, per + 1])
        return np.ascontiguousarray(np.concatenate([p.reshape(-1, *tensor.shape[1:]) for p in parts]))


class _LinearPerGroup(_PerTensor):
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba, stored per key-head group ([groups, q | k | v | z] rows, [groups,
    b | a]), shown q | k | v | z (b | a) rows as Qwen3.5 stores them apart (models/linear_config.py)."""

    def __init__(self, inner: WeightSource, chosen: set[str], hybrid: HybridConfig):
        super().__init__(inner, chosen)
        self._h = hybrid

    def _array(self, tensor: np.ndarray) -> np.ndarray:
        h = self._h
        per = h.num_v_heads // h.num_k_heads
        parts = [h.k_dim, h.k_dim, per * h.v_dim, per * h.v_dim] if tensor.shape[0] != 2 * h.num_v_heads else [per, per]
        rows = tensor.reshape(h.num_k_heads, sum(parts), -1)
        cuts = np.cumsum(parts)[:-1]
        return np.ascontiguousarray(np.concatenate([p.reshape(-1, rows.shape[-1]) for p in np.split(rows, cuts, axis=1)]))


class _Transposed(_PerTensor):
    """The 2-D tensors chosen (GPT-2's Conv1D weights, stored [in, out]) shown [out, in]."""

    def _shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(reversed(shape))

    def _array(self, tensor: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(tensor.T)


class _Scalars(_PerTensor):
    """The 0-d tensors chosen (xIELU's beta / eps buffers) shown as [1]."""

    def _shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1,)

    def _array(self, tensor: np.ndarray) -> np.ndarray:
        return tensor.reshape(1)


class _Ones(WeightSource):
    """`inner` with the tensors `ones` (name -> shape) added, all ones (OLMo 1's LayerNorms have no gain)."""

    def __init__(self, inner: WeightSource, ones: dict[str, tuple[int, ...]], dtype: np.dtype):
        self._inner, self._ones, self._dtype = inner, ones, dtype

    def info(self, name: str) -> TensorInfo:
        return TensorInfo(self._ones[name], self._dtype) if name in self._ones else self._inner.info(name)

    def read(self, name: str) -> np.ndarray:
        return np.ones(self._ones[name], self._dtype) if name in self._ones else self._inner.read(name)

    def names(self) -> list[str]:
        return [*self._inner.names(), *self._ones]


class _GateApart(WeightSource):
    """AFMoE's attention output gate, a projection of its own ([heads * head_dim, in]; LFM3's: [heads, in], one gate a
    head), shown inside q_proj as Qwen3-Next keeps it: [heads, q | gate] rows (`ModelConfig.attn_output_gate`,
    `attn_head_gate`); the gate tensors themselves hidden."""

    def __init__(self, inner: WeightSource, query: str, gate: str, heads: int):
        self._inner, self._heads = inner, heads
        self._gates = {n[:-len(gate)] + query: n for n in inner.names() if n.startswith("model.layers.") and n.endswith("." + gate)}

    def info(self, name: str) -> TensorInfo:
        info = self._inner.info(name)
        if name not in self._gates:
            return info
        return TensorInfo((info.shape[0] + self._inner.info(self._gates[name]).shape[0], *info.shape[1:]), info.dtype)

    def read(self, name: str) -> np.ndarray:
        query = self._inner.read(name)
        if name not in self._gates:
            return query
        gate = self._inner.read(self._gates[name])
        both = np.concatenate([query.reshape(self._heads, -1, *query.shape[1:]), gate.reshape(self._heads, -1, *gate.shape[1:])], axis=1)
        return both.reshape(query.shape[0] + gate.shape[0], *query.shape[1:])

    def names(self) -> list[str]:
        hidden = set(self._gates.values())
        return [n for n in self._inner.names() if n not in hidden]


class _RowsJoined(WeightSource):
    """`inner` with the tensors of each `joined` name's parts shown as one, their rows concatenated; the parts hidden."""

    def __init__(self, inner: WeightSource, joined: dict[str, tuple[str, ...]]):
        self._inner, self._joined = inner, joined
        parts = {part for group in joined.values() for part in group}
        self._names = [n for n in inner.names() if n not in parts] + list(joined)

    def info(self, name: str) -> TensorInfo:
        if name not in self._joined:
            return self._inner.info(name)
        shapes = [self._inner.shape(part) for part in self._joined[name]]
        return TensorInfo((sum(s[0] for s in shapes), *shapes[0][1:]), self._inner.info(self._joined[name][0]).dtype)

    def read(self, name: str) -> np.ndarray:
        if name not in self._joined:
            return self._inner.read(name)
        return np.concatenate([self._inner.read(part) for part in self._joined[name]])

    def names(self) -> list[str]:
        return list(self._names)


def _olmo_hybrid_linear(source: WeightSource) -> WeightSource:
    """OLMo Hybrid's tensors (a source with a linear_attn.q_proj: no other family has one) under the table's names
    (models/linear_config.py OLMO_HYBRID_RENAMES, OLMO_HYBRID_JOINED: parts present joined); any other source as it is."""
    first = ".linear_attn.q_proj.weight"
    if not any(n.startswith("model.layers.") and n.endswith(first) for n in source.names()):
        return source
    layers = sorted({".".join(n.split(".")[:3]) + "." for n in source.names() if n.startswith("model.layers.")})
    present = set(source.names())
    source = _RowsJoined(source, {p + name: tuple(p + part for part in parts) for p in layers for name, parts in OLMO_HYBRID_JOINED.items()
                                  if all(p + part in present for part in parts)})
    return source.renamed({p + old: p + new for p in layers for old, new in OLMO_HYBRID_RENAMES.items() if p + old in present})


def _weightless_norms(source: WeightSource, fam: Family, heads: int) -> WeightSource:
    """`source` with a gain of ones for each norm of every layer (those of the layers its tensors name) and the final
    norm, of the embedding's width (OLMo 1, nanochat), and for per-head q / k norms of the head's (nanochat)."""
    hidden = source.shape("model.embed_tokens.weight")[1]
    layers = sorted({int(n.split(".")[2]) for n in source.names() if n.startswith("model.layers.")})
    roles = fam.layer_names()
    norms = [roles[role][0] for role in ("input_norm", "post_norm")]
    ones = {f"model.layers.{i}.{norm}": (hidden,) for i in layers for norm in norms}
    if fam.qk_norm in ("head", "after_rope") and layers:  # head_dim: q_proj's rows per head
        dim = source.shape(f"model.layers.{layers[0]}.{roles['qkv'][0]}")[0] // heads
        ones.update({f"model.layers.{i}.{roles[role][0]}": (dim,) for i in layers for role in ("q_norm", "k_norm")})
    ones["model.norm.weight"] = (hidden,)
    return _Ones(source, {n: s for n, s in ones.items() if n not in source}, source.info("model.embed_tokens.weight").dtype)


class _Scaled(_PerTensor):
    """Layer tensors times factors per run of rows (`HybridConfig.scales`: Falcon-H1's muP multipliers, folded as
    llama.cpp's converter folds them), in float32."""

    def __init__(self, inner: WeightSource, scales: dict[str, list[list[float]]]):
        chosen = {n for n in inner.names() if n.startswith("model.layers.") and n.split(".", 3)[3] in scales}
        super().__init__(inner, chosen)
        self._scales = scales

    def info(self, name: str) -> TensorInfo:
        info = self._inner.info(name)
        return TensorInfo(info.shape, np.dtype(np.float32)) if name in self._chosen else info

    def read(self, name: str) -> np.ndarray:
        if name not in self._chosen:
            return self._inner.read(name)
        runs = self._scales[name.split(".", 3)[3]]
        factors = np.repeat(np.array([f for _, f in runs], dtype=np.float32), [int(r) for r, _ in runs])
        return self._inner.read_float32(name) * factors.reshape(-1, *[1] * (len(self.shape(name)) - 1))


def hf_view(source: WeightSource, fam: Family, heads: int, hybrid: HybridConfig | None = None, kv_heads: int = 0) -> WeightSource:
    """`source` under the table's names: the family's `prefix` renamed to `model.` and its `layers_key` to `layers`,
    then its `top_names`, a fused qkv per KV group (`qkv_per_head`, `heads` query heads in `kv_heads` groups, 0: a
    group per head) shown q | k | v, Falcon's two norms as the table's, and Qwen3-Next's
    per-group linear-attention projections (`hybrid`) shown as Qwen3.5's rows, Nemotron-H's blocks as layers, and an output gate of its own
    (`output_gate`: AFMoE) inside q_proj."""
    if fam.prefix and fam.layers_key and not any(n.startswith(fam.prefix) for n in source.names()):  # a base model's save
        source = source.renamed({n: fam.prefix + n for n in source.names() if not n.startswith("lm_head.")})  # (GPT-2's `h.0.*`)
    if fam.prefix:
        source = source.renamed({n: "model." + n[len(fam.prefix):] for n in source.names() if n.startswith(fam.prefix)})
    if fam.layers_key:
        old = f"model.{fam.layers_key}."
        source = source.renamed({n: "model.layers." + n[len(old):] for n in source.names() if n.startswith(old)})
    if fam.hybrid == "nemotron_h":  # one block a layer, grouped into the table's layers (models/nemotron_h.py)
        source = blocks_view(source)
    if "falcon" in fam.model_types:
        source = falcon_view(source)
    if fam.hybrid in ("kda", "bailing"):  # Kimi Linear saved by transformers: its dense MLPs' names; Ling's names
        source = bailing_view(kimi_view(source))
    source = source.renamed(fam.top_names)
    if fam.conv1d:  # Conv1D [in, out]; the causal-mask buffers old saves keep (attn.bias, attn.masked_bias) are not weights
        layer = [n for n in source.names() if n.startswith("model.layers.")]
        source = source.without({n for n in layer if n.endswith((".attn.bias", ".attn.masked_bias"))})
        source = _Transposed(source, {n for n in layer if n.endswith(".weight") and len(source.shape(n)) == 2})
    if fam.weightless_norms:
        source = _weightless_norms(source, fam, heads)
    if fam.sub_norms:  # BitNet's packed ternary weights shown as float (models/bitnet.py)
        source = unpacked_view(source)
    if fam.mlp_act == "xielu":
        source = _Scalars(source, {n for n in source.names() if n.startswith("model.layers.") and source.shape(n) == ()})
    if hybrid is not None and hybrid.scales:  # Falcon-H1's muP multipliers folded (models/falcon_h1.py)
        source = _Scaled(source, hybrid.scales)
    if hybrid is not None:
        grouped = {n for n in source.names() if n.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"))}
        source = _LinearPerGroup(source, grouped, hybrid) if grouped else _olmo_hybrid_linear(source)
    if fam.output_gate not in ("", "fused"):
        source = _GateApart(source, fam.layer_names()["qkv"][0], fam.output_gate, heads)
    if not fam.qkv_per_head:
        return source
    layer = fam.layer_names()
    parts = {*layer["qkv"], *layer["qkv_bias"]}
    fused = {n for n in source.names() if n.startswith("model.layers.") and n.split(".", 3)[3] in parts}
    return _QkvPerGroup(source, fused, heads, kv_heads or heads)
