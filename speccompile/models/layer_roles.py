"""The roles a decoder layer has weights for, by its layer description (the vocabulary of models/architectures.py)."""

from __future__ import annotations

_PLACEMENT_NORMS = {"pre": ("input_norm", "post_norm"), "sandwich": ("input_norm", "post_attn_norm", "post_norm", "post_mlp_norm"),
                    "post": ("post_attn_norm", "post_mlp_norm"), "parallel": ("input_norm",), "parallel2": ("input_norm", "post_norm")}


MLA_ROLES = {"lora": ["q_kv_a", "q_a_norm", "q_b", "kv_a_norm", "kv_b"], "plain": ["q_kv", "kv_a_norm", "kv_b"]}
MLA_ROLES.update({f"{k}_gated": [*v, "mla_gate"] for k, v in MLA_ROLES.items()})  # each head's output times sigmoid(g_proj(x)) (Bailing)


def layer_roles(placement: str, attention_bias: bool, qk_norm: bool, o_bias: bool = False, sinks: bool = False,
                moe: bool = False, norm_bias: bool = False, mlp: str = "gated", mla: str = "", act: bool = False) -> list[str]:
    """The roles a layer has weights for, by its norm placement, q/k/v biases, q/k norms, o_proj bias, attention
    sinks, norm biases, MLP kind (gated | gated_bias | plain | plain_bias; a MoE layer's experts are not roles:
    models/moe_config.py), latent attention (`mla`: "" none, "lora" with q_lora_rank, "plain" without;
    "_gated": and a per-head output gate) and the
    activation's learned scalars (`act`: xIELU)."""
    mlp_roles = {"gated": ["gate_up", "down"], "gated_bias": ["gate_up", "down", "gate_up_bias", "down_bias"], "plain": ["up", "down"], "plain_bias": ["up", "down", "up_bias", "down_bias"]}
    attention = MLA_ROLES[mla] if mla else ["qkv"]
    roles = [*_PLACEMENT_NORMS[placement], *attention, "o_proj", *([] if moe else mlp_roles[mlp]), *(["act"] if act and not moe else [])]
    if norm_bias:
        roles += [f"{role}_bias" for role in _PLACEMENT_NORMS[placement]]
    if attention_bias:
        roles.append("qkv_bias")
    roles += [role for role, used in (("o_bias", o_bias), ("sinks", sinks)) if used]
    if qk_norm:
        roles += ["q_norm", "k_norm", *(["q_norm_bias", "k_norm_bias"] if norm_bias else [])]
    return roles
