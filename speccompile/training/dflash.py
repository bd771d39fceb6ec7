"""Self-distillation of a DFlash block drafter (`train-draft --method dflash`), on the same cached target features
as EAGLE-3 (the taps (2, L//2, L-3)) and the same top-k labels.

Each training sequence gets `anchors` random anchor positions a; the block of anchor a is [x_a, mask, ...,
mask] at positions a..a+B-1 and sees the context features of positions < a plus its own rows (non-causal),
exactly what a drafting pass sees. Block slot j (1..B-1) is trained towards the target's distribution at
position a+j-1 (the distribution of x_{a+j}), weighted exp(-(j-1)/gamma) as DFlash does: early slots matter
most, a block is accepted up to its first miss. All anchors of a batch run in one forward pass (one
[anchors*B, T + anchors*B] mask). Embeddings and the lm_head are the target's and stay frozen.
"""

from __future__ import annotations

import math

import numpy as np

GAMMA = 4.0  # position weight decay (speculators' default dflash_decay_gamma)


def new_training_drafter(model, options):
    """A fresh drafter for `model` reading EAGLE-3's default taps, block `options.block_size`."""
    from ..models.dflash_io import new_dflash

    return new_dflash(model.config, model.weights, block_size=options.block_size, seed=options.seed)


def frozen_parameters() -> set[str]:
    """Parameters taken from the target and not trained."""
    return {"embed_tokens.weight", "lm_head.weight"}


def anchor_layout(t: int, block: int, anchors: np.ndarray, torch):
    """Block positions [A*B], and the mask [A*B, t + A*B] of A anchor blocks over a t-token sequence."""
    a = torch.from_numpy(anchors).long()
    count = len(anchors)
    positions = (a[:, None] + torch.arange(block)[None, :]).reshape(-1)
    ctx = torch.arange(t)[None, :] < a[:, None]  # [A, t]: positions before the anchor
    own = torch.eye(count, dtype=torch.bool)  # [A, A]: a block sees only itself
    ctx = ctx.repeat_interleave(block, dim=0)
    own = own.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return positions, torch.cat([ctx, own], dim=1)


def dflash_loss(head, tokens, hidden, top_idx, top_p, rng: np.random.Generator, soft_ce, hits):
    """Weighted block loss over a batch of [b, T] sequences; stats acc{j-1} = top-1 agreement of slot j."""
    import torch

    b, t = tokens.shape
    block = head.head_config.block_size
    mask_id = head.head_config.mask_token_id
    count = max(1, min(t - block, t // block))
    anchors = np.sort(rng.choice(np.arange(1, t - block + 2), size=count, replace=False))
    positions, mask = anchor_layout(t, block, anchors, torch)
    ids = torch.full((b, count * block), mask_id, dtype=torch.long)
    ids[:, ::block] = tokens[:, anchors]
    pos = positions.expand(b, -1)
    ctx_pos = torch.arange(t).expand(b, -1)
    x, _ = head.blocks(ids, pos, mask.expand(b, -1, -1), hidden, ctx_pos)
    logits = head.lm_head(head.norm(x)).float().view(b, count, block, -1)
    total = 0.0
    stats: dict[str, float] = {}
    label_rows = torch.from_numpy(anchors).long()[:, None] + torch.arange(block - 1)[None, :]  # a + j - 1, j = 1..B-1
    lab_idx, lab_p = top_idx[:, label_rows], top_p[:, label_rows]  # [b, A, B-1, k]
    norm = sum(math.exp(-j / GAMMA) for j in range(block - 1))
    for j in range(1, block):
        valid = torch.ones(b, count, dtype=torch.bool)
        ce, ok = soft_ce(logits[:, :, j], lab_idx[:, :, j - 1], lab_p[:, :, j - 1], valid)
        total = total + ce * math.exp(-(j - 1) / GAMMA) / norm
        hit, seen = hits(logits[:, :, j].detach(), lab_idx[:, :, j - 1], ok)
        stats[f"acc{j - 1}"] = hit / max(seen, 1)
    return total, stats
