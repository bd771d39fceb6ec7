"""llama.cpp's `jamba` GGUF (AI21 Jamba) as the config.json keys models/linear_config.py `mamba1_from_hf` and
models/moe_config.py read.

llama.cpp's converter writes a layer as attention where `attention.head_count_kv` has a nonzero entry (Mamba-1 where
it is 0), the SSM's sizes as `ssm.*` (`ssm.inner_size`, `ssm.state_size`, `ssm.time_step_rank`: the dt rank,
`ssm.conv_kernel`), the experts' count but not which layers have them: a MoE layer is one with a router
(`ffn_gate_inp`). Both layer sets are read back as transformers' period and offset (attention where i % period ==
offset); sets no period gives are refused in one line. The conv bias is there where the file has `ssm_conv1d.bias`.
A is stored as -exp(A_log) [inner, d_state] (models/mamba2_gguf.py `ALogView` shows it as A_log), the conv kernel 2-D
(models/weights.py shows it [inner, 1, kernel]).
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from .linear_config import gguf_kv_heads


def mamba1_gguf_keys(meta: dict[str, Any], p: str, tensors: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """The config.json keys (Jamba's) of a jamba GGUF's metadata and tensor names."""
    kv = gguf_kv_heads(meta, p)
    layers, hidden, inner = len(kv), int(meta[p + "embedding_length"]), int(meta[p + "ssm.inner_size"])
    if inner % hidden:
        raise UnsupportedError(f"{source}: {p}ssm.inner_size {inner} is not a multiple of the width {hidden}")
    attention = _period([i for i, heads in enumerate(kv) if heads], layers, "attention", source)
    experts = _period([i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors], layers, "expert", source)
    return {"num_hidden_layers": layers, "num_key_value_heads": max(kv), "attn_layer_period": attention[0],
            "attn_layer_offset": attention[1], "expert_layer_period": experts[0], "expert_layer_offset": experts[1],
            "num_experts": int(meta.get(p + "expert_count") or 1), "num_experts_per_tok": int(meta.get(p + "expert_used_count") or 1),
            "mamba_expand": inner // hidden, "mamba_d_state": int(meta[p + "ssm.state_size"]), "mamba_d_conv": int(meta[p + "ssm.conv_kernel"]),
            "mamba_dt_rank": int(meta[p + "ssm.time_step_rank"]), "mamba_conv_bias": any(name.endswith("ssm_conv1d.bias") for name in tensors)}


def _period(layers_of: list[int], layers: int, what: str, source: str) -> tuple[int, int]:
    """(period, offset) such that layer i is in `layers_of` iff i % period == offset (none: a period past the last layer)."""
    if not layers_of:
        return layers + 1, layers
    period = layers_of[1] - layers_of[0] if len(layers_of) > 1 else layers
    if layers_of[0] >= period or [i for i in range(layers) if i % period == layers_of[0]] != layers_of:
        raise UnsupportedError(f"{source}: the {what} layers {layers_of} are not every n-th layer from one before n (Jamba's "
                               f"{what}_layer_period / offset)")
    return period, layers_of[0]
