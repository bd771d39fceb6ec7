"""The torch reference of a Kimi Delta Attention layer (Kimi Linear; models/kda_config.py has the shapes and names,
export/kda_ops.py the graphs' nodes, op for op).

As the gated delta net (models/linear_attention.py), a pass runs its rows one token at a time (`KimiDeltaAttention.step`:
transformers' causal_conv1d_update and recurrent_kimi_delta_attention); the layer takes (conv state, recurrent state)
and returns its output rows and the states after each row.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .linear_attention import _Gain, delta_rule, l2norm, zero_states
from .linear_config import HybridConfig


class KimiDeltaAttention(nn.Module):
    """transformers' KimiLinearDeltaAttention under the checkpoint's names (q / k / v convs apart, the forget gate's
    f_a_proj, f_b_proj, A_log [1, 1, H, 1], dt_bias [H * D] on the layer; Bailing's full-rank f_proj / g_proj
    in f_a_proj / g_a_proj, A_log [H], its bounded forget gate: `HybridConfig.full_gates`, `gate_bound`), with an explicit cache: forward(x,
    conv_state [b, C, K-1], recurrent [b, H, D, D]) -> (out, per-row conv states, per-row recurrent states)."""

    def __init__(self, hidden: int, hybrid: HybridConfig, eps: float):
        super().__init__()
        self.h, self.eps = hybrid, eps
        width = hybrid.value_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, width, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Conv1d(width, width, hybrid.conv_kernel, groups=width, bias=False)
                                                       for _ in range(3))
        low = hybrid.key_dim if hybrid.full_gates else hybrid.k_dim  # Bailing: f_proj / g_proj in f_a_proj / g_a_proj
        self.f_a_proj = nn.Linear(hidden, low, bias=False)
        self.A_log = nn.Parameter(torch.zeros(*((hybrid.num_v_heads,) if hybrid.full_gates else (1, 1, hybrid.num_v_heads, 1))))
        self.dt_bias = nn.Parameter(torch.zeros(hybrid.key_dim))
        self.b_proj = nn.Linear(hidden, hybrid.num_v_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, low, bias=False)
        if not hybrid.full_gates:
            self.f_b_proj = nn.Linear(hybrid.k_dim, hybrid.key_dim, bias=False)
            self.g_b_proj = nn.Linear(hybrid.v_dim, width, bias=False)
        self.o_norm = _Gain(hybrid.v_dim)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, conv_state: torch.Tensor,
                recurrent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rotary` / `biases`: unused (attention's arguments); the states are the committed ones."""
        b, q, hy = x.shape[0], x.shape[1], self.h
        mixed = torch.cat([proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        forget, beta_in = self.up("f", self.f_a_proj(x)), self.b_proj(x)
        outs, convs, states = [], [], []
        for t in range(q):
            o, conv_state, recurrent = self.step(mixed[:, t], beta_in[:, t], forget[:, t], conv_state, recurrent)
            outs.append(o)
            convs.append(conv_state)
            states.append(recurrent)
        gate = self.up("g", self.g_a_proj(x)).reshape(b, q, hy.num_v_heads, hy.v_dim)
        core = self.gated_norm(torch.stack(outs, dim=1), gate)
        return self.o_proj(core.reshape(b, q, hy.value_dim)), torch.stack(convs, dim=1), torch.stack(states, dim=1)

    def step(self, mixed: torch.Tensor, beta_in: torch.Tensor, forget: torch.Tensor, conv_state: torch.Tensor,
             recurrent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: its conv input `mixed` [b, C], b [b, H], the forget gate's f_b(f_a(x)) [b, H * D] and the states
        before it -> its output [b, H, D] and the states after it."""
        hy = self.h
        window = torch.cat((conv_state, mixed.unsqueeze(-1)), dim=-1)  # [b, C, K]
        kernel = torch.cat([c.weight[:, 0, :] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])  # [C, K]
        conv = nn.functional.silu((window * kernel).sum(dim=-1))
        query, key, value = (t.reshape(-1, hy.num_v_heads, hy.k_dim) for t in torch.split(conv, [hy.key_dim] * 3, dim=-1))
        query, key = l2norm(query) / math.sqrt(hy.k_dim), l2norm(key)
        beta = torch.sigmoid(beta_in)
        gate = (forget + self.dt_bias).reshape(-1, hy.num_v_heads, hy.k_dim)
        if hy.gate_bound:  # Bailing's safe gate
            g = hy.gate_bound * torch.sigmoid(self.A_log.reshape(-1, 1).exp() * gate)
        else:
            g = -self.A_log.reshape(-1, 1).exp() * nn.functional.softplus(gate)  # [b, H, D]: per key channel
        out, state = delta_rule(recurrent * g.exp().unsqueeze(-1), query, key, value, beta)
        return out, window[..., 1:], state

    def up(self, which: str, low: torch.Tensor) -> torch.Tensor:
        """The forget ("f") or output ("g") gate's up projection of its low-rank input (full-rank gates: as it is)."""
        return low if self.h.full_gates else getattr(self, f"{which}_b_proj")(low)

    def gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values, times the gain, times sigmoid(gate) (transformers' KimiLinearRMSNormGated)."""
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.o_norm.weight * x * torch.sigmoid(gate)

    def empty_states(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The states before the first token: zeros."""
        return zero_states(self.h, batch, dtype)
