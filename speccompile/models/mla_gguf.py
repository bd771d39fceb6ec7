"""llama.cpp's `deepseek2` GGUF (DeepSeek-V2 / V3, Kimi K2, Moonlight) and `minicpm3`: its metadata as config.json keys,
its split kv_b_proj joined back.

llama.cpp's converter writes multi-head latent attention as `attention.kv_lora_rank`, `attention.q_lora_rank`
(absent: q_proj), `rope.dimension_count` (the roped dims), `attention.key_length_mla` (nope + rope) and
`attention.value_length_mla` (v) (older files: `attention.key_length` / `value_length` are those two and kv_b_proj is
one tensor, `attn_kv_b`); the routing as `expert_gating_func` (2: sigmoid, DeepSeek-V3; 1 or absent: softmax,
DeepSeek-V2), `expert_group_count` / `expert_group_used_count`, `expert_weights_norm` / `expert_weights_scale`; yarn
as `rope.scaling.*` with `rope.scaling.yarn_log_multiplier` = 0.1 * mscale_all_dim. It splits kv_b_proj per head
into `attn_k_b` [heads, rank, nope] (transposed) and `attn_v_b` [heads, v, rank]; q / k rows are not permuted
(llama.cpp ropes DeepSeek's interleaved pairs, as transformers does). The torch reference and the graphs read the
result as they read the safetensors checkpoint (models/mla.py).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import UnsupportedError
from .moe_config import MoeConfig
from .weights import TensorInfo, WeightSource

_GATING = {1: "deepseek_v2", 2: "deepseek_v3"}  # llama.cpp's expert_gating_func: softmax, sigmoid
_SPLIT = re.compile(r"^(model\.layers\.\d+\.self_attn\.)k_b_proj\.weight$")


def mla_gguf_keys(meta: dict[str, Any], arch: str, p: str, source: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(metadata, family, the config.json keys of its latent attention) of a latent-attention file: llama.cpp's
    `deepseek2` (`deepseek2_keys`), its `minicpm3` (`minicpm3_keys`) or its `kimi-linear` (DeepSeek's keys, its own
    routing: models/kda_gguf.py)."""
    if arch == "minicpm3":
        return minicpm3_keys(meta, p)
    family, keys = deepseek2_keys(meta, p, source)
    return meta, arch if arch == "kimi_linear" else family, keys


