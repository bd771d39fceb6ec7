"""The torch reference of a mixture-of-experts block (models/moe_config.py says what each family does).

Parameter names equal the Hugging Face per-expert checkpoints' (`mlp.gate.weight`, `mlp.experts.3.up_proj.weight`,
Mixtral's `block_sparse_moe.experts.3.w3.weight`, ...), so their state dicts load as is. The block computes what
the graphs compute (export/moe_ops.py): every row's routing from that row alone, then the sum over its experts
in expert order of weight * expert(row), starting from zero, plus Qwen2-MoE's gated shared expert. Gemma 4's block
sits beside the layer's dense MLP (`attach_beside_dense`, `beside_dense`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .feed_forward import MLP, activation
from .moe_config import MoeConfig
from .trace_ops import static_reshape


def swiglu(gate: torch.Tensor, up: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """act(gate) * up (SiLU; Gemma 4: GELU), or gpt-oss' clamped form gate * sigmoid(alpha * gate) * (up + 1), or
    Bailing's clamp after the activation (`clip`)."""
    if moe.clip:
        return activation(gate, moe.act).clamp(max=moe.clip) * up.clamp(min=-moe.clip, max=moe.clip)
    if not moe.swiglu_limit:
        return activation(gate, moe.act) * up
    gate = gate.clamp(max=moe.swiglu_limit)
    up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))


class Expert(nn.Module):
    """One SwiGLU expert; its three Linear modules carry the family's names (gate_proj/up_proj/down_proj, w1/w3/w2).
    Ungated (`expert_gated` False, Nemotron-H): down(act(up x)), no gate module."""

    def __init__(self, hidden: int, inter: int, moe: MoeConfig, names: tuple[str, str, str] | None = None,
                 bias: bool = False):
        super().__init__()
        self.moe = moe
        self.names = names or moe.projections
        gate, up, down = self.names
        if moe.expert_gated:
            setattr(self, gate, nn.Linear(hidden, inter, bias=bias))
        setattr(self, up, nn.Linear(hidden, inter, bias=bias))
        setattr(self, down, nn.Linear(inter, hidden, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self, n) for n in self.names[1:])
        if not self.moe.expert_gated:
            return down(activation(up(x), self.moe.act))
        return down(swiglu(getattr(self, self.names[0])(x), up(x), self.moe))


def route(logits: torch.Tensor, moe: MoeConfig, score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert indices) [rows, top_k] of router logits [rows, experts] (`score_bias`: sigmoid_group's
    e_score_correction_bias). Positive axes: torch's TorchScript exporter (the traced MTP module) lost a tensor's
    rank after a run-time Reshape."""
    if moe.routing in ("sigmoid_group", "softmax_group"):
        return _group_route(logits, moe, score_bias)
    if moe.routing == "sparsemixer":
        return _sparsemixer(logits, moe.jitter_eps)
    if moe.routing == "topk_softmax":
        values, index = torch.topk(logits, moe.top_k, dim=1)
        return torch.softmax(values, dim=1), index
    if moe.routing == "topk_sigmoid":
        values, index = torch.topk(logits, moe.top_k, dim=1)
        values = torch.sigmoid(values)
    else:
        values, index = torch.topk(torch.softmax(logits, dim=1), moe.top_k, dim=1)
    if moe.norm_topk_prob:
        values = values / values.sum(dim=1, keepdim=True)
    return values, index


def _sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-MoE's sparsemixer at inference: twice, the best remaining logit m wins, weighted by its softmax among the
    remaining logits s with (m - s) / max(|s|, m) <= 2 eps (transformers' `sparsemixer`, training false)."""
    scores, weights, indices = logits, [], []
    for _ in range(2):
        top, index = torch.topk(scores, 1, dim=1)
        far = (top - logits) / torch.maximum(logits.abs(), top) > 2 * eps
        weights.append(torch.softmax(scores.masked_fill(far, float("-inf")), dim=1).gather(1, index))
        indices.append(index)
        scores = scores.scatter(1, index, float("-inf"))
    return torch.cat(weights, dim=1), torch.cat(indices, dim=1)


