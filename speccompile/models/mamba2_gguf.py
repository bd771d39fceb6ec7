"""llama.cpp's `granitehybrid` GGUF (IBM Granite 4.0-H) as the table's Mamba-2 hybrid (models/linear_config.py
`mamba2_from_hf`): the config.json keys its metadata gives, and its Mamba-2 tensors shown as transformers stores them.

llama.cpp's converter writes a layer as attention where `attention.head_count_kv` has a nonzero entry (Mamba-2
where it is 0), the SSM's sizes as `ssm.*` (`ssm.time_step_rank`: the heads), A as -exp(A_log) [heads, 1], D as
[heads, 1], the gated norm's gain as [groups, inner / groups] and the conv kernel 2-D (models/weights.py shows the
last three in transformers' shapes); `rope.scaling.finetuned` false: no rope on the attention layers (Granite 4.0-H).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .linear_config import gguf_kv_heads
from .weights import TensorInfo, WeightSource


def mamba2_gguf_keys(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """The config.json keys (granitemoehybrid's) of a granitehybrid GGUF's metadata."""
    kv = gguf_kv_heads(meta, p)
    inner, heads = int(meta[p + "ssm.inner_size"]), int(meta[p + "ssm.time_step_rank"])
    hidden = int(meta[p + "embedding_length"])
    if inner % hidden or inner % heads:
        raise UnsupportedError(f"{source}: {p}ssm.inner_size {inner} is not a multiple of the width and the heads")
    return {"layer_types": ["attention" if heads_kv else "mamba" for heads_kv in kv], "num_key_value_heads": max(kv) or 1,
            "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // hidden,
            "mamba_d_state": int(meta[p + "ssm.state_size"]), "mamba_n_groups": int(meta[p + "ssm.group_count"]),
            "mamba_d_conv": int(meta[p + "ssm.conv_kernel"]),
            "position_embedding_type": "rope" if meta.get(p + "rope.scaling.finetuned") else "nope"}


class ALogView(WeightSource):
    """`inner` (a GGUF's tensors under transformers' names) with each recurrent layer's A (Mamba-2's, a gated delta
    net's), which llama.cpp stores as A = -exp(A_log), shown as transformers' A_log = log(-A)."""

    def __init__(self, inner: WeightSource):
        self._inner = inner

    def info(self, name: str) -> TensorInfo:
        return self._inner.info(name)

    def read(self, name: str) -> np.ndarray:
        tensor = self._inner.read(name)
        return np.log(-tensor).astype(np.float32) if name.endswith(".A_log") else tensor

    def names(self) -> list[str]:
        return self._inner.names()
