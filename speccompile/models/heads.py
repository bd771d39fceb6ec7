"""Drafter heads as export-friendly torch modules: their config, their modules, the target weights they share.

Reading a published checkpoint is head_loaders.py's job; a fresh head and writing one, head_writers.py's.

Four kinds (docs/DESIGN.md, "Drafter checkpoint formats"):

* ``eagle``  (EAGLE-1/2): ``fc`` [H, 2H] (+ ``fc.bias`` unless config ``"bias": false``) on
  cat(embed(x_{t+1}), f_t), one Llama decoder layer *without* ``input_layernorm``, logits through
  the target's ``lm_head``. f_t is the target's final-norm hidden state.
* ``eagle3``: ``fc`` [H, n H_t] fuses the target taps (residual-stream inputs of n layers), a
  ``midlayer`` whose attention reads cat(input_layernorm(emb), hidden_norm(h)) (width 2H), optional plain
  decoder ``layers``, ``norm``, its own ``lm_head`` [draft_vocab, H] and ``d2t`` (target id = i + d2t[i]) /
  ``t2d`` (the published layouts: models/eagle3_layouts.py).
* ``medusa``: ``medusa_head.{i}.{j}.linear`` ResBlocks (x + SiLU(Wx + b)) then ``medusa_head.{i}.{L}``
  [V, H]; head i predicts token t+i+2 from f_t. Legacy ``medusa_lm_head.pt`` is read with
  ``torch.load(weights_only=True)``.
* ``mtp`` (DeepSeek-V3 names, Llama-family block): ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H] on
  cat(enorm(emb), hnorm(h)), one full decoder block, ``shared_head.norm`` / ``shared_head.head`` (the other
  namings: models/mtp_layouts.py).

Autoregressive heads (eagle, eagle3, mtp) share one graph interface: inputs ``input_ids``,
``position_ids``, ``attention_mask`` (bool [b, q, past + q]), ``hidden_states`` [b, q, H] (EAGLE-3 also
``aux_hidden_states`` [b, q, n H_t]) and ``past_key_values.{i}.key/value`` per head layer; outputs ``logits``,
``present.{i}.key/value`` and ``draft_hidden_states`` (the head's own output feature, fed back as
``hidden_states`` for the next draft step). Row t of the head pairs the target feature of position t
with the token at position t+1 and sits at RoPE position t.

EAGLE-3 tap convention here: "the residual-stream *input* of layer j" = Hugging Face ``output_hidden_states[j]``
(index 0 = the embeddings, L = the final hidden state before the norm), as ``models.config.eagle3_tap_layers``
(default (2, L//2, L-3)); configs that count layer outputs (SGLang's ``eagle_config``) are shifted by one on reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import InputError
from .config import ModelConfig
from .decoder import MLP, DecoderLayer, RMSNorm, RotaryEmbedding, apply_rope
from .masks import attention_bias, mask_to_bias

_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
)

# a head layer on a multi-head latent attention target (models/mla.py) is a plain Llama layer
_NOT_LATENT = dict(kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0, v_head_dim=0, rotary_dim=0, rope_interleaved=False,
                   attn_scale=0.0)


@dataclass
class HeadConfig:
    """What a head needs beyond its one-layer ModelConfig; serialised into the manifest and config.json."""

    kind: str
    layer: ModelConfig  # the head's decoder layer (num_hidden_layers = 1); unused by medusa
    target_hidden_size: int
    target_vocab_size: int
    draft_vocab_size: int
    fc_bias: bool = True  # eagle
    norm_before_residual: bool = False  # eagle3 (speculators option)
    aux_layer_ids: list[int] = field(default_factory=list)  # eagle3, "input of layer j" convention (j = L: final)
    medusa_num_heads: int = 0
    medusa_num_layers: int = 1
    has_embed: bool = False  # the checkpoint carries its own embed_tokens
    num_layers: int = 1  # eagle3: the Eagle-3 first layer + num_layers - 1 plain decoder layers
    norm_before_fc: bool = False  # eagle3: one RMSNorm over the concatenated taps (`input_norm`)
    fc_norm: bool = False  # eagle3: one RMSNorm per tap (`fc_norm.{i}`)
    norm_output: bool = False  # eagle3: the fed-back feature is norm(out) (Eagle 3.1)
    mtp_style: str = "deepseek"  # mtp: deepseek | qwen3_next | mimo | speculators (models/mtp_layouts.py)
    mtp_modules: int = 1  # mtp: modules in the checkpoint (module i drafts depth i of a chain; MTPHead.chain)
    layout: str = ""  # the published layout it was read from (for inspect)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "layer": self.layer.to_dict(),
            "target_hidden_size": self.target_hidden_size,
            "target_vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "fc_bias": self.fc_bias,
            "norm_before_residual": self.norm_before_residual,
            "aux_layer_ids": list(self.aux_layer_ids),
            "medusa_num_heads": self.medusa_num_heads,
            "medusa_num_layers": self.medusa_num_layers,
            "has_embed": self.has_embed,
            "num_layers": self.num_layers,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "mtp_style": self.mtp_style,
            "mtp_modules": self.mtp_modules,
            "layout": self.layout,
        }


TargetWeights = Mapping[str, Any]  # the target's weights: torch tensors by HF name, or a (lazy) WeightSource


def head_layer_config(raw: dict[str, Any], target: ModelConfig, hidden: int | None = None) -> ModelConfig:
    """The head layer's ModelConfig: target values overridden by the checkpoint's config."""
    base = target.to_dict()
    layer_type = str(raw.get("model_type") or "llama")
    base.update(architecture="llama", num_hidden_layers=1, qk_norm=layer_type == "qwen3", attention_bias=layer_type == "qwen2",
                tie_word_embeddings=False, moe=None, qk_norm_after_rope=False,  # a head's q/k norms: Qwen3's, before rope
                kv_sources=[], layer_intermediate_sizes=[], per_layer_input_size=0,  # the target's KV sharing / PLE: not a head's
                altup_inputs=0, laurel_rank=0, activation_sparsity=[], soft_token_offset=0)  # nor its AltUp streams (Gemma 3n)
    if target.mla:  # a Llama layer: not the target's latent attention geometry (its partial interleaved rope, scale)
        base.update(_NOT_LATENT)
    params = raw.get("rope_parameters") or {}
    raw = {"rope_theta": params.get("rope_theta"),
           "rope_scaling": params if params.get("rope_type", "default") != "default" else None, **raw}
    if hidden is not None and hidden != target.hidden_size and "num_attention_heads" not in raw:
        raise InputError("head hidden size differs from the target's but its config gives no attention shape")
    for key in _LAYER_KEYS:
        if raw.get(key) is not None:
            base[key] = raw[key]
    if raw.get("hidden_size") is not None and raw.get("head_dim") is None:
        base["head_dim"] = int(base["hidden_size"]) // int(base["num_attention_heads"])
    if raw.get("num_attention_heads") is not None and raw.get("num_key_value_heads") is None:
        base["num_key_value_heads"] = base["num_attention_heads"]
    return ModelConfig.from_dict(base)


def target_tensor(target_weights: TargetWeights, name: str) -> torch.Tensor:
    """One target weight as torch: from a WeightSource only that tensor is read, never the whole target."""
    from .weights import WeightSource

    if isinstance(target_weights, WeightSource):
        return target_weights.torch_tensor(name)
    return target_weights[name]


def target_embed(target_weights: TargetWeights) -> torch.Tensor:
    """The target's input embeddings (the heads that do not carry their own share them)."""
    return target_tensor(target_weights, "model.embed_tokens.weight")


