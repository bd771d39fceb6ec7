"""The DFlash block drafter as an export-friendly torch module (docs/DESIGN.md, "DFlash: a block drafter").

DFlash (z-lab, "Block Diffusion for Flash Speculative Decoding") drafts a whole block in one pass: the block
is the pending token followed by ``block_size - 1`` mask tokens, embedded with the target's embeddings; its
rows attend *non-causally* to each other and to the context, the target's tap features of every committed
position. A tap feature is the concatenation of the residual stream at a few target layers (the inputs of
layers ``tap_layers``), fused by ``fc`` [H, n_taps * H_t] and normalised by ``hidden_norm``; each draft layer
projects it with its own ``k_proj`` / ``v_proj`` (then ``k_norm`` and RoPE at the context position), so the
context lives in a per-layer KV cache that holds committed rows only. The layers are Qwen3 layers (q/k
norms); ``norm`` then an lm_head (the target's, or the checkpoint's own over a draft vocabulary with
``d2t``) gives the logits of the block positions that predict (1..B-1; with ``sample_from_anchor``, as DSpark
trains, 0..B-1, position j then predicting the token after it).

Graph interface (one pass per block): ``input_ids`` / ``position_ids`` [b, B] (the block, at positions
n..n+B-1 when the pending token sits at n), ``attention_mask`` bool [b, B, past + c + B], ``aux_hidden_states``
[b, c, n_taps * H_t] (the c context rows not yet cached: positions n-c..n-1), ``past_key_values.{l}.key/value``;
outputs ``logits`` [b, B or B-1, V_draft] and ``present.{l}.key/value`` = past + the c new context rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import ModelConfig
from .decoder import MLP, RMSNorm, RotaryEmbedding, apply_rope
from .masks import mask_to_bias


@dataclass
class DFlashConfig:
    """A DFlash drafter: its layers' shape, the target taps it reads, its block and mask token."""

    layer: ModelConfig  # one draft layer (Qwen3: q/k norms); num_hidden_layers = number of draft layers
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    block_size: int
    mask_token_id: int
    tap_layers: list[int] = field(default_factory=list)  # inputs of these target layers (z-lab ids + 1)
    sample_from_anchor: bool = False  # slot 0 predicts too (DSpark's default): B drafts per block, else B - 1
    has_embed: bool = False  # the checkpoint carries its own embed_tokens
    has_lm_head: bool = False  # the checkpoint carries its own lm_head (speculators layout)
    layout: str = "z-lab"  # the published layout it was read from: z-lab | speculators

    kind = "dflash"

    @property
    def num_layers(self) -> int:
        return self.layer.num_hidden_layers

    @property
    def drafts_per_block(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "dflash",
            "layer": self.layer.to_dict(),
            "target_hidden_size": self.target_hidden_size,
            "target_vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "tap_layers": list(self.tap_layers),
            "sample_from_anchor": self.sample_from_anchor,
            "layout": self.layout,
        }


def zlab_default_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default target layers when a config names none, in *output-of-layer* numbering."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class DFlashAttention(nn.Module):
    """Block queries over cached context keys + new context keys + the block's own keys, no causal mask."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope_config = cfg  # which dims rotate, and how (partial rotary: the first rope_dim)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin, self.rope_config)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of the context rows [b, kv, c, d]."""
        k = self._rope(self.k_norm(self._heads(self.k_proj(ctx), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(ctx), self.num_kv_heads)

    def forward(self, x, cos, sin, past_k, past_v, bias):
        """x [b, B, H] (normed block rows); past_k/v: cached + new context [b, kv, P+c, d]; bias [b, 1, B, P+c+B]."""
        b, q_len, _ = x.shape
        q = self._rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k = self._rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        k_all = torch.cat((past_k, k), dim=2)
        v_all = torch.cat((past_v, self._heads(self.v_proj(x), self.num_kv_heads)), dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k_all, v_all = k_all.repeat_interleave(groups, dim=1), v_all.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k_all.transpose(2, 3)).to(torch.float32) * (1.0 / math.sqrt(self.head_dim))
        probs = torch.softmax(scores + bias, dim=-1).to(v_all.dtype)
        out = torch.matmul(probs, v_all).transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context keys/values."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, past_k, past_v, bias):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v, bias)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the taps, `num_layers` DFlash layers over the block, norm, lm_head (module docstring)."""

    kind = "dflash"

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.markov: tuple[torch.Tensor, torch.Tensor] | None = None  # DSpark Markov head (W1, W2): dflash_io.py
        self.head_config = config
        c = config.layer
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        self.fc = nn.Linear(len(config.tap_layers) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(c)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))

    @property
    def input_names(self) -> list[str]:
        names = ["input_ids", "position_ids", "attention_mask", "aux_hidden_states"]
        for i in range(self.head_config.num_layers):
            names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        return names

    @property
    def output_names(self) -> list[str]:
        names = ["logits"]
        for i in range(self.head_config.num_layers):
            names += [f"present.{i}.key", f"present.{i}.value"]
        return names

    def forward(self, input_ids, position_ids, attention_mask, aux_hidden_states, *past):
        """One block pass (module docstring); `past` is the flat (k0, v0, k1, v1, ...) context cache."""
        positions = context_positions(position_ids, aux_hidden_states)
        x, presents = self.blocks(input_ids, position_ids, attention_mask, aux_hidden_states, positions, past)
        start = 0 if self.head_config.sample_from_anchor else 1
        logits = self.lm_head(self.norm(x[:, start:])).to(torch.float32)
        return (logits, *presents)

    def blocks(self, input_ids, position_ids, attention_mask, aux, aux_positions, past=()):
        """The layers over block rows `input_ids` [b, Q] (any number of blocks, the mask [b, Q, P + c + Q] says
        which context and block rows each sees) and context taps `aux` [b, c, F] at `aux_positions`; returns
        the last layer's rows [b, Q, H] and the per-layer context caches (past + c rows)."""
        x = self.embed_tokens(input_ids)
        ctx = self.hidden_norm(self.fc(aux))
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        ccos, csin = self.rotary_emb(aux_positions, x.dtype)
        bias = mask_to_bias(attention_mask).unsqueeze(1)
        presents = []
        for i, layer in enumerate(self.layers):
            k_all, v_all = layer.self_attn.context_kv(ctx, ccos, csin)
            if past:
                k_all, v_all = torch.cat((past[2 * i], k_all), dim=2), torch.cat((past[2 * i + 1], v_all), dim=2)
            presents += [k_all, v_all]
            x = layer(x, cos, sin, k_all, v_all, bias)
        return x, presents

    def empty_past(self, batch: int = 1, length: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
        c = self.head_config.layer
        return [torch.zeros(batch, c.num_key_value_heads, length, c.head_dim, dtype=dtype) for _ in range(2 * c.num_hidden_layers)]

    def draft_to_target(self) -> torch.Tensor:
        """Target token id of every draft-vocabulary entry."""
        return torch.arange(self.head_config.draft_vocab_size) + self.d2t


def context_positions(position_ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Positions of the c context rows: the c positions just before the block's first ([b, c], traceable)."""
    ones = torch.ones_like(aux[..., 0], dtype=torch.int64)
    count = ones.sum(dim=-1, keepdim=True)
    return position_ids[:, :1] - count + ones.cumsum(dim=-1) - 1
