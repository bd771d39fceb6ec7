"""Kimi Linear (`kimi_linear`): which layers are Kimi Delta Attention (KDA), their shapes and weights' names, read
from config.json (docs/DESIGN.md, "Hybrid linear attention"; models/kda.py is the torch reference).

A KDA layer is a gated delta net (`HybridConfig.kind` "kda") whose forget gate is per key channel: q, k, v
projections (heads x head_dim each, as many key as value heads), a depthwise causal conv1d over q|k|v with SiLU, per
token the delta rule on a state [heads, head_dim, head_dim] decayed by exp(g), g = -exp(A_log[head]) *
softplus(f_b(f_a(x)) + dt_bias) per channel, beta = sigmoid(b_proj(x)); its readout RMS-normed per head times
sigmoid(g_b(g_a(x))) before o_proj. The other layers are DeepSeek-V3's latent attention without rope (`mla_use_nope`).
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from .linear_config import HybridConfig
from .weights import WeightSource

# a KDA layer's roles -> the checkpoint's names (relative to `model.layers.{i}.`; transformers renames some at load):
# q|k|v, the three down projections of the normed input (forget gate, output gate, beta) read as one MatMul, the two up
# projections, the q|k|v convs, A_log [1, 1, H, 1], dt_bias [H * D], the gated norm's gain [D], o_proj
KDA_NAMES: dict[str, tuple[str, ...]] = {
    "kda_qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "kda_down": ("self_attn.f_a_proj.weight", "self_attn.g_a_proj.weight", "self_attn.b_proj.weight"),
    "kda_f_up": ("self_attn.f_b_proj.weight",), "kda_g_up": ("self_attn.g_b_proj.weight",),
    "kda_conv": tuple(f"self_attn.{x}_conv1d.weight" for x in "qkv"), "kda_a_log": ("self_attn.A_log",),
    "kda_dt_bias": ("self_attn.dt_bias",), "kda_norm": ("self_attn.o_norm.weight",), "kda_out": ("self_attn.o_proj.weight",),
}
KDA_MATMULS = ("kda_qkv", "kda_down", "kda_f_up", "kda_g_up", "kda_out")  # MatMul weights [in, out] in the graphs
# config.json's MoE keys under DeepSeek-V3's names (transformers' KimiLinearConfig.attribute_map)
KIMI_KEYS = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
             "num_expert_group": "n_group", "moe_renormalize": "norm_topk_prob", "model_max_length": "max_position_embeddings"}


def kda_shapes(hy: HybridConfig, hidden: int) -> dict[str, list[tuple[int, ...]]]:
    """The checkpoint shapes of a KDA layer's roles."""
    width, d, heads = hy.value_dim, hy.k_dim, hy.num_v_heads
    if hy.full_gates:  # Bailing: f_proj | g_proj | b_proj, A_log [H]
        return {**kda_shapes(HybridConfig(kind="kda", num_k_heads=heads, num_v_heads=heads, k_dim=d, v_dim=d, conv_kernel=hy.conv_kernel), hidden),
                "kda_down": [(width, hidden), (width, hidden), (heads, hidden)], "kda_a_log": [(heads,)]}
    return {"kda_qkv": [(width, hidden)] * 3, "kda_down": [(d, hidden), (d, hidden), (heads, hidden)], "kda_f_up": [(width, d)],
            "kda_g_up": [(width, d)], "kda_conv": [(width, 1, hy.conv_kernel)] * 3, "kda_a_log": [(1, 1, heads, 1)],
            "kda_dt_bias": [(width,)], "kda_norm": [(d,)], "kda_out": [(hidden, width)]}


def kda_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Kimi Linear config.json: `hybrid` (layer_types, else linear_attn_config's 1-indexed
    kda_layers / full_attn_layers, else transformers' default: layer i > 0 with i % 4 == 0 full), every layer NoPE;
    an activation other than SiLU, rope on the latent attention (mla_use_nope false), a router other than sigmoid, MoE
    layers not every layer (moe_layer_freq) and no attention layer are refused."""
    lin = data.get("linear_attn_config") or {}
    types = data.get("layer_types")
    if not types and "full_attn_layers" in lin and "kda_layers" in lin:
        types = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in lin[key]:
                types[int(layer) - 1] = kind
    types = list(types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)])[:layers]
    other = sorted({str(t) for t in types} - {"full_attention", "linear_attention"})
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in a Kimi Linear model")
    if str(data.get("hidden_act", "silu")) != "silu":
        raise UnsupportedError(f"{source}: hidden_act {data['hidden_act']!r} is not supported in a Kimi Linear model")
    if data.get("mla_use_nope") is False:
        raise UnsupportedError(f"{source}: mla_use_nope false (rope on Kimi Linear's latent attention) is not supported")
    if int(data.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedError(f"{source}: moe_layer_freq {data['moe_layer_freq']!r} is not supported (1: every layer past the dense ones MoE)")
    if str(data.get("moe_router_activation_func", "sigmoid")) != "sigmoid":
        raise UnsupportedError(f"{source}: moe_router_activation_func {data['moe_router_activation_func']!r} is not supported (sigmoid)")
    heads = int(lin.get("num_heads", data.get("linear_num_heads", 32)))
    dim = int(lin.get("head_dim", data.get("linear_head_dim", 128)))
    kernel = int(lin.get("short_conv_kernel_size", data.get("linear_conv_kernel_dim", 4)))
    hybrid = HybridConfig(linear=[t == "linear_attention" for t in types], kind="kda", num_k_heads=heads, num_v_heads=heads,
                          k_dim=dim, v_dim=dim, conv_kernel=kernel)
    return dict(hybrid=hybrid, nope_layers=list(range(layers)))


def kimi_view(source: WeightSource) -> WeightSource:
    """A checkpoint transformers saved: its dense layers' MLP under `block_sparse_moe.` (its save renames every `mlp.`)
    read under `mlp.`, as Moonshot's checkpoints store it."""
    dense = {n: n.replace(".block_sparse_moe.", ".mlp.") for n in source.names()
             if n.endswith(tuple(f".block_sparse_moe.{p}_proj.weight" for p in ("gate", "up", "down")))}
    return source.renamed(dense)