def target_lm_head(target: ModelConfig, target_weights: TargetWeights) -> torch.Tensor:
    """The target's output projection (its embeddings when they are tied)."""
    if "lm_head.weight" in target_weights and not target.tie_word_embeddings:
        return target_tensor(target_weights, "lm_head.weight")
    return target_tensor(target_weights, "model.embed_tokens.weight")


# ----------------------------------------------------------------------------------------------
# Modules (the heads own their small building blocks: trainable with autograd, exportable, and
# independent of the target decoder's export-specific internals; parameter names follow HF)


class HeadAttention(nn.Module):
    """Grouped-query attention over past + new keys with an explicit mask (HF parameter names).

    The heads keep their own copy (rather than decoder.Attention) so they stay trainable with autograd
    and independent of the target graph's export tricks; the math is the same.
    """

    def __init__(self, cfg: ModelConfig, in_features: int | None = None):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        width = in_features or cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm of each head's q and k before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rope_config = cfg  # which dims rotate, and how (partial rotary: the first rope_dim)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        """bias: additive mask [b, 1, q, past + q]."""
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, q_len, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.rope_config), apply_rope(k, cos, sin, self.rope_config)
        k_all = torch.cat((past_k, k), dim=2)
        v_all = torch.cat((past_v, v), dim=2)
        groups = self.num_heads // self.num_kv_heads
        qg = q.reshape(b, self.num_kv_heads, groups * q_len, self.head_dim)
        scores = torch.matmul(qg, k_all.transpose(2, 3)).to(torch.float32) * (1.0 / math.sqrt(self.head_dim))
        scores = scores.view(b, self.num_kv_heads, groups, q_len, -1) + bias.unsqueeze(1)
        probs = torch.softmax(scores, dim=-1).to(v_all.dtype).view(b, self.num_kv_heads, groups * q_len, -1)
        out = torch.matmul(probs, v_all).view(b, self.num_heads, q_len, self.head_dim)
        out = out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out), k_all, v_all


