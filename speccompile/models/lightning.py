"""The torch reference of a MiniMax-01 lightning attention layer (transformers' `MiniMaxLightningAttention`;
docs/DESIGN.md "Hybrid linear attention").

q | k | v = SiLU(qkv_proj(h)) per head; a state kv [H, D, D] per head with the fixed decay exp(-slope): kv <- exp(-slope)
kv + k^T v, out = q kv; then out_proj(sigmoid(output_gate(h)) * RMSNorm(out over H * D, eps 1e-6)). transformers'
prefill computes the same sums in blocks of `block_size` (query / key / diagonal decays exp(-slope n)); its cached path
is this recurrence, token by token, which this reference runs for every pass (`Lightning.step`). The slope depends on
the layer's index (`slope_rate`). A pending row is a token's SiLU'd k | v; the runtime's first pending row, all zeros,
adds 0 and decays a zero state to zero, so it leaves the zero states as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear_config import HybridConfig

# transformers' buffers of these decays, which a checkpoint may hold; derived from the config, so not read (models/load.py)


def slope_rate(heads: int, layer: int, layers: int) -> torch.Tensor:
    """Layer `layer`'s per-head decay rate [H] of `layers` (transformers' get_slope_rate, in float32 as it computes it)."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer / (layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(heads) + 1) * factor


class Lightning(nn.Module):
    """transformers' MiniMaxLightningAttention of layer `layer` (of len(hybrid.linear)) with an explicit cache: forward(x, rotary, biases, state [b, H, D, D],
    placeholder [b, 0]) -> (out, per-row states, per-row placeholders)."""

    def __init__(self, hidden: int, hybrid: HybridConfig, layer: int):
        super().__init__()
        self.h, heads, width = hybrid, hybrid.num_v_heads, hybrid.value_dim
        self.qkv_proj = nn.Linear(hidden, 3 * width, bias=False)
        self.out_proj = nn.Linear(width, hidden, bias=False)
        self.output_gate = nn.Linear(hidden, width, bias=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(width))
        self.register_buffer("decay", torch.exp(-slope_rate(heads, layer, len(hybrid.linear))).reshape(heads, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, state: torch.Tensor,
                placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rotary` / `biases`: unused (attention's arguments); `state`: the committed one."""
        b, q, hy = x.shape[0], x.shape[1], self.h
        qkv = nn.functional.silu(self.qkv_proj(x)).reshape(b, q, hy.num_v_heads, 3 * hy.v_dim)
        query, key, value = torch.split(qkv, hy.v_dim, dim=-1)  # each [b, q, H, D]
        outs, states = [], []
        for t in range(q):
            out, state = self.step(query[:, t], key[:, t], value[:, t], state)
            outs.append(out)
            states.append(state)
        out = torch.stack(outs, dim=1).reshape(b, q, hy.value_dim)
        normed = out.float() * torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        gated = torch.sigmoid(self.output_gate(x)) * (self.norm.weight * normed.to(x.dtype))
        return self.out_proj(gated), torch.stack(states, dim=1), torch.stack([placeholder] * q, dim=1)

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: its q, k, v [b, H, D] and the state before it -> its output [b, H, D] and the state after it."""
        state = self.decay * state + key.unsqueeze(-1) * value.unsqueeze(-2)
        return (query.unsqueeze(-2) @ state).squeeze(-2), state

    def empty_states(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The states before the first token: a zero state and the empty placeholder."""
        return [torch.zeros((batch, *self.h.recurrent_state_shape()), dtype=dtype), torch.zeros((batch, 0), dtype=dtype)]
