"""llama.cpp's `kimi-linear` GGUF (Moonshot's Kimi Linear) as the table's `kimi_linear` (models/kda_config.py): the
config.json keys its metadata gives, and its Kimi Delta Attention tensors shown in transformers' shapes.

llama.cpp's converter writes a layer as KDA where `attention.head_count_kv` is 0 (latent attention where it is not:
the converter's 1, MQA over the latent), the KDA head width as `kda.head_dim`, the conv kernel as `ssm.conv_kernel`;
it writes no KDA head count (llama.cpp's graph takes `attention.head_count`, the latent attention's). Its tensors:
q / k / v / o_proj as attn_q / attn_k / attn_v / attn_output, f_a / f_b / g_a / g_b_proj as ssm_f_a / ssm_f_b /
ssm_g_a / ssm_g_b, b_proj as ssm_beta, o_norm as ssm_norm, dt_bias as `ssm_dt.bias`, A as -exp(A_log) `ssm_a`
[1, 1, heads, 1] (models/mamba2_gguf.py `ALogView` shows it as A_log), each q / k / v conv kernel [channels, kernel]
as `ssm_conv1d_{q,k,v}` [1, channels, 1, kernel] (`KdaShapes` shows them as [channels, 1, kernel]); the latent
attention as DeepSeek's (kv_b_proj split: models/mla_gguf.py), the experts stacked as DeepSeek-V3's under Mixtral's
w1 / w3 / w2, the dense layers' MLP as ffn_gate / ffn_up / ffn_down. llama.cpp's graph always renormalises the top k
(models/moe_config.py) and routes by sigmoid (`expert_gating_func` 2, which the converter writes where config.json
names the router's function); a file naming another gating function is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .linear_config import gguf_kv_heads
from .weights import TensorInfo, WeightSource

_SIGMOID = 2  # llama.cpp's expert_gating_func


def kda_gguf_keys(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """The config.json keys (kimi_linear's) of a kimi-linear GGUF's metadata."""
    gating = meta.get(p + "expert_gating_func")
    if gating is not None and int(gating) != _SIGMOID:
        raise UnsupportedError(f"{source}: {p}expert_gating_func {gating} is not supported in a Kimi Linear model (2: sigmoid)")
    types = ["full_attention" if heads else "linear_attention" for heads in gguf_kv_heads(meta, p)]
    return {"model_type": "kimi_linear", "layer_types": types, "mla_use_nope": True, "moe_router_activation_func": "sigmoid",
            "linear_attn_config": {"num_heads": int(meta[p + "attention.head_count"]), "head_dim": int(meta[p + "kda.head_dim"]),
                                   "short_conv_kernel_size": int(meta[p + "ssm.conv_kernel"])}}


class KdaShapes(WeightSource):
    """`inner` (a kimi-linear GGUF's tensors under transformers' names) with each KDA layer's conv kernels
    [1, channels, 1, kernel] (a quantized file's [channels, 1, kernel]) shown as transformers' [channels, 1, kernel]
    and A ([1, 1, heads, 1], or [heads, 1]) as its [1, 1, heads, 1]."""

    def __init__(self, inner: WeightSource):
        self._inner = inner

    def info(self, name: str) -> TensorInfo:
        info = self._inner.info(name)
        shape = _shape(name, info.shape)
        return info if shape is None else TensorInfo(shape, info.dtype)

    def read(self, name: str) -> np.ndarray:
        tensor = self._inner.read(name)
        shape = _shape(name, tensor.shape)
        return tensor if shape is None else tensor.reshape(shape)

    def names(self) -> list[str]:
        return self._inner.names()


def _shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """transformers' shape of a KDA conv kernel or A stored as `shape` by llama.cpp; None for another tensor."""
    if name.endswith(("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight")):
        return (int(np.prod(shape[:-1])), 1, int(shape[-1]))
    if name.endswith("self_attn.A_log"):
        return (1, 1, int(np.prod(shape)), 1)
    return None
