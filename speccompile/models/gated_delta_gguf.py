"""llama.cpp's `qwen35` / `qwen35moe` GGUF (Qwen3.5, Qwen3.5-MoE) as the table's gated-delta-net hybrid
(models/linear_config.py `hybrid_from_hf`): the config.json keys its metadata gives, and its linear layers' tensors
shown as transformers stores them.

llama.cpp's converter writes the linear layers' sizes as `ssm.*` (`ssm.group_count`: key heads, `ssm.time_step_rank`:
value heads, `ssm.state_size`: the key head width), which layers are recurrent as `attention.recurrent_layers`, A as
-exp(A_log), and, where there are more value heads than key heads, every value-head axis in its "tiled" order
(value head j of key group g at j * groups + g, where transformers groups them: g * per_group + j). The view below
undoes the order (`ALogView` the A); the zero-centred gains it stored as 1 + w are read as plain gains (config_from_gguf sets norm_offset 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .linear_config import HybridConfig
from .weights import TensorInfo, WeightSource


def gated_delta_gguf_keys(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """The config.json keys (qwen3_5_text's / qwen3_5_moe_text's) of a qwen35 / qwen35moe GGUF's metadata."""
    values = int(meta[p + "ssm.time_step_rank"])
    recurrent = list(meta[p + "attention.recurrent_layers"])
    text_type = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}[meta["general.architecture"]]
    return {"model_type": text_type, "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
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
