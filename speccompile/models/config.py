"""Architecture configuration of a Llama-family decoder, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError, UnsupportedError
from .moe_config import MoeConfig, moe_from_hf

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
_ARCH_ALIASES = {
    "llama": "llama",
    "smollm2": "llama",
    "smollm": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}
_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
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
    moe: MoeConfig | None = None  # mixture-of-experts layers (models/moe_config.py); None: dense MLPs

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from a manifest's JSON
            self.moe = MoeConfig(**self.moe)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


def normalize_architecture(name: str, source: str) -> str:
    """Map a model_type / GGUF architecture name to one of SUPPORTED_ARCHITECTURES or raise."""
    arch = _ARCH_ALIASES.get(str(name).lower())
    if arch is None:
        raise UnsupportedError(
            f"{source}: unsupported architecture '{name}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _check_rope_scaling(scaling: dict[str, Any] | None, source: str) -> dict[str, Any] | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"{source}: rope_scaling type '{rope_type}' is not supported (supported: {', '.join(_SUPPORTED_ROPE_TYPES)})"
        )
    return dict(scaling, rope_type=rope_type)


def config_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from the contents of a Hugging Face config.json."""
    model_type = data.get("model_type")
    if model_type is None:
        raise InputError(f"{source}: config.json has no 'model_type'")
    arch = normalize_architecture(model_type, source)
    if arch in ("mistral", "mixtral") and data.get("sliding_window"):
        raise UnsupportedError(
            f"{source}: {model_type} with sliding_window={data['sliding_window']} is not supported yet "
            "(only full attention, sliding_window null)"
        )
    if arch.startswith("qwen") and data.get("use_sliding_window"):
        raise UnsupportedError(f"{source}: use_sliding_window=true is not supported yet")
    try:
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        rope_params = data.get("rope_parameters") or {}
        rope_scaling = data.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        return ModelConfig(
            architecture=arch,
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=int(data["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6 if arch.startswith("qwen") else 1e-5)),
            rope_theta=float(data.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=_check_rope_scaling(rope_scaling, source),
            max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=bool(data.get("attention_bias", data.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=_eos_list(data.get("eos_token_id")),
            moe=moe_from_hf(arch, data),
        )
    except KeyError as exc:
        raise InputError(f"{source}: config.json is missing required key {exc}") from None


def config_from_gguf(meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool, source: str) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (keys like `llama.block_count`)."""
    arch_name = meta.get("general.architecture")
    if arch_name is None:
        raise InputError(f"{source}: GGUF metadata has no general.architecture")
    arch = normalize_architecture(arch_name, source)
    if arch in ("qwen2_moe", "qwen3_moe", "mixtral"):
        raise UnsupportedError(f"{source}: mixture-of-experts GGUF files ({arch_name}) are not supported yet; export the safetensors checkpoint")
    p = f"{arch_name}."
    try:
        hidden = int(meta[p + "embedding_length"])
        heads = int(meta[p + "attention.head_count"])
        vocab = meta.get(p + "vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", []))
        head_dim = meta.get(p + "attention.key_length") or meta.get(p + "rope.dimension_count") or hidden // heads
        scaling = None
        if meta.get(p + "rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
        if arch == "mistral" and meta.get(p + "attention.sliding_window"):
            raise UnsupportedError(f"{source}: Mistral with a sliding window is not supported yet")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            num_hidden_layers=int(meta[p + "block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(p + "attention.head_count_kv") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(meta.get(p + "context_length", 2048)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=has_qkv_bias,
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_eos_list(meta.get("tokenizer.ggml.eos_token_id")),
        )
    except KeyError as exc:
        raise InputError(f"{source}: GGUF metadata is missing {exc}") from None
