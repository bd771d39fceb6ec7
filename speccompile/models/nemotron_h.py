"""NVIDIA Nemotron-H (`nemotron_h`: Nemotron-H 8B / 47B, Nemotron Nano 2): checkpoint blocks grouped into table layers.

A Nemotron-H block holds one thing, norm -> block -> residual add (transformers' `NemotronHBlock`): a Mamba-2 mixer
("M", `linear_attention`), NoPE attention ("*", `full_attention`), an ungated relu2 MLP ("-", `mlp`) or a MoE ("E",
`moe`), by `layers_block_type` (else `hybrid_override_pattern`). The table's layer is (norm, mixer, residual, norm,
MLP, residual), so each mixer block and the MLP block after it (if any) are one table layer; a mixer followed by
another mixer is a layer without an MLP (`ModelConfig.layer_intermediate_sizes` 0). The config keys are read as
Granite 4.0-H's Mamba-2 keys (models/linear_config.py, `mamba2_from_hf`: the same computation) and the tensors are
shown under the table's names (`blocks_view`). A MoE block (Nemotron 3 Nano) after a mixer is that layer's MLP: its
`MoeConfig` (models/moe_config.py, `_nemotron_h_moe`) has ungated experts and an ungated shared expert (`expert_gated`
False), and the layers whose MLP is dense or absent are its `dense_layers`. Refused in one line: an MLP or MoE block
not after a mixer, MTP layers (`num_nextn_predict_layers`), latent expert projections (`moe_latent_size`), experts
whose activation has learned parameters (xIELU). A pure Mamba-2 (`mamba2`, Mamba2ForCausalLM) stores the same blocks,
every one Mamba-2 (`MAMBA2_KEYS`, `block_types`): table layers without attention or an MLP.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import UnsupportedError
from .linear_config import MAMBA2_NAMES, mamba2_from_hf
from .weights import WeightSource

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_MIXERS = {"linear_attention": "mamba", "full_attention": "attention"}
# the table's roles -> a layer's names as `blocks_view` shows them (the mixer block's under `mixer.`, the MLP's under `mlp.`)
NEMOTRON_H_NAMES = {**{role: tuple(n.replace("mamba.", "mixer.") for n in names) for role, names in MAMBA2_NAMES.items()},
                    "qkv": tuple(f"mixer.{p}_proj.weight" for p in "qkv"), "o_proj": ("mixer.o_proj.weight",)}
# transformers' NemotronHConfig defaults and its legacy key names (the first one given wins)
_MAMBA_KEYS = {"mamba_n_heads": (("mamba_num_heads",), 128), "mamba_d_head": (("mamba_head_dim",), 64),
               "mamba_n_groups": (("n_groups", "mamba_n_groups"), 8), "mamba_d_state": (("ssm_state_size",), 128),
               "mamba_d_conv": (("conv_kernel", "mamba_d_conv"), 4), "mamba_conv_bias": (("use_conv_bias", "mamba_conv_bias"), True),
               "time_step_limit": (("time_step_limit", "mamba_dt_limit"), None), "hidden_act": (("mamba_hidden_act",), "silu")}

# Mamba-2 (`mamba2`, Mamba2ForCausalLM and llama.cpp's mamba2 GGUF: the same blocks, every one Mamba-2, no attention, no
# MLP): its table entry's fields, its config keys under Nemotron-H's names, its embeddings (older saves: `embedding`)
MAMBA2_KEYS = dict(hybrid="nemotron_h", act_key="mlp_hidden_act", prefix="backbone.",
                   config_keys={"num_heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state_size": "ssm_state_size",
                                "hidden_act": "mamba_hidden_act", "layer_norm_epsilon": "rms_norm_eps"},
                   config_defaults={"num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 0},
                   top_names={"model.embeddings.weight": "model.embed_tokens.weight", "model.embedding.weight": "model.embed_tokens.weight",
                              "model.norm_f.weight": "model.norm.weight"})


def block_types(data: dict[str, Any], source: str) -> list[str]:
    """The checkpoint's block kinds: `layers_block_type` (or `layer_types`), else `hybrid_override_pattern`; a pure
    Mamba-2 (`mamba2`: Mamba2ForCausalLM, the same blocks) every block Mamba-2."""
    if data.get("model_type") == "mamba2":
        return ["linear_attention"] * int(data["num_hidden_layers"])
    types = data.get("layers_block_type") or data.get("layer_types")
    if types:
        return [str(t) for t in types]
    pattern = str(data.get("hybrid_override_pattern") or "")
    bad = sorted(set(pattern) - set(_PATTERN))
    if not pattern or bad:
        raise UnsupportedError(f"{source}: hybrid_override_pattern {pattern!r} is not a Nemotron-H pattern (M, *, -, E)")
    return [_PATTERN[c] for c in pattern]


def group_blocks(types: list[str], source: str) -> list[tuple[int, int | None]]:
    """Table layers as (mixer block, MLP block or None): each mixer block with the MLP block right after it."""
    groups: list[tuple[int, int | None]] = []
    for b, kind in enumerate(types):
        if kind in _MIXERS:
            groups.append((b, None))
        elif kind in ("mlp", "moe") and groups and groups[-1][1] is None and types[b - 1] in _MIXERS:
            groups[-1] = (groups[-1][0], b)
        else:
            raise UnsupportedError(f"{source}: layers_block_type {kind!r} at block {b} (not an MLP or MoE block right after a "
                                   "Mamba-2 or attention block) is not supported")
    return groups


def nemotron_h_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json's keys as the table reads them: the table layers' count and kinds (Granite's "mamba" / "attention"),
    the Mamba-2 keys under Granite 4.0-H's names, the layers without an MLP (`layer_intermediate_sizes` 0); attention
    without biases (transformers' NemotronHAttention ignores attention_bias; use_bias, the Mamba-2 projections' and
    mlp_bias are refused as biases the family does not have)."""
    if int(data.get("num_nextn_predict_layers") or 0):
        raise UnsupportedError(f"{source}: num_nextn_predict_layers {data['num_nextn_predict_layers']} (Nemotron-H MTP layers) is not supported")
    types = block_types(data, source)
    groups = group_blocks(types, source)
    if "moe" in types and data.get("moe_latent_size") is not None:
        raise UnsupportedError(f"{source}: moe_latent_size {data['moe_latent_size']} (Nemotron-H's latent expert projections) is not supported")
    if "moe" in types and str(data.get("mlp_hidden_act")) == "xielu":
        raise UnsupportedError(f"{source}: mlp_hidden_act 'xielu' in Nemotron-H's experts is not supported")
    mamba = {key: next((data[k] for k in names if data.get(k) is not None), default) for key, (names, default) in _MAMBA_KEYS.items()}
    heads, head_dim = int(mamba["mamba_n_heads"]), int(mamba["mamba_d_head"])
    inter = int(data["intermediate_size"])
    rest = {k: v for k, v in data.items() if k not in ("attention_bias", "mamba_proj_bias", "layer_types", "hybrid_override_pattern")}
    return {**rest, **mamba, "num_hidden_layers": len(groups), "layer_types": [_MIXERS[types[m]] for m, _ in groups],
            "mamba_d_inner": heads * head_dim, "nemotron_h_widths": [inter if mlp is not None else 0 for _, mlp in groups],
            "nemotron_h_moe_layers": [i for i, (_, mlp) in enumerate(groups) if mlp is not None and types[mlp] == "moe"]}


