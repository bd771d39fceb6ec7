"""Hybrid linear attention (Qwen3-Next, Qwen3.5, OLMo Hybrid): which layers are gated delta nets, their shapes, their weights' roles.

A `linear_attention` layer (docs/DESIGN.md, "Hybrid linear attention") replaces attention by a gated delta net: the
projections q|k|v|z and b|a of the normed input, a depthwise causal conv1d (kernel `conv_kernel`) over q|k|v with
SiLU, then per token the recurrence of transformers' `torch_recurrent_gated_delta_rule` on a state [value heads,
key_head_dim, value_head_dim], and a gated RMSNorm of its output times SiLU(z) before out_proj. Its cache is
(conv state [conv_dim, kernel - 1], recurrent state) instead of KV rows. The other layers are full attention with
an output gate (q_proj doubled: per head q then gate; the output times sigmoid(gate) before o_proj). Other kinds of
recurrent layer (`HybridConfig.kind`): LFM2's short convs (models/short_conv.py), Granite 4.0-H's and Bamba's
Mamba-2 layers (models/mamba2.py) and Jamba's Mamba-1 layers (models/mamba1.py), each with its config reader below; Falcon-H1's Mamba-2
mixer runs beside attention in every layer (`HybridConfig.parallel`, models/falcon_h1.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import UnsupportedError
from .weight_names import LLAMA_GGUF

# roles of a linear layer's weights -> Hugging Face names (relative to `model.layers.{i}.`). Qwen3.5 stores q|k|v
# and z (b and a) apart; Qwen3-Next fused, per key-head group, shown q|k|v|z (b|a) at load (models/hf_layouts.py)
LINEAR_NAMES: dict[str, tuple[str, ...]] = {
    "lin_qkvz": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"),
    "lin_ba": ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
    "lin_conv": ("linear_attn.conv1d.weight",), "lin_a_log": ("linear_attn.A_log",), "lin_dt_bias": ("linear_attn.dt_bias",),
    "lin_norm": ("linear_attn.norm.weight",), "lin_out": ("linear_attn.out_proj.weight",),
}
FUSED_LINEAR_NAMES = {"lin_qkvz": ("linear_attn.in_proj_qkvz.weight",), "lin_ba": ("linear_attn.in_proj_ba.weight",)}
LINEAR_ROLES = tuple(LINEAR_NAMES)
# a RecurrentGemma recurrent block's roles (models/rglru_config.py has their names)
RGLRU_ROLES = ("lru_y", "lru_y_bias", "lru_x", "lru_x_bias", "lru_conv", "lru_conv_bias", "lru_a", "lru_in_gate", "lru_in_gate_bias",
               "lru_a_gate", "lru_a_gate_bias", "lru_out", "lru_out_bias")
KDA_ROLES = ("kda_qkv", "kda_down", "kda_f_up", "kda_g_up", "kda_conv", "kda_a_log", "kda_dt_bias", "kda_norm", "kda_out")
# attention's roles, none of which a recurrent layer has (latent attention's too: Kimi Linear)
ATTENTION_ONLY = ("qkv", "o_proj", "q_norm", "k_norm", "qkv_bias", "o_bias", "q_kv", "q_kv_a", "q_b", "q_a_norm", "kv_a_norm", "kv_b", "mla_gate")
# a short-conv layer's roles (LFM2: in_proj -> B | C | x, the depthwise conv, out_proj)
SHORT_CONV_NAMES: dict[str, tuple[str, ...]] = {"conv_in": ("conv.in_proj.weight",), "conv_kernel": ("conv.conv.weight",),
                                                "conv_out": ("conv.out_proj.weight",)}
# LFM3's layer names: LFM2's short conv and MLP, sandwich norms (post_operator_norm / post_ffn_norm), Qwen3's attention
# names (q_norm / k_norm / o_proj; its per-head gate, stored gate_proj, shown inside q_proj at load: models/hf_layouts.py)
LFM3_NAMES = {**SHORT_CONV_NAMES, "input_norm": ("operator_norm.weight",), "post_norm": ("ffn_norm.weight",),
              "post_attn_norm": ("post_operator_norm.weight",), "post_mlp_norm": ("post_ffn_norm.weight",),
              "gate_up": ("feed_forward.w1.weight", "feed_forward.w3.weight"), "down": ("feed_forward.w2.weight",)}
# a Mamba-2 layer's roles (Granite 4.0-H: in_proj -> z | xBC | dt, the conv1d and its bias, the SSM's A_log / dt_bias /
# D, the gated group norm, out_proj)
MAMBA2_NAMES: dict[str, tuple[str, ...]] = {
    "ssm_in": ("mamba.in_proj.weight",), "ssm_conv": ("mamba.conv1d.weight",), "ssm_conv_bias": ("mamba.conv1d.bias",),
    "ssm_a_log": ("mamba.A_log",), "ssm_dt_bias": ("mamba.dt_bias",), "ssm_d": ("mamba.D",), "ssm_norm": ("mamba.norm.weight",),
    "ssm_out": ("mamba.out_proj.weight",),
}
# a Mamba-1 layer's roles (Jamba: in_proj -> x | z, the conv1d and its bias, x_proj -> dt | B | C and their RMS norms'
# gains, dt_proj and its bias, the SSM's A_log [inner, d_state] and D, out_proj)
MAMBA1_NAMES: dict[str, tuple[str, ...]] = {
    "ssm_in": ("mamba.in_proj.weight",), "ssm_conv": ("mamba.conv1d.weight",), "ssm_conv_bias": ("mamba.conv1d.bias",),
    "ssm_x": ("mamba.x_proj.weight",), "ssm_dt_norm": ("mamba.dt_layernorm.weight",), "ssm_b_norm": ("mamba.b_layernorm.weight",),
    "ssm_c_norm": ("mamba.c_layernorm.weight",), "ssm_dt": ("mamba.dt_proj.weight",), "ssm_dt_proj_bias": ("mamba.dt_proj.bias",),
    "ssm_a_log": ("mamba.A_log",), "ssm_d": ("mamba.D",), "ssm_out": ("mamba.out_proj.weight",),
}
MAMBA1_GAINS = ("ssm_dt_norm", "ssm_b_norm", "ssm_c_norm")  # absent where the norms have no gains (Falcon-Mamba) or are absent (Mamba)
# a Jamba layer's names: the Mamba-1 layer's, the SwiGLU under feed_forward after pre_ff_layernorm (its experts: moe_config.py)
JAMBA_NAMES = {**MAMBA1_NAMES, "gate_up": ("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight"),
               "down": ("feed_forward.down_proj.weight",), "post_norm": ("pre_ff_layernorm.weight",)}
# llama.cpp's names of a Jamba layer's tensors (its `jamba` GGUF, models/mamba1_gguf.py; A stored as -exp(A_log):
# models/mamba2_gguf.py ALogView): Llama's attention, the SwiGLU under feed_forward after pre_ff_layernorm, the Mamba-1 layer
JAMBA_GGUF = {**LLAMA_GGUF, "ffn_norm": "pre_ff_layernorm", **{f"ffn_{x}": f"feed_forward.{x}_proj" for x in ("gate", "up", "down")},
              **{f"ssm_{k}": f"mamba.{v}" for k, v in (("in", "in_proj"), ("conv1d", "conv1d"), ("x", "x_proj"), ("dt", "dt_proj"), ("a", "A_log"),
                 ("d", "D"), ("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"), ("c_norm", "c_layernorm"), ("out", "out_proj"))}}


# a MiniMax-01 lightning attention layer's roles -> Hugging Face names (relative to `model.layers.{i}.`; models/lightning.py)
LIGHTNING_NAMES: dict[str, tuple[str, ...]] = {
    "lightning_qkv": ("self_attn.qkv_proj.weight",), "lightning_gate": ("self_attn.output_gate.weight",),
    "lightning_norm": ("self_attn.norm.weight",), "lightning_out": ("self_attn.out_proj.weight",)}
# a RecurrentGemma recurrent block's roles -> Hugging Face names (relative to `model.layers.{i}.`; models/rglru_config.py);
# its layers' names: Gemma's roles under temporal_block / mlp_block, the norms temporal_pre_norm / channel_pre_norm
RGLRU_NAMES: dict[str, tuple[str, ...]] = {
    **{f"lru_{b}{s}": (f"temporal_block.linear_{b}.{w}",) for b in ("y", "x", "out") for s, w in (("", "weight"), ("_bias", "bias"))},
    "lru_conv": ("temporal_block.conv_1d.weight",), "lru_conv_bias": ("temporal_block.conv_1d.bias",),
    "lru_a": ("temporal_block.rg_lru.recurrent_param",),
    **{f"lru_{g}{s}": (f"temporal_block.rg_lru.{n}_{w}",) for g, n in (("in_gate", "input_gate"), ("a_gate", "recurrent_gate"))
       for s, w in (("", "weight"), ("_bias", "bias"))},
}
RECURRENT_GEMMA_NAMES = {**RGLRU_NAMES, "input_norm": ("temporal_pre_norm.weight",), "post_norm": ("channel_pre_norm.weight",),
                         "qkv": tuple(f"temporal_block.{x}_proj.weight" for x in "qkv"), "o_proj": ("temporal_block.o_proj.weight",),
                         "o_bias": ("temporal_block.o_proj.bias",), **{f"gate_up{s}": tuple(f"mlp_block.{x}_proj.{w}" for x in ("gate", "up"))
                                                                        for s, w in (("", "weight"), ("_bias", "bias"))},
                         "down": ("mlp_block.down_proj.weight",), "down_bias": ("mlp_block.down_proj.bias",)}


@dataclass(frozen=True)
class HybridConfig:
    """The recurrent layers' shapes and which layers they are (`linear[i]`: layer i is one). `kind`: "gated_delta"
    (Qwen3-Next, Qwen3.5: conv and recurrent states), "short_conv" (LFM2: a conv state alone over `width` channels) or
    "mamba2" (Granite 4.0-H, Bamba: conv and SSM states; heads `num_v_heads` of `v_dim`, groups `num_k_heads` of state size
    `k_dim`, so that the state [heads, d_state, head_dim] and the conv channels x | B | C have the gated delta net's shapes)
    or "mamba1" (Jamba: conv and SSM states; `width` inner channels, each with its own state of `k_dim` (d_state),
    dt of rank `dt_rank`) or "kda" (Kimi Linear: a gated delta net whose decay is per key channel, models/kda_config.py)
    or "rglru" (RecurrentGemma: conv and RG-LRU states over `width` channels, gates in `num_v_heads` blocks, models/rglru_config.py)
    or "lightning" (MiniMax-01: a state [num_v_heads, v_dim, v_dim] alone with a fixed decay per head, models/lightning.py). `parallel` (Falcon-H1, models/falcon_h1.py): every attention layer also runs the Mamba-2
    mixer on its normed input, the two outputs summed; `gate_norm` the Mamba-2 output's gate: "gated" (RMS-normed
    y * SiLU(z), Granite), "none" (y * SiLU(z)) or "before_gate" (RMS-normed y, then * SiLU(z)); `scales`: factors
    folded into tensors at load (muP multipliers: a layer tensor's name -> [rows, factor] runs of its rows,
    models/hf_layouts.py). A gated delta net's `beta_scale`, its gated norm's `norm_eps` and the recurrent layers' own
    norm `placement`: OLMo Hybrid's (`olmo_hybrid_from_hf`)."""

    linear: list[bool] = field(default_factory=list)
    kind: str = "gated_delta"
    width: int = 0  # a short-conv layer's channels (the hidden size)
    num_k_heads: int = 0
    num_v_heads: int = 0
    k_dim: int = 0  # linear_key_head_dim
    v_dim: int = 0  # linear_value_head_dim
    conv_kernel: int = 4
    conv_bias: bool = False  # a Mamba conv1d's bias (mamba_conv_bias)
    dt_rank: int = 0  # a Mamba-1 layer's dt rank (mamba_dt_rank)
    mixer_norms: str = "gains"  # a Mamba-1 layer's dt / B / C RMS norms: gains (Jamba) | plain (no gains: Falcon-Mamba, eps `norm_eps`) | none (Mamba)
    parallel: bool = False  # Falcon-H1: the Mamba-2 mixer beside each attention layer
    gate_norm: str = "gated"  # gated | none | before_gate (the Mamba-2 output's norm and gate)
    scales: dict[str, list[list[float]]] = field(default_factory=dict)  # name -> [rows, factor] runs, folded at load
    beta_scale: float = 1.0  # a gated delta net's beta = sigmoid(b) times this (OLMo Hybrid's linear_allow_neg_eigval: 2)
    norm_eps: float = 0.0  # its gated RMSNorm's epsilon (0: the model's rms_norm_eps; OLMo Hybrid: FLA's 1e-5)
    placement: str = ""  # the recurrent layers' norm placement ("": the model's; OLMo Hybrid: pre beside post-norm attention)
    full_gates: bool = False  # KDA: full-rank forget and output gates (f_proj, g_proj; Bailing) instead of Kimi's LoRA pairs
    gate_bound: float = 0.0  # KDA: g = gate_bound * sigmoid(exp(A_log) * (f + dt_bias)) (Bailing's safe gate); 0: Kimi's softplus

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """The conv1d's channels: q | k | v (a short conv, Mamba-1: `width`)."""
        return self.width if self.short_conv or self.mamba1 or self.rglru else 2 * self.key_dim + self.value_dim

    @property
    def short_conv(self) -> bool:
        return self.kind == "short_conv"

    @property
    def attention_free(self) -> bool:
        """Every layer recurrent (pure Mamba-2, an all-recurrent hybrid): a cache of states alone, no KV rows."""
        return all(self.linear)

    @property
    def mamba2(self) -> bool:
        return self.kind == "mamba2"

    @property
    def mamba1(self) -> bool:
        return self.kind == "mamba1"

    @property
    def kda(self) -> bool:
        return self.kind == "kda"

    @property
    def rglru(self) -> bool:
        return self.kind == "rglru"

    @property
    def lightning(self) -> bool:
        return self.kind == "lightning"

    def roles(self) -> tuple[str, ...]:
        """A recurrent layer's roles in the place of attention's."""
        if self.kda:  # Kimi Delta Attention (models/kda_config.py)
            return tuple(r for r in KDA_ROLES if not (self.full_gates and r in ("kda_f_up", "kda_g_up")))
        if self.rglru or self.lightning:  # RecurrentGemma (models/rglru_config.py), MiniMax-01 (models/lightning.py)
            return RGLRU_ROLES if self.rglru else tuple(LIGHTNING_NAMES)
        if self.mamba2 or self.mamba1:
            names = MAMBA2_NAMES if self.mamba2 else MAMBA1_NAMES
            return tuple(r for r in names if (self.conv_bias or r != "ssm_conv_bias") and (self.gate_norm != "none" or r != "ssm_norm")
                         and not (self.mixer_norms != "gains" and r in MAMBA1_GAINS))
        return tuple(SHORT_CONV_NAMES) if self.short_conv else LINEAR_ROLES

    def state_kinds(self) -> tuple[str, ...]:
        """A recurrent layer's cache tensors: its states, then its pending rows."""
        if self.lightning:  # MiniMax-01: no conv
            return ("recurrent", "rows")
        return ("conv", "rows") if self.short_conv else ("conv", "recurrent", "rows")

    def row_width(self) -> int:
        """A pending row's floats: its conv input (a gated delta net: and b, a; Mamba-2: and dt, and 1, the flag that
        tells a row from the runtime's first zero row, which must leave the states as they are; Mamba-1: and 1)."""
        if self.rglru:  # RecurrentGemma: and its flags keep, reset (models/rglru.py)
            return self.conv_dim + 2
        if self.lightning:  # MiniMax-01: a token's SiLU'd k | v (models/lightning.py)
            return 2 * self.value_dim
        if self.mamba1 or self.kda:  # KDA: and b [H], the forget gate's f_b(f_a(x)) [H * k_dim]
            return self.conv_dim + (1 if self.mamba1 else self.num_v_heads + self.key_dim)
        return self.conv_dim + (0 if self.short_conv else self.num_v_heads + 1 if self.mamba2 else 2 * self.num_v_heads)

    def fused_sizes(self) -> dict[str, list[int]]:
        """Rows of the fused roles' parts: q|k|v and z, b and a (Qwen3-Next's in_proj_qkvz / in_proj_ba, split)."""
        return {"lin_qkvz": [self.conv_dim, self.value_dim], "lin_ba": [self.num_v_heads] * 2}

    def conv_state_shape(self) -> tuple[int, int]:
        """A layer's conv state per sequence: the last kernel - 1 conv inputs, [conv_dim, kernel - 1]."""
        return (self.conv_dim, self.conv_kernel - 1)

    def recurrent_state_shape(self) -> tuple[int, ...]:
        """A layer's recurrent state per sequence: [value heads, key_head_dim, value_head_dim] (Mamba-1: [inner, d_state])."""
        if self.rglru:  # RecurrentGemma: [width]
            return (self.width,)
        return (self.width, self.k_dim) if self.mamba1 else (self.num_v_heads, self.k_dim, self.v_dim)


