"""The checkpoint under the reference decoder's module names (models/decoder.py): each layer role's module names
(Hugging Face's, plus the decoder's own norms) and the split of a fused tensor into its parts."""

from __future__ import annotations

from typing import Mapping

import torch

from .architectures import MLA_NAMES, family
from .config import ModelConfig
from .kda_config import KDA_NAMES
from .linear_config import LIGHTNING_NAMES, LINEAR_NAMES, MAMBA1_NAMES, MAMBA2_NAMES, RGLRU_NAMES, SHORT_CONV_NAMES
from .weight_names import ALTUP_NAMES, BESIDE_ROLES, LLAMA_NAMES, NORM_ROLES

_MODULE_NAMES = {**LLAMA_NAMES, **MLA_NAMES, **ALTUP_NAMES, **LINEAR_NAMES, **SHORT_CONV_NAMES, **MAMBA2_NAMES, **MAMBA1_NAMES, **KDA_NAMES, **RGLRU_NAMES, **LIGHTNING_NAMES, "mla_gate": ("self_attn.g_proj.weight",), "post_attn_norm": ("post_attn_norm.weight",), "post_mlp_norm": ("post_mlp_norm.weight",),
                 **{role: (f"{role}.weight",) for role in BESIDE_ROLES}}
_MODULE_NAMES.update({f"{r}_bias": (_MODULE_NAMES[r][0].replace(".weight", ".bias"),) for r in (*NORM_ROLES, "q_norm", "k_norm")})


def by_role(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint under this module's names: each layer role's tensors (a fused one split in parts)."""
    state = dict(weights)
    names = family(config.architecture).layer_names()
    for i in range(config.num_hidden_layers):
        q, kv, inter = config.num_attention_heads * config.layer(i).head_dim, config.layer(i).kv_dim, config.layer(i).intermediate_size
        sizes = {"qkv": [q + config.num_attention_heads * config.layer(i).gate_dim, kv, kv], "qkv_bias": [q, kv, kv], "gate_up": [inter, inter],
                 **(config.hybrid.fused_sizes() if config.hybrid is not None else {})}
        p = f"model.layers.{i}."
        roles = config.layer_roles(i)
        found = {role: [state.pop(p + n) for n in names[role] if p + n in state] for role in roles}
        for role, tensors in found.items():
            targets = _MODULE_NAMES[role]
            if len(tensors) == 1 and len(targets) > 1 and len(names[role]) == 1:  # a fused tensor (not q_proj alone)
                tensors = list(torch.split(tensors[0], sizes[role], dim=0))
            state.update({p + t: w for t, w in zip(targets, tensors)})
    return state
