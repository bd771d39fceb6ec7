"""Hybrid linear attention (Qwen3-Next, Qwen3.5): which layers are gated delta nets, their shapes, their weights' roles.

A `linear_attention` layer (docs/DESIGN.md, "Hybrid linear attention") replaces attention by a gated delta net: the
projections q|k|v|z and b|a of the normed input, a depthwise causal conv1d (kernel `conv_kernel`) over q|k|v with
SiLU, then per token the recurrence of transformers' `torch_recurrent_gated_delta_rule` on a state [value heads,
key_head_dim, value_head_dim], and a gated RMSNorm of its output times SiLU(z) before out_proj. Its cache is
(conv state [conv_dim, kernel - 1], recurrent state) instead of KV rows. The other layers are full attention with
an output gate (q_proj doubled: per head q then gate; the output times sigmoid(gate) before o_proj).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedError

# roles of a linear layer's weights -> Hugging Face names (relative to `model.layers.{i}.`). Qwen3.5 stores q|k|v
# and z (b and a) apart; Qwen3-Next fused, per key-head group, shown q|k|v|z (b|a) at load (models/hf_layouts.py)
LINEAR_NAMES: dict[str, tuple[str, ...]] = {
    "lin_qkvz": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"),
    "lin_ba": ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
    "lin_conv": ("linear_attn.conv1d.weight",), "lin_a_log": ("linear_attn.A_log",), "lin_dt_bias": ("linear_attn.dt_bias",),
    "lin_norm": ("linear_attn.norm.weight",), "lin_out": ("linear_attn.out_proj.weight",),
}
FUSED_LINEAR_NAMES = {"lin_qkvz": ("linear_attn.in_proj_qkvz.weight",), "lin_ba": ("linear_attn.in_proj_ba.weight",)}
LINEAR_ROLES = tuple(LINEAR_NAMES)
# a short-conv layer's roles (LFM2: in_proj -> B | C | x, the depthwise conv, out_proj)
SHORT_CONV_NAMES: dict[str, tuple[str, ...]] = {"conv_in": ("conv.in_proj.weight",), "conv_kernel": ("conv.conv.weight",),
                                                "conv_out": ("conv.out_proj.weight",)}


@dataclass(frozen=True)
class HybridConfig:
    """The recurrent layers' shapes and which layers they are (`linear[i]`: layer i is one). `kind`: "gated_delta"
    (Qwen3-Next, Qwen3.5: conv and recurrent states) or "short_conv" (LFM2: a conv state alone over `width` channels)."""

    linear: list[bool] = field(default_factory=list)
    kind: str = "gated_delta"
    width: int = 0  # a short-conv layer's channels (the hidden size)
    num_k_heads: int = 0
    num_v_heads: int = 0
    k_dim: int = 0  # linear_key_head_dim
    v_dim: int = 0  # linear_value_head_dim
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """The conv1d's channels: q | k | v (a short conv: `width`)."""
        return self.width if self.short_conv else 2 * self.key_dim + self.value_dim

    @property
    def short_conv(self) -> bool:
        return self.kind == "short_conv"

    def roles(self) -> tuple[str, ...]:
        """A recurrent layer's roles in the place of attention's."""
        return tuple(SHORT_CONV_NAMES) if self.short_conv else LINEAR_ROLES

    def state_kinds(self) -> tuple[str, ...]:
        """A recurrent layer's cache tensors: its states, then its pending rows."""
        return ("conv", "rows") if self.short_conv else ("conv", "recurrent", "rows")

    def row_width(self) -> int:
        """A pending row's floats: its conv input (a gated delta net: and b, a)."""
        return self.conv_dim if self.short_conv else self.conv_dim + 2 * self.num_v_heads

    def fused_sizes(self) -> dict[str, list[int]]:
        """Rows of the fused roles' parts: q|k|v and z, b and a (Qwen3-Next's in_proj_qkvz / in_proj_ba, split)."""
        return {"lin_qkvz": [self.conv_dim, self.value_dim], "lin_ba": [self.num_v_heads] * 2}

    def conv_state_shape(self) -> tuple[int, int]:
        """A layer's conv state per sequence: the last kernel - 1 conv inputs, [conv_dim, kernel - 1]."""
        return (self.conv_dim, self.conv_kernel - 1)

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """A layer's recurrent state per sequence: [value heads, key_head_dim, value_head_dim]."""
        return (self.num_v_heads, self.k_dim, self.v_dim)


def short_conv_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of an LFM2 config.json: `hybrid` (layer_types, else full_attn_idxs: "conv" layers are short
    convs), the MLP width after transformers' `block_auto_adjust_ff_dim`; conv biases and no attention layer refused."""
    types = data.get("layer_types") or ["full_attention" if i in (data.get("full_attn_idxs") or []) else "conv" for i in range(layers)]
    types = list(types)[:layers]
    other = sorted(set(types) - {"full_attention", "conv"})
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in an LFM2 model")
    if data.get("conv_bias"):
        raise UnsupportedError(f"{source}: conv_bias true (short-conv biases) is not supported")
    if "full_attention" not in types:
        raise UnsupportedError(f"{source}: an LFM2 model without a full_attention layer is not supported")
    inter = int(data["intermediate_size"])
    if data.get("block_auto_adjust_ff_dim"):  # transformers' Lfm2MLP
        inter = int(2 * inter / 3)
        if data.get("block_ffn_dim_multiplier") is not None:
            multiple = int(data.get("block_multiple_of") or 256)
            inter = int(float(data["block_ffn_dim_multiplier"]) * inter)
            inter = multiple * ((inter + multiple - 1) // multiple)
    hybrid = HybridConfig(linear=[t == "conv" for t in types], kind="short_conv", width=int(data["hidden_size"]),
                          conv_kernel=int(data.get("conv_L_cache") or 3))
    return dict(hybrid=hybrid, intermediate_size=inter)


def hybrid_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a hybrid checkpoint's config.json: `hybrid` (layer_types, else every
    full_attention_interval-th layer full, as transformers), the output gate; other layer kinds, no full-attention
    layer at all and a hidden_act other than SiLU (the conv's and the gated norm's activation) are refused."""
    types = data.get("layer_types")
    if not types:
        interval = int(data.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    types = list(types)[:layers]
    other = sorted(set(types) - {"full_attention", "linear_attention"})
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in a hybrid linear-attention model")
    if str(data.get("hidden_act", "silu")) != "silu":
        raise UnsupportedError(f"{source}: hidden_act {data['hidden_act']!r} is not supported in a hybrid linear-attention model")
    hybrid = HybridConfig(linear=[t == "linear_attention" for t in types], num_k_heads=int(data["linear_num_key_heads"]),
                          num_v_heads=int(data["linear_num_value_heads"]), k_dim=int(data["linear_key_head_dim"]),
                          v_dim=int(data["linear_value_head_dim"]), conv_kernel=int(data.get("linear_conv_kernel_dim") or 4))
    if all(hybrid.linear):  # the runtime's sessions key off the KV inputs (every Qwen3-Next / Qwen3.5 has full layers)
        raise UnsupportedError(f"{source}: a hybrid linear-attention model whose every layer is linear_attention (no "
                               "full_attention layer) is not supported")
    if hybrid.num_v_heads % hybrid.num_k_heads:
        raise UnsupportedError(f"{source}: linear_num_value_heads not a multiple of linear_num_key_heads is not supported")
    return dict(hybrid=hybrid, attn_output_gate=True)

