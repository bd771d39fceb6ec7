"""Rotary position embedding for the torch reference and the traced drafters: cos/sin from explicit position ids
(tree nodes share a position), applied to the first rope_dim dims; longrope's long set per row past its boundary
(models/rope.py computes the frequencies, shared with the graph builders)."""

from __future__ import annotations

import torch
from torch import nn

from . import rope
from .config import ModelConfig
from .trace_ops import static_reshape


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    """[-x2, x1] for x = [x1, x2]; `half` is a Python int so the export has constant slice bounds."""
    return torch.cat((-x[..., half:], x[..., :half]), dim=x.dim() - 1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """x * cos + rotate(x) * sin over the first rope_dim dims (halves, or (x0, x1) pairs when interleaved). Axes are
    positive and reshapes constant: torch's TorchScript exporter lost a tensor's rank after a run-time Reshape."""
    rot, last = config.rope_dim, x.dim() - 1
    if rot == x.shape[-1] and not config.rope_interleaved:  # the traced contract graph's nodes, as before
        return x * cos + rotate_half(x, rot // 2) * sin
    part = x.narrow(last, 0, rot)
    if config.rope_interleaved:
        keep = [0] * last
        pairs = static_reshape(part, *keep, -1, 2)
        rotated = static_reshape(torch.stack((-pairs.select(last + 1, 1), pairs.select(last + 1, 0)), dim=last + 1), *keep, -1)
    else:
        rotated = rotate_half(part, rot // 2)
    out = part * cos + rotated * sin
    return out if rot == x.shape[-1] else torch.cat((out, x.narrow(last, rot, x.shape[-1] - rot)), dim=last)


def query_scale(config: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Llama 4's query scaling (Ministral 3) [b, 1, q, 1]: 1 + beta log(1 + floor(position / length)) in float32 (as
    transformers), in `dtype`; None without it. Per position, so it commutes with rope and scales a query anywhere after
    its norms."""
    if not config.query_scale_beta:
        return None
    floor = torch.floor(position_ids.to(torch.float32) / config.query_scale_length)
    return (1 + config.query_scale_beta * torch.log(1 + floor))[:, None, :, None].to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed from explicit position ids (so tree nodes can share a position)."""

    def __init__(self, config: ModelConfig, kind: str = "global"):
        super().__init__()
        self.register_buffer("inv_freq", torch.from_numpy(rope.rope_inv_freq(config, kind)), persistent=False)
        self.long_start = rope.long_rope_start(config, kind)  # longrope: rows at positions >= it use long_inv_freq
        if self.long_start is not None:
            self.register_buffer("long_inv_freq", torch.from_numpy(rope.rope_inv_freq(config, kind, long=True)), persistent=False)
        self.interleaved = config.rope_interleaved
        self.factor = rope.rope_attention_factor(config, kind)
        self.reversed = config.rope_reversed  # nanochat: the rotation by -angle (sin negated)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = position_ids.to(torch.float32).unsqueeze(-1)
        freqs = pos * self.inv_freq  # [b, q, d/2]
        if self.long_start is not None:  # per row: the long set at and past the boundary
            freqs = torch.where(position_ids.unsqueeze(-1) < self.long_start, freqs, pos * self.long_inv_freq)
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        emb = emb.unsqueeze(1)  # [b, 1, q, d]
        sin = -emb.sin() if self.reversed else emb.sin()
        if self.factor == 1.0:
            return emb.cos().to(dtype), sin.to(dtype)
        return (emb.cos() * self.factor).to(dtype), (sin * self.factor).to(dtype)


def bound_positions(module: nn.Module, positions: int) -> None:
    """Every rotary table in `module` serves positions below `positions` (a traced drafter of an artifact whose
    context stays inside longrope's original length holds the short set alone)."""
    for m in module.modules():
        if isinstance(m, RotaryEmbedding) and m.long_start is not None and positions <= m.long_start:
            m.long_start = None  # no row reaches the long set: traced, the short set alone (as before)
