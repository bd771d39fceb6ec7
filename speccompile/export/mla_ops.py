"""Multi-head latent attention (DeepSeek-V2/V3) as ONNX nodes, for the contract and fused graph builders.

The absorbed form of models/mla.py: the cache is one KV head of [k_pe, c_kv] (rotary_dim + kv_lora_rank values),
used as key and value; a query head is [q_pe, q_nope @ W_UK_h]; the attention's output keeps its latent part and
leaves through W_UV_h^T, then o_proj. Rope covers the first rotary_dim dims of the query heads and of the key,
which is GroupQueryAttention's partial rotary, so the fused CPU graph runs the ordinary operator (kv_num_heads 1,
head_size rotary_dim + kv_lora_rank). W_UK and W_UV^T are slices of kv_b_proj's weight [heads * (nope + v), rank],
computed from the initializer by Reshape / Split / Transpose (ONNX Runtime folds them when it loads the graph).

The per-head products are batched MatMuls [heads, rows, K] @ [heads, K, N]. ONNX Runtime CPU does not prepack a
3-D weight and multiplies a one-row matrix with MLAS's GEMV kernel, whose sums run in another order than the
GEMM kernel's; a copy of the last row is appended before each product and dropped after (rows >= 2 always), so
a row's bits do not depend on the pass's rows.
"""

from __future__ import annotations

from typing import Callable

from ..models.config import ModelConfig
from .moe_ops import Emitter
from .recipes import layer_recipe


def mla_weight(em: Emitter, cfg: ModelConfig, i: int, role: str) -> str:
    """Layer i's initializer of latent attention role `role` (the contract graph's name: layers.{i}.{role})."""
    return em.weight(f"layers.{i}.{role}", layer_recipe(cfg, i, role, em.dtype))


def latent_inputs(em: Emitter, cfg: ModelConfig, i: int, h: str, norm: Callable[[str, str], str],
                  gates: dict[int, str]) -> tuple[str, str]:
    """(q [b, s, heads * (nope + rope)], key [b, s, rope + rank] = [k_pe, kv_a_layernorm(c_kv)], before rope) of
    `h`: q_a_proj (or q_proj) and kv_a_proj_with_mqa as one MatMul; `norm(x, role)` is the builder's RMSNorm. A
    per-head output gate (Bailing's g_proj, `attn_head_gate`): its logits [b, s, heads, 1] in gates[i]."""
    if cfg.attn_head_gate:
        logits = em.one("MatMul", [h, mla_weight(em, cfg, i, "mla_gate")])
        gates[i] = em.one("Reshape", [logits, em.const("mla.gate_heads", [0, 0, cfg.num_attention_heads, 1])])
    first = cfg.q_lora_rank or cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.rope_dim)
    both = em.one("MatMul", [h, mla_weight(em, cfg, i, "q_kv_a" if cfg.q_lora_rank else "q_kv")])
    q, c_kv, k_pe = em.op("Split", [both, em.const(f"mla.split_a.{first}", [first, cfg.kv_lora_rank, cfg.rope_dim])], 3,
                          axis=-1)
    if cfg.q_lora_rank:
        q = em.one("MatMul", [norm(q, "q_a_norm"), mla_weight(em, cfg, i, "q_b")])
    return q, em.one("Concat", [k_pe, norm(c_kv, "kv_a_norm")], axis=-1)


def absorbed(em: Emitter, cfg: ModelConfig, i: int) -> tuple[str, str]:
    """(W_UK [heads, nope, rank], W_UV^T [heads, rank, v]) of layer i's kv_b_proj."""
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    per_head = em.one("Reshape", [mla_weight(em, cfg, i, "kv_b"), em.const("mla.kv_b_shape", [heads, nope + v, cfg.kv_lora_rank])])
    w_uk, w_uv = em.op("Split", [per_head, em.const("mla.kv_b_split", [nope, v])], 2, axis=1)
    return w_uk, em.one("Transpose", [w_uv], perm=[0, 2, 1])


def per_head(em: Emitter, x: str, weight: str, heads: int, width: int, out: int) -> str:
    """x [b, s, heads, width] times each head's weight[h] [width, out]: [b, s, heads, out] (rows >= 2: module doc)."""
    rows = em.one("Transpose", [em.one("Reshape", [x, em.const(f"mla.rows.{width}", [-1, heads, width])])], perm=[1, 0, 2])
    last = em.one("Slice", [rows, em.const("mla.minus_one", [-1]), em.const("mla.int_max", [2 ** 62]), em.const("mla.one", [1])])
    y = em.one("MatMul", [em.one("Concat", [rows, last], axis=1), weight])
    y = em.one("Slice", [y, em.const("mla.zero", [0]), em.const("mla.minus_one", [-1]), em.const("mla.one", [1])])
    shape = em.one("Concat", [em.one("Shape", [x], end=3), em.const(f"mla.width.{out}", [out])], axis=0)
    return em.one("Reshape", [em.one("Transpose", [y], perm=[1, 0, 2]), shape])


def absorbed_query(em: Emitter, cfg: ModelConfig, q: str, w_uk: str) -> str:
    """The query heads [b, s, heads, rope + rank] = [q_pe, q_nope @ W_UK_h], before rope."""
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.rope_dim
    q4 = em.one("Reshape", [q, em.const("mla.q_heads", [0, 0, heads, nope + rope])])
    q_nope, q_pe = em.op("Split", [q4, em.const("mla.q_split", [nope, rope])], 2, axis=-1)
    return em.one("Concat", [q_pe, per_head(em, q_nope, w_uk, heads, nope, cfg.kv_lora_rank)], axis=-1)


def latent_output(em: Emitter, cfg: ModelConfig, context: str, w_uv: str) -> str:
    """The attention's output heads [b, s, heads, rope + rank] -> [b, s, heads * v]: the latent part through W_UV_h^T."""
    heads, rope = cfg.num_attention_heads, cfg.rope_dim
    latent = em.one("Slice", [context, em.const("mla.rope", [rope]), em.const("mla.int_max", [2 ** 62]), em.const("mla.axis3", [3])])
    out = per_head(em, latent, w_uv, heads, cfg.kv_lora_rank, cfg.v_head_dim)
    return em.one("Reshape", [out, em.const("mla.out_shape", [0, 0, heads * cfg.v_head_dim])])


def latent_scores(em: Emitter, cfg: ModelConfig, qg: str, keys: str) -> str:
    """qg [b, kv, rows, dim] @ keys [b, kv, dim, T]. A latent head wider than 128 (MLA's 576) as slices of 128 dims
    summed in order: MLAS splits a dot product into chunks whose size depends on T (256 and more at T <= 64, 128
    above), so one MatMul would round a row by the pass's total; a slice of <= 128 dims is one chunk at every T."""
    dim = cfg.head_dim
    if not (cfg.mla and dim > 128):
        return em.one("MatMul", [qg, keys])
    total = ""
    for start in range(0, dim, 128):
        bounds = [em.const("mla.slice", [start]), em.const("mla.slice", [min(start + 128, dim)])]
        axis_q, axis_k = em.const("mla.slice", [3]), em.const("mla.slice", [2])
        part = em.one("MatMul", [em.one("Slice", [qg, *bounds, axis_q]), em.one("Slice", [keys, *bounds, axis_k])])
        total = em.one("Add", [total, part]) if total else part
    return total
