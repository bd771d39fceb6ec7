"""Falcon-H1 (`falcon_h1`, transformers' FalconH1ForCausalLM): its config.json read into the table's description.

Every layer runs Llama's attention (full rope) and a Mamba-2 mixer (Granite 4.0-H's, models/mamba2.py) side by side on
the same normed input, their outputs summed into the residual (`HybridConfig.parallel`), then Bamba's SwiGLU. The
Mamba-2 width is `mamba_d_ssm` (else mamba_expand x hidden); its output is y * SiLU(z) unless `mamba_rms_norm`, then
RMS-normed per group before the gate (`mamba_norm_before_gate`) or after it (`HybridConfig.gate_norm`). The muP
multipliers that scale a projection's input or output are folded into its weights at load, as llama.cpp's converter
does (`HybridConfig.scales`, shown by models/hf_layouts.py): attention_in_multiplier into q/k/v, key_multiplier into
k, attention_out_multiplier into o_proj, ssm_in_multiplier and ssm_multipliers (per z | x | B | C | dt rows) into
in_proj, ssm_out_multiplier into out_proj, mlp_multipliers into gate_proj and down_proj; the embedding and LM head
multipliers are the table's embedding and logit scales. Refused in one line: projection biases (`attention_bias`,
`projectors_bias`, `mamba_proj_bias`, `mlp_bias`), a clamped dt, an activation other than SiLU.

llama.cpp's `falcon-h1` GGUF is read too (`falcon_h1_gguf_keys`): its converter folded every multiplier into the
tensors (the embedding and LM head ones included), wrote the Mamba-2 sizes as `ssm.*` and A as -exp(A_log)
(models/mamba2_gguf.py shows it as A_log); it records neither `mamba_rms_norm` nor `mamba_norm_before_gate`, so a
file with the mixer's norm (`ssm_norm`) is refused, as is one without an output tensor (the folded embedding
multiplier would scale the tied head).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import UnsupportedError
from .linear_config import HybridConfig, mamba2_from_hf


def falcon_h1_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Falcon-H1 config.json: Granite 4.0-H's Mamba-2 fields (`mamba2_from_hf`) beside every
    attention layer (rope), the gate's norm and the muP multipliers to fold."""
    hidden = int(data["hidden_size"])
    inner = int(data["mamba_d_ssm"]) if data.get("mamba_d_ssm") is not None else int(data.get("mamba_expand") or 2) * hidden
    keys = {**data, "layer_types": ["attention"] * layers, "mamba_d_inner": inner, "position_embedding_type": "rope"}
    fields = mamba2_from_hf(keys, layers, source)
    hy = fields["hybrid"]
    gate = ("before_gate" if data.get("mamba_norm_before_gate", True) else "gated") if data.get("mamba_rms_norm") else "none"
    return dict(fields, hybrid=dataclasses.replace(hy, parallel=True, gate_norm=gate, scales=mup_scales(data, hy)))


def mup_scales(data: dict[str, Any], hy: HybridConfig) -> dict[str, list[list[float]]]:
    """The factors Falcon-H1's muP multipliers fold into a layer's tensors: name -> [rows, factor] runs (only those
    not all 1)."""
    def m(key: str) -> float:
        return 1.0 if data.get(key) is None else float(data[key])

    heads, kv = int(data["num_attention_heads"]), int(data.get("num_key_value_heads") or data["num_attention_heads"])
    hidden = int(data["hidden_size"])
    dim = int(data.get("head_dim") or hidden // heads)
    attn_in, inter = m("attention_in_multiplier"), int(data["intermediate_size"])
    gate, down = (float(v) for v in data.get("mlp_multipliers") or [1.0, 1.0])
    z, x, b, c, dt = (float(v) * m("ssm_in_multiplier") for v in data.get("ssm_multipliers") or [1.0] * 5)
    runs = {"self_attn.q_proj.weight": [[heads * dim, attn_in]], "self_attn.k_proj.weight": [[kv * dim, attn_in * m("key_multiplier")]],
            "self_attn.v_proj.weight": [[kv * dim, attn_in]], "self_attn.o_proj.weight": [[hidden, m("attention_out_multiplier")]],
            "mamba.in_proj.weight": [[hy.value_dim, z], [hy.value_dim, x], [hy.key_dim, b], [hy.key_dim, c], [hy.num_v_heads, dt]],
            "mamba.out_proj.weight": [[hidden, m("ssm_out_multiplier")]], "feed_forward.gate_proj.weight": [[inter, gate]],
            "feed_forward.down_proj.weight": [[hidden, down]]}
    return {name: parts for name, parts in runs.items() if any(f != 1.0 for _, f in parts)}


def falcon_h1_gguf_keys(meta: dict[str, Any], p: str, tensors: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """The config.json keys of a llama.cpp falcon-h1 GGUF (`tensors`: its tensor names): the Mamba-2 sizes, the conv
    bias where the file has one; the multipliers are already in the tensors (none given: 1)."""
    if any(name.endswith(".ssm_norm.weight") for name in tensors):
        raise UnsupportedError(f"{source}: a falcon-h1 GGUF with ssm_norm (mamba_rms_norm) is not supported: the file does "
                               "not record whether the norm comes before the gate (mamba_norm_before_gate)")
    if "output.weight" not in tensors:
        raise UnsupportedError(f"{source}: a falcon-h1 GGUF without output.weight (tied embeddings) is not supported: the "
                               "converter folded embedding_multiplier into the table the head would share")
    inner, heads = int(meta[p + "ssm.inner_size"]), int(meta[p + "ssm.time_step_rank"])
    return {"mamba_d_ssm": inner, "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_state": int(meta[p + "ssm.state_size"]),
            "mamba_n_groups": int(meta[p + "ssm.group_count"]), "mamba_d_conv": int(meta[p + "ssm.conv_kernel"]),
            "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in tensors}
