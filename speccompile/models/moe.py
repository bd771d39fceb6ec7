"""The torch reference of a mixture-of-experts block (models/moe_config.py says what each family does).

Parameter names equal the Hugging Face per-expert checkpoints' (`mlp.gate.weight`, `mlp.experts.3.up_proj.weight`,
Mixtral's `block_sparse_moe.experts.3.w3.weight`, ...), so their state dicts load as is. The block computes what
the graphs compute (export/moe_ops.py): every row's routing from that row alone, then the sum over its experts
in expert order of weight * expert(row), starting from zero, plus Qwen2-MoE's gated shared expert.
"""

from __future__ import annotations

import torch
from torch import nn

from .moe_config import MoeConfig


def swiglu(gate: torch.Tensor, up: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """SiLU(gate) * up, or gpt-oss' clamped form gate * sigmoid(alpha * gate) * (up + 1)."""
    if not moe.swiglu_limit:
        return nn.functional.silu(gate) * up
    gate = gate.clamp(max=moe.swiglu_limit)
    up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))


class Expert(nn.Module):
    """One SwiGLU expert; its three Linear modules carry the family's names (gate_proj/up_proj/down_proj, w1/w3/w2)."""

    def __init__(self, hidden: int, inter: int, moe: MoeConfig, names: tuple[str, str, str] | None = None,
                 bias: bool = False):
        super().__init__()
        self.moe = moe
        self.names = names or moe.projections
        gate, up, down = self.names
        setattr(self, gate, nn.Linear(hidden, inter, bias=bias))
        setattr(self, up, nn.Linear(hidden, inter, bias=bias))
        setattr(self, down, nn.Linear(inter, hidden, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(swiglu(gate(x), up(x), self.moe))


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert indices) [..., top_k] of router logits [..., experts]."""
    if moe.routing == "topk_softmax":
        values, index = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(values, dim=-1), index
    values, index = torch.topk(torch.softmax(logits, dim=-1), moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, index


class SparseMoe(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.moe = moe
        setattr(self, moe.router, nn.Linear(hidden, moe.num_experts, bias=moe.router_bias))
        self.experts = nn.ModuleList(Expert(hidden, moe.expert_size, moe, bias=moe.expert_bias)
                                     for _ in range(moe.num_experts))
        if moe.shared_expert_size:
            plain = MoeConfig(1, 1, moe.shared_expert_size)
            self.shared_expert = Expert(hidden, moe.shared_expert_size, plain, ("gate_proj", "up_proj", "down_proj"))
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = route(getattr(self, self.moe.router)(x).to(torch.float32), self.moe)  # in float32, as the graphs
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = index == e  # [..., top_k]: at most one true per row
            rows = chosen.any(dim=-1)
            if bool(rows.any()):
                weight = (weights * chosen).sum(dim=-1, keepdim=True)[rows]
                out[rows] = out[rows] + expert(x[rows]) * weight
        if self.moe.shared_expert_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
