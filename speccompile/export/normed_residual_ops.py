"""MiniMax-01's decoder layer residuals for the contract and the fused CPU graph (models/normed_residual.py is the torch
reference): each block's residual is its normed input, both sides scaled (`ModelConfig.residual_factors`)."""

from __future__ import annotations

from typing import Callable

from .emitter import Emitter
from .recipes import np_dtype


def normed_residual_nodes(em: Emitter, factors: list[float], h: str, attn: str, post_norm: Callable[[str, str], str],
                          mlp: Callable[[str], str]) -> tuple[str, str]:
    """Layer output's two terms (alpha_mlp z, beta_mlp mlp(z)), z = post_norm(beta_attn attn, alpha_attn h): the norm
    of their sum (a builder may fuse the add into the norm); `h` the normed input, `attn` the attention output."""
    attn_alpha, attn_beta, mlp_alpha, mlp_beta = factors
    z = post_norm(scaled(em, attn, attn_beta), scaled(em, h, attn_alpha))
    return scaled(em, z, mlp_alpha), scaled(em, mlp(z), mlp_beta)


def scaled(em: Emitter, x: str, factor: float, key: str = "") -> str:
    """x times `factor`, a constant under `key` (default: by its value); no node for 1, the same bits (Granite's
    residual multiplier too)."""
    return x if factor == 1.0 else em.one("Mul", [x, em.const(key or f"residual_factor.{factor!r}", factor, np_dtype(em.dtype))])
