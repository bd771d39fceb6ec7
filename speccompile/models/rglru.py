"""The torch reference of a RecurrentGemma (Griffin) recurrent block (transformers' `RecurrentGemmaRecurrentBlock` and
`RecurrentGemmaRglru`, its non-cuda scan; models/rglru_config.py has its config reader, docs/DESIGN.md "Hybrid linear
attention"): y = GELU-tanh(linear_y(h)); x = linear_x(h) through a depthwise causal conv1d with its bias; the RG-LRU
per channel: input gate i and recurrence gate r from block-diagonal linear maps of x (a block per head, with biases),
log a = -8 r softplus(a_param), state = a state + sqrt(1 - a^2) (i x); then linear_out(state * y).

transformers resets at position 0: a multiplied by 0 and the input's factor sqrt(1 - a^2) replaced by 1. A row's
conv input x is stored with two flags, `keep` (1: a row after position 0) and `reset` (1: the row at position 0):
the factor is keep sqrt(1 - a^2) + reset and a is multiplied by 1 - reset. The runtime's first pending row, all
zeros (runtime/state_cache.py), has neither: its factor is 0 and its x 0, so it leaves the zero states as they are
although the conv bias makes its conv output nonzero. A real row's factor is 1 * s + 0 = s or 0 * s + 1 = 1 exactly
(s finite), the same bits as transformers' choice. As `Mamba1`, a pass runs its rows one token at a time
(`RgLru.step`, the graphs' scan body op for op) and returns the states after each row.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear_config import HybridConfig


class RgLru(nn.Module):
    """transformers' RecurrentGemmaRecurrentBlock with an explicit cache: forward(x, rotary, biases, conv_state
    [b, width, K-1], state [b, width]) -> (out, per-row conv states, per-row states); rotary["positions"] [b, q]
    tells the row at position 0."""

    def __init__(self, hidden: int, hybrid: HybridConfig):
        super().__init__()
        self.h, width, heads = hybrid, hybrid.width, hybrid.num_v_heads
        block = width // heads
        self.linear_y = nn.Linear(hidden, width)
        self.linear_x = nn.Linear(hidden, width)
        self.linear_out = nn.Linear(width, hidden)
        self.conv_1d = nn.Conv1d(width, width, hybrid.conv_kernel, groups=width)
        self.rg_lru = nn.Module()
        self.rg_lru.recurrent_param = nn.Parameter(torch.zeros(width))
        for gate in ("input_gate", "recurrent_gate"):
            self.rg_lru.register_parameter(f"{gate}_weight", nn.Parameter(torch.zeros(heads, block, block)))
            self.rg_lru.register_parameter(f"{gate}_bias", nn.Parameter(torch.zeros(heads, block)))

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, conv_state: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`biases`: unused (attention's argument); the states are the committed ones."""
        y = nn.functional.gelu(self.linear_y(x), approximate="tanh")
        x_in = self.linear_x(x)
        reset = (rotary["positions"] == 0).to(x.dtype).unsqueeze(-1)  # [b, q, 1]
        flags = torch.cat((1 - reset, reset), dim=-1)
        outs, convs, states = [], [], []
        for t in range(x.shape[1]):
            out, conv_state, state = self.step(x_in[:, t], flags[:, t], conv_state, state)
            outs.append(out)
            convs.append(conv_state)
            states.append(state)
        return self.linear_out(torch.stack(outs, dim=1) * y), torch.stack(convs, dim=1), torch.stack(states, dim=1)

    def step(self, x_in: torch.Tensor, flags: torch.Tensor, conv_state: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: its conv input x [b, width], its flags keep | reset [b, 2] and the states before it -> its
        output (the new state) and the states after it."""
        window = torch.cat((conv_state, x_in.unsqueeze(-1)), dim=-1)  # [b, width, K]
        x = (window * self.conv_1d.weight[:, 0, :]).sum(dim=-1) + self.conv_1d.bias
        lru, heads = self.rg_lru, self.h.num_v_heads
        blocks = x.reshape(x.shape[0], heads, 1, -1)  # [b, H, 1, block]
        gate_i = torch.sigmoid((blocks @ lru.input_gate_weight).squeeze(-2) + lru.input_gate_bias).reshape(x.shape)
        gate_r = torch.sigmoid((blocks @ lru.recurrent_gate_weight).squeeze(-2) + lru.recurrent_gate_bias).reshape(x.shape)
        log_a = -8.0 * gate_r * nn.functional.softplus(lru.recurrent_param)
        keep, reset = flags[:, :1], flags[:, 1:]
        factor = keep * torch.sqrt(1 - torch.exp(2 * log_a)) + reset
        state = torch.exp(log_a) * (1 - reset) * state + x * gate_i * factor
        return state, window[..., 1:], state

    def empty_states(self, batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The states before the first token: zeros."""
        return [torch.zeros((batch, *self.h.conv_state_shape()), dtype=dtype),
                torch.zeros((batch, *self.h.recurrent_state_shape()), dtype=dtype)]