def short_conv_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of an LFM2 / LFM3 config.json: `hybrid` (layer_types, else full_attn_idxs: "conv" layers are
    short convs, full_attention / sliding_attention ones attention), the MLP width after transformers'
    `block_auto_adjust_ff_dim`; conv biases and LFM3's sliding layers without a window refused (every layer a short
    conv is built)."""
    types = data.get("layer_types") or ["full_attention" if i in (data.get("full_attn_idxs") or []) else "conv" for i in range(layers)]
    types = list(types)[:layers]
    other = sorted(set(types) - {"full_attention", "sliding_attention", "conv"})
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in an LFM2 model")
    if data.get("conv_bias"):
        raise UnsupportedError(f"{source}: conv_bias true (short-conv biases) is not supported")
    _check_sliding(data, types, source)
    inter = int(data["intermediate_size"])
    if data.get("block_auto_adjust_ff_dim"):  # transformers' Lfm2MLP
        inter = int(2 * inter / 3)
        if data.get("block_ffn_dim_multiplier") is not None:
            multiple = int(data.get("block_multiple_of") or 256)
            inter = int(float(data["block_ffn_dim_multiplier"]) * inter)
            inter = multiple * ((inter + multiple - 1) // multiple)
    hybrid = HybridConfig(linear=[t == "conv" for t in types], kind="short_conv", width=int(data["hidden_size"]),
                          conv_kernel=int(data.get("conv_L_cache") or 3))
    return dict(hybrid=hybrid, intermediate_size=inter)


def _check_sliding(data: dict[str, Any], types: list[str], source: str) -> None:
    """LFM3's rope per layer type: full layers' partial_rotary_factor with proportional rope only (transformers' default
    rope turns the whole head, its other types fail); sliding layers with a sliding_window and default rope (the
    local rotary table is unscaled: models/rope.py); refused otherwise."""
    full = (data.get("rope_parameters") or {}).get("full_attention") or {}
    if full.get("rope_type") != "proportional" and float(full.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedError(f"{source}: rope_parameters full_attention {full!r} is not supported (partial rotary only "
                               "with rope_type proportional)")
    if "sliding_attention" not in types:
        return
    if not data.get("sliding_window"):
        raise UnsupportedError(f"{source}: sliding_attention layers without a sliding_window are not supported")
    local = (data.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default" or float(local.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedError(f"{source}: rope_parameters sliding_attention {local!r} is not supported (default rope only)")


def gguf_kv_heads(meta: dict[str, Any], p: str) -> list[int]:
    """llama.cpp's `attention.head_count_kv` per layer: a hybrid's list (0 on its recurrent layers), or one count."""
    kv = meta[p + "attention.head_count_kv"]
    return [int(h) for h in kv] if isinstance(kv, (list, tuple)) else [int(kv)] * int(meta[p + "block_count"])


def short_conv_gguf_keys(meta: dict[str, Any], p: str, source: str) -> dict[str, Any]:
    """The config.json keys of llama.cpp's lfm2 / lfm2moe metadata: a layer is attention where its
    `attention.head_count_kv` entry is not 0 (a short conv where it is), the conv's `shortconv.l_cache`; the MLP
    width as written (the converter already adjusted it)."""
    kv = gguf_kv_heads(meta, p)
    return {"layer_types": ["full_attention" if heads else "conv" for heads in kv], "num_key_value_heads": max(kv) or 1,
            "conv_L_cache": int(meta[p + "shortconv.l_cache"]), "block_auto_adjust_ff_dim": False}


def hybrid_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a hybrid checkpoint's config.json: `hybrid` (layer_types, else every
    full_attention_interval-th layer full, as transformers; every layer may be linear), the output gate; other layer
    kinds and a hidden_act other than SiLU (the conv's and the gated norm's activation) are refused."""
    types = data.get("layer_types")
    if not types:
        interval = int(data.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    types = list(types)[:layers]
    other = sorted(set(types) - {"full_attention", "linear_attention"})
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in a hybrid linear-attention model")
    if str(data.get("hidden_act", "silu")) != "silu":
        raise UnsupportedError(f"{source}: hidden_act {data['hidden_act']!r} is not supported in a hybrid linear-attention model")
    hybrid = HybridConfig(linear=[t == "linear_attention" for t in types], num_k_heads=int(data["linear_num_key_heads"]),
                          num_v_heads=int(data["linear_num_value_heads"]), k_dim=int(data["linear_key_head_dim"]),
                          v_dim=int(data["linear_value_head_dim"]), conv_kernel=int(data.get("linear_conv_kernel_dim") or 4))
    if hybrid.num_v_heads % hybrid.num_k_heads:
        raise UnsupportedError(f"{source}: linear_num_value_heads not a multiple of linear_num_key_heads is not supported")
    return dict(hybrid=hybrid, attn_output_gate=True)


# OLMo Hybrid's checkpoint names (its hub format, as transformers' conversion_mapping reads it) -> the table's: the delta net
# under Qwen3.5's names (q | k | v projections and their convs joined, rows concatenated: models/hf_layouts.py), the layer
# norms under transformers' (attention_layer_norm: input_layernorm; feedforward_layer_norm: post_attention_layernorm)
OLMO_HYBRID_RENAMES = {"attention_layer_norm.weight": "input_layernorm.weight", "feedforward_layer_norm.weight": "post_attention_layernorm.weight",
                       **{f"linear_attn.{old}.weight": f"linear_attn.{new}.weight" for old, new in
                          (("g_proj", "in_proj_z"), ("b_proj", "in_proj_b"), ("a_proj", "in_proj_a"), ("o_proj", "out_proj"), ("o_norm", "norm"))}}
OLMO_HYBRID_JOINED = {"linear_attn.in_proj_qkv.weight": tuple(f"linear_attn.{x}_proj.weight" for x in "qkv"),
                      "linear_attn.conv1d.weight": tuple(f"linear_attn.{x}_conv1d.weight" for x in "qkv")}

def olmo_hybrid_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of an OLMo Hybrid config.json: `hybrid_from_hf`'s with transformers' defaults (linear heads:
    num_attention_heads; key head dim 0.75 hidden / key heads, value head dim twice it; every 4th layer full, else the
    last), beta scaled to [0, 2] (linear_allow_neg_eigval, default true), FLA's gated-norm epsilon 1e-5, the delta-net
    layers pre-norm (Llama's) beside OLMo 3's post-norm attention, no output gate (rope on the attention layers: transformers fills a missing rope_theta)."""
    data = dict(data)
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        data[key] = data.get(key) or data["num_attention_heads"]
    data["linear_key_head_dim"] = data.get("linear_key_head_dim") or int(0.75 * int(data["hidden_size"]) / int(data["linear_num_key_heads"]))
    data["linear_value_head_dim"] = data.get("linear_value_head_dim") or 2 * int(data["linear_key_head_dim"])
    if not data.get("layer_types"):
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        data["layer_types"] = types if "full_attention" in types else [*types[:-1], "full_attention"]
    fields = hybrid_from_hf(data, layers, source)
    neg = data.get("linear_allow_neg_eigval")
    hybrid = replace(fields["hybrid"], beta_scale=1.0 if neg is False else 2.0, norm_eps=1e-5, placement="pre")
    return dict(hybrid=hybrid, attn_output_gate=False)


def _infinite(value: Any) -> bool:
    """A config.json float that is +inf (json's Infinity, or transformers' {"__float__": "Infinity"})."""
    return value == {"__float__": "Infinity"} or (isinstance(value, (int, float)) and value == float("inf"))


def _refuse_mamba_keys(data: dict[str, Any], source: str, kind: str) -> None:
    """UnsupportedError where a Mamba hybrid's config.json has an activation other than SiLU (the conv's and the MLP's)
    or projection biases (mamba_proj_bias)."""
    if str(data.get("hidden_act", "silu")) != "silu":
        raise UnsupportedError(f"{source}: hidden_act {data['hidden_act']!r} is not supported in a {kind} hybrid model")
    if data.get("mamba_proj_bias"):
        raise UnsupportedError(f"{source}: mamba_proj_bias true (in_proj / out_proj biases) is not supported")


def mamba2_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Granite 4.0-H (granitemoehybrid) or Bamba config.json: `hybrid` ("mamba" /
    "linear_attention" layers are Mamba-2, "attention" / "full_attention" or Bamba's attn_layer_indices attention), NoPE
    attention unless position_embedding_type is "rope" (Bamba's default), Granite's dense MLP width
    (shared_intermediate_size) when num_local_experts is 0; projection biases, a
    time_step_limit other than (0, inf) and an activation other than SiLU refused (every layer may be Mamba-2)."""
    kinds = {"mamba": True, "linear_attention": True, "attention": False, "full_attention": False}
    indices = data.get("attn_layer_indices") or []  # Bamba's
    types = list(data.get("layer_types") or ["attention" if i in indices else "mamba" for i in range(layers)])[:layers]
    other = sorted(set(types) - set(kinds))
    if other:
        raise UnsupportedError(f"{source}: layer_types {other[0]!r} is not supported in a Mamba-2 hybrid model")
    _refuse_mamba_keys(data, source, "Mamba-2")
    limit = data.get("time_step_limit")
    if limit is not None and not (len(limit) == 2 and limit[0] == 0 and _infinite(limit[1])):
        raise UnsupportedError(f"{source}: time_step_limit {limit!r} (a clamped dt) is not supported (0, inf)")
    inner = int(data.get("mamba_d_inner") or int(data.get("mamba_expand") or 2) * int(data["hidden_size"]))  # Nemotron-H: heads x head_dim
    heads, groups = int(data.get("mamba_n_heads") or 128), int(data.get("mamba_n_groups") or 1)
    head_dim = inner // heads if data.get("mamba_d_head", "auto") == "auto" else int(data["mamba_d_head"])
    if heads * head_dim != inner or heads % groups:
        raise UnsupportedError(f"{source}: mamba_n_heads x mamba_d_head != mamba_expand x hidden_size, or heads not a "
                               "multiple of mamba_n_groups, is not supported")
    hybrid = HybridConfig(linear=[kinds[t] for t in types], kind="mamba2", num_k_heads=groups, num_v_heads=heads,
                          k_dim=int(data.get("mamba_d_state") or 256), v_dim=head_dim, conv_kernel=int(data.get("mamba_d_conv") or 4),
                          conv_bias=bool(data.get("mamba_conv_bias", True)))
    dense = {"intermediate_size": int(data["shared_intermediate_size"])} if "shared_intermediate_size" in data and not data["num_local_experts"] else {}
    nope = {} if data.get("position_embedding_type") == "rope" else {"nope_layers": list(range(layers))}
    return dict(hybrid=hybrid, **dense, **nope)


def mamba1_from_hf(data: dict[str, Any], layers: int, source: str) -> dict[str, Any]:
    """ModelConfig fields of a Jamba config.json: `hybrid` (layer i attention where i % attn_layer_period ==
    attn_layer_offset, else Mamba-1, as transformers' `layers_block_type`), every layer NoPE (Jamba's attention has no
    positions; every layer may be Mamba-1); projection biases (mamba_proj_bias) and an activation other than SiLU refused."""
    period, offset = int(data.get("attn_layer_period", 8)), int(data.get("attn_layer_offset", 4))  # transformers' defaults
    _refuse_mamba_keys(data, source, "Mamba-1")
    hidden = int(data["hidden_size"])
    rank = data.get("mamba_dt_rank", "auto")
    hybrid = HybridConfig(linear=[i % period != offset for i in range(layers)], kind="mamba1",
                          width=int(data.get("mamba_expand") or 2) * hidden, k_dim=int(data.get("mamba_d_state") or 16),
                          conv_kernel=int(data.get("mamba_d_conv") or 4), conv_bias=bool(data.get("mamba_conv_bias", True)),
                          dt_rank=-(-hidden // 16) if rank == "auto" else int(rank))
    return dict(hybrid=hybrid, nope_layers=list(range(layers)))
