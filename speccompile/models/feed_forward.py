"""The decoder's MLP (gated or plain, its activations) and the fused projections it shares with the attention."""

from __future__ import annotations

import torch
from torch import nn

from .bitnet import act_quant
from .config import ModelConfig


def fused_linear(x: torch.Tensor, layers: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """Several Linear layers on the same input as one matmul (q/k/v, gate/up), then split.

    The exporter folds the concatenated weight into one initializer, so the graph has one larger
    MatMul instead of several small ones (fewer kernel launches and thread-pool dispatches per step).
    Parameters keep their Hugging Face names.
    """
    weight = torch.cat([layer.weight for layer in layers], dim=0)
    biases = [layer.bias for layer in layers]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    out = nn.functional.linear(x, weight, bias)
    return tuple(torch.split(out, [layer.out_features for layer in layers], dim=-1))


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """ModelConfig.mlp_act `kind` of `x` (xIELU, with learned scalars, is the `XIELU` module)."""
    if kind == "relu2":  # Nemotron / Arcee: relu(x) ** 2
        return torch.square(nn.functional.relu(x))
    if kind == "relu":  # OPT
        return nn.functional.relu(x)
    if kind in ("gelu", "gelu_tanh"):  # exact (erf) or tanh GELU
        return nn.functional.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")
    return nn.functional.silu(x)


def sparsity_multiplier(sparsity: float) -> float:
    """Phi^-1(sparsity) in float32, as transformers computes it (torch's Normal(0, 1).icdf)."""
    return float(torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32)))


def gaussian_topk(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """relu(x - (mean + std * Phi^-1(sparsity))) over the last axis (std: the population's)."""
    multiplier = torch.tensor(sparsity_multiplier(sparsity), dtype=x.dtype)
    cutoff = x.mean(-1, keepdim=True) + torch.std(x, dim=-1, keepdim=True, unbiased=False) * multiplier
    return nn.functional.relu(x - cutoff)


class XIELU(nn.Module):
    """transformers' xIELU (Apertus) on its learned scalars, each [1] (the checkpoint's beta / eps: models/hf_layouts.py)."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n, self.beta, self.eps = (nn.Parameter(torch.zeros(1)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n = nn.functional.softplus(self.alpha_p), self.beta + nn.functional.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


class MLP(nn.Module):
    """down(act(gate) * up), gate and up from one matmul (biases where `mlp_bias`: RecurrentGemma); or, not `mlp_gated`, down(act(up)) (Phi-2)."""

    def __init__(self, config: ModelConfig, sparsity: float = 0.0):
        super().__init__()
        bias, self.sparsity = config.mlp_bias, sparsity  # sparsity: the gate's Gaussian top-k (Gemma 3n, models/altup.py)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias) if config.mlp_gated else None
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = config.mlp_act
        self.act_fn = XIELU() if self.act == "xielu" else None
        self.ffn_sub_norm: nn.Module | None = None  # BitNet: the norm of down_proj's input (set by the layer)
        self.quant = config.act_quant  # BitNet: the projections' inputs through int8 and back (models/bitnet.py)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(x) if self.act_fn is not None else activation(x, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = act_quant(x) if self.quant else x
        if self.gate_proj is None:
            return self._down(self._act(self.up_proj(x)))
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj))
        if self.sparsity:
            gate = gaussian_topk(gate, self.sparsity)
        return self._down(self._act(gate) * up)

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        h = h if self.ffn_sub_norm is None else self.ffn_sub_norm(h)
        return self.down_proj(act_quant(h) if self.quant else h)