class _HeadAttentionLayer(nn.Module):
    """Attention + MLP block used by the autoregressive heads (input width configurable)."""

    def __init__(self, cfg: ModelConfig, in_features: int | None = None, input_layernorm: bool = True):
        super().__init__()
        if input_layernorm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg, in_features)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))


class _ARHead(nn.Module):
    """Common parts of the autoregressive heads: rotary tables, mask bias, graph names."""

    kind = ""
    extra_inputs: tuple[str, ...] = ("hidden_states",)

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.head_config = config
        self.rotary_emb = RotaryEmbedding(config.layer)

    @property
    def num_layers(self) -> int:
        """Decoder layers of the head, each with its own KV cache."""
        return self.head_config.num_layers

    @property
    def input_names(self) -> list[str]:
        past = [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        return ["input_ids", "position_ids", "attention_mask", *self.extra_inputs, *past]

    @property
    def output_names(self) -> list[str]:
        presents = [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]
        return ["logits", *presents, "draft_hidden_states"]

    def _prep(self, position_ids, attention_mask, dtype):
        cos, sin = self.rotary_emb(position_ids, dtype)
        return cos, sin, mask_to_bias(attention_mask).unsqueeze(1)  # [b, 1, q, T]

    def empty_past(self, batch: int = 1, length: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
        c = self.head_config.layer
        return [torch.zeros(batch, c.num_key_value_heads, length, c.head_dim, dtype=dtype) for _ in range(2 * self.num_layers)]


class EagleHead(_ARHead):
    """EAGLE-1/2: fc(cat(emb(x_{t+1}), f_t)) -> one decoder layer (no input_layernorm) -> target lm_head."""

    kind = "eagle"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        c = config.layer
        self.embed_tokens = nn.Embedding(config.target_vocab_size, c.hidden_size)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([_HeadAttentionLayer(c, input_layernorm=False)])
        self.lm_head = nn.Linear(c.hidden_size, config.target_vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask, hidden_states, past_k, past_v):
        x = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
        cos, sin, bias = self._prep(position_ids, attention_mask, x.dtype)
        layer = self.layers[0]
        attn, k_all, v_all = layer.self_attn(x, cos, sin, bias, past_k, past_v)
        x = layer.mlp_block(x + attn)
        logits = self.lm_head(x).to(torch.float32)
        return logits, k_all, v_all, x


class Eagle3Head(_ARHead):
    """EAGLE-3: h = fc(taps) + hidden (exactly one of them is non-zero per row), the Eagle-3 first layer
    (`midlayer`), optional plain decoder `layers`, norm, draft lm_head.

    Committed rows pass the target's fused taps as ``aux_hidden_states`` and zeros as ``hidden_states``;
    draft rows pass zeros as ``aux_hidden_states`` and the parent's ``draft_hidden_states``. fc has no
    bias and an RMSNorm maps 0 to 0, so fc(norm(0)) == 0 and the sum is exact. The speculators options:
    `norm_before_fc` (`input_norm` over the concatenated taps), `fc_norm` (one norm per tap),
    `norm_before_residual`, `norm_output` (the fed-back feature is norm(out))."""

    kind = "eagle3"
    extra_inputs = ("aux_hidden_states", "hidden_states")

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        c = config.layer
        h, th, eps = c.hidden_size, config.target_hidden_size, c.rms_norm_eps
        taps = len(config.aux_layer_ids) or 3
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        if config.norm_before_fc:
            self.input_norm = RMSNorm(taps * th, eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(th, eps) for _ in range(taps))
        self.fc = nn.Linear(taps * th, h, bias=False)
        self.midlayer = _HeadAttentionLayer(c, in_features=2 * h)
        self.midlayer.hidden_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList(_HeadAttentionLayer(c) for _ in range(config.num_layers - 1))
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.target_vocab_size, dtype=torch.bool))

    def fuse_taps(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the (normed) concatenated taps."""
        if self.head_config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.head_config.fc_norm:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(self, input_ids, position_ids, attention_mask, aux_hidden_states, hidden_states, *past):
        h = self.fuse_taps(aux_hidden_states) + hidden_states
        cos, sin, bias = self._prep(position_ids, attention_mask, h.dtype)
        m = self.midlayer
        normed = m.hidden_norm(h)
        residual = normed if self.head_config.norm_before_residual else h
        x = torch.cat((m.input_layernorm(self.embed_tokens(input_ids)), normed), dim=-1)
        attn, k_all, v_all = m.self_attn(x, cos, sin, bias, past[0], past[1])
        out = m.mlp_block(residual + attn)
        presents = [k_all, v_all]
        for i, layer in enumerate(self.layers, start=1):
            attn, k_all, v_all = layer.self_attn(layer.input_layernorm(out), cos, sin, bias, past[2 * i], past[2 * i + 1])
            out = layer.mlp_block(out + attn)
            presents += [k_all, v_all]
        if self.head_config.norm_output:
            out = self.norm(out)
            logits = self.lm_head(out).to(torch.float32)
        else:
            logits = self.lm_head(self.norm(out)).to(torch.float32)
        return (logits, *presents, out)

    def draft_to_target(self) -> torch.Tensor:
        """Target token id of every draft-vocabulary entry."""
        return torch.arange(self.head_config.draft_vocab_size) + self.d2t


class MTPHead(_ARHead):
    """A multi-token prediction module with a Llama-family block, in the module names of DeepSeek-V3
    (models/mtp_layouts.py maps the Qwen3-Next and MiMo names onto them). `mtp_style`:

    * deepseek (also GLM-4.5): eh_proj(cat(enorm(emb), hnorm(h))), block, logits = head(shared_head.norm(out)),
      fed back: out;
    * qwen3_next (Qwen3.5): the same with the fed-back feature norm(out);
    * mimo: eh_proj(cat(hnorm(h), enorm(emb))) with emb zeroed at position 0, fed back norm(out);
    * speculators (its MTPDraftModel): as qwen3_next.

    On a multi-head latent attention or MoE target (DeepSeek-V3, GLM-4.5) the block is the target's own decoder layer
    (decoder.DecoderLayer: its attention, latent with one cached latent head, and the MoE MLP;
    mtp_layouts.mtp_layer_config).

    A checkpoint with several modules loads as module 0 with modules 1..N-1 in `chain` (a plain list: module 0's
    state dict stays its own); module i reads module i-1's fed-back feature (DeepSeek-V3's sequential MTP).
    """

    kind = "mtp"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        self.chain: list[MTPHead] = []
        c = config.layer
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        self.enorm = RMSNorm(h, c.rms_norm_eps)
        self.hnorm = RMSNorm(h, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        own = c.mla or c.moe is not None or c.attn_output_gate  # the target's own layer (head_layer_config's have none)
        self.block = DecoderLayer(c) if own else _HeadAttentionLayer(c)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, c.rms_norm_eps)
        self.shared_head.head = nn.Linear(h, config.target_vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask, hidden_states, past_k, past_v):
        style = self.head_config.mtp_style
        emb = self.enorm(self.embed_tokens(input_ids))
        if style == "mimo":  # MiMo masks the embedding of position 0
            emb = emb * (position_ids != 0).unsqueeze(-1).to(emb.dtype)
        pair = (self.hnorm(hidden_states), emb) if style == "mimo" else (emb, self.hnorm(hidden_states))
        x = self.eh_proj(torch.cat(pair, dim=-1))
        cos, sin, bias = self._prep(position_ids, attention_mask, x.dtype)
        if isinstance(self.block, DecoderLayer):
            c = self.head_config.layer
            bias = attention_bias(attention_mask, c.num_attention_heads, c.num_key_value_heads)
            x, k_all, v_all = self.block(x, {"global": (cos, sin)}, {False: bias}, past_k, past_v)
        else:
            attn, k_all, v_all = self.block.self_attn(self.block.input_layernorm(x), cos, sin, bias, past_k, past_v)
            x = self.block.mlp_block(x + attn)
        normed = self.shared_head.norm(x)
        logits = self.shared_head.head(normed).to(torch.float32)
        return logits, k_all, v_all, (x if style == "deepseek" else normed)


class _ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """Medusa: head i = ResBlocks then a [V, H] projection; logits [b, q, num_heads, V]."""

    kind = "medusa"
    input_names = ["hidden_states"]
    output_names = ["logits"]

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.head_config = config
        h, v = config.target_hidden_size, config.target_vocab_size
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[_ResBlock(h) for _ in range(config.medusa_num_layers)], nn.Linear(h, v, bias=False))
            for _ in range(config.medusa_num_heads)
        )

    def forward(self, hidden_states):
        return torch.stack([head(hidden_states) for head in self.medusa_head], dim=2).to(torch.float32)


HEAD_CLASSES = {"eagle": EagleHead, "eagle3": Eagle3Head, "mtp": MTPHead, "medusa": MedusaHeads}