def nemotron_h_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Nemotron-H config.json read by `nemotron_h_keys`: Granite 4.0-H's Mamba-2 fields, every
    layer NoPE, the MLP-less layers' width 0."""
    widths = list(data["nemotron_h_widths"])
    return dict(mamba2_from_hf(data, layers, source), layer_intermediate_sizes=widths if 0 in widths else [])


def blocks_view(source: WeightSource) -> WeightSource:
    """`source` (`model.layers.{block}.norm` / `.mixer.*`, the prefix already `model.`) under the table's layer names:
    a mixer block's norm as layer i's input_layernorm and its tensors under `mixer.`, the MLP block after it as layer
    i's post_attention_layernorm and `mlp.` (blocks told apart by their tensors: an MLP block has `mixer.up_proj`, a MoE
    block its router `mixer.gate`; a GGUF's, models/nemotron_h_gguf.py, has its tensors under `mlp.` already)."""
    found = [re.match(r"model\.layers\.(\d+)\.(.*)$", n) for n in source.names()]
    blocks = sorted({int(m.group(1)) for m in found if m})
    mlp = {int(m.group(1)) for m in found if m and (m.group(2) in ("mixer.up_proj.weight", "mixer.gate.weight") or m.group(2).startswith("mlp."))}
    rename, layer = {}, -1
    for b in blocks:
        layer += b not in mlp
        norm, part = ("post_attention_layernorm", "mlp") if b in mlp else ("input_layernorm", "mixer")
        rename[b] = (layer, norm, part)
    names = {}
    for m in found:
        if m:
            layer, norm, part = rename[int(m.group(1))]
            rest = m.group(2)
            names[m.group(0)] = f"model.layers.{layer}." + (f"{norm}.weight" if rest == "norm.weight" else f"{part}.{rest.split('.', 1)[1]}")
    return source.renamed(names)
