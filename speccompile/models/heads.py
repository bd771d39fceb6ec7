"""Drafter heads as export-friendly torch modules, and loaders for their published checkpoint layouts.

Four kinds (docs/DESIGN.md, "Drafter checkpoint formats"):

* ``eagle``  (EAGLE-1/2): ``fc`` [H, 2H] (+ ``fc.bias`` unless config ``"bias": false``) on
  cat(embed(x_{t+1}), f_t), one Llama decoder layer *without* ``input_layernorm``, logits through
  the target's ``lm_head``. f_t is the target's final-norm hidden state.
* ``eagle3``: ``fc`` [H, 3H_t] fuses the target taps (residual-stream inputs of three layers), a
  ``midlayer`` whose attention reads cat(input_layernorm(emb), hidden_norm(h)) (width 2H), ``norm``,
  its own ``lm_head`` [draft_vocab, H] and ``d2t`` (target id = i + d2t[i]) / ``t2d``.
* ``medusa``: ``medusa_head.{i}.{j}.linear`` ResBlocks (x + SiLU(Wx + b)) then ``medusa_head.{i}.{L}``
  [V, H]; head i predicts token t+i+2 from f_t. Legacy ``medusa_lm_head.pt`` is read with
  ``torch.load(weights_only=True)``.
* ``mtp`` (DeepSeek-V3 layout, Llama-family block): ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H] on
  cat(enorm(emb), hnorm(h)), one full decoder block, ``shared_head.norm`` / ``shared_head.head``.

Autoregressive heads (eagle, eagle3, mtp) share one graph interface: inputs ``input_ids``,
``position_ids``, ``attention_mask`` (bool [b, q, past + q]), ``hidden_states`` [b, q, H] (EAGLE-3 also
``aux_hidden_states`` [b, q, 3H_t]) and ``past_key_values.0.key/value``; outputs ``logits``,
``present.0.key/value`` and ``draft_hidden_states`` (the head's own output feature, fed back as
``hidden_states`` for the next draft step). Row t of the head pairs the target feature of position t
with the token at position t+1 and sits at RoPE position t.

EAGLE-3 tap convention: ``eagle_aux_hidden_state_layer_ids`` (speculators / vLLM configs) are read as
"the residual-stream *input* of layer j" = Hugging Face ``output_hidden_states[j]`` (index 0 = the
embeddings). That is the convention of ``models.decoder.eagle3_tap_layers`` (default (2, L//2, L-3)).
Trainers that count "output of layer i" must add 1 before writing the config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import InputError, UnsupportedError
from .config import ModelConfig
from .decoder import MLP, RMSNorm, RotaryEmbedding, describe_key_mismatch, eagle3_tap_layers, rotate_half, mask_to_bias

HEAD_KINDS = ("eagle", "eagle3", "medusa", "mtp")
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
    aux_layer_ids: list[int] = field(default_factory=list)  # eagle3, "input of layer j" convention
    medusa_num_heads: int = 0
    medusa_num_layers: int = 1
    has_embed: bool = False  # the checkpoint carries its own embed_tokens

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
        }


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

    def forward(self, x, cos, sin, bias, past_k, past_v):
        """bias: additive mask [b, 1, q, past + q]."""
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q, self.head_dim // 2) * sin
        k = k * cos + rotate_half(k, self.head_dim // 2) * sin
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
    def input_names(self) -> list[str]:
        return ["input_ids", "position_ids", "attention_mask", *self.extra_inputs,
                "past_key_values.0.key", "past_key_values.0.value"]

    @property
    def output_names(self) -> list[str]:
        return ["logits", "present.0.key", "present.0.value", "draft_hidden_states"]

    def _prep(self, position_ids, attention_mask, dtype):
        cos, sin = self.rotary_emb(position_ids, dtype)
        return cos, sin, mask_to_bias(attention_mask).unsqueeze(1)  # [b, 1, q, T]

    def empty_past(self, batch: int = 1, length: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
        c = self.head_config.layer
        return [torch.zeros(batch, c.num_key_value_heads, length, c.head_dim, dtype=dtype) for _ in range(2)]


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
    """EAGLE-3: h = fc(aux taps) + hidden (exactly one of them is non-zero per row), midlayer, norm, draft lm_head.

    Committed rows pass the target's fused taps as ``aux_hidden_states`` and zeros as ``hidden_states``;
    draft rows pass zeros as ``aux_hidden_states`` and the parent's ``draft_hidden_states``. fc has no
    bias, so fc(0) == 0 and the sum is exact.
    """

    kind = "eagle3"
    extra_inputs = ("aux_hidden_states", "hidden_states")

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        c = config.layer
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = _HeadAttentionLayer(c, in_features=2 * h)
        self.midlayer.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.target_vocab_size, dtype=torch.bool))

    def forward(self, input_ids, position_ids, attention_mask, aux_hidden_states, hidden_states, past_k, past_v):
        h = self.fc(aux_hidden_states) + hidden_states
        cos, sin, bias = self._prep(position_ids, attention_mask, h.dtype)
        m = self.midlayer
        normed = m.hidden_norm(h)
        residual = normed if self.head_config.norm_before_residual else h
        x = torch.cat((m.input_layernorm(self.embed_tokens(input_ids)), normed), dim=-1)
        attn, k_all, v_all = m.self_attn(x, cos, sin, bias, past_k, past_v)
        out = m.mlp_block(residual + attn)
        logits = self.lm_head(self.norm(out)).to(torch.float32)
        return logits, k_all, v_all, out

    def draft_to_target(self) -> torch.Tensor:
        """Target token id of every draft-vocabulary entry."""
        return torch.arange(self.head_config.draft_vocab_size) + self.d2t


class MTPHead(_ARHead):
    """DeepSeek-V3 style multi-token prediction module with a Llama-family block."""

    kind = "mtp"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        c = config.layer
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        self.enorm = RMSNorm(h, c.rms_norm_eps)
        self.hnorm = RMSNorm(h, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = _HeadAttentionLayer(c)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, c.rms_norm_eps)
        self.shared_head.head = nn.Linear(h, config.target_vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask, hidden_states, past_k, past_v):
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden_states)), dim=-1))
        cos, sin, bias = self._prep(position_ids, attention_mask, x.dtype)
        attn, k_all, v_all = self.block.self_attn(self.block.input_layernorm(x), cos, sin, bias, past_k, past_v)
        x = self.block.mlp_block(x + attn)
        logits = self.shared_head.head(self.shared_head.norm(x)).to(torch.float32)
        return logits, k_all, v_all, x


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


_CLASSES = {"eagle": EagleHead, "eagle3": Eagle3Head, "mtp": MTPHead, "medusa": MedusaHeads}


# ----------------------------------------------------------------------------------------------
# Checkpoint reading


def _read_checkpoint(path: Path, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """(config.json contents or {}, tensors, source) from a folder or a single weights file."""
    from .load import read_safetensors

    path = Path(path)
    if not path.exists():
        raise InputError(f"--drafter {kind}:{path}: no such file or directory")
    folder = path if path.is_dir() else path.parent
    config: dict[str, Any] = {}
    if (folder / "config.json").is_file():
        try:
            config = json.loads((folder / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise InputError(f"{folder / 'config.json'}: not valid JSON ({exc})") from None
    if path.is_file():
        files = [path]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files and kind == "medusa" and (folder / "medusa_lm_head.pt").is_file():
            files = [folder / "medusa_lm_head.pt"]
        if not files:
            raise InputError(
                f"--drafter {kind}:{path}: no *.safetensors weights"
                + (" (or legacy medusa_lm_head.pt)" if kind == "medusa" else "")
                + "; pickled .bin checkpoints are not loaded for safety"
            )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            tensors.update(read_safetensors(file))
        elif file.suffix in (".pt", ".pth", ".bin") and kind == "medusa":
            try:
                data = torch.load(str(file), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - unpickling errors vary
                raise InputError(f"{file}: not a readable weights-only torch file ({str(exc).splitlines()[0]})") from None
            if not isinstance(data, dict):
                raise InputError(f"{file}: expected a state dict, got {type(data).__name__}")
            tensors.update(data)
        else:
            raise InputError(f"{file}: expected a .safetensors file")
    return config, tensors, folder


def _layer_config(raw: dict[str, Any], target: ModelConfig, hidden: int | None = None) -> ModelConfig:
    """The head layer's ModelConfig: target values overridden by the checkpoint's config."""
    base = target.to_dict()
    base.update(architecture="llama", num_hidden_layers=1, qk_norm=False, attention_bias=False, tie_word_embeddings=False)
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


def _strip(tensors: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        for p in prefixes:
            if key.startswith(p):
                key = key[len(p):]
                break
        out[key] = value
    return out


def _check_and_load(module: nn.Module, state: dict[str, torch.Tensor], kind: str, source: Path, optional: tuple[str, ...] = ()) -> None:
    """strict load with an InputError naming missing/unexpected keys and shape mismatches."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state and k not in optional]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise InputError(f"{source}: not a {kind} checkpoint in the published layout ({describe_key_mismatch(missing, unexpected)})")
    bad = [f"{k} {tuple(v.shape)} (expected {tuple(expected[k].shape)})" for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        raise InputError(f"{source}: {kind} checkpoint shapes do not match its config: {', '.join(bad[:4])}")
    dtype = next((v.dtype for k, v in expected.items() if v.is_floating_point()), torch.float32)
    module.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v.to(expected[k].dtype)) for k, v in state.items()}, strict=False)


