"""Bailing hybrid (`bailing_hybrid`: Ant Group's Ling / Ring 2.5): which layers are Kimi Delta Attention, their gates,
and the names its checkpoints use, read from config.json (docs/DESIGN.md, "Hybrid linear attention").

Groups of `layer_group_size` layers, the last of each DeepSeek-V3's latent attention with rope (q LoRA optional) whose
heads' outputs are each times sigmoid(g_proj(x)) [heads] before o_proj (`attn_head_gate`), the others KDA
(models/kda.py) with full-rank gates (`HybridConfig.full_gates`: f_proj and g_proj [heads * head_dim, hidden] in
place of Kimi's LoRA pairs, A_log [heads]) and, with kda_safe_gate, the bounded decay g = kda_lower_bound *
sigmoid(exp(A_log) * (f_proj(x) + dt_bias)) (`gate_bound`); DeepSeek-V3's MoE. Ling's checkpoint names
(model.word_embeddings, layers.{i}.attention.*, attention.dense, mlp.gate.expert_bias) are read under transformers'
(`bailing_view`). The MTP layers stored after the decoder are not read.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import UnsupportedError
from .linear_config import HybridConfig
from .weights import WeightSource

# the roles whose checkpoint names differ from Kimi Linear's (relative to `model.layers.{i}.`, after `bailing_view`)
BAILING_NAMES: dict[str, tuple[str, ...]] = {
    "kda_down": ("self_attn.f_proj.weight", "self_attn.g_proj.weight", "self_attn.b_proj.weight"),
    "mla_gate": ("self_attn.g_proj.weight",)}
BAILING_TOP = {"model.word_embeddings.weight": "model.embed_tokens.weight"}
_RENAMES = ((re.compile(r"\.attention\."), ".self_attn."), (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
            (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"))


def bailing_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Bailing hybrid config.json: `hybrid` (layer_types, else the last layer of every
    layer_group_size full attention), rope on every attention layer (rope_theta 6e6 unless given). Refused in one line: an activation other than
    SiLU, a SwiGLU limit list (expert_swiglu_limit_list / share_expert_swiglu_limit_list) not one a layer, a safe gate
    bounded at 0, a layer type other than full / linear attention, no attention layer."""
    group = int(data.get("layer_group_size") or 6)
    types = list(data.get("layer_types") or ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(layers)])
    other = sorted({str(t) for t in types[:layers]} - {"full_attention", "linear_attention"})
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in a Bailing hybrid model")
    if str(data.get("hidden_act", "silu")) != "silu":
        raise UnsupportedError(f"{source}: hidden_act {data['hidden_act']!r} is not supported in a Bailing hybrid model")
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):  # models/moe_config.py `clip_limits`
        if data.get(key) and len(data[key]) != layers:
            raise UnsupportedError(f"{source}: {key} has {len(data[key])} limits for {layers} layers")
    bound = float(data.get("kda_lower_bound", -5.0)) if data.get("kda_safe_gate", True) else 0.0
    if data.get("kda_safe_gate", True) and not bound:
        raise UnsupportedError(f"{source}: kda_safe_gate with kda_lower_bound 0 is not supported")
    heads = int(data.get("linear_num_heads") or data["num_attention_heads"])
    dim = int(data.get("linear_head_dim") or data.get("head_dim") or 128)
    kernel = int(data.get("linear_conv_kernel_dim") or data.get("short_conv_kernel_size") or 4)
    hybrid = HybridConfig(linear=[t == "linear_attention" for t in types[:layers]], kind="kda", num_k_heads=heads, num_v_heads=heads,
                          k_dim=dim, v_dim=dim, conv_kernel=kernel, full_gates=True, gate_bound=bound)
    theta = (data.get("rope_parameters") or {}).get("rope_theta", data.get("rope_theta", 6e6))  # transformers' default: 6e6
    return dict(hybrid=hybrid, nope_layers=[], rope_theta=float(theta))


def bailing_view(source: WeightSource) -> WeightSource:
    """Ling's checkpoint names read under transformers' (`attention.` as `self_attn.`, `dense` as `o_proj`, the
    router's expert_bias as e_score_correction_bias); a checkpoint without them (Kimi Linear's) as it is."""
    renamed = {}
    for name in source.names():
        new = name
        for pattern, repl in _RENAMES:
            new = pattern.sub(repl, new)
        if new != name:
            renamed[name] = new
    return source.renamed(renamed)
