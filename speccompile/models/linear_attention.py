"""The torch reference of a gated delta net layer (hybrid linear attention: Qwen3-Next, Qwen3.5) and of gated
attention's output gate (models/linear_config.py has the shapes and names; docs/DESIGN.md "Hybrid linear attention").

A pass runs its rows through the recurrence one token at a time, the same ops in the same shapes for every row
(`GatedDeltaNet.step`), as the graphs do. The layer takes (conv state, recurrent state) and returns, besides its
output rows, the states after each row [batch, q, ...]: the numerical reference, whose cache interface is simpler
than the graphs' (they take pending rows and fold them in: export/linear_ops.py, runtime/state_cache.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .linear_config import HybridConfig


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last axis, as transformers' (FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class _Gain(nn.Module):
    """A module holding one gain (`norm.weight`)."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class GatedDeltaNet(nn.Module):
    """transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet under Qwen3.5's parameter names, with an explicit
    cache: forward(x, conv_state [b, C, K-1], recurrent [b, H, Dk, Dv]) -> (out, per-row conv states, per-row
    recurrent states)."""

    def __init__(self, hidden: int, hybrid: HybridConfig, eps: float):
        super().__init__()
        self.h, self.eps = hybrid, hybrid.norm_eps or eps  # OLMo Hybrid: its gated norm's own epsilon
        self.in_proj_qkv = nn.Linear(hidden, hybrid.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, hybrid.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, hybrid.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, hybrid.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(hybrid.conv_dim, hybrid.conv_dim, hybrid.conv_kernel, groups=hybrid.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hybrid.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(hybrid.num_v_heads))
        self.norm = _Gain(hybrid.v_dim)
        self.out_proj = nn.Linear(hybrid.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, conv_state: torch.Tensor,
                recurrent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rotary` / `biases`: unused (attention's arguments); the states are the committed ones."""
        b, q = x.shape[0], x.shape[1]
        mixed, z, beta_in, a = (proj(x) for proj in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
        outs, convs, states = [], [], []
        for t in range(q):
            o, conv_state, recurrent = self.step(mixed[:, t], beta_in[:, t], a[:, t], conv_state, recurrent)
            outs.append(o)
            convs.append(conv_state)
            states.append(recurrent)
        core = self.gated_norm(torch.stack(outs, dim=1), z.reshape(b, q, self.h.num_v_heads, self.h.v_dim))
        return self.out_proj(core.reshape(b, q, self.h.value_dim)), torch.stack(convs, dim=1), torch.stack(states, dim=1)

    def step(self, mixed: torch.Tensor, beta_in: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
             recurrent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: its conv input `mixed` [b, C], b / a [b, H] and the states before it -> its output [b, H, Dv]
        and the states after it (transformers' causal_conv1d_update and torch_recurrent_gated_delta_rule)."""
        h = self.h
        window = torch.cat((conv_state, mixed.unsqueeze(-1)), dim=-1)  # [b, C, K]
        conv = nn.functional.silu((window * self.conv1d.weight[:, 0, :]).sum(dim=-1))
        query, key, value = torch.split(conv, [h.key_dim, h.key_dim, h.value_dim], dim=-1)
        groups = h.num_v_heads // h.num_k_heads
        query, key = (l2norm(t.reshape(-1, h.num_k_heads, h.k_dim)) for t in (query, key))
        if groups > 1:
            query, key = (t.repeat_interleave(groups, dim=1) for t in (query, key))
        query = query / math.sqrt(h.k_dim)
        value = value.reshape(-1, h.num_v_heads, h.v_dim)
        beta = torch.sigmoid(beta_in) if h.beta_scale == 1.0 else torch.sigmoid(beta_in) * h.beta_scale  # OLMo Hybrid: [0, 2]
        g = -self.A_log.float().exp() * nn.functional.softplus(a + self.dt_bias)
        out, recurrent = delta_rule(recurrent * g.exp()[..., None, None], query, key, value, beta)
        return out, window[..., 1:], recurrent

    def gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values, times the gain, times SiLU(gate) (transformers' RMSNormGated)."""
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.weight * x * nn.functional.silu(gate)

    def empty_states(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The states before the first token: zeros."""
        return zero_states(self.h, batch, dtype)


def delta_rule(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule on the decayed state [b, H, Dk, Dv] -> (the readout [b, H, Dv], the state after the token)."""
    memory = (state * key.unsqueeze(-1)).sum(dim=-2)
    delta = (value - memory) * beta.unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * query.unsqueeze(-1)).sum(dim=-2), state


def zero_states(h: HybridConfig, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """A delta-rule layer's states before the first token: zero conv and recurrent states."""
    return [torch.zeros((batch, *h.conv_state_shape()), dtype=dtype), torch.zeros((batch, *h.recurrent_state_shape()), dtype=dtype)]


def split_output_gate(q: torch.Tensor, heads: int, head_dim: int, gate_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated attention's q_proj output [b, q, heads * (head_dim + gate_dim)] (per head: q, then gate; gate_dim
    head_dim, or 1: LFM3) -> q [b, q, heads * head_dim] and the gate [b, q, heads * gate_dim]."""
    both = q.reshape(q.shape[0], q.shape[1], heads, head_dim + gate_dim)
    return both[..., :head_dim].reshape(q.shape[0], q.shape[1], -1), both[..., head_dim:].reshape(q.shape[0], q.shape[1], -1)


def gated_output(out: torch.Tensor, gate: torch.Tensor, heads: int) -> torch.Tensor:
    """The attention output [b, q, heads * dim] times sigmoid(gate): of its shape, or one value a head [b, q, heads]."""
    if gate.shape[-1] == out.shape[-1]:
        return out * torch.sigmoid(gate)
    per_head = out.reshape(out.shape[0], out.shape[1], heads, -1) * torch.sigmoid(gate).unsqueeze(-1)
    return per_head.reshape(out.shape)
