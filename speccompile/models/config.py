"""Architecture configuration of a Llama-family decoder, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError, UnsupportedError
from .altup_keys import altup_keys
from .architectures import FAMILIES, Family, family, family_name
from .weight_names import ALTUP_NAMES, BESIDE_ROLES, MLP_ROLES
from .layer_roles import layer_roles
from .attention_keys import latent_attention, layer_shapes
from .bitnet import bitnet_fields, bitnet_gguf_keys
from .llama4 import llama4_fields
from .layer_keys import biases_of, family_keys, kv_heads, layer_types_of, mlp_act_of, multipliers, nope_layers_of, placement
from .gemma4_gguf import gemma4_keys
from .gated_delta_gguf import gated_delta_gguf_keys
from .mamba1_gguf import mamba1_gguf_keys
from .mamba_config import mamba_from_hf, mamba_gguf_keys
from .rglru_config import rglru_from_hf
from .minimax_config import minimax_from_hf
from .mamba2_gguf import mamba2_gguf_keys
from .mla_gguf import mla_gguf_keys
from .moe_config import MoeConfig, moe_from_hf, moe_keys_from_gguf
from .linear_config import ATTENTION_ONLY, HybridConfig, hybrid_from_hf, mamba1_from_hf, olmo_hybrid_from_hf, mamba2_from_hf, short_conv_from_hf, short_conv_gguf_keys
from .falcon_h1 import falcon_h1_from_hf, falcon_h1_gguf_keys
from .falcon import falcon_gguf_keys, falcon_keys
from .kda_config import kda_from_hf
from .bailing_config import bailing_from_hf
from .kda_gguf import kda_gguf_keys
from .nemotron_h import nemotron_h_from_hf, nemotron_h_keys
from .nemotron_h_gguf import nemotron_h_gguf_keys
from .refused import REFUSED
from .rope_keys import check_rope_scaling, gpt_oss_gguf_keys, layer_rope_bases, ministral3_gguf_keys, rope_params
from .gguf_layer_keys import gguf_layer_keys as _gguf_layer_keys

_GGUF_KEYS = {"gpt_oss": gpt_oss_gguf_keys, "ministral3": ministral3_gguf_keys, "bitnet": bitnet_gguf_keys,
              "lfm2": short_conv_gguf_keys, "lfm2_moe": short_conv_gguf_keys, "granitemoehybrid": mamba2_gguf_keys,
              "qwen3_next": gated_delta_gguf_keys, "qwen3_5": gated_delta_gguf_keys, "qwen3_5_moe": gated_delta_gguf_keys,
              "kimi_linear": kda_gguf_keys}  # a family's rope / activation keys of llama.cpp's metadata
HIDDEN_STATE_MODES = ("none", "final", "eagle3")  # extra outputs of a target graph: none | final norm | EAGLE-3 taps


def eagle3_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """Layers whose *inputs* (residual stream before the layer) EAGLE-3 fuses: (2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class ModelConfig:
    """Everything the decoder needs to know about the architecture (names follow Hugging Face)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # the layer description (models/architectures.py; the defaults are Llama's)
    norm: str = "rms"  # rms | layer (LayerNorm)
    norm_bias: bool = False  # the layer and final norms add a bias (Phi-2)
    norm_offset: float = 0.0  # gain = norm_offset + weight (Gemma: 1)
    placement: str = "pre"  # pre | sandwich | post | parallel | parallel2
    qk_norm_full: bool = False  # q/k norms over all heads at once (OLMo 2) instead of per head
    qk_norm_after_rope: bool = False  # the per-head q/k norms take the roped q / k (Hunyuan) instead of rope taking theirs
    mlp_act: str = "silu"  # silu | gelu_tanh | gelu | relu | relu2 | xielu
    mlp_gated: bool = True  # False: down(act(up x)) (Phi-2)
    mlp_bias: bool = False  # the MLP's up / down biases (gated: and the gate's)
    lm_head_bias: bool = False
    rotary_dim: int = 0  # rotated dims of a head (0: all; partial rotary otherwise)
    rope_interleaved: bool = False
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention | sliding_attention ([]: all full)
    sliding_window: int = 0  # a sliding layer's query at position p attends key slots p - W < j <= p
    rope_local_theta: float = 0.0  # the rope base of sliding layers (0: rope_theta)
    nope_layers: list[int] = field(default_factory=list)  # layers without rope
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    query_scale_beta: float = 0.0  # Llama 4's query scaling (Ministral 3): q times 1 + beta log(1 + floor(position / length)); 0: none
    query_scale_length: int = 0  # its length (rope_parameters' original_max_position_embeddings)
    query_scale_offset: int = 0  # added to the position first (Llama 4's temperature: 1)
    nope_temperature: bool = False  # Llama 4: the query scale on NoPE layers only, the q/k norms on rope layers only (`layer`)
    window_chunks: bool = False  # Llama 4: a sliding layer's window is its chunk, positions p - p % W .. p (models/llama4.py)
    attn_softcap: float = 0.0  # scores = cap * tanh(scores / cap) (0: none)
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap) (0: none)
    embed_scale: float = 1.0
    residual_scale: float = 1.0  # multiplies each block's output before the residual add
    residual_factors: list[list[float]] = field(default_factory=list)  # MiniMax-01, per layer (models/normed_residual.py)
    logit_scale: float = 1.0
    attn_sinks: bool = False  # per-head sink logits in the attention softmax (gpt-oss)
    o_proj_bias: bool = False
    moe: MoeConfig | None = None  # mixture-of-experts layers (models/moe_config.py); None: dense MLPs
    # multi-head latent attention (DeepSeek-V2/V3; kv_lora_rank 0: none). The cache holds one vector per token,
    # [k_pe (rotary_dim), c_kv (kv_lora_rank)]: num_key_value_heads 1, head_dim kv_lora_rank + rotary_dim
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # per-layer attention shapes (Gemma 4: full-attention layers' global_head_dim / kv heads; []: every layer's is
    # head_dim / num_key_value_heads); `layer(i)` is the config as layer i sees it
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    k_eq_v: bool = False  # full-attention layers have no v_proj: the values are the key projection (before k_norm)
    v_norm: bool = False  # the values get a scale-free RMSNorm per head (Gemma 4)
    layer_scalar: bool = False  # each layer's output times its learned scalar (Gemma 4's `layer_scalar`, role of that name)
    # KV sharing (Gemma 4): per layer, the layer whose pass's new key / value rows it takes as its own (-1: its own
    # projections); []: none. `layer_intermediate_sizes`: per layer MLP widths (the shared layers' double-wide MLP); 0: no MLP (Nemotron-H)
    kv_sources: list[int] = field(default_factory=list)
    layer_intermediate_sizes: list[int] = field(default_factory=list)
    per_layer_input_size: int = 0  # per-layer embeddings (Gemma 4's PLE): each layer's width (0: none)
    per_layer_vocab_size: int = 0  # the rows of their table
    # Gemma 3n (models/altup.py): AltUp's parallel streams (0: none), LAuReL's rank, the Gaussian top-k's target
    # sparsity of each layer's MLP gate ([]: none; 0: that layer dense)
    altup_inputs: int = 0
    laurel_rank: int = 0
    activation_sparsity: list[float] = field(default_factory=list)
    soft_token_offset: int = 0  # its wrapper's image / audio tokens (ids from here on) embed from their own table (models/soft_tokens.py)
    # learned absolute positions (GPT-2's wpe; 0: none): the table's rows; position p reads row p + position_offset
    position_embeddings: int = 0
    position_offset: int = 0
    sub_norms: bool = False  # norms of o_proj's and down_proj's inputs (BitNet: roles attn_sub_norm / ffn_sub_norm)
    act_quant: bool = False  # every projection's input per token through int8 and back (BitNet's BitLinear: models/bitnet.py)
    embed_norm: bool = False  # the final norm (its gain) also normalises the embeddings before layer 0 (nanochat)
    rope_reversed: bool = False  # rope turned the other way: the rotation by -angle, i.e. sin negated (nanochat)
    hybrid: HybridConfig | None = None  # gated delta net layers (models/linear_config.py; None: attention only)
    attn_output_gate: bool = False  # q_proj doubled (per head q, gate): attention output times sigmoid(gate) (Qwen3-Next)
    attn_head_gate: bool = False  # that gate one value a head (LFM3): q_proj's rows per head q, then one gate row (MLA: g_proj, Bailing)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from a manifest's JSON
            self.moe = MoeConfig(**self.moe)
        if isinstance(self.hybrid, dict):
            self.hybrid = HybridConfig(**self.hybrid)

    def linear(self, layer: int) -> bool:
        """Layer `layer` is a gated delta net (hybrid linear attention) instead of attention."""
        return self.hybrid is not None and self.hybrid.linear[layer]

    def placement_of(self, layer: int) -> str:
        """Layer `layer`'s norm placement: the recurrent layers' own (`HybridConfig.placement`: OLMo Hybrid's), else the model's."""
        return self.hybrid.placement if self.linear(layer) and self.hybrid.placement else self.placement

    def parallel_mixer(self, layer: int) -> bool:
        """Layer `layer` runs a Mamba-2 mixer beside its attention on the same normed input (Falcon-H1)."""
        return self.hybrid is not None and self.hybrid.parallel and not self.hybrid.linear[layer]

    def has_mlp(self, layer: int) -> bool:
        """Layer `layer` has an MLP block (Nemotron-H: a mixer block with no MLP block after it has width 0)."""
        return not self.layer_intermediate_sizes or self.layer_intermediate_sizes[layer] > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (the compressed cache)."""
        return bool(self.kv_lora_rank)

    def layer(self, i: int) -> "ModelConfig":
        """The config as layer `i` sees it: its own head_dim, KV heads (`layer_head_dims`), MLP width
        (`layer_intermediate_sizes`), q/k norms and query scale (`nope_temperature`); `self` when uniform."""
        if not (self.layer_head_dims or self.layer_intermediate_sizes or self.nope_temperature):
            return self
        dims, kv, inter, nope = self.layer_head_dims, self.layer_kv_heads, self.layer_intermediate_sizes, i in self.nope_layers
        return dataclasses.replace(self, head_dim=dims[i] if dims else self.head_dim, num_key_value_heads=kv[i] if kv else self.num_key_value_heads,
                                   intermediate_size=inter[i] if inter else self.intermediate_size, layer_head_dims=[], layer_kv_heads=[],
                                   layer_intermediate_sizes=[], nope_temperature=False, **({"qk_norm": self.qk_norm and not nope,
                                   "query_scale_beta": self.query_scale_beta * nope} if self.nope_temperature else {}))

    def kv_source(self, i: int) -> int | None:
        """The layer whose new key / value rows layer i takes as its own (KV sharing), or None: its own."""
        return self.kv_sources[i] if self.kv_sources and self.kv_sources[i] >= 0 else None

    def values_are_keys(self, i: int) -> bool:
        """Layer i's values are its key projection (`k_eq_v` on a full-attention layer: no v_proj)."""
        return self.k_eq_v and not self.sliding(i)

    @property
    def max_head_dim(self) -> int:
        """The widest head of any layer (the fused CPU graph's wide-head rule)."""
        return max(self.layer_head_dims or [self.head_dim])

    def kind_head_dim(self, kind: str) -> int:
        """The head_dim of the layers using rotary table `kind` (per-layer shapes: every such layer has one)."""
        return next((self.layer(i).head_dim for i in range(self.num_hidden_layers) if self.rope_kind(i) == kind), self.head_dim)

    @property
    def gate_dim(self) -> int:
        """The output gate's rows per head in q_proj (after the head's q rows): head_dim, 1 (`attn_head_gate`) or 0."""
        return (1 if self.attn_head_gate else self.head_dim) if self.attn_output_gate else 0

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Rotated dims of a head."""
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        """The attention scores' multiplier."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_roles(self, layer: int = 0) -> list[str]:
        """The roles layer `layer` has weights for (models/architectures.py; a MoE layer's experts are not roles)."""
        mlp = ("gated" if self.mlp_gated else "plain") + "_bias" * self.mlp_bias
        moe = self.moe is not None and self.moe.is_moe(layer)
        beside = moe and self.moe.beside_dense  # Gemma 4: the dense MLP's roles too, and the norms around both
        roles = layer_roles(self.placement_of(layer), self.attention_bias, self.layer(layer).qk_norm, o_bias=self.o_proj_bias, sinks=self.attn_sinks,
                            moe=moe and not beside, norm_bias=self.norm_bias, mlp=mlp,
                            mla=("lora" if self.q_lora_rank else "plain") + "_gated" * self.attn_head_gate if self.kv_lora_rank else "", act=self.mlp_act == "xielu")
        if self.kv_source(layer) is not None:  # KV sharing: q_proj alone (role qkv) and q_norm
            roles = [role for role in roles if role not in ("k_norm", "k_norm_bias")]
        if self.linear(layer):  # its norms and MLP; the gated delta net's roles for the attention's
            roles = [*self.hybrid.roles(), *(r for r in roles if r not in ATTENTION_ONLY)]
        roles += [*self.hybrid.roles()] if self.parallel_mixer(layer) else []  # Falcon-H1: the Mamba-2 mixer's too
        if not self.has_mlp(layer):  # Nemotron-H: the MLP's norm and weights absent
            roles = [r for r in roles if r not in MLP_ROLES]
        altup = [role for role in ALTUP_NAMES if self.altup_inputs and (self.laurel_rank or not role.startswith("laurel"))]
        return roles + [*BESIDE_ROLES] * beside + ["layer_scalar"] * self.layer_scalar + ["ple_gate", "ple_proj", "ple_norm"] * bool(self.per_layer_input_size) \
            + ["attn_sub_norm", "ffn_sub_norm"] * self.sub_norms + altup

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def rope_kind(self, layer: int) -> str:
        """Which rotary table layer `layer` uses: "global", "local" (sliding layers with their own base) or ""."""
        if layer in self.nope_layers:
            return ""
        return "local" if self.rope_local_theta and self.sliding(layer) else "global"

    def rope_kinds(self) -> list[str]:
        """The rotary tables the layers use, in a fixed order."""
        used = {self.rope_kind(i) for i in range(self.num_hidden_layers) if not self.linear(i)}
        return [k for k in ("global", "local") if k in used]


def normalize_architecture(name: str, source: str) -> str:
    """Map a model_type / GGUF architecture name to its family in the architecture table, or raise."""
    arch = family_name(name)
    if arch is None:
        why = REFUSED.get(str(name).lower())
        if why:
            raise UnsupportedError(f"{source}: architecture '{name}': {why}")
        raise UnsupportedError(
            f"{source}: unsupported architecture '{name}' (supported: {', '.join(sorted(FAMILIES))})"
        )
    return arch


def _eos_list(value: Any) -> list[int]:
    return [] if value is None else [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _layer_description(data: dict[str, Any], fam: Family, arch: str, layers: int, hidden: int, head_dim: int,
                       source: str) -> dict[str, Any]:
    """The ModelConfig fields of the family's layer description, read from a config.json."""
    rope, local = rope_params(data)
    types, window = layer_types_of(data, fam, layers)
    partial = float(rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "proportional":  # the whole head turns, frequencies past the fraction 0 (models/rope.py)
        partial = 1.0
    if data.get("rotary_dim") and "partial_rotary_factor" not in rope:  # MiniMax-M2's legacy key: the rotated dims
        partial = int(data["rotary_dim"]) / head_dim
    fields = dict(
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=check_rope_scaling(rope, source, alpha=fam.rope_alpha),
        attn_sinks=fam.attn_sinks, **biases_of(data, fam, arch, source),
        qk_norm=bool(fam.qk_norm or (fam.qk_norm_key and data.get(fam.qk_norm_key))), qk_norm_full=fam.qk_norm == "full",
        qk_norm_after_rope=fam.qk_norm == "after_rope", norm=fam.norm, norm_offset=fam.norm_offset, placement=placement(data, fam), mlp_act=mlp_act_of(data, fam, arch, source),
        lm_head_bias=bool(data.get(fam.bias_keys["lm_head"], fam.lm_head_bias)) if "lm_head" in fam.bias_keys else fam.lm_head_bias,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0, rope_interleaved=fam.rope_interleaved, norm_bias=fam.norm_bias, mlp_gated=fam.mlp_gated,
        layer_types=types, sliding_window=window, rope_local_theta=float(local.get("rope_theta", 0.0)) if types else 0.0,
        nope_layers=nope_layers_of(data, fam, types, layers),
        attn_softcap=float(data.get("attn_logit_softcapping") or 0.0), final_softcap=float(data.get("final_logit_softcapping") or 0.0),
        **multipliers(data, fam, hidden, head_dim),
        **(layer_shapes(data, types, layers, head_dim, source) if fam.layer_shapes else {}),
        **(altup_keys(data, types, layers, source) if fam.altup else {}),
        v_norm=fam.v_norm, layer_scalar=fam.layer_scalar, position_offset=fam.position_offset, **bitnet_fields(data, fam.sub_norms, source),
        embed_norm=fam.embed_norm, rope_reversed=fam.rope_reversed, attn_output_gate=bool(fam.output_gate) and bool(data.get("use_attention_gate", True)),
        attn_head_gate=fam.head_gate, position_embeddings=int(data.get("max_position_embeddings", 2048)) + fam.position_offset if fam.learned_positions else 0,
    )
    return {**fields, **layer_rope_bases(data, types, fields["rope_theta"], source), **(llama4_fields(data) if fam.attn_scale == "llama4_nope" else {})}


def config_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from the contents of a Hugging Face config.json (the family's entry in
    models/architectures.py says which keys mean what)."""
    model_type = data.get("model_type")
    if model_type is None:
        raise InputError(f"{source}: config.json has no 'model_type'")
    arch = normalize_architecture(model_type, source)
    fam = family(arch)
    try:
        data = nemotron_h_keys(family_keys(data, fam), source) if fam.hybrid == "nemotron_h" else family_keys(data, fam)
        data = falcon_keys(data, source) if arch == "falcon" else data
        if data.get("intermediate_size") is None and fam.inner_multiple:  # GPT-J's n_inner None
            data["intermediate_size"] = fam.inner_multiple * int(data["hidden_size"])
        if "intermediate_size" not in data and "moe_intermediate_size" in data:  # every layer MoE (Solar Open): no dense size
            data["intermediate_size"] = data["moe_intermediate_size"]
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        layers = int(data["num_hidden_layers"])
        head_dim = int(data.get("head_dim") or hidden // heads)
        eps = next((data[k] for k in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps") if data.get(k) is not None),
                   1e-6 if arch.startswith("qwen") else 1e-5)
        fields = dict(
            architecture=arch,
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads(data, fam, heads, source),
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=_eos_list(data.get("eos_token_id")),
            **_layer_description(data, fam, arch, layers, hidden, head_dim, source),
            moe=moe_from_hf(fam.moe, data),
        )
        recurrent = {"short_conv": short_conv_from_hf, "gated_delta": hybrid_from_hf, "mamba2": mamba2_from_hf, "nemotron_h": nemotron_h_from_hf,
                     "mamba1": mamba1_from_hf, "falcon_h1": falcon_h1_from_hf, "olmo_hybrid": olmo_hybrid_from_hf,
                     "kda": kda_from_hf, "rglru": rglru_from_hf, "bailing": bailing_from_hf, "lightning": minimax_from_hf,
                     "mamba": mamba_from_hf}
        extra = {**(latent_attention(data, source) if fam.mla else {}), **(recurrent[fam.hybrid](data, layers, source) if fam.hybrid else {})}
        return ModelConfig(**{**fields, **extra})
    except KeyError as exc:
        raise InputError(f"{source}: config.json is missing required key {exc}") from None
    except (TypeError, ValueError) as exc:  # a key null or of another type than the family reads
        raise InputError(f"{source}: config.json has a value this family cannot read ({exc})") from None


def _gguf_config_json(meta: dict[str, Any], arch: str, source: str,
                      rope_factors: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The config.json keys that GGUF metadata (`<arch>.block_count`, ...) gives; `rope_factors`: longrope's
    long_factor / short_factor, from the file's `rope_factors_{long,short}.weight`, or `factors` from its
    `rope_freqs.weight` (each frequency divided by its factor)."""
    p = meta["general.architecture"] + "."
    hidden = int(meta[p + "embedding_length"])
    heads = int(meta[p + "attention.head_count"])
    vocab = meta.get(p + "vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    rotary = meta.get(p + "rope.dimension_count")
    head_dim = int(meta.get(p + "attention.key_length") or hidden // heads)
    ffn = p + "feed_forward_length"
    if ffn not in meta and p + "expert_feed_forward_length" in meta:
        ffn = p + "expert_feed_forward_length"  # a MoE file without the dense size (no dense layer reads it)
    data: dict[str, Any] = {
        "model_type": arch, "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(meta[ffn]),  # GLM-4.5's MTP blocks follow the decoder's in block_count
        "num_hidden_layers": int(meta[p + "block_count"]) - int(meta.get(p + "nextn_predict_layers") or 0),
        "num_attention_heads": heads, "num_key_value_heads": _kv_heads(meta.get(p + "attention.head_count_kv"), heads),
        "head_dim": head_dim, "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon",
                                                             meta.get(p + "attention.layer_norm_epsilon", 1e-5))),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if rotary and int(rotary) < head_dim:  # partial rotary (Phi-2)
        data["partial_rotary_factor"] = int(rotary) / head_dim
    if meta.get(p + "rope.scaling.type") == "linear":
        data["rope_scaling"] = {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
    if rope_factors and "factors" in rope_factors:  # `rope_freqs`: llama.cpp's llama3 scaling, per frequency
        data["rope_scaling"] = {"rope_type": "factors", "factors": rope_factors["factors"]}
    elif rope_factors:  # llama.cpp's longrope (Phi-3): the factor sets are tensors, the original length metadata
        data["rope_scaling"] = {"rope_type": "longrope", **rope_factors,
                                "original_max_position_embeddings": int(meta[p + "rope.scaling.original_context_length"])}
    if arch in _GGUF_KEYS:
        data.update(_GGUF_KEYS[arch](meta, p, source))
    data.update(_gguf_layer_keys(meta, p, family(arch), arch, data, source))
    return data


def _kv_heads(value: Any, heads: int) -> int:
    """llama.cpp's `attention.head_count_kv`: one count, or one per layer (LFM2: 0 on its short-conv layers)."""
    if isinstance(value, (list, tuple)):
        return max((int(v) for v in value), default=0) or heads
    return int(value or heads)


def config_from_gguf(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool, source: str,
                     rope_factors: dict[str, list[float]] | None = None, present: frozenset[str] = frozenset(),
                     tensors: dict[str, tuple[int, ...]] | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (keys like `llama.block_count`; longrope's factors from tensors;
    `present`: the `Family.bias_keys` roles whose bias tensors the file holds, and "qk_norm" if it has q/k norms;
    `tensors`: the file's tensor names with their shapes, which Gemma 4's per-layer attention reads)."""
    arch_name = meta.get("general.architecture")
    if arch_name is None:
        raise InputError(f"{source}: GGUF metadata has no general.architecture")
    arch = normalize_architecture(arch_name, source)
    if not family(arch).gguf:  # a family whose llama.cpp tensor names the table does not map (GPT-J)
        raise UnsupportedError(f"{source}: a GGUF {arch_name} is not supported (its llama.cpp layout is not read; export its safetensors)")
    if arch == "llama" and meta.get(f"{arch_name}.expert_count"):
        arch = "mixtral"  # llama.cpp writes Mixtral as a llama with experts
    try:
        meta, arch, mla_keys = mla_gguf_keys(meta, arch, arch_name + ".", source) if family(arch).mla else (meta, arch, {})
        shapes: dict[str, Any] = {}
        if family(arch).layer_shapes:  # Gemma 4's per-layer shapes, KV sharing, PLE and rope (models/gemma4_gguf.py)
            meta, shapes = gemma4_keys(meta, arch_name + ".", tensors or {}, (rope_factors or {}).get("factors"), source)
            rope_factors = None
        if family(arch).hybrid in ("nemotron_h", "mamba"):  # Nemotron-H's block pattern from per-block metadata and tensors (models/nemotron_h_gguf.py), Mamba's sizes
            meta, shapes = (nemotron_h_gguf_keys if family(arch).hybrid == "nemotron_h" else mamba_gguf_keys)(meta, arch_name + ".", tensors or {}, source)
        if family(arch).hybrid in ("mamba1", "falcon_h1"):  # from metadata and tensors: Jamba's layer periods (models/mamba1_gguf.py), Falcon-H1's sizes
            shapes = (mamba1_gguf_keys if family(arch).hybrid == "mamba1" else falcon_h1_gguf_keys)(meta, arch_name + ".", tensors or {}, source)
        data = {**_gguf_config_json(meta, arch, source, rope_factors), **mla_keys, **shapes}
        if arch == "falcon":  # its norms and KV groups from the tensors (models/falcon.py)
            data.update(falcon_gguf_keys(data, tensors or {}))
        if family(arch).moe and not shapes:  # Gemma 4's MoE block: models/gemma4_gguf.py
            data.update(moe_keys_from_gguf(meta, arch_name + ".", family(arch).moe, frozenset(tensors or ())))
    except KeyError as exc:
        raise InputError(f"{source}: GGUF metadata is missing {exc}") from None
    data.update(tie_word_embeddings=not has_output_weight, attention_bias=has_qkv_bias)
    for role, key in family(arch).bias_keys.items():
        data[key] = data.get(key) or role in present
    if family(arch).qk_norm_key:
        data[family(arch).qk_norm_key] = "qk_norm" in present
    config = config_from_hf(data, source)
    config.norm_offset = 0.0  # llama.cpp's converter stored Gemma's gains as 1 + weight
    if config.moe and config.moe.routing == "softmax_group" and data.get("norm_topk_prob"):  # llama.cpp renormalises V2 too
        config.moe = dataclasses.replace(config.moe, norm_topk_prob=True)
    return config
