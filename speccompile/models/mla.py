"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight) in its absorbed form: the torch reference.

The cache holds one vector per token, [k_pe, c_kv]: the roped key part shared by every head (rotary_dim values)
and the compressed latent after kv_a_layernorm (kv_lora_rank values): one KV head of head_dim = rotary_dim +
kv_lora_rank, read as both key and value. kv_b_proj, [heads * (nope + v), kv_lora_rank], is never applied to the
cache: per head h its first `nope` rows W_UK_h move the query into the latent space (q_nope_h @ W_UK_h), its
last `v` rows W_UV_h take the attention's latent output back (latent_h @ W_UV_h^T), so

    score(h, j) = q_pe_h . k_pe_j + (q_nope_h @ W_UK_h) . c_kv_j = transformers' q_h . k_h,j
    out_h       = (sum_j p_hj c_kv_j) @ W_UV_h^T                  = transformers' sum_j p_hj v_h,j

with the sums taken in another order (docs/DESIGN.md, "Multi-head latent attention"). The graphs compute the
same ops (export/mla_ops.py); the per-head products keep >= 2 rows (`with_last_row`) so that ONNX Runtime runs
one GEMM kernel whatever the pass's rows.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .rotary import apply_rope
from .trace_ops import drop_last_row, static_reshape, with_last_row


def absorbed_weights(kv_b: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [heads, nope, rank], W_UV^T [heads, rank, v]) of kv_b_proj's weight [heads * (nope + v), rank]."""
    per_head = kv_b.reshape(config.num_attention_heads, config.qk_nope_head_dim + config.v_head_dim, config.kv_lora_rank)
    w_uk, w_uv = torch.split(per_head, [config.qk_nope_head_dim, config.v_head_dim], dim=1)
    return w_uk, w_uv.transpose(1, 2)


class LatentAttention(nn.Module):
    """MLA over past + new latent vectors with an explicit bias; returns (output, keys, values) as `Attention`."""

    def __init__(self, config: ModelConfig, norm_of: Callable[[ModelConfig, int], nn.Module], layer: int = 0):
        """`norm_of(config, size)`: the family's norm module (models.decoder.norm_of)."""
        super().__init__()
        self.config, self.layer = config, layer
        c = config
        heads, rank, rope = c.num_attention_heads, c.kv_lora_rank, c.rope_dim
        q_out = heads * (c.qk_nope_head_dim + rope)
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = norm_of(c, c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, rank + rope, bias=False)
        self.kv_a_layernorm = norm_of(c, rank)
        self.kv_b_proj = nn.Linear(rank, heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * c.v_head_dim, c.hidden_size, bias=False)
        if c.attn_head_gate:  # Bailing: each head's output times sigmoid(g_proj(x))
            self.g_proj = nn.Linear(c.hidden_size, heads, bias=False)

    def _query_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, heads, q, nope + rope], k_pe [b, q, rope] and c_kv [b, q, rank] (normed), before rope."""
        c = self.config
        first = self.q_a_proj if c.q_lora_rank else self.q_proj
        both = nn.functional.linear(x, torch.cat((first.weight, self.kv_a_proj_with_mqa.weight), dim=0))
        q, c_kv, k_pe = torch.split(both, [first.out_features, c.kv_lora_rank, c.rope_dim], dim=2)
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = static_reshape(q, 0, 0, c.num_attention_heads, -1).transpose(1, 2)
        return q, k_pe, self.kv_a_layernorm(c_kv)

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, past_k: torch.Tensor,
                past_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        heads, rope, dim = c.num_attention_heads, c.rope_dim, c.head_dim
        q, k_pe, c_kv = self._query_and_latent(x)
        q_nope, q_pe = torch.split(q, [c.qk_nope_head_dim, rope], dim=3)
        w_uk, w_uv = absorbed_weights(self.kv_b_proj.weight, c)
        q_latent = drop_last_row(torch.matmul(with_last_row(q_nope), w_uk))  # [b, heads, q, rank]
        query, key = torch.cat((q_pe, q_latent), dim=3), torch.cat((k_pe, c_kv), dim=2).unsqueeze(1)  # [b, heads | 1, q, dim]
        if c.rope_kind(self.layer):  # Kimi Linear's latent attention: no rope (NoPE), k_pe as it is
            query, key = (apply_rope(t, *rotary["global"], c) for t in (query, key))
        k_all = torch.cat((past_k, key), dim=2)
        v_all = torch.cat((past_v, key), dim=2)
        bias = biases[False]  # [b, 1, heads * q, T]
        qg = static_reshape(query, 0, 1, -1, dim)
        scores = torch.matmul(qg, k_all.transpose(2, 3)).to(torch.float32) * c.scale
        probs = torch.softmax(scores + bias, dim=3).to(v_all.dtype)
        context = static_reshape(torch.matmul(probs, v_all), 0, heads, -1, dim)[..., rope:]
        out = drop_last_row(torch.matmul(with_last_row(context), w_uv)).transpose(1, 2)  # [b, q, heads, v]
        if c.attn_head_gate:
            out = out * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        out = static_reshape(out, 0, -1, heads * c.v_head_dim)
        return self.o_proj(out), k_all, v_all
