"""Pure Mamba-1 (transformers' `mamba`: state-spaces/mamba-*-hf, MambaForCausalLM; `falcon_mamba`: TII Falcon-Mamba):
its table entry's fields and its config.json read as ModelConfig fields (models/mamba1.py is the layer's torch reference).

Every block is norm -> Mamba-1 mixer -> residual add (`backbone.layers.{i}.norm` / `.mixer.*`, `backbone.embeddings`,
`backbone.norm_f`): table layers of the Mamba-1 kind without attention or an MLP, and without Jamba's dt / B / C norms
(`HybridConfig.mixer_norms` "none"). Falcon-Mamba RMS-norms dt, B and C inside the mixer without gains ("plain") with its own epsilon (mixer_rms_eps, transformers' default
1e-6; llama.cpp's `mamba` GGUF says only that the norms are there, `ssm.dt_b_c_rms`, and uses the model's epsilon).
Refused in one line: in / out projection biases (use_bias: the table's generic refusal), an activation other than SiLU.
residual_in_fp32 changes nothing in fp32.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..errors import UnsupportedError
from .linear_config import JAMBA_GGUF, MAMBA1_GAINS, MAMBA1_NAMES, mamba1_from_hf

# a block's roles -> its names (relative to `model.layers.{i}.`): the mixer's under `mixer.`, its norm as the input norm
MAMBA_NAMES = {**{role: tuple(n.replace("mamba.", "mixer.") for n in names) for role, names in MAMBA1_NAMES.items() if role not in MAMBA1_GAINS},
               "input_norm": ("norm.weight",)}
# llama.cpp's `mamba` GGUF names (Mamba and Falcon-Mamba alike): the block's norm as attn_norm, Jamba's `ssm_*` under `mixer.`
# without the norms' gains (A stored as -exp(A_log): models/mamba2_gguf.py ALogView)
MAMBA_GGUF = {"attn_norm": "norm", **{k: v.replace("mamba.", "mixer.") for k, v in JAMBA_GGUF.items()
                                      if k.startswith("ssm_") and not k.endswith("_norm")}}
# the table entry's fields: transformers' MambaConfig keys under Jamba's names, no attention heads, no MLP
MAMBA_KEYS = dict(hybrid="mamba", prefix="backbone.", names=MAMBA_NAMES, gguf=MAMBA_GGUF,
                  config_keys={"expand": "mamba_expand", "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv",
                               "use_conv_bias": "mamba_conv_bias", "time_step_rank": "mamba_dt_rank", "layer_norm_epsilon": "rms_norm_eps"},
                  config_defaults={"num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 0, "tie_word_embeddings": True},
                  top_names={"model.embeddings.weight": "model.embed_tokens.weight", "model.embedding.weight": "model.embed_tokens.weight",
                             "model.norm_f.weight": "model.norm.weight"})


def mamba_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Mamba / Falcon-Mamba config.json: Jamba's Mamba-1 fields with every layer Mamba-1, no
    MLP (intermediate_size is the mixer's width: expand x hidden), no dt / B / C norms (Falcon-Mamba's: without gains)."""
    hidden = int(data["hidden_size"])
    inner = int(data.get("intermediate_size") or int(data.get("mamba_expand") or 2) * hidden)
    fields = mamba1_from_hf(dict(data, attn_layer_period=1, attn_layer_offset=1), layers, source)  # i % 1 != 1: every layer Mamba-1
    norms = dict(mixer_norms="none")
    if data.get("model_type") == "falcon_mamba" or data.get("ssm_dt_b_c_rms"):  # the latter: llama.cpp's mamba GGUF
        norms = dict(mixer_norms="plain", norm_eps=float(data.get("mixer_rms_eps") or 1e-6))
    if inner <= 0:
        raise UnsupportedError(f"{source}: intermediate_size {inner} (the Mamba mixer's width) is not supported")
    return dict(fields, hybrid=replace(fields["hybrid"], width=inner, **norms), intermediate_size=0, layer_intermediate_sizes=[0] * layers)


def mamba_gguf_keys(meta: dict[str, Any], p: str, tensors: dict[str, tuple[int, ...]],
                    source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the metadata with one attention head: llama.cpp writes `attention.head_count` 0, the config.json keys) of
    llama.cpp's `mamba` GGUF: the mixer's sizes as `ssm.*`, the conv bias where the file has it, Falcon-Mamba's norms
    (`ssm.dt_b_c_rms`) at the file's epsilon, as llama.cpp computes them."""
    eps = float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5))
    return {**meta, p + "attention.head_count": 1}, {
        "intermediate_size": int(meta[p + "ssm.inner_size"]), "mamba_d_state": int(meta[p + "ssm.state_size"]),
        "mamba_d_conv": int(meta[p + "ssm.conv_kernel"]), "mamba_dt_rank": int(meta[p + "ssm.time_step_rank"]),
        "mamba_conv_bias": any(name.endswith("ssm_conv1d.bias") for name in tensors),
        "ssm_dt_b_c_rms": bool(meta.get(p + "ssm.dt_b_c_rms", False)), "mixer_rms_eps": eps}
