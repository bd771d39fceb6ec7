"""The torch reference's attention masks: a boolean [b, q, T] mask (true = may attend), a sliding layer's and a
chunked layer's cut of it, and the additive bias `decoder.Attention` takes."""

from __future__ import annotations

import torch


def mask_to_bias(attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean mask (true = may attend) -> additive float bias (0 or a large negative number)."""
    zero = torch.zeros((), dtype=dtype)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype)
    return torch.where(attention_mask, zero, neg)


def sliding_mask(attention_mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """`attention_mask` [b, q, T] without the key slots j at position - j >= window (a sliding layer's mask)."""
    slots = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return attention_mask & ((position_ids.unsqueeze(-1) - slots) < window)


def chunk_mask(attention_mask: torch.Tensor, position_ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """`attention_mask` [b, q, T] without the keys of positions before the query's chunk (p - p % chunk; Llama 4's
    chunked layers): a past key's position is its slot, the pass's own keys' (the last q slots) their `position_ids`."""
    slots = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    past = attention_mask.shape[-1] - position_ids.shape[1]
    own = position_ids.gather(1, (slots - past).clamp(min=0).unsqueeze(0).expand(position_ids.shape[0], -1))
    keys = torch.where(slots < past, slots, own)  # [b, T]
    return attention_mask & (keys.unsqueeze(1) >= (position_ids - position_ids % chunk).unsqueeze(-1))


def attention_bias(attention_mask: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Boolean [b, q, T] mask -> the additive bias `Attention` expects: [b, 1, groups*q, T].

    Attention folds the query heads of each KV group into the row axis (row = group * q + position),
    so the bias is tiled once per forward instead of once per layer.
    """
    bias = mask_to_bias(attention_mask).unsqueeze(1)
    groups = num_heads // num_kv_heads
    return bias.repeat(1, 1, groups, 1) if groups > 1 else bias
