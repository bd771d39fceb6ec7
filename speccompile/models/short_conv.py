"""The torch reference of a short-conv layer (LFM2's `Lfm2ShortConv`; models/linear_config.py has its shape and
names, docs/DESIGN.md "Hybrid linear attention"): in_proj -> B | C | x, B * x through a depthwise causal conv1d (no
bias, no activation) whose conv state is the last kernel - 1 inputs, times C, out_proj.

As `GatedDeltaNet`, a pass runs its rows one token at a time (`ShortConv.step`, the graphs' scan body op for op)
and returns the conv state after each row: the numerical reference. It has no recurrent state: the cache's second
tensor per layer is an empty placeholder [b, 0] carried through, so the decoder's two tensors a layer still hold.
"""

from __future__ import annotations

import torch
from torch import nn

from .kda import KimiDeltaAttention
from .linear_attention import GatedDeltaNet
from .linear_config import HybridConfig
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .rglru import RgLru
from .lightning import Lightning


class ShortConv(nn.Module):
    """transformers' Lfm2ShortConv with an explicit cache: forward(x, conv_state [b, C, K-1], placeholder) -> (out,
    per-row conv states [b, q, C, K-1], per-row placeholders)."""

    def __init__(self, hidden: int, hybrid: HybridConfig):
        super().__init__()
        self.h = hybrid
        self.in_proj = nn.Linear(hidden, 3 * hybrid.width, bias=False)
        self.conv = nn.Conv1d(hybrid.width, hybrid.width, hybrid.conv_kernel, groups=hybrid.width, bias=False)
        self.out_proj = nn.Linear(hybrid.width, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, conv_state: torch.Tensor,
                placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rotary` / `biases`: unused (attention's arguments); `conv_state`: the committed one."""
        b_in, c_in, x_in = self.in_proj(x).chunk(3, dim=-1)
        bx = b_in * x_in
        outs, convs = [], []
        for t in range(x.shape[1]):
            out, conv_state = self.step(bx[:, t], conv_state)
            outs.append(out)
            convs.append(conv_state)
        rows = torch.stack([placeholder] * x.shape[1], dim=1)
        return self.out_proj(c_in * torch.stack(outs, dim=1)), torch.stack(convs, dim=1), rows

    def step(self, bx: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: its conv input B * x [b, C] and the conv state before it -> its conv output and the state after."""
        window = torch.cat((conv_state, bx.unsqueeze(-1)), dim=-1)  # [b, C, K]
        return (window * self.conv.weight[:, 0, :]).sum(dim=-1), window[..., 1:]

    def empty_states(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The states before the first token: a zero conv state and the empty placeholder."""
        return [torch.zeros((batch, *self.h.conv_state_shape()), dtype=dtype), torch.zeros((batch, 0), dtype=dtype)]


def recurrent_layer(hidden: int, hybrid: HybridConfig, eps: float, layer: int = 0) -> nn.Module:
    """A recurrent layer's torch reference: a short conv (LFM2), a Mamba-2 layer (Granite 4.0-H, models/mamba2.py), a
    Mamba-1 layer (Jamba, models/mamba1.py), a RecurrentGemma RG-LRU block, Kimi Delta Attention or a gated delta net (Qwen3-Next, Qwen3.5)."""
    if hybrid.mamba2 or hybrid.mamba1:
        return (Mamba2 if hybrid.mamba2 else Mamba1)(hidden, hybrid, eps)
    if hybrid.lightning:  # MiniMax-01 (models/lightning.py): its decay depends on the layer's index
        return Lightning(hidden, hybrid, layer)
    if hybrid.kda or hybrid.rglru:  # Kimi Linear (models/kda.py), RecurrentGemma (models/rglru.py)
        return KimiDeltaAttention(hidden, hybrid, eps) if hybrid.kda else RgLru(hidden, hybrid)
    return ShortConv(hidden, hybrid) if hybrid.short_conv else GatedDeltaNet(hidden, hybrid, eps)


def mixer_name(hybrid: HybridConfig) -> str:
    """The recurrent layer's module name (transformers')."""
    if hybrid.rglru or hybrid.lightning:
        return "temporal_block" if hybrid.rglru else "self_attn"
    return "mamba" if hybrid.mamba2 or hybrid.mamba1 else "self_attn" if hybrid.kda else "conv" if hybrid.short_conv else "linear_attn"
