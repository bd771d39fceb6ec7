"""MiniMax-01's decoder layer residuals (transformers' `MiniMaxDecoderLayer`; `ModelConfig.residual_factors`): each
block's residual is its normed input, both sides scaled: h = input_norm(x), y = alpha_attn h + beta_attn attn(h),
z = post_norm(y), out = alpha_mlp z + beta_mlp mlp(z)."""

from __future__ import annotations

from typing import Callable

import torch


def normed_residual(factors: list[float], h: torch.Tensor, attn: torch.Tensor, post_norm: Callable[[torch.Tensor], torch.Tensor],
                    mlp: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The layer's output of its normed input `h` and its attention (or lightning attention) output `attn`."""
    attn_alpha, attn_beta, mlp_alpha, mlp_beta = factors
    z = post_norm(h * attn_alpha + attn * attn_beta)
    return z * mlp_alpha + mlp(z) * mlp_beta
