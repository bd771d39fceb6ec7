"""The torch reference of a Mamba-1 layer (Jamba's `JambaMambaMixer`, transformers' `mamba_selective_state_update`;
models/linear_config.py has its shape and names, docs/DESIGN.md "Hybrid linear attention"): in_proj -> x | z; x
through a depthwise causal conv1d with its bias, then SiLU; x_proj -> dt | B | C, each RMS-normed with its gain
(`rms_norm_eps`; `HybridConfig.mixer_norms`: Falcon-Mamba's without gains, eps `norm_eps`; Mamba: none); dt = softplus(dt_proj(dt) + its bias) [inner]; per channel c, state_c [d_state] = exp(dt_c A_c)
state_c + dt_c B x_c (A = -exp(A_log) [inner, d_state]), y_c = state_c . C + D_c x_c; then y * SiLU(z), out_proj.

As `Mamba2`, a pass runs its rows one token at a time (`Mamba1.step`, the graphs' scan body op for op) and returns
the states after each row: the numerical reference. A row's dt is multiplied by its flag (1; the runtime's first
pending row, all zeros, has 0), so that row leaves the zero states as they are although the conv bias makes its x,
B and C nonzero (runtime/state_cache.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .linear_attention import _Gain
from .linear_config import HybridConfig


class Mamba1(nn.Module):
    """transformers' JambaMambaMixer with an explicit cache: forward(x, conv_state [b, inner, K-1], ssm state
    [b, inner, d_state]) -> (out, per-row conv states, per-row ssm states)."""

    def __init__(self, hidden: int, hybrid: HybridConfig, eps: float):
        super().__init__()
        self.h, self.eps, inner, n = hybrid, hybrid.norm_eps or eps, hybrid.width, hybrid.k_dim
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.conv1d = nn.Conv1d(inner, inner, hybrid.conv_kernel, groups=inner, bias=hybrid.conv_bias)
        self.x_proj = nn.Linear(inner, hybrid.dt_rank + 2 * n, bias=False)
        gains = (_Gain(hybrid.dt_rank), _Gain(n), _Gain(n)) if hybrid.mixer_norms == "gains" else (None,) * 3
        self.dt_layernorm, self.b_layernorm, self.c_layernorm = gains
        self.dt_proj = nn.Linear(hybrid.dt_rank, inner)
        self.A_log = nn.Parameter(torch.zeros(inner, n))
        self.D = nn.Parameter(torch.zeros(inner))
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, conv_state: torch.Tensor,
                ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rotary` / `biases`: unused (attention's arguments); the states are the committed ones."""
        x_in, z = self.in_proj(x).chunk(2, dim=-1)
        flag = torch.ones(x.shape[0], 1, dtype=x.dtype)
        outs, convs, states = [], [], []
        for t in range(x.shape[1]):
            y, conv_state, ssm = self.step(x_in[:, t], flag, conv_state, ssm)
            outs.append(y)
            convs.append(conv_state)
            states.append(ssm)
        y = torch.stack(outs, dim=1)
        return self.out_proj(y * nn.functional.silu(z)), torch.stack(convs, dim=1), torch.stack(states, dim=1)

    def step(self, x_in: torch.Tensor, flag: torch.Tensor, conv_state: torch.Tensor,
             ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: its conv input x [b, inner], its flag [b, 1] and the states before it -> its output [b, inner]
        and the states after it."""
        h = self.h
        window = torch.cat((conv_state, x_in.unsqueeze(-1)), dim=-1)  # [b, inner, K]
        conv = (window * self.conv1d.weight[:, 0, :]).sum(dim=-1)
        x = nn.functional.silu(conv + self.conv1d.bias if h.conv_bias else conv)
        dt, b_in, c_in = torch.split(x @ self.x_proj.weight.T, [h.dt_rank, h.k_dim, h.k_dim], dim=-1)
        if h.mixer_norms != "none":
            dt, b_in, c_in = (self._norm(t, g) for t, g in ((dt, self.dt_layernorm), (b_in, self.b_layernorm), (c_in, self.c_layernorm)))
        dt = nn.functional.softplus(dt @ self.dt_proj.weight.T + self.dt_proj.bias) * flag  # [b, inner]
        decay = torch.exp(dt.unsqueeze(-1) * -torch.exp(self.A_log))  # [b, inner, N]
        ssm = ssm * decay + (dt * x).unsqueeze(-1) * b_in.unsqueeze(-2)
        y = (ssm * c_in.unsqueeze(-2)).sum(dim=-1) + x * self.D
        return y, window[..., 1:], ssm

    def _norm(self, t: torch.Tensor, gain: _Gain | None) -> torch.Tensor:
        """transformers' JambaRMSNorm: t / sqrt(mean(t^2) + eps) times the gain (FalconMambaWeightlessRMSNorm: none)."""
        normed = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed if gain is None else gain.weight * normed

    def empty_states(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The states before the first token: zeros."""
        return [torch.zeros((batch, *self.h.conv_state_shape()), dtype=dtype),
                torch.zeros((batch, *self.h.recurrent_state_shape()), dtype=dtype)]
