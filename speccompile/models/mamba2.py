"""The torch reference of a Mamba-2 layer (Granite 4.0-H's `GraniteMoeHybridMambaLayer`, transformers' `torch_forward`
and `mamba2_selective_state_update`; models/linear_config.py has its shape and names, docs/DESIGN.md "Hybrid linear
attention"): in_proj -> z | xBC | dt; xBC through a depthwise causal conv1d with its bias, then SiLU; x | B | C; per
head h (its group g's B, C): dt = softplus(dt + dt_bias), state_h = exp(dt A_h) state_h + dt B_g x_h^T (state
[d_state, head_dim], A = -exp(A_log)), y_h = state_h^T C_g + D_h x_h; then y * SiLU(z) RMS-normed in n_groups groups
times the gain, out_proj.

As `GatedDeltaNet`, a pass runs its rows one token at a time (`Mamba2.step`, the graphs' scan body op for op) and
returns the states after each row: the numerical reference.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear_attention import _Gain
from .linear_config import HybridConfig


class Mamba2(nn.Module):
    """transformers' GraniteMoeHybridMambaLayer with an explicit cache: forward(x, conv_state [b, C, K-1], ssm state
    [b, H, N, P]) -> (out, per-row conv states, per-row ssm states)."""

    def __init__(self, hidden: int, hybrid: HybridConfig, eps: float):
        super().__init__()
        self.h, self.eps = hybrid, eps
        self.in_proj = nn.Linear(hidden, hybrid.value_dim + hybrid.conv_dim + hybrid.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(hybrid.conv_dim, hybrid.conv_dim, hybrid.conv_kernel, groups=hybrid.conv_dim, bias=hybrid.conv_bias)
        self.A_log, self.dt_bias, self.D = (nn.Parameter(torch.zeros(hybrid.num_v_heads)) for _ in range(3))  # per head
        self.norm = _Gain(hybrid.value_dim) if hybrid.gate_norm != "none" else None  # Falcon-H1 without mamba_rms_norm: none
        self.out_proj = nn.Linear(hybrid.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, conv_state: torch.Tensor,
                ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rotary` / `biases`: unused (attention's arguments); the states are the committed ones."""
        h = self.h
        z, xbc, dt = torch.split(self.in_proj(x), [h.value_dim, h.conv_dim, h.num_v_heads], dim=-1)
        outs, convs, states = [], [], []
        for t in range(x.shape[1]):
            y, conv_state, ssm = self.step(xbc[:, t], dt[:, t], conv_state, ssm)
            outs.append(y)
            convs.append(conv_state)
            states.append(ssm)
        y = torch.stack(outs, dim=1).reshape(*x.shape[:2], h.value_dim)
        return self.out_proj(self.gated_norm(y, z)), torch.stack(convs, dim=1), torch.stack(states, dim=1)

    def step(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor,
             ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: its conv input xBC [b, C], dt [b, H] and the states before it -> its output [b, H, P] and the
        states after it."""
        h = self.h
        window = torch.cat((conv_state, xbc.unsqueeze(-1)), dim=-1)  # [b, C, K]
        conv = (window * self.conv1d.weight[:, 0, :]).sum(dim=-1)
        conv = nn.functional.silu(conv + self.conv1d.bias if h.conv_bias else conv)
        x, b_in, c_in = torch.split(conv, [h.value_dim, h.key_dim, h.key_dim], dim=-1)
        groups = h.num_v_heads // h.num_k_heads
        b_in, c_in = (t.reshape(-1, h.num_k_heads, h.k_dim).repeat_interleave(groups, dim=1) for t in (b_in, c_in))
        x = x.reshape(-1, h.num_v_heads, h.v_dim)
        dt = nn.functional.softplus(dt + self.dt_bias)  # [b, H]
        decay = torch.exp(dt * -torch.exp(self.A_log))
        ssm = ssm * decay[..., None, None] + dt[..., None, None] * b_in.unsqueeze(-1) * x.unsqueeze(-2)  # (dt B) x^T
        y = (ssm * c_in.unsqueeze(-1)).sum(dim=-2) + x * self.D.unsqueeze(-1)
        return y, window[..., 1:], ssm

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * SiLU(z), RMS-normed over each of the n_groups groups, times the gain (transformers' RMSNormGated with
        norm_before_gate False); `gate_norm` "none": y * SiLU(z); "before_gate": y normed times the gain, then * SiLU(z)
        (Falcon-H1's FalconH1RMSNormGated with norm_before_gate True)."""
        kind = self.h.gate_norm
        g = y if kind == "before_gate" else y * nn.functional.silu(z)
        if kind == "none":
            return g
        parts = g.reshape(*g.shape[:-1], self.h.num_k_heads, -1)
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.norm.weight * parts.reshape(g.shape)
        return normed * nn.functional.silu(z) if kind == "before_gate" else normed

    def empty_states(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The states before the first token: zeros."""
        return [torch.zeros((batch, *self.h.conv_state_shape()), dtype=dtype),
                torch.zeros((batch, *self.h.recurrent_state_shape()), dtype=dtype)]
