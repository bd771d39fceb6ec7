"""The architecture table: every supported decoder family as one `Family` entry.

A family says how a checkpoint's config keys map onto the typed layer description of `ModelConfig` (norm kind
and placement, attention features, MLP kind, rope kind, multipliers) and what its weights are called (Hugging
Face names per role, GGUF names per role). The torch reference (models/decoder.py), the graph builders
(export/contract_graph.py, export/ort_fused_graph.py), the weight recipes (export/recipes.py) and the loaders
(models/load.py) read only `ModelConfig` fields and the roles below, never a family's name: a family that only
recombines existing features is one entry here (docs/DESIGN.md, "The architecture table").

The weights' roles and Llama's names for them: models/weight_names.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .linear_config import FUSED_LINEAR_NAMES, JAMBA_GGUF, JAMBA_NAMES, LFM3_NAMES, LIGHTNING_NAMES, LINEAR_NAMES, MAMBA2_NAMES, RECURRENT_GEMMA_NAMES, SHORT_CONV_NAMES
from .nemotron_h import MAMBA2_KEYS, NEMOTRON_H_NAMES
from .mamba_config import MAMBA_KEYS
from .kda_config import KDA_NAMES, KIMI_KEYS
from .bailing_config import BAILING_NAMES, BAILING_TOP
from .hybrid_names import KIMI_GGUF, LFM2_GGUF, MAMBA2_GGUF, NEMOTRON_H_GGUF, QWEN35_GGUF, QWEN3NEXT_GGUF
from .gemma4_gguf import GEMMA4_GGUF, GEMMA_GGUF
from .weight_names import ALTUP_NAMES, LLAMA_GGUF, LLAMA_NAMES, NORM_ROLES, PHI2_GGUF

_SANDWICH_NAMES = {"post_attn_norm": ("post_attention_layernorm.weight",), "post_norm": ("pre_feedforward_layernorm.weight",),
                   "post_mlp_norm": ("post_feedforward_layernorm.weight",)}  # Gemma 2 / 3: post_attention_layernorm: the attention output's
_POST_NAMES = {"post_attn_norm": ("post_attention_layernorm.weight",),  # OLMo 2 / EXAONE 4: norms after each block only
               "post_mlp_norm": ("post_feedforward_layernorm.weight",)}
_POST_GGUF = {**{k: v for k, v in LLAMA_GGUF.items() if k not in ("attn_norm", "ffn_norm")},  # OLMo 2 / EXAONE 4
              "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class Family:
    """One decoder family: its config reading and weight names. Field values are `ModelConfig`'s vocabulary."""

    model_types: tuple[str, ...]  # HF model_type / GGUF general.architecture names
    norm: str = "rms"  # rms | layer (LayerNorm; with a bias when `norm_bias`)
    norm_offset: float = 0.0  # Gemma: the gain is (1 + weight) (HF checkpoints; llama.cpp stores 1 + weight)
    # pre | sandwich (pre + post norms) | post (post only) | parallel (attn + MLP on one norm) | parallel2 (attn and MLP
    # each on its own norm of the same input: GPT-NeoX)
    placement: str = "pre"
    # config key choosing between `pre` (false) and `placement` (true; `parallel` where `placement` is pre); absent from
    # the config, `placement` (StableLM / GPT-NeoX: use_parallel_residual; HyperCLOVA X: use_post_norm, sandwich)
    parallel_key: str = ""
    qk_norm: str = ""  # "" | head (per head) | full (over all heads) | after_rope (per head, of the roped q / k: Hunyuan)
    attention_bias: bool = False  # default of the `attention_bias` config key (q/k/v biases)
    # config keys that, true, switch biases on: "qkv" (default: attention_bias, else use_bias), "o" (o_proj), "mlp"
    # (the plain MLP's up / down), "lm_head" (Phi-MoE's lm_head_bias); a use_bias / mlp_bias key the family does not name here is refused
    bias_keys: dict[str, str] = field(default_factory=dict)
    mlp_act: str = "silu"  # silu | gelu_tanh | gelu (exact, erf) | relu2 (relu(x) ** 2) | xielu (its scalars: role `act`)
    act_key: str = ""  # config key naming the activation in transformers' names (`HF_ACTS`; GPT-NeoX: hidden_act)
    rope_interleaved: bool = False  # rotate (x0, x1) pairs (GPT-J) instead of halves
    rope_alpha: bool = False  # rope type "dynamic" with an `alpha` is NTK-alpha, static (Hunyuan: rope kind ntk_alpha)
    global_nope: bool = False  # full-attention layers have no rope when the model has sliding layers
    embed_scale: str = ""  # "" | sqrt_hidden | a config key (multiplier)
    attn_scale: str = ""  # "" (head_dim ** -0.5) | query_pre_attn_scalar | attention_multiplier | unit | llama4 (q times Llama 4's scaling by position) | llama4_nope
    residual_key: str = ""  # config key multiplying each block's output (Granite)
    logit_key: str = ""  # config key multiplying the logits (Cohere) or, prefixed "1/", dividing them (Granite)
    sliding_key: str = ""  # config key that must be true for sliding layers to count (Qwen2: use_sliding_window)
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)  # roles overriding LLAMA_NAMES
    gguf: dict[str, str] = field(default_factory=lambda: dict(LLAMA_GGUF))  # {}: the family's GGUF is refused
    gguf_llama_order: bool = False  # llama.cpp permuted the q/k rows (its LlamaModel converters: llama, mistral, granite, smollm3)
    # GGUF metadata (llama.cpp's `<arch>.<key>`) -> the config key it gives (scales, softcaps)
    gguf_keys: dict[str, str] = field(default_factory=dict)
    # llama.cpp's sliding period when a file has `attention.sliding_window` but no `attention.sliding_window_pattern`
    # (layer i slides iff i % period < period - 1; 0: every layer); None: llama.cpp reads no pattern (refused)
    gguf_swa_period: int | None = None
    gguf_local_base: float = 0.0  # llama.cpp's rope base of sliding layers without `rope.freq_base_swa` (0: the global)
    gguf_top: dict[str, str] = field(default_factory=dict)  # llama.cpp's names outside the blocks beyond Llama's (LFM2's token_embd_norm)
    gguf_nope_period: int = 0  # llama.cpp's fixed NoPE layers: (i + 1) % period == 0 (SmolLM3: 4)
    attn_sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss `self_attn.sinks`)
    o_bias: bool = False  # o_proj has a bias
    moe: str = ""  # the MLP kind: "" dense, else the MoE layout of models/moe_config.py `moe_from_hf` (qwen2_moe, deepseek_v3, ...)
    norm_bias: bool = False  # the norms (layer and final) have a bias (Phi-2's LayerNorm)
    mlp_gated: bool = True  # False: a plain MLP down(act(up x)) (Phi-2's fc1 / fc2)
    mlp_bias: bool = False  # the plain MLP's up / down have biases
    lm_head_bias: bool = False
    top_names: dict[str, str] = field(default_factory=dict)  # checkpoint name -> the name every consumer reads
    prefix: str = ""  # the checkpoint's prefix where Llama's has `model.` (GPT-NeoX: gpt_neox.), renamed at load
    layers_key: str = ""  # the checkpoint's name of the layer list where Llama's has `layers` (EXAONE 3: h), renamed at load
    # config keys of the checkpoint's own config.json -> the names this table reads (EXAONE 3: num_layers ->
    # num_hidden_layers); the standard name wins where both are present
    config_keys: dict[str, str] = field(default_factory=dict)
    config_defaults: dict[str, object] = field(default_factory=dict)  # config keys' values where config.json has none (transformers' defaults)
    inner_multiple: int = 0  # intermediate_size = this x hidden_size where the config gives none (GPT-J's n_inner None: 4)
    # learned absolute positions (GPT-2: wpe, role `model.embed_positions.weight`) added to the token embeddings, no rope;
    # the table's row of position p is p + position_offset (OPT: 2)
    learned_positions: bool = False
    position_offset: int = 0
    conv1d: bool = False  # the layers' 2-D weights are stored [in, out] (GPT-2's Conv1D), shown [out, in] at load
    multi_query_key: str = ""  # config key that, true, gives one KV head (GPT-BigCode: multi_query); false is refused
    # config keys whose value, where given, must be this (a str: the value of that config key) or the checkpoint is refused
    # (OPT: do_layer_norm_before true, word_embed_proj_dim = hidden_size)
    refused_unless: dict[str, object] = field(default_factory=dict)
    qkv_per_head: bool = False  # a fused qkv stored per head ([heads, 3, head_dim] rows: GPT-NeoX), shown q|k|v at load
    qk_norm_key: str = ""  # config key that, true, gives the layers per-head q/k norms (Phi-2: qk_layernorm)
    mla: bool = False  # multi-head latent attention (DeepSeek-V2/V3: a compressed KV cache, the `MLA_NAMES` roles)
    minicpm: bool = False  # MiniCPM's config keys, read as the table's (models/layer_keys.py `minicpm_keys`)
    refused_keys: tuple[str, ...] = ()  # config keys the table does not build: set (true), the checkpoint is refused
    weightless_norms: bool = False  # norms without a gain (OLMo 1, nanochat): gains of ones shown at load (models/hf_layouts.py)
    # Gemma 4's attention: full-attention layers' own head_dim / kv heads (per_layer_config, else global_head_dim /
    # num_global_key_value_heads), values = keys on them where `attention_k_eq_v`, a scale-free value norm, a learned
    # scalar per layer (role `layer_scalar`)
    layer_shapes: bool = False
    v_norm: bool = False
    layer_scalar: bool = False
    sub_norms: bool = False  # BitNet: norms of o_proj's and down_proj's inputs (models/bitnet.py: its packed ternary weights)
    embed_norm: bool = False  # the final norm also normalises the embeddings before layer 0 (nanochat)
    rope_reversed: bool = False  # rope turned the other way: rotate_half [x2, -x1], i.e. sin negated (nanochat)
    altup: bool = False  # Gemma 3n's AltUp streams, LAuReL, activation sparsity (models/altup.py, models/altup_keys.py)
    output_gate: str = ""  # attention output times sigmoid(gate): "fused" (q_proj rows per head q | gate: MiniCPM5-MoE)
    # or the gate projection's own name (AFMoE's self_attn.gate_proj.weight: shown fused at load, models/hf_layouts.py)
    head_gate: bool = False  # that gate is one value a head (LFM3's gate_proj [heads, in]; latent attention: Bailing's g_proj, role mla_gate): q rows per head q | 1 gate row
    hybrid: str = ""  # recurrent layers (models/linear_config.py): gated_delta (Qwen3-Next, Qwen3.5) | short_conv (LFM2) | mamba2 (Granite 4.0-H, Bamba) | nemotron_h (its Mamba-2 blocks grouped) | mamba1 (Jamba) | falcon_h1 (Mamba-2 inside each attention layer) | olmo_hybrid (gated delta nets, OLMo's) | kda (Kimi Linear) | bailing (Bailing hybrid: KDA with full-rank gates, models/bailing_config.py) | rglru (RecurrentGemma) | lightning (MiniMax-01) | mamba (pure Mamba-1, models/mamba_config.py)

    def layer_names(self) -> dict[str, tuple[str, ...]]:
        names = {**LLAMA_NAMES, **self.names}
        for role in (*NORM_ROLES, "q_norm", "k_norm"):  # a norm's bias sits next to its weight unless named
            names.setdefault(f"{role}_bias", tuple(n.removesuffix(".weight") + ".bias" for n in names.get(role, ())))
        return names