TargetWeights = Mapping[str, Any]  # the target's weights: torch tensors by HF name, or a (lazy) WeightSource


def target_tensor(target_weights: TargetWeights, name: str) -> torch.Tensor:
    """One target weight as torch: from a WeightSource only that tensor is read, never the whole target."""
    from .weights import WeightSource

    if isinstance(target_weights, WeightSource):
        return target_weights.torch_tensor(name)
    return target_weights[name]


def _target_embed(target_weights: TargetWeights) -> torch.Tensor:
    return target_tensor(target_weights, "model.embed_tokens.weight")


def _target_lm_head(target: ModelConfig, target_weights: TargetWeights) -> torch.Tensor:
    if "lm_head.weight" in target_weights and not target.tie_word_embeddings:
        return target_tensor(target_weights, "lm_head.weight")
    return target_tensor(target_weights, "model.embed_tokens.weight")


def _shape(tensors, key, kind, source):
    if key not in tensors:
        raise InputError(f"{source}: not a {kind} checkpoint in the published layout (missing keys: {key})")
    return tuple(tensors[key].shape)


def load_head(kind: str, path: str | Path, target: ModelConfig, target_weights: TargetWeights) -> nn.Module:
    """Read a drafter checkpoint of `kind` for `target` and return the torch head (eval mode, fp32)."""
    if kind not in HEAD_KINDS:
        raise InputError(f"unknown head kind {kind!r} (expected one of {', '.join(HEAD_KINDS)})")
    raw, tensors, source = _read_checkpoint(Path(path), kind)
    if kind == "medusa":
        return _load_medusa(raw, tensors, source, target)
    if kind == "eagle":
        return _load_eagle(raw, tensors, source, target, target_weights)
    if kind == "eagle3":
        return _load_eagle3(raw, tensors, source, target, target_weights)
    return _load_mtp(raw, tensors, source, target, target_weights)


