"""llama.cpp's gated-delta-net GGUFs as the table's hybrid (models/linear_config.py `hybrid_from_hf`): `qwen35` /
`qwen35moe` (Qwen3.5, Qwen3.5-MoE) and `qwen3next` (Qwen3-Next): the config.json keys their metadata gives, and their
linear layers' tensors shown as the table reads them.

llama.cpp's converter writes the linear layers' sizes as `ssm.*` (`ssm.group_count`: key heads, `ssm.time_step_rank`:
value heads, `ssm.state_size`: the key head width), which layers are recurrent as `attention.recurrent_layers` (else
every `full_attention_interval`-th layer is full), A as -exp(A_log); the zero-centred gains it stored as 1 + w are
read as plain gains (config_from_gguf sets norm_offset 0). For qwen35, where there are more value heads than key heads,
every value-head axis is in its "tiled" order (value head j of key group g at j * groups + g, where transformers groups
them: g * per_group + j): `GroupedValueHeads` undoes it. For qwen3next it splits Qwen3-Next's per-group in_proj_qkvz
into q | k | v rows (`attn_qkv`) and z rows (`attn_gate`), the values in transformers' grouped order, and keeps in_proj_ba
(`ssm_ba`) as stored, per key-head group: `JoinedQkvz` shows them as the fused rows the table reads for Qwen3-Next
(models/hf_layouts.py). Both then read A through `ALogView` (models/mamba2_gguf.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .linear_config import HybridConfig
from .weights import TensorInfo, WeightSource


def gated_delta_gguf_keys(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """The config.json keys (qwen3_5_text's / qwen3_5_moe_text's / qwen3_next's) of a qwen35 / qwen35moe / qwen3next
    GGUF's metadata."""
    values = int(meta[p + "ssm.time_step_rank"])
    text_type = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}[meta["general.architecture"]]
    if p + "attention.recurrent_layers" in meta:
        layers = {"layer_types": ["linear_attention" if r else "full_attention" for r in meta[p + "attention.recurrent_layers"]]}
    else:  # hybrid_from_hf: every interval-th layer full
        layers = {"full_attention_interval": int(meta.get(p + "full_attention_interval") or 4)}
    return {"model_type": text_type, **layers,
            "linear_conv_kernel_dim": int(meta[p + "ssm.conv_kernel"]), "linear_key_head_dim": int(meta[p + "ssm.state_size"]),
            "linear_num_key_heads": int(meta[p + "ssm.group_count"]), "linear_num_value_heads": values,
            "linear_value_head_dim": int(meta[p + "ssm.inner_size"]) // values}


class GroupedValueHeads(WeightSource):
    """`inner` (a qwen35 GGUF's tensors under transformers' names) with every value-head axis back in transformers'
    grouped order (A as log(-A): models/mamba2_gguf.py `ALogView`): in_proj_qkv's value rows, in_proj_z's rows, in_proj_a / in_proj_b's rows,
    A_log, dt_bias, the conv kernel's value channels, out_proj's columns."""

    def __init__(self, inner: WeightSource, hybrid: HybridConfig):
        self._inner, self._h = inner, hybrid

    def info(self, name: str) -> TensorInfo:
        return self._inner.info(name)

    def names(self) -> list[str]:
        return self._inner.names()

    def read(self, name: str) -> np.ndarray:
        tensor, h = self._inner.read(name), self._h
        if h.num_v_heads == h.num_k_heads or ".linear_attn." not in name:
            return tensor
        keys = 2 * h.num_k_heads * h.k_dim  # q and k rows (channels) ahead of the values
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            return np.concatenate([tensor[:keys], self._grouped(tensor[keys:], 0, h.v_dim)])
        if name.endswith("in_proj_z.weight"):
            return self._grouped(tensor, 0, h.v_dim)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return self._grouped(tensor, 0, 1)
        if name.endswith("out_proj.weight"):
            return self._grouped(tensor, 1, h.v_dim)
        return tensor

    def _grouped(self, tensor: np.ndarray, axis: int, width: int) -> np.ndarray:
        """`tensor` with axis `axis` ([value heads x width]) from the tiled order [per_group, groups, width] to the
        grouped one [groups, per_group, width]."""
        h = self._h
        per = h.num_v_heads // h.num_k_heads
        moved = np.moveaxis(tensor, axis, 0)
        tiles = moved.reshape(per, h.num_k_heads, width, *moved.shape[1:])
        grouped = np.swapaxes(tiles, 0, 1).reshape(moved.shape)
        return np.ascontiguousarray(np.moveaxis(grouped, 0, axis))


class JoinedQkvz(WeightSource):
    """`inner` (a qwen3next GGUF's tensors under transformers' names) with each linear layer's in_proj_qkv (q | k | v
    rows) and in_proj_z shown as the one in_proj_qkvz [q | k | v | z rows] and its per-group in_proj_ba [groups, b | a]
    as b | a rows: Qwen3-Next's fused projections as models/hf_layouts.py shows its checkpoint's."""

    def __init__(self, inner: WeightSource, hybrid: HybridConfig):
        self._inner, self._h = inner, hybrid
        self._joined = {n.replace("in_proj_qkv.", "in_proj_qkvz."): (n, n.replace("in_proj_qkv.", "in_proj_z."))
                        for n in inner.names() if n.endswith("linear_attn.in_proj_qkv.weight")}
        parts = {part for pair in self._joined.values() for part in pair}
        self._names = [n for n in inner.names() if n not in parts] + list(self._joined)

    def info(self, name: str) -> TensorInfo:
        if name not in self._joined:
            return self._inner.info(name)
        (qkv, width), (z, _) = (self._inner.shape(part) for part in self._joined[name])
        return TensorInfo((qkv + z, width), self._inner.info(self._joined[name][0]).dtype)

    def read(self, name: str) -> np.ndarray:
        if name in self._joined:
            return np.concatenate([self._inner.read(part) for part in self._joined[name]])
        tensor = self._inner.read(name)
        if not name.endswith("linear_attn.in_proj_ba.weight"):
            return tensor
        per = self._h.num_v_heads // self._h.num_k_heads
        rows = tensor.reshape(self._h.num_k_heads, 2, per, -1)  # [groups, b | a, per group, hidden]
        return np.ascontiguousarray(np.swapaxes(rows, 0, 1)).reshape(tensor.shape)

    def names(self) -> list[str]:
        return list(self._names)