def _group_route(logits: torch.Tensor, moe: MoeConfig, score_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited routing. sigmoid_group (V3): sigmoid scores, a group scored by the sum of its top 2
    biased scores, the rest -inf; softmax_group (V2): softmax scores, a group scored by its largest, the rest 0. The
    choice among the best topk_group groups; weights the (unbiased) scores, renormalised when norm_topk_prob, scaled."""
    sigmoid = moe.routing == "sigmoid_group"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=1)
    choice = scores if score_bias is None else scores + score_bias.to(torch.float32)
    grouped = choice.reshape(choice.shape[0], moe.n_group, -1)
    group_scores = torch.topk(grouped, 2, dim=2)[0].sum(dim=2) if sigmoid else grouped.amax(dim=2)
    groups = torch.topk(group_scores, moe.topk_group, dim=1)[1]
    keep = torch.zeros_like(group_scores).scatter(1, groups, 1.0).unsqueeze(2).expand_as(grouped).reshape(choice.shape)
    index = torch.topk(choice.masked_fill(keep == 0, float("-inf") if sigmoid else 0.0), moe.top_k, dim=1)[1]
    values = scores.gather(1, index)
    if moe.norm_topk_prob:
        values = values / (values.sum(dim=1, keepdim=True) + moe.renorm_eps)
    return values * moe.routed_scale, index


class SparseMoe(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.moe, self.hidden = moe, hidden
        setattr(self, moe.router, nn.Linear(hidden, moe.num_experts, bias=moe.router_bias))
        if moe.score_bias:  # DeepSeek-V3: `gate.e_score_correction_bias`
            getattr(self, moe.router).register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))
        if moe.routing == "normed_softmax_topk":  # Gemma 4: the router input's gain, each expert's weight multiplier
            getattr(self, moe.router).scale = nn.Parameter(torch.ones(hidden))
            getattr(self, moe.router).per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.experts = nn.ModuleList(Expert(hidden, moe.expert_size, moe, bias=moe.expert_bias)
                                     for _ in range(moe.num_experts))
        if moe.shared_expert_size:
            plain = MoeConfig(1, 1, moe.shared_expert_size, clip=moe.shared_clip) if moe.expert_gated else \
                MoeConfig(1, 1, moe.shared_expert_size, act=moe.act, expert_gated=False)
            setattr(self, moe.shared_name, Expert(hidden, moe.shared_expert_size, plain, ("gate_proj", "up_proj", "down_proj")))
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if moe.shared_gated else None

    def forward(self, x: torch.Tensor, expert_x: torch.Tensor | None = None) -> torch.Tensor:
        """The block on `x` [..., hidden]; `expert_x`: the experts' input where it is not the router's (Gemma 4)."""
        router = getattr(self, self.moe.router)
        bias = router.e_score_correction_bias if self.moe.score_bias else None
        flat = static_reshape(x, -1, self.hidden)  # rows [N, hidden]
        normed = self.moe.routing == "normed_softmax_topk"
        logits = router(_router_input(flat, router.scale, self.moe.router_eps) if normed else flat)
        weights, index = route(logits.to(torch.float32), self.moe, bias)  # in float32, as the graphs
        if normed:
            weights = weights * router.per_expert_scale.to(torch.float32)[index]
        weights = weights.to(x.dtype)
        x = x if expert_x is None else expert_x
        flat = static_reshape(x, -1, self.hidden)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):  # rows by index, no branch on the data: the traced heads' graph too
            chosen = index == e  # [N, top_k]: at most one true per row
            rows = torch.nonzero(chosen.any(dim=1)).reshape(-1)
            weight = (weights * chosen).sum(dim=1, keepdim=True).index_select(0, rows)
            chosen_x = flat.index_select(0, rows)
            y = expert(chosen_x * weight) if self.moe.scale_input else expert(chosen_x) * weight  # Llama 4: the input scaled
            out = out.index_put((rows,), out.index_select(0, rows) + y)
        out = out.reshape_as(x)
        if self.moe.shared_expert_size:
            shared = getattr(self, self.moe.shared_name)(x)
            out = out + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
            out = out / 2 if self.moe.shared_average else out
        return out


def _router_input(flat: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's router input: the rows' RMS norm without a gain (in float32), times `scale` and 1 / sqrt(hidden)."""
    x32 = flat.to(torch.float32)
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(flat.dtype)
    return normed * scale * torch.tensor(flat.shape[-1] ** -0.5, dtype=flat.dtype)


def attach_beside_dense(layer: nn.Module, config: ModelConfig, i: int, norm_of: Callable[[ModelConfig], nn.Module]) -> None:
    """Gemma 4's MoE layer i: the dense MLP (`mlp`) beside the experts, and the norms around them (BESIDE_ROLES)."""
    layer.mlp = MLP(config.layer(i))
    layer.dense_out_norm, layer.moe_in_norm, layer.moe_out_norm = (norm_of(config) for _ in range(3))


def beside_dense(layer: nn.Module, moe_block_name: str, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dense_out_norm(mlp(h)) + moe_out_norm(experts(moe_in_norm(x)) routed by x): `h` the MLP's normed input,
    `x` the residual stream; the experts: the layer's module `moe_block_name`."""
    return layer.dense_out_norm(layer.mlp(h)) + layer.moe_out_norm(getattr(layer, moe_block_name)(x, layer.moe_in_norm(x)))