def _load_eagle(raw, tensors, source, target, target_weights) -> EagleHead:
    tensors = _strip(tensors, ("model.",))
    out_h, in_h = _shape(tensors, "fc.weight", "eagle", source)
    if in_h != 2 * out_h:
        raise InputError(f"{source}: eagle fc.weight is {[out_h, in_h]}, expected [H, 2H] (an EAGLE-3 head? use eagle3:PATH)")
    if out_h != target.hidden_size:
        raise InputError(f"{source}: eagle head hidden size {out_h} differs from the target's {target.hidden_size}")
    bias = bool(raw.get("bias", "fc.bias" in tensors))
    cfg = HeadConfig("eagle", _layer_config(raw, target, out_h), target.hidden_size, target.vocab_size, target.vocab_size,
                     fc_bias=bias, has_embed="embed_tokens.weight" in tensors)
    head = EagleHead(cfg)
    state = dict(tensors)
    state.setdefault("embed_tokens.weight", _target_embed(target_weights))
    state["lm_head.weight"] = _target_lm_head(target, target_weights)
    _check_and_load(head, state, "eagle", source)
    return head.eval()


def _load_eagle3(raw, tensors, source, target, target_weights) -> Eagle3Head:
    tensors = _strip(tensors, ("model.",))
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    layer_raw = dict(raw.get("transformer_layer_config") or raw)
    h, in3 = _shape(tensors, "fc.weight", "eagle3", source)
    if in3 % 3:
        raise InputError(f"{source}: eagle3 fc.weight is {[h, in3]}, expected [H, 3*H_target]")
    t_hidden = in3 // 3
    if t_hidden != target.hidden_size:
        raise InputError(f"{source}: eagle3 fc.weight expects target hidden size {t_hidden}, the target has {target.hidden_size}")
    draft_vocab = _shape(tensors, "lm_head.weight", "eagle3", source)[0]
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    default = list(eagle3_tap_layers(target.num_hidden_layers))
    ids = [int(i) for i in ids] if ids else default
    if ids != default:
        raise UnsupportedError(
            f"{source}: eagle_aux_hidden_state_layer_ids {ids} (inputs of those layers) differ from the taps the "
            f"target graph exports {default}; custom taps are not supported yet"
        )
    layer_raw.setdefault("hidden_size", h)
    cfg = HeadConfig("eagle3", _layer_config(layer_raw, target, h), t_hidden, target.vocab_size, draft_vocab,
                     fc_bias=False, norm_before_residual=bool(raw.get("norm_before_residual", False)),
                     aux_layer_ids=ids, has_embed="embed_tokens.weight" in tensors)
    head = Eagle3Head(cfg)
    state = dict(tensors)
    if "embed_tokens.weight" not in state:
        if h != target.hidden_size:
            raise InputError(f"{source}: eagle3 head of width {h} needs its own embed_tokens.weight")
        state["embed_tokens.weight"] = _target_embed(target_weights)
    if "d2t" not in state:
        if draft_vocab != target.vocab_size:
            raise InputError(f"{source}: draft vocabulary {draft_vocab} != target {target.vocab_size} but no d2t mapping")
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
    if "t2d" not in state:
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + state["d2t"].long()] = True
        state["t2d"] = t2d
    mapped = torch.arange(draft_vocab) + state["d2t"].long()
    if int(mapped.min()) < 0 or int(mapped.max()) >= target.vocab_size:
        raise InputError(f"{source}: d2t maps draft ids outside the target vocabulary (0..{target.vocab_size - 1})")
    _check_and_load(head, state, "eagle3", source)
    return head.eval()