def minicpm3_keys(meta: dict[str, Any], p: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """llama.cpp's `minicpm3`: the ranks, `attention.key_length` (nope + rope), `rope.dimension_count`; no value length
    (llama.cpp's default hidden / heads) and no longrope original length (llama.cpp's: `context_length`, given to the
    metadata). Its multipliers are not written: llama.cpp fixes MiniCPM3-4B's (scale_emb 12, scale_depth 1.4,
    dim_model_base 256), transformers' MiniCPM3Config defaults (models/layer_keys.py `minicpm_keys`). q / k rows as
    stored by transformers (the converter does not permute them)."""
    rope, hidden, heads = int(meta[p + "rope.dimension_count"]), int(meta[p + "embedding_length"]), int(meta[p + "attention.head_count"])
    keys = {"kv_lora_rank": int(meta[p + "attention.kv_lora_rank"]), "q_lora_rank": int(meta.get(p + "attention.q_lora_rank") or 0),
            "qk_rope_head_dim": rope, "qk_nope_head_dim": int(meta[p + "attention.key_length"]) - rope, "partial_rotary_factor": 1.0,
            "v_head_dim": int(meta.get(p + "attention.value_length") or hidden // heads)}
    return {p + "rope.scaling.original_context_length": meta.get(p + "context_length", 2048), **meta}, "minicpm3", keys


def deepseek2_keys(meta: dict[str, Any], p: str, source: str) -> tuple[str, dict[str, Any]]:
    """(family, the config.json keys of its latent attention and yarn rope) of a `deepseek2` file's metadata (`p`:
    `deepseek2.`); what llama.cpp computes otherwise than transformers is refused naming the key."""
    gating = int(meta.get(p + "expert_gating_func") or 1)
    if gating not in _GATING:
        raise UnsupportedError(f"{source}: {p}expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
    groups, used = int(meta.get(p + "expert_group_count") or 1), int(meta.get(p + "expert_group_used_count") or 1)
    if gating == 1 and used < groups:
        raise UnsupportedError(f"{source}: {p}expert_group_used_count {used} of {groups} groups with softmax routing is not "
                               "supported (llama.cpp scores a group by its two best experts, DeepSeek-V2 by its best)")
    rope = int(meta[p + "rope.dimension_count"])
    mla = p + "attention.key_length_mla" in meta
    keys: dict[str, Any] = {
        "kv_lora_rank": int(meta[p + "attention.kv_lora_rank"]), "q_lora_rank": int(meta.get(p + "attention.q_lora_rank") or 0),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": int(meta[p + ("attention.key_length_mla" if mla else "attention.key_length")]) - rope,
        "v_head_dim": int(meta[p + ("attention.value_length_mla" if mla else "attention.value_length")]),
        "partial_rotary_factor": 1.0, "rope_interleave": True}
    if meta.get(p + "rope.scaling.type") == "yarn":
        keys["rope_scaling"] = _yarn(meta, p, source)
    return _GATING[gating], keys


def _yarn(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """transformers' DeepSeek yarn keys: llama.cpp keeps the rope tables unscaled (mscale = mscale_all_dim) and the
    attention scale's mscale_all_dim as `yarn_log_multiplier` / 0.1; betas 32 / 1 unless named."""
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"):
        if meta.get(p + key) is not None and float(meta[p + key]) != 1.0:
            raise UnsupportedError(f"{source}: {p}{key} {meta[p + key]} is not supported (1)")
    mscale = round(10.0 * float(meta.get(p + "rope.scaling.yarn_log_multiplier") or 0.0), 6)
    return {"rope_type": "yarn", "factor": float(meta[p + "rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta[p + "rope.scaling.original_context_length"]),
            "beta_fast": float(meta.get(p + "rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(meta.get(p + "rope.scaling.yarn_beta_slow") or 1.0), "mscale": mscale, "mscale_all_dim": mscale}


def check_choice_bias(names: set[str], moe: MoeConfig | None, source: str) -> None:
    """A softmax-routed file with a choice bias (`exp_probs_b`, which llama.cpp would add) is refused: the DeepSeek-V2
    routing has none."""
    if moe is not None and not moe.score_bias and any(n.endswith(".exp_probs_b.bias") for n in names):
        raise UnsupportedError(f"{source}: exp_probs_b with softmax routing (no deepseek2.expert_gating_func 2) is not supported")


class JoinedKvB(WeightSource):
    """`inner` with each layer's `self_attn.k_b_proj` [heads, rank, nope] and `v_b_proj` [heads, v, rank] (llama.cpp's
    split) shown as the `self_attn.kv_b_proj.weight` [heads * (nope + v), rank] they came from."""

    def __init__(self, inner: WeightSource):
        self._inner = inner
        self._joined: dict[str, tuple[str, str]] = {}
        for name in inner.names():
            match = _SPLIT.match(name)
            if match is not None and f"{match.group(1)}v_b_proj.weight" in inner:
                self._joined[f"{match.group(1)}kv_b_proj.weight"] = (name, f"{match.group(1)}v_b_proj.weight")
        parts = {part for pair in self._joined.values() for part in pair}
        self._names = [n for n in inner.names() if n not in parts] + list(self._joined)

    def info(self, name: str) -> TensorInfo:
        if name not in self._joined:
            return self._inner.info(name)
        (heads, rank, nope), (_, v, _) = (self._inner.shape(part) for part in self._joined[name])
        return TensorInfo((heads * (nope + v), rank), np.dtype(np.float32))

    def read(self, name: str) -> np.ndarray:
        if name not in self._joined:
            return self._inner.read(name)
        k_b, v_b = (self._inner.read_float32(part) for part in self._joined[name])
        per_head = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)  # [heads, nope + v, rank]
        return np.ascontiguousarray(per_head.reshape(-1, per_head.shape[-1]))

    def names(self) -> list[str]:
        return list(self._names)