# transformers' `hidden_act` names -> mlp_act (gelu_new / gelu_fast are the tanh form, written differently)
HF_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu", "relu": "relu", "relu2": "relu2", "xielu": "xielu"}
_NEOX_NAMES = {"qkv": ("attention.query_key_value.weight",), "qkv_bias": ("attention.query_key_value.bias",), "o_proj": ("attention.dense.weight",),
               "o_bias": ("attention.dense.bias",), "up": ("mlp.dense_h_to_4h.weight",), "up_bias": ("mlp.dense_h_to_4h.bias",),
               "down": ("mlp.dense_4h_to_h.weight",), "down_bias": ("mlp.dense_4h_to_h.bias",)}
_NEOX_GGUF = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_qkv": "attention.query_key_value",
              "attn_output": "attention.dense", "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}  # qkv rows q|k|v

MLA_NAMES = {"q_kv_a": ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
             "q_kv": ("self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
             "q_a_norm": ("self_attn.q_a_layernorm.weight",), "q_b": ("self_attn.q_b_proj.weight",),
             "kv_a_norm": ("self_attn.kv_a_layernorm.weight",), "kv_b": ("self_attn.kv_b_proj.weight",)}
_MLA_GGUF = {**{k: LLAMA_GGUF[k] for k in ("attn_norm", "ffn_norm", "attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
             **{k: f"self_attn.{v}" for k, v in (("attn_q_a", "q_a_proj"), ("attn_q_a_norm", "q_a_layernorm"), ("attn_q_b", "q_b_proj"),
                                                 ("attn_kv_a_mqa", "kv_a_proj_with_mqa"), ("attn_kv_a_norm", "kv_a_layernorm"),
                                                 ("attn_kv_b", "kv_b_proj"), ("attn_k_b", "k_b_proj"), ("attn_v_b", "v_b_proj"))}}
_EXAONE_NAMES = {"input_norm": ("ln_1.weight",), "post_norm": ("ln_2.weight",),
                 "qkv": tuple(f"attn.attention.{x}_proj.weight" for x in "qkv"), "o_proj": ("attn.attention.out_proj.weight",),
                 "gate_up": ("mlp.c_fc_0.weight", "mlp.c_fc_1.weight"), "down": ("mlp.c_proj.weight",)}
_EXAONE_GGUF = {"attn_norm": "ln_1", "ffn_norm": "ln_2", **{f"attn_{x}": f"attn.attention.{x}_proj" for x in "qkv"},
                "attn_output": "attn.attention.out_proj", "ffn_gate": "mlp.c_fc_0", "ffn_up": "mlp.c_fc_1", "ffn_down": "mlp.c_proj"}
_GEMMA = dict(norm_offset=1.0, mlp_act="gelu_tanh", embed_scale="sqrt_hidden", gguf=GEMMA_GGUF)
_GRANITE = dict(embed_scale="embedding_multiplier", attn_scale="attention_multiplier", residual_key="residual_multiplier",
                logit_key="1/logits_scaling", gguf_llama_order=True,
                gguf_keys={"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                           "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"})
_HUNYUAN = dict(qk_norm="after_rope", rope_alpha=True, bias_keys={"o": "attention_bias"},
                names={"q_norm": ("self_attn.query_layernorm.weight",), "k_norm": ("self_attn.key_layernorm.weight",)},
                gguf={**LLAMA_GGUF, "attn_q_norm": "self_attn.query_layernorm", "attn_k_norm": "self_attn.key_layernorm"})
_FEED_FORWARD, _SHARED_MLP = ({"gate_up": (f"{m}.gate_proj.weight", f"{m}.up_proj.weight"), "down": (f"{m}.down_proj.weight",)}
                              for m in ("feed_forward", "block_sparse_moe.shared_expert"))
_BAMBA_NAMES = dict(names={**MAMBA2_NAMES, **_FEED_FORWARD, "post_norm": ("pre_ff_layernorm.weight",)},
                    top_names={"model.final_layernorm.weight": "model.norm.weight"})
_HYBRID = dict(hybrid="gated_delta", norm_offset=1.0, qk_norm="head", gguf={}, config_defaults={"norm_topk_prob": True})
_LFM2 = dict(hybrid="short_conv", qk_norm="head", gguf=LFM2_GGUF, gguf_top={"token_embd_norm.weight": "model.norm.weight"},
             top_names={"model.embedding_norm.weight": "model.norm.weight"},
             names={**SHORT_CONV_NAMES, "input_norm": ("operator_norm.weight",), "post_norm": ("ffn_norm.weight",),
                    "o_proj": ("self_attn.out_proj.weight",), "q_norm": ("self_attn.q_layernorm.weight",),
                    "k_norm": ("self_attn.k_layernorm.weight",), "gate_up": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
                    "down": ("feed_forward.w2.weight",)}, config_keys={"block_ff_dim": "intermediate_size", "tie_embedding": "tie_word_embeddings"})
_EXPERT_KEYS = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}
_GPT2_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_inner": "intermediate_size",
              "n_positions": "max_position_embeddings", "layer_norm_epsilon": "rms_norm_eps"}
_GPT2_NAMES = {"input_norm": ("ln_1.weight",), "post_norm": ("ln_2.weight",), "qkv": ("attn.c_attn.weight",),
               "qkv_bias": ("attn.c_attn.bias",), "o_proj": ("attn.c_proj.weight",), "o_bias": ("attn.c_proj.bias",),
               "up": ("mlp.c_fc.weight",), "up_bias": ("mlp.c_fc.bias",), "down": ("mlp.c_proj.weight",), "down_bias": ("mlp.c_proj.bias",)}
_GPT2_GGUF = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2 = dict(norm="layer", norm_bias=True, attention_bias=True, o_bias=True, mlp_gated=False, mlp_bias=True, mlp_act="gelu_tanh",
             act_key="activation_function", prefix="transformer.", layers_key="h", config_keys=_GPT2_KEYS, inner_multiple=4,
             learned_positions=True, gguf=_GPT2_GGUF, names=_GPT2_NAMES,
             top_names={"model.wte.weight": "model.embed_tokens.weight", "model.wpe.weight": "model.embed_positions.weight",
                        "model.ln_f.weight": "model.norm.weight", "model.ln_f.bias": "model.norm.bias"})
_SOFTCAPS = {"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping"}

FAMILIES: dict[str, Family] = {
    "llama": Family(("llama", "smollm2", "smollm", "iquestcoder"), gguf_llama_order=True, bias_keys={"o": "attention_bias"}),
    "mistral": Family(("mistral", "ministral", "cwm"), gguf_llama_order=True),  # Ministral, CWM: per-layer layer_types
    "ministral3": Family(("ministral3", "mistral3"), attn_scale="llama4", gguf_llama_order=True),  # Mistral's layers, yarn rope, Llama 4's query scaling
    "qwen2": Family(("qwen2",), attention_bias=True, sliding_key="use_sliding_window"),
    "qwen3": Family(("qwen3",), qk_norm="head", sliding_key="use_sliding_window", bias_keys={"o": "attention_bias"}),
    "gemma": Family(("gemma",), bias_keys={"o": "attention_bias"}, **{**_GEMMA, "gguf": dict(LLAMA_GGUF)}),  # pre norms: ffn_norm is post_attention_layernorm
    "gemma2": Family(("gemma2",), placement="sandwich", attn_scale="query_pre_attn_scalar", names=_SANDWICH_NAMES,
                     gguf_keys=_SOFTCAPS, gguf_swa_period=2, bias_keys={"o": "attention_bias"}, **_GEMMA),
    "gemma3": Family(("gemma3_text", "gemma3"), placement="sandwich", qk_norm="head", attn_scale="query_pre_attn_scalar",
                     names=_SANDWICH_NAMES, gguf_keys=_SOFTCAPS, gguf_swa_period=6, gguf_local_base=10000.0, bias_keys={"o": "attention_bias"},
                     **_GEMMA),
    "phi3": Family(("phi3",), names={"qkv": ("self_attn.qkv_proj.weight",), "gate_up": ("mlp.gate_up_proj.weight",)},
                   gguf={**LLAMA_GGUF, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}, gguf_swa_period=0),
    "granite": Family(("granite",), **_GRANITE, bias_keys={"o": "attention_bias"}),
    "granitemoe": Family(("granitemoe", "granitemoeshared"), **_GRANITE, bias_keys={"o": "attention_bias"}, moe="granitemoe"),
    # OLMo 1: Llama's layers with LayerNorms of no weight or bias (eps 1e-5); clip_qkv (a clamp of q / k / v) not built
    "olmo": Family(("olmo",), norm="layer", weightless_norms=True, refused_keys=("clip_qkv",)),
    "olmo2": Family(("olmo2", "olmo3"), placement="post", qk_norm="full", names=_POST_NAMES, gguf=_POST_GGUF, gguf_swa_period=4,
                    bias_keys={"o": "attention_bias"}),
    "smollm3": Family(("smollm3",), sliding_key="use_sliding_window", gguf_llama_order=True, gguf_nope_period=4,
                      bias_keys={"o": "attention_bias"}),
    "glm4": Family(("glm4",), placement="sandwich", attention_bias=True, rope_interleaved=True,
                   names={"post_attn_norm": ("post_self_attn_layernorm.weight",), "post_norm": ("post_attention_layernorm.weight",),
                          "post_mlp_norm": ("post_mlp_layernorm.weight",), "gate_up": ("mlp.gate_up_proj.weight",)},
                   gguf={**LLAMA_GGUF, "post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
                         "ffn_up": "mlp.gate_up_proj"}),
    "cohere2": Family(("cohere2",), norm="layer", placement="parallel", rope_interleaved=True, global_nope=True,
                      logit_key="logit_scale", gguf_keys={"logit_scale": "logit_scale"}, gguf_swa_period=4, bias_keys={"o": "attention_bias"}),
    # Cohere 2's layers with a MoE block (models/moe_config.py); its RMSNorm variant (rms_norm_eps set) is not built
    "cohere2_moe": Family(("cohere2_moe",), norm="layer", placement="parallel", rope_interleaved=True, global_nope=True,
                          logit_key="logit_scale", bias_keys={"o": "attention_bias"}, moe="cohere2_moe", refused_keys=("rms_norm_eps",)),
    "exaone4": Family(("exaone4",), placement="post", qk_norm="head", global_nope=True, names=_POST_NAMES, gguf=_POST_GGUF,
                      gguf_swa_period=4),
    "ernie4_5": Family(("ernie4_5", "helium"), rope_interleaved=True),  # Helium: the same layer, attention_bias for q/k/v
    "ernie4_5_moe": Family(("ernie4_5_moe", "ernie4_5-moe"), rope_interleaved=True, moe="ernie4_5_moe"),
    "qwen2_moe": Family(("qwen2_moe", "qwen2moe"), attention_bias=True, sliding_key="use_sliding_window", moe="qwen2_moe"),
    "qwen3_moe": Family(("qwen3_moe", "qwen3moe"), qk_norm="head", sliding_key="use_sliding_window", moe="qwen3_moe", bias_keys={"o": "attention_bias"}),
    "mixtral": Family(("mixtral",), gguf_llama_order=True, moe="mixtral"),
    "minimax": Family(("minimax",), hybrid="lightning", moe="mixtral", names=LIGHTNING_NAMES, gguf={}),  # MiniMax-01: lightning attention beside softmax attention (models/normed_residual.py)
    "gpt_oss": Family(("gpt_oss", "gpt-oss"), attention_bias=True, attn_sinks=True, o_bias=True, moe="gpt_oss", gguf_swa_period=2,
                      gguf={**LLAMA_GGUF, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}),
    # GLM-4.7-Flash (glm4_moe_lite): V3's latent attention and routing, dense layers by mlp_layer_types (default: the first)
    # Sarvam (sarvam_mla): DeepSeek-V3's config under its own expert-count keys
    "deepseek_v3": Family(("deepseek_v3", "kimi_k2", "glm4_moe_lite", "sarvam_mla"), mla=True, moe="deepseek_v3", names=MLA_NAMES, gguf=_MLA_GGUF, config_keys=_EXPERT_KEYS),
    # llama.cpp's `deepseek2` reads as V2, as V3 with sigmoid routing (models/mla_gguf.py)
    "deepseek_v2": Family(("deepseek_v2", "deepseek2"), mla=True, moe="deepseek_v2", names=MLA_NAMES, gguf=_MLA_GGUF),
    # GLM-4.5 / 4.6 / Air: GQA with partial rotary (halves), optional q/k norms; DeepSeek-V3's sigmoid group routing
    # Solar Open: the same layers without q/k norms, every layer MoE (no intermediate_size)
    "glm4_moe": Family(("glm4_moe", "glm4moe", "solar_open"), qk_norm_key="use_qk_norm", moe="deepseek_v3",
                       gguf={**LLAMA_GGUF, "post_attention_norm": "post_attention_layernorm"}),
    "dots1": Family(("dots1",), qk_norm="head", moe="deepseek_v3", bias_keys={"o": "attention_bias"}),  # Qwen3's attention, DeepSeek-V3's routing
    "olmoe": Family(("olmoe",), qk_norm="full", bias_keys={"o": "attention_bias"}, moe="olmoe", refused_keys=("clip_qkv",)),
    "seed_oss": Family(("seed_oss",), attention_bias=True, bias_keys={"o": "attention_out_bias"},
                       gguf={**LLAMA_GGUF, "post_attention_norm": "post_attention_layernorm"}),
    "starcoder2": Family(("starcoder2",), norm="layer", norm_bias=True, mlp_gated=False, mlp_act="gelu_tanh",
                         bias_keys={"qkv": "use_bias", "o": "use_bias", "mlp": "use_bias"},
                         gguf={**LLAMA_GGUF, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                         names={"up": ("mlp.c_fc.weight",), "up_bias": ("mlp.c_fc.bias",), "down": ("mlp.c_proj.weight",),
                                "down_bias": ("mlp.c_proj.bias",)}),
    "stablelm": Family(("stablelm",), norm="layer", norm_bias=True, parallel_key="use_parallel_residual",
                       bias_keys={"qkv": "use_qkv_bias"}, refused_keys=("qk_layernorm",)),  # per-head q/k LayerNorms: not built
    "nemotron": Family(("nemotron",), norm="layer", norm_offset=1.0, norm_bias=True, mlp_gated=False, mlp_act="relu2",
                       bias_keys={"o": "attention_bias", "mlp": "mlp_bias"}),  # LayerNorm1P: gain 1 + weight
    "arcee": Family(("arcee",), mlp_gated=False, mlp_act="relu2", bias_keys={"o": "attention_bias", "mlp": "mlp_bias"},
                    gguf_llama_order=True),
    "phi": Family(("phi", "phi2"), norm="layer", gguf=PHI2_GGUF, norm_bias=True, placement="parallel", attention_bias=True, o_bias=True,
                  mlp_act="gelu_tanh", mlp_gated=False, mlp_bias=True, lm_head_bias=True, qk_norm_key="qk_layernorm",
                  names={"q_norm": ("self_attn.q_layernorm.weight",), "k_norm": ("self_attn.k_layernorm.weight",),
                         "o_proj": ("self_attn.dense.weight",), "o_bias": ("self_attn.dense.bias",), "up": ("mlp.fc1.weight",),
                         "up_bias": ("mlp.fc1.bias",), "down": ("mlp.fc2.weight",), "down_bias": ("mlp.fc2.bias",)},
                  top_names={"model.final_layernorm.weight": "model.norm.weight", "model.final_layernorm.bias": "model.norm.bias"}),
    # Pythia / GPT-NeoX-20B: two norms of the same input (parallel2) unless use_parallel_residual is false, a fused qkv stored per head, biases everywhere, exact GELU, partial rotary (halves), an untied embed_out
    "gpt_neox": Family(("gpt_neox", "gptneox"), gguf=_NEOX_GGUF, gguf_keys={"use_parallel_residual": "use_parallel_residual"}, norm="layer", norm_bias=True, placement="parallel2", parallel_key="use_parallel_residual",
                       attention_bias=True, o_bias=True, bias_keys={"o": "attention_bias"}, mlp_gated=False, mlp_bias=True,
                       mlp_act="gelu", act_key="hidden_act", names=_NEOX_NAMES, prefix="gpt_neox.", qkv_per_head=True,
                       top_names={"model.embed_in.weight": "model.embed_tokens.weight", "model.final_layer_norm.weight": "model.norm.weight",
                                  "model.final_layer_norm.bias": "model.norm.bias", "embed_out.weight": "lm_head.weight"}),
    # Falcon: attention and a plain MLP on one or two LayerNorms of the same input, or pre norms (models/falcon.py), the
    # fused qkv per KV group (multi-query, grouped or per head), biases by `bias`, a tied head
    "falcon": Family(("falcon",), norm="layer", norm_bias=True, placement="parallel2", mlp_gated=False, mlp_act="gelu", act_key="activation",
                     bias_keys={"qkv": "bias", "o": "bias", "mlp": "bias"}, prefix="transformer.", layers_key="h", qkv_per_head=True,
                     gguf={"attn_norm": "input_layernorm", "attn_norm_2": "post_attention_layernorm", "attn_qkv": "self_attention.query_key_value",
                           "attn_output": "self_attention.dense", "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
                     config_keys={"layer_norm_epsilon": "layer_norm_eps"},
                     names={**_NEOX_NAMES, **{k: (v[0].replace("attention.", "self_attention."),) for k, v in _NEOX_NAMES.items() if k.startswith(("qkv", "o_"))}},
                     top_names={"model.word_embeddings.weight": "model.embed_tokens.weight", "model.ln_f.weight": "model.norm.weight", "model.ln_f.bias": "model.norm.bias"}),
    # Command R v1: Cohere 2's parallel LayerNorm block without sliding layers; its per-head q/k LayerNorms (a gain per head: Command R+) are not built
    "cohere": Family(("cohere", "command-r"), norm="layer", placement="parallel", rope_interleaved=True, logit_key="logit_scale",
                     gguf_keys={"logit_scale": "logit_scale"}, bias_keys={"o": "attention_bias"}, refused_keys=("use_qk_norm",)),
    # GLM-4-9B (older than glm4): pre norms, q/k/v biases, interleaved partial rotary, a fused gate_up_proj
    "glm": Family(("glm",), attention_bias=True, rope_interleaved=True, names={"gate_up": ("mlp.gate_up_proj.weight",)}),
    # VaultGemma: Gemma 2 without the sandwich's post norms (pre_feedforward_layernorm is the MLP's pre norm)
    "vaultgemma": Family(("vaultgemma",), attn_scale="query_pre_attn_scalar", names={"post_norm": ("pre_feedforward_layernorm.weight",)},
                         bias_keys={"o": "attention_bias"}, **{**_GEMMA, "gguf": {**LLAMA_GGUF, "ffn_norm": "pre_feedforward_layernorm"}}),
    # FlexOlmo: OLMo 2's post norms and q/k norms over all heads, OLMoE's softmax top k
    "flex_olmo": Family(("flex_olmo",), placement="post", qk_norm="full", names=_POST_NAMES, gguf=_POST_GGUF, moe="olmoe",
                        bias_keys={"o": "attention_bias"}),
    # InternLM3: Llama under its own config keys (qkv_bias: q/k/v/o biases; bias: the gated MLP's, refused)
    "internlm3": Family(("internlm3",), bias_keys={"o": "attention_bias"}, config_keys={"qkv_bias": "attention_bias", "bias": "mlp_bias"}),
    # EXAONE 3 / 3.5: Llama in GPT-2's names (transformer.h.N, attn.attention.*, c_fc_0 / c_fc_1 / c_proj, ln_1 / ln_2)
    "exaone": Family(("exaone",), prefix="transformer.", layers_key="h", names=_EXAONE_NAMES, gguf=_EXAONE_GGUF,
                     config_keys={"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps"},
                     top_names={"model.wte.weight": "model.embed_tokens.weight", "model.ln_f.weight": "model.norm.weight"}),
    "youtu": Family(("youtu",), mla=True, names=MLA_NAMES, gguf=_MLA_GGUF),  # Youtu-LLM: DeepSeek-V3's latent attention, dense SwiGLU
    # MiniCPM3: that attention with rope on halves, Granite's multipliers from MiniCPM's keys (models/layer_keys.py)
    "minicpm3": Family(("minicpm3",), mla=True, names=MLA_NAMES, gguf=_MLA_GGUF, minicpm=True, embed_scale="embedding_multiplier", residual_key="residual_multiplier", logit_key="1/logits_scaling"),
    # K-EXAONE (exaone_moe): EXAONE 4's attention (per-head q/k norms, no rope on full layers) in pre norms, DeepSeek-V3's routing
    "exaone_moe": Family(("exaone_moe",), qk_norm="head", global_nope=True, moe="deepseek_v3", config_defaults={"first_k_dense_replace": 1},
                         config_keys={"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}),
    # MiniMax-M2: q/k norms over all heads, partial rotary (rotary_dim), Mixtral's expert names, sigmoid top k with a score bias
    "minimax_m2": Family(("minimax_m2", "minimax-m2"), qk_norm="full", moe="minimax_m2"),
    # Phi-3.5-MoE: biased LayerNorms, q/k/v/o biases, an lm_head bias, Mixtral's expert names, sparsemixer top 2
    "phimoe": Family(("phimoe",), norm="layer", norm_bias=True, moe="phimoe", bias_keys={"o": "attention_bias", "lm_head": "lm_head_bias"}),
    # Hunyuan v1: Llama with per-head q/k norms after rope (query_layernorm / key_layernorm), NTK-alpha rope; its MoE:
    # softmax top k renormalised (router mlp.gate.wg), a shared MLP (mlp.shared_mlp) added ungated
    "hunyuan_v1_dense": Family(("hunyuan_v1_dense", "hunyuan-dense"), **_HUNYUAN),  # llama.cpp: alpha folded into freq_base
    "hunyuan_v1_moe": Family(("hunyuan_v1_moe",), moe="hunyuan_v1_moe", **_HUNYUAN),
    # Apertus: q/k norms per head, a plain MLP with xIELU (or the hidden_act it names), Llama's norms under other names Apertus 1.5 (apertus1p5_text): the same layers; an LM head pruned to fewer rows (output_vocab_size) is not built
    "apertus": Family(("apertus", "apertus1p5_text"), mlp_gated=False, mlp_act="xielu", act_key="hidden_act", qk_norm="head",
                      refused_keys=("output_vocab_size",),
                      bias_keys={"o": "attention_bias"}, names={"input_norm": ("attention_layernorm.weight",),
                                                                  "post_norm": ("feedforward_layernorm.weight",)}),
    # Gemma 4 (text; the multimodal `gemma4` config's text_config): Gemma 3's sandwich and per-head q/k norms with plain
    # gains, attention scale 1, a scale-free value norm, full-attention layers of their own head_dim / kv heads (values
    # = keys where attention_k_eq_v) and proportional partial rope, a learned scalar per layer, KV sharing (the last
    # num_kv_shared_layers take an earlier layer's keys; their MLP double-wide where use_double_wide_mlp), per-layer
    # embeddings (the `ple_*` roles); the MoE block (enable_moe_block, 26B-A4B) beside the dense MLP, its norms the
    # `BESIDE_ROLES` (models/moe_config.py `normed_softmax_topk`). Its GGUF: models/gemma4_gguf.py
    "gemma4": Family(("gemma4_text", "gemma4", "gemma4_unified_text"), placement="sandwich", qk_norm="head", mlp_act="gelu_tanh", act_key="hidden_activation",
                     embed_scale="sqrt_hidden", attn_scale="unit", bias_keys={"o": "attention_bias"}, moe="gemma4",
                     names={**_SANDWICH_NAMES, "dense_out_norm": ("post_feedforward_layernorm_1.weight",),
                            "moe_in_norm": ("pre_feedforward_layernorm_2.weight",), "moe_out_norm": ("post_feedforward_layernorm_2.weight",)},
                     layer_shapes=True, v_norm=True, layer_scalar=True, gguf=GEMMA4_GGUF, gguf_keys=_SOFTCAPS),
    # Gemma 3n (text; the multimodal `gemma3n` config's text_config): Gemma 4's attention (per-head q/k norms, scale 1, a
    # scale-free value norm) on one head shape, KV sharing and per-layer embeddings, inside AltUp's parallel streams with
    # LAuReL's low-rank residual (the `ALTUP_NAMES` roles) and the Gaussian top-k on the first layers' MLP gates
    "gemma3n": Family(("gemma3n_text",), placement="sandwich", qk_norm="head", mlp_act="gelu_tanh", act_key="hidden_activation",
                      embed_scale="sqrt_hidden", attn_scale="unit", bias_keys={"o": "attention_bias"}, v_norm=True, altup=True,
                      names={**_SANDWICH_NAMES, **ALTUP_NAMES}, gguf={}),
    # Jais 2: Llama's attention with q/k/v/o biases, biased LayerNorms, a plain ReLU-squared MLP with biases
    "jais2": Family(("jais2",), norm="layer", norm_bias=True, attention_bias=True, o_bias=True, mlp_gated=False, mlp_act="relu2",
                    act_key="hidden_act", mlp_bias=True, bias_keys={"o": "attention_bias", "mlp": "mlp_bias"}),
    # Persimmon: GPT-NeoX's per-head fused qkv, Phi-2's per-head biased q/k LayerNorms, a plain ReLU-squared MLP, pre norms
    "persimmon": Family(("persimmon",), norm="layer", norm_bias=True, attention_bias=True, o_bias=True, mlp_gated=False,
                        mlp_act="relu2", act_key="hidden_act", mlp_bias=True, qk_norm_key="qk_layernorm", qkv_per_head=True,
                        names={"qkv": ("self_attn.query_key_value.weight",), "qkv_bias": ("self_attn.query_key_value.bias",),
                               "o_proj": ("self_attn.dense.weight",), "o_bias": ("self_attn.dense.bias",),
                               "q_norm": ("self_attn.q_layernorm.weight",), "k_norm": ("self_attn.k_layernorm.weight",),
                               **{k: v for k, v in _NEOX_NAMES.items() if k.startswith(("up", "down"))}},
                        top_names={f"model.final_layernorm.{x}": f"model.norm.{x}" for x in ("weight", "bias")}),
    # Granite SWA (granite_swa, granitemoe_swa): Granite / Granite-MoE-Shared with sliding layers, attention sinks and a rope base per layer (layer_rope_theta, 0: no rope)
    "granite_swa": Family(("granite_swa",), **_GRANITE, attn_sinks=True, bias_keys={"o": "attention_bias"}),
    "granitemoe_swa": Family(("granitemoe_swa",), **_GRANITE, attn_sinks=True, bias_keys={"o": "attention_bias"}, moe="granitemoe"),
    # HyperCLOVA X: Granite's multipliers (the logits multiplied) in sandwich norms (post_norm1 / post_norm2; pre norms when use_post_norm is false)
    "hyperclovax": Family(("hyperclovax",), **{**_GRANITE, "logit_key": "logits_scaling"}, placement="sandwich",
                          parallel_key="use_post_norm", bias_keys={"o": "attention_bias"},
                          names={"post_attn_norm": ("post_norm1.weight",), "post_mlp_norm": ("post_norm2.weight",)}),
    # Mellum: Qwen3-MoE's attention and routing, sliding layers with their own rope base, dense layers by mlp_layer_types
    "mellum": Family(("mellum",), qk_norm="head", moe="qwen3_moe", bias_keys={"o": "attention_bias"}),
    # Flint: Qwen3-MoE's attention with sinks, no rope on full-attention layers; sigmoid top k renormalised, an ungated shared expert, dense mlp_only_layers
    "flint": Family(("flint",), qk_norm="head", attn_sinks=True, global_nope=True, moe="flint", bias_keys={"o": "attention_bias"},
                    names={"sinks": ("self_attn.softmax_offset",)}),
    # Hy3 (hy_v3): per-head q/k norms; DeepSeek-V3's sigmoid routing in one group (router mlp.router.gate, score bias mlp.expert_bias, scaled by router_scaling_factor), ungated shared experts (mlp.shared_mlp), dense layers by mlp_layer_types
    # Sarvam-MoE, Param2-MoE: GLM-4.5's layers (full rotary by default) in Ling's names (word_embeddings, a fused
    # attention.query_key_value, attention.dense, query_layernorm / key_layernorm, the score bias gate.expert_bias)
    "sarvam_moe": Family(("sarvam_moe", "param2moe"), qk_norm_key="use_qk_norm", moe="deepseek_v3",
                         config_keys={**_EXPERT_KEYS, "use_qkv_bias": "attention_bias"},
                         names={"qkv": ("attention.query_key_value.weight",), "qkv_bias": ("attention.query_key_value.bias",),
                                "o_proj": ("attention.dense.weight",), "q_norm": ("attention.query_layernorm.weight",),
                                "k_norm": ("attention.key_layernorm.weight",)},
                         top_names={"model.word_embeddings.weight": "model.embed_tokens.weight"}),
    "hy_v3": Family(("hy_v3",), qk_norm="head", moe="hy_v3", bias_keys={"o": "attention_bias"}),
    # Qwen3-Next, Qwen3.5 (text; MoE): gated delta nets, gated full attention, zero-centred gains (models/linear_config.py)
    "qwen3_next": Family(("qwen3_next", "qwen3next"), **{**_HYBRID, "gguf": QWEN3NEXT_GGUF}, moe="qwen2_moe",
                         names={**LINEAR_NAMES, **FUSED_LINEAR_NAMES}),
    "qwen3_5": Family(("qwen3_5_text", "qwen35"), **{**_HYBRID, "gguf": QWEN35_GGUF}, names=LINEAR_NAMES),
    # OLMo Hybrid: OLMo 3's post-norm attention (full q/k norms, no sliding window) beside pre-norm gated delta nets (models/linear_config.py)
    "olmo_hybrid": Family(("olmo_hybrid",), placement="post", qk_norm="full", hybrid="olmo_hybrid", names={**_POST_NAMES, **LINEAR_NAMES}, gguf={}, bias_keys={"o": "attention_bias"},
                          config_defaults={"rms_norm_eps": 1e-6}),
    "qwen3_5_moe": Family(("qwen3_5_moe_text", "qwen35moe"), **{**_HYBRID, "gguf": QWEN35_GGUF}, moe="qwen2_moe", names=LINEAR_NAMES),
    # Mamba-2 hybrids (models/mamba2.py). Granite 4.0-H: NoPE attention ("rope": rope), Granite's multipliers, Granite-MoE-Shared's
    # experts and shared MLP (no experts: the shared MLP alone, named as models/moe_weights.py shows it); transformers' defaults
    "granitemoehybrid": Family(("granitemoehybrid", "granitehybrid"), **_GRANITE, hybrid="mamba2", moe="granitemoe", gguf=MAMBA2_GGUF,
                               bias_keys={"o": "attention_bias"},
                               names={**MAMBA2_NAMES, **_SHARED_MLP},
                               config_defaults={"num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024}),
    # Bamba: attention at attn_layer_indices (Llama's, rope on half of each head), a SwiGLU (feed_forward, after pre_ff_layernorm)
    "bamba": Family(("bamba",), hybrid="mamba2", gguf={}, bias_keys={"o": "attention_bias"}, **_BAMBA_NAMES, config_defaults={"position_embedding_type": "rope", "partial_rotary_factor": 0.5}),
    # Falcon-H1: Bamba's names; every layer attention (full rope) beside a Mamba-2 mixer, muP multipliers (models/falcon_h1.py)
    "falcon_h1": Family(("falcon_h1", "falcon-h1"), hybrid="falcon_h1", **_BAMBA_NAMES, embed_scale="embedding_multiplier", logit_key="lm_head_multiplier",
                        refused_keys=("attention_bias", "projectors_bias"), gguf={**MAMBA2_GGUF, "ffn_norm": "pre_ff_layernorm.weight", **{f"ffn_{x}": f"feed_forward.{x}_proj" for x in ("gate", "up", "down")}}),
    "jamba": Family(("jamba",), hybrid="mamba1", moe="jamba", gguf=JAMBA_GGUF, names=JAMBA_NAMES, top_names={"model.final_layernorm.weight": "model.norm.weight"}),  # Mamba-1: models/mamba1.py
    # Nemotron-H: a block each of Mamba-2, NoPE attention (no biases), a plain relu2 MLP or (Nemotron 3 Nano) ungated relu2 experts, grouped into layers (models/nemotron_h.py;
    # llama.cpp's nemotron_h / nemotron_h_moe GGUF, q / k rows permuted: models/nemotron_h_gguf.py)
    "nemotron_h": Family(("nemotron_h", "nemotron_h_moe"), hybrid="nemotron_h", moe="nemotron_h", mlp_gated=False, mlp_act="relu2", act_key="mlp_hidden_act",
                         prefix="backbone.", gguf=NEMOTRON_H_GGUF, gguf_llama_order=True,
                         config_keys={"layer_norm_epsilon": "rms_norm_eps", "attention_head_dim": "head_dim"}, config_defaults={"head_dim": 128}, names=NEMOTRON_H_NAMES,
                         top_names={"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}),
    "mamba2": Family(("mamba2",), gguf=NEMOTRON_H_GGUF, names=NEMOTRON_H_NAMES, **MAMBA2_KEYS),  # Nemotron-H's Mamba-2 blocks alone (models/nemotron_h.py)
    "mamba": Family(("mamba", "falcon_mamba"), **MAMBA_KEYS),  # Mamba-1 blocks alone; Falcon-Mamba's dt / B / C norms without gains (models/mamba_config.py; llama.cpp's mamba GGUF)
    # LFM2: short convs beside attention; LFM2-MoE: its layers with DeepSeek-V3's sigmoid routing in one group (score bias feed_forward.expert_bias) and dense first num_dense_layers
    "lfm2": Family(("lfm2",), **_LFM2),
    "lfm2_moe": Family(("lfm2_moe", "lfm2moe"), **_LFM2, moe="lfm2_moe"),
    # LFM3: LFM2's short convs and MLP, sliding / full Qwen3 attention (proportional partial rope on full layers), a per-head output gate (`head_gate`), sandwich norms
    "lfm3": Family(("lfm3",), hybrid="short_conv", qk_norm="head", placement="sandwich", parallel_key="use_sandwich_norm", output_gate="self_attn.gate_proj.weight", head_gate=True,
                   refused_keys=("attention_bias",), gguf={}, names=LFM3_NAMES, top_names={"model.embedding_norm.weight": "model.norm.weight"}),
    # AFMoE (Arcee Trinity): Gemma 3's sandwich norms and sliding / full layers (rope on sliding layers only), per-head q/k
    # norms, a gated attention output (a gate_proj of its own), sigmoid routing with a score bias in one group, ungated
    # shared experts, dense first num_dense_layers; muP's sqrt(hidden) embedding scale when mup_enabled
    "afmoe": Family(("afmoe",), placement="sandwich", qk_norm="head", global_nope=True, output_gate="self_attn.gate_proj.weight",
                    embed_scale="sqrt_hidden:mup_enabled", moe="afmoe", gguf={}, refused_keys=("attention_bias",),
                    names={**_SANDWICH_NAMES, "post_norm": ("pre_mlp_layernorm.weight",), "post_mlp_norm": ("post_mlp_layernorm.weight",)}),
    # MiniCPM5-MoE: Llama's attention with q and the output gate in one q_proj (per head q | gate; transformers' module
    # calls it q_gate_proj), DeepSeek-V3's sigmoid group routing, dense layers by mlp_layer_types
    "minicpm5_moe": Family(("minicpm5_moe",), output_gate="fused", moe="deepseek_v3", config_keys=_EXPERT_KEYS, gguf={},
                           refused_keys=("attention_bias",)),
    # GPT-J: attention and a plain gelu_new MLP with biases on one biased LayerNorm (parallel), interleaved partial rotary
    # (rotary_dim), no attention biases, an lm_head bias; GPT-2's config keys (n_embd, n_inner None: 4 x n_embd)
    "gptj": Family(("gptj",), norm="layer", norm_bias=True, placement="parallel", rope_interleaved=True, mlp_gated=False,
                   mlp_bias=True, mlp_act="gelu_tanh", act_key="activation_function", lm_head_bias=True, prefix="transformer.",
                   layers_key="h", config_keys=_GPT2_KEYS, inner_multiple=4, gguf={},
                   names={"input_norm": ("ln_1.weight",), "qkv": tuple(f"attn.{x}_proj.weight" for x in "qkv"),
                          "o_proj": ("attn.out_proj.weight",), "up": ("mlp.fc_in.weight",), "up_bias": ("mlp.fc_in.bias",),
                          "down": ("mlp.fc_out.weight",), "down_bias": ("mlp.fc_out.bias",)},
                   top_names={"model.wte.weight": "model.embed_tokens.weight", "model.ln_f.weight": "model.norm.weight",
                              "model.ln_f.bias": "model.norm.bias"}),
    # GPT-2 / DistilGPT-2: learned absolute positions (wpe; every layer without rope), pre biased LayerNorms, a fused c_attn (q | k | v) and c_proj with biases, a plain gelu_new MLP with biases, Conv1D weights stored [in, out]
    "gpt2": Family(("gpt2",), conv1d=True, refused_keys=("scale_attn_by_inverse_layer_idx",), **_GPT2),
    # OPT: learned positions (table row = position + 2), pre biased LayerNorms, q/k/v/o biases, a plain ReLU MLP with
    # biases (fc1 / fc2), a tied head; post-norm blocks (do_layer_norm_before false) and project_in / project_out refused
    "opt": Family(("opt",), norm="layer", norm_bias=True, attention_bias=True, o_bias=True, mlp_gated=False, mlp_bias=True,
                  mlp_act="relu", act_key="activation_function", learned_positions=True, position_offset=2, prefix="model.decoder.",
                  bias_keys={"qkv": "enable_bias", "o": "enable_bias", "mlp": "enable_bias"}, config_keys={"ffn_dim": "intermediate_size"},
                  refused_unless={"do_layer_norm_before": True, "word_embed_proj_dim": "hidden_size", "_remove_final_layer_norm": False,
                                  "layer_norm_elementwise_affine": True}, gguf={},
                  names={"input_norm": ("self_attn_layer_norm.weight",), "post_norm": ("final_layer_norm.weight",),
                         "o_proj": ("self_attn.out_proj.weight",), "o_bias": ("self_attn.out_proj.bias",), "up": ("fc1.weight",),
                         "up_bias": ("fc1.bias",), "down": ("fc2.weight",), "down_bias": ("fc2.bias",)},
                  top_names={"model.final_layer_norm.weight": "model.norm.weight", "model.final_layer_norm.bias": "model.norm.bias"}),
    # GPT-BigCode (StarCoder, SantaCoder; llama.cpp's starcoder): GPT-2's layers as nn.Linear, multi-query attention (c_attn: q, one k, one v head)
    "gpt_bigcode": Family(("gpt_bigcode", "starcoder"), multi_query_key="multi_query", **_GPT2),
    # nanochat: gainless RMSNorms (q/k norms after rope included), the embeddings normed, rope turned the other way, a plain relu2 MLP
    "nanochat": Family(("nanochat",), mlp_gated=False, mlp_act="relu2", act_key="hidden_act", qk_norm="after_rope", weightless_norms=True, embed_norm=True, rope_reversed=True, names={"up": ("mlp.fc1.weight",), "down": ("mlp.fc2.weight",)}, bias_keys={"o": "attention_bias"}, gguf={}),
    # BitNet b1.58: Llama with sub-norms (of o_proj's, down_proj's inputs), a gated relu2 MLP, packed ternary weights, int8 activations (models/bitnet.py)
    "bitnet": Family(("bitnet",), mlp_act="relu2", act_key="hidden_act", sub_norms=True, bias_keys={"o": "attention_bias"}, gguf={**LLAMA_GGUF, "attn_sub_norm": "self_attn.attn_sub_norm", "ffn_sub_norm": "mlp.ffn_sub_norm"}),
    # Llama 4 (text; Scout / Maverick's `llama4` wrapper): chunked rope layers, NoPE layers' temperature, gainless q/k norms (models/llama4.py)
    "llama4": Family(("llama4_text",), attn_scale="llama4_nope", rope_interleaved=True, moe="llama4", gguf={}, names=_FEED_FORWARD),
    "kimi_linear": Family(("kimi_linear", "kimi-linear"), hybrid="kda", mla=True, moe="kimi_linear", names={**MLA_NAMES, **KDA_NAMES}, gguf={**_MLA_GGUF, **KIMI_GGUF}, config_keys=KIMI_KEYS),  # Kimi Linear: Kimi Delta Attention (models/kda_config.py) beside DeepSeek-V3's latent attention without rope, and its MoE (GGUF: models/kda_gguf.py)
    "recurrent_gemma": Family(("recurrent_gemma",), hybrid="rglru", norm_offset=1.0, mlp_act="gelu_tanh", mlp_bias=True, o_bias=True, names=RECURRENT_GEMMA_NAMES, gguf={}, top_names={"model.final_norm.weight": "model.norm.weight"}),  # Griffin: RG-LRU blocks beside local attention (models/rglru.py, models/rglru_config.py)
    "bailing_hybrid": Family(("bailing_hybrid",), hybrid="bailing", mla=True, moe="deepseek_v3", head_gate=True, names={**MLA_NAMES, **KDA_NAMES, **BAILING_NAMES}, gguf={}, config_keys=KIMI_KEYS, top_names=BAILING_TOP),  # Bailing hybrid (Ling / Ring 2.5): KDA with full-rank gates beside latent attention with rope and a per-head output gate (models/bailing_config.py)
}

_BY_TYPE = {t: name for name, fam in FAMILIES.items() for t in fam.model_types}


def family_name(model_type: str) -> str | None:
    """The table's family for a model_type / GGUF architecture name (None if not in the table)."""
    return _BY_TYPE.get(str(model_type).lower())


def family(name: str) -> Family:
    """The entry of family `name` (a ModelConfig.architecture)."""
    return FAMILIES[name]