def _load_mtp(raw, tensors, source, target, target_weights) -> MTPHead:
    import re

    layer_ids = {m.group(1) for k in tensors if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if len(layer_ids) > 1:
        raise UnsupportedError(f"{source}: {len(layer_ids)} MTP modules ({', '.join(sorted(layer_ids))}); only one is supported")
    tensors = _strip(tensors, tuple(f"model.layers.{i}." for i in layer_ids) + ("model.",))
    renamed = {}
    for key, value in tensors.items():
        for sub in ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."):
            if key.startswith(sub):
                key = "block." + key
                break
        renamed[key] = value
    h = _shape(renamed, "eh_proj.weight", "mtp", source)[0]
    if h != target.hidden_size:
        raise InputError(f"{source}: mtp hidden size {h} differs from the target's {target.hidden_size}")
    cfg = HeadConfig("mtp", _layer_config(raw, target, h), target.hidden_size, target.vocab_size, target.vocab_size,
                     has_embed="embed_tokens.weight" in renamed)
    head = MTPHead(cfg)
    renamed.setdefault("embed_tokens.weight", _target_embed(target_weights))
    renamed.setdefault("shared_head.head.weight", _target_lm_head(target, target_weights))
    _check_and_load(head, renamed, "mtp", source)
    return head.eval()


def _load_medusa(raw, tensors, source, target) -> MedusaHeads:
    tensors = {("medusa_head." + k if not k.startswith("medusa_head.") else k): v for k, v in tensors.items()}
    heads = sorted({int(k.split(".")[1]) for k in tensors if k.split(".")[1].isdigit()})
    if not heads:
        raise InputError(f"{source}: no medusa_head.* tensors (unexpected keys: {', '.join(list(tensors)[:6])})")
    num_heads = int(raw.get("medusa_num_heads") or len(heads))
    num_layers = raw.get("medusa_num_layers")
    if num_layers is None:
        num_layers = len({k.split(".")[2] for k in tensors if k.startswith("medusa_head.0.") and k.endswith("linear.weight")})
    cfg = HeadConfig("medusa", _layer_config({}, target), target.hidden_size, target.vocab_size, target.vocab_size,
                     medusa_num_heads=num_heads, medusa_num_layers=int(num_layers))
    module = MedusaHeads(cfg)
    # nn.Sequential names the projection `medusa_head.{i}.{L}.weight`, exactly the published layout
    _check_and_load(module, tensors, "medusa", source)
    return module.eval()


# ----------------------------------------------------------------------------------------------
# Writing (the training command and tests write the published layouts)


def head_state_dict(head: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a published checkpoint of this head holds (target-shared weights left out)."""
    cfg: HeadConfig = head.head_config
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    if cfg.kind == "eagle":
        state.pop("lm_head.weight", None)
        if not cfg.has_embed:
            state.pop("embed_tokens.weight", None)
    elif cfg.kind in ("eagle3", "mtp"):
        if not cfg.has_embed:
            state.pop("embed_tokens.weight", None)
    if cfg.kind == "mtp":
        state = {(k[len("block."):] if k.startswith("block.") else k): v for k, v in state.items()}
        state = {f"model.layers.0.{k}": v for k, v in state.items()}  # DeepSeek: model.layers.{L}.*
    return state


def head_config_json(head: nn.Module) -> dict[str, Any]:
    """config.json contents in the published style of each kind."""
    cfg: HeadConfig = head.head_config
    c = cfg.layer
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
    }
    if cfg.kind == "eagle":
        return {**layer, "bias": cfg.fc_bias}
    if cfg.kind == "eagle3":
        return eagle3_config_json(layer, cfg)
    if cfg.kind == "mtp":
        return {**layer, "num_nextn_predict_layers": 1}
    return {"medusa_num_heads": cfg.medusa_num_heads, "medusa_num_layers": cfg.medusa_num_layers,
            "hidden_size": cfg.target_hidden_size, "vocab_size": cfg.target_vocab_size}


def eagle3_config_json(layer: dict[str, Any], cfg: HeadConfig) -> dict[str, Any]:
    """The flat Hugging Face EAGLE-3 config (`LlamaForCausalLMEagle3`, as the EAGLE-3 reference heads publish it):
    the layer's sizes at the top level, `draft_vocab_size`, `target_hidden_size` and the tap layers under
    `eagle_config` (vLLM, SGLang, TensorRT-LLM's ModelOpt heads) and as `target_layer_ids` (TensorRT Edge-LLM);
    both count "the input of layer j", the convention of `models.decoder.eagle3_tap_layers`."""
    taps = list(cfg.aux_layer_ids)
    return {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True},
        "target_layer_ids": taps,
    }


def save_head(head: nn.Module, out: str | Path, extra_config: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors in the published layout of the head's kind."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = head_state_dict(head)
    save_file({k: v.clone() for k, v in state.items()}, str(out / "model.safetensors"))
    config = head_config_json(head)
    if extra_config:
        config.update(extra_config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def new_head(kind: str, target: ModelConfig, target_weights: TargetWeights | None = None,
             draft_vocab_size: int | None = None, medusa_num_heads: int = 4, medusa_num_layers: int = 1,
             intermediate_size: int | None = None, fc_bias: bool = True, seed: int = 0) -> nn.Module:
    """A freshly initialised head for `target` (training, tests); target-shared weights copied in."""
    torch.manual_seed(seed)
    raw = {"intermediate_size": intermediate_size} if intermediate_size else {}
    layer = _layer_config(raw, target)
    v = target.vocab_size
    cfg = HeadConfig(kind, layer, target.hidden_size, v, draft_vocab_size or v, fc_bias=fc_bias,
                     aux_layer_ids=list(eagle3_tap_layers(target.num_hidden_layers)) if kind == "eagle3" else [],
                     medusa_num_heads=medusa_num_heads if kind == "medusa" else 0, medusa_num_layers=medusa_num_layers)
    head = _CLASSES[kind](cfg)
    if target_weights is not None:
        with torch.no_grad():
            if hasattr(head, "embed_tokens"):
                head.embed_tokens.weight.copy_(_target_embed(target_weights))
            if kind == "eagle":
                head.lm_head.weight.copy_(_target_lm_head(target, target_weights))
            elif kind == "mtp":
                head.shared_head.head.weight.copy_(_target_lm_head(target, target_weights))
                head.shared_head.norm.weight.copy_(target_tensor(target_weights, "model.norm.weight"))
            elif kind == "eagle3" and cfg.draft_vocab_size == v:
                head.lm_head.weight.copy_(_target_lm_head(target, target_weights))
                head.norm.weight.copy_(target_tensor(target_weights, "model.norm.weight"))
            elif kind == "medusa":
                for sub in head.medusa_head:
                    sub[-1].weight.copy_(_target_lm_head(target, target_weights))
                    for block in list(sub)[:-1]:
                        block.linear.weight.zero_()
                        block.linear.bias.zero_()
    return head.eval()
