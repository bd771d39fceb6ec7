"""The text decoder of a multimodal checkpoint: an image / audio-text wrapper whose language model is a family of the
architecture table (Gemma 3 / 4 / 3n, Mistral 3, LLaVA, Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE, Llama 4, Qwen3.5 / Qwen3.5-MoE,
Phi-4-multimodal), read as that family's checkpoint.

The config is the wrapper's `text_config` as transformers reads it (`AutoConfig.for_model`: the defaults old saves
leave out filled in, older keys moved to where transformers 5 keeps them, Qwen2.5-VL's flat text keys gathered), its
model_type the text family's, what sits at the top level (`quantization_config`) carried over. The lm_head is tied
iff the checkpoint has none (transformers 5 ties only then: a stored lm_head that differs from the embedding is not
tied, whatever the config says). The weights are the language model's under the text family's names
(`model.language_model.*` of transformers 5 or `language_model.model.*` of older saves become `model.*`,
`language_model.lm_head.*` becomes `lm_head.*`); the vision / audio towers and their projectors are left out,
never read, and said so at export; a tensor that is neither is refused in one line. Qwen-VL's multimodal rope
("mrope") is plain rope on text: its three position axes (time, height, width) are each the token's position for
text tokens (transformers' `get_rope_index`), so every frequency section turns by the same angle. Qwen3-VL-MoE's text
decoder is Qwen3-MoE's (top k always renormalised) with fused experts, shown per expert (models/moe_weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedError
from .architectures import family_name
from .hf_config import transformers_config
from .moe_weights import ChunkedExpertSource
from .soft_tokens import SOFT_TABLE, Part, gemma3n_soft_tokens, soft_token_table
from .weights import WeightSource

# wrappers read as their text decoder -> the text_config model_types read (None: any family of the table)
WRAPPERS: dict[str, tuple[str, ...] | None] = {
    "gemma3": ("gemma3_text",), "gemma4": ("gemma4_text",), "gemma3n": ("gemma3n_text",), "mistral3": None, "llava": None,
    "qwen2_vl": ("qwen2_vl_text",), "qwen2_5_vl": ("qwen2_5_vl_text",), "qwen3_vl": ("qwen3_vl_text",),
    "qwen3_vl_moe": ("qwen3_vl_moe_text",), "llama4": ("llama4_text",), "qwen3_5": ("qwen3_5_text",), "qwen3_5_moe": ("qwen3_5_moe_text",),
    "phi4_multimodal": ("phi4_multimodal",),  # its text keys at the top level beside vision_config / audio_config
}
# text decoders of a wrapper that are a family of the table under another name (their mrope is plain rope on text)
TEXT_TYPES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe",
              "phi4_multimodal": "phi3"}  # Phi-4-multimodal's language model: Phi-4-mini's layers
_SUB_CONFIGS = ("vision_config", "audio_config")  # a flat wrapper's (Phi-4-multimodal) towers, not text keys
# remote-code saves -> the wrapper transformers converts them to, and their keys that are not the text decoder's
REMOTE_SAVES = {"phi4mm": "phi4_multimodal"}
_REMOTE_KEYS = ("embd_layer", "audio_processor", "img_processor", "vision_lora", "speech_lora", "auto_map", "architectures")
_ADAPTERS = (".lora_A.", ".lora_B.")  # PEFT's per-modality LoRA tensors (Phi-4-multimodal's vision / speech: off on text)
# wrappers whose text decoder is not a family of the table, and why
REFUSED_WRAPPERS = {
    "mllama": "Llama 3.2 Vision's text decoder has cross-attention layers (not supported)",
    "paligemma": "PaliGemma attends to the whole prompt both ways (prefix LM), not causally (not supported)",
}
# top-level parts of a wrapper that are not the language model (under `model.` in transformers 5's saves)
LEFT_OUT = ("vision_tower", "vision_model", "multi_modal_projector", "visual", "embed_vision", "audio_tower", "embed_audio",
            "embed_tokens_extend")
_RENAMED = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
_TOP_LEVEL = ("quantization_config",)  # wrapper keys the text decoder's config reads


@dataclass(frozen=True)
class TextDecoder:
    """The text decoder of a multimodal checkpoint: its config.json keys (before the lm_head tying) and where."""

    wrapper: str  # the wrapper's model_type
    config: dict[str, Any]  # the text decoder's config.json keys, model_type a family's of the table
    source: str  # config.json's path (errors)
    soft_tokens: tuple[Part, ...] = ()  # Gemma 3n: the embedders of its image / audio tokens (models/soft_tokens.py)

    def weights(self, stored: WeightSource) -> tuple[WeightSource, str]:
        """(the language model's tensors under the text family's names, the line saying what is left out);
        a tensor that is neither the language model's nor a left-out part is refused."""
        names, dropped = {}, set()
        adapters = {n for n in stored.names() if any(a in n for a in _ADAPTERS)}  # the base layer's weight is the text one
        base = {n: n.replace(".base_layer.", ".") for n in stored.names() if ".base_layer." in n}
        if adapters or base:
            stored = stored.without(adapters).renamed(base)
        for name in stored.names():
            part = name.removeprefix("model.").split(".", 1)[0]
            renamed = next((new + name[len(old):] for old, new in _RENAMED if name.startswith(old)), None)
            if part in LEFT_OUT and renamed is None:
                dropped.add(name)
            elif renamed is not None or name.startswith(("model.", "lm_head.", "mtp.")):  # Qwen2.5-VL's: the text names already
                # (Qwen3.5's MTP block `mtp.*`: the target's loader leaves it out, as a text checkpoint's)
                names[name] = renamed or name
            else:
                raise UnsupportedError(f"{self.source}: {self.wrapper} tensor {name} is neither the language model's nor a "
                                       f"vision / audio part ({', '.join(LEFT_OUT)}); not read")
        parts = sorted({n.removeprefix("model.").split(".", 1)[0] for n in dropped})
        note = f"text decoder only: {', '.join(parts) or 'no other part'} not exported ({len(dropped)} tensors)"
        if adapters:
            note += f"; {len(adapters)} LoRA adapter tensors (vision / speech) not applied"
        text = stored.without(dropped).renamed(names)
        if self.soft_tokens:  # Gemma 3n's image / audio tokens: their embedders' outputs, one table
            text = text.with_arrays({SOFT_TABLE: soft_token_table(stored, self.soft_tokens)})
            note += f"; {'/'.join(p[0] for p in self.soft_tokens)} token rows read as {SOFT_TABLE}"
        if self.wrapper == "qwen3_vl_moe":  # its fused experts, per expert as Qwen3-MoE's
            text = ChunkedExpertSource(text, int(self.config["hidden_size"]), int(self.config["moe_intermediate_size"]), self.source)
        return text, note

    def text_config(self, weights: WeightSource) -> dict[str, Any]:
        """The config.json keys of the text decoder, tied iff `weights` (the language model's) has no lm_head."""
        return {**self.config, "tie_word_embeddings": "lm_head.weight" not in weights}


def text_decoder(raw: dict[str, Any], source: str) -> TextDecoder | None:
    """The text decoder of a multimodal config.json (None: a text model's); UnsupportedError (one line, naming the
    key) for a wrapper or a text decoder that is not read."""
    kind = str(raw.get("model_type", "")).lower()
    if kind in REFUSED_WRAPPERS:
        raise UnsupportedError(f"{source}: model_type '{kind}': {REFUSED_WRAPPERS[kind]}")
    if "text_config" not in raw and (kind not in WRAPPERS or "vision_config" not in raw) and kind not in REMOTE_SAVES:
        return None
    if kind in REMOTE_SAVES:  # read as the wrapper transformers converts the save to
        raw, kind = {k: v for k, v in raw.items() if k not in _REMOTE_KEYS} | {"model_type": REMOTE_SAVES[kind]}, REMOTE_SAVES[kind]
    if kind not in WRAPPERS:
        text_type = (raw.get("text_config") or {}).get("model_type")
        raise UnsupportedError(f"{source}: model_type '{kind}' (a multimodal wrapper, text_config '{text_type}') is not "
                               f"supported (supported: {', '.join(sorted(WRAPPERS))})")
    text = {k: v for k, v in _transformers_text_config(kind, raw).items() if k not in _SUB_CONFIGS}
    text_type = str(text.get("model_type", "")).lower()
    allowed = WRAPPERS[kind]
    family_type = TEXT_TYPES.get(text_type, text_type)
    if (allowed is not None and text_type not in allowed) or family_name(family_type) is None:
        raise UnsupportedError(f"{source}: {kind} with text_config model_type '{text_type}' is not supported")
    if text.get("use_bidirectional_attention") in (True, "all"):
        raise UnsupportedError(f"{source}: {kind} with use_bidirectional_attention is not supported (a causal decoder only)")
    text.update({k: raw[k] for k in _TOP_LEVEL if k in raw}, model_type=family_type)
    if text_type in TEXT_TYPES:
        _plain_rope(text, source)
    if text_type == "qwen3_vl_moe_text":  # its router always renormalises the top k (no norm_topk_prob key)
        text["norm_topk_prob"] = True
    soft: tuple[Part, ...] = ()
    if kind == "gemma3n":  # its image / audio tokens' embedders (models/soft_tokens.py)
        soft = gemma3n_soft_tokens(transformers_config(dict(raw, model_type=kind)), text, source)
        text["soft_token_offset"] = soft[0][1]
    return TextDecoder(kind, text, source, soft)


def _transformers_text_config(kind: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's text config as transformers reads it (its class defaults filled in), or, where this transformers
    does not know the wrapper, `text_config` as stored (Qwen2.5-VL's older saves: the top level, less vision_config)."""
    config = transformers_config(dict(raw, model_type=kind))
    if config is not None:
        return dict(config.get_text_config().to_dict())
    stored = raw.get("text_config")
    return dict(stored) if stored else {k: v for k, v in raw.items() if k != "vision_config"}


def _plain_rope(text: dict[str, Any], source: str) -> None:
    """Qwen-VL's mrope read as the plain rope it is on text (mrope_section / mrope_interleaved dropped); a section
    list that does not cover the rotated half of a head is refused."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if not isinstance(rope, dict):
            continue
        section = rope.get("mrope_section")
        heads = int(text.get("num_attention_heads") or 1)
        head_dim = int(text.get("head_dim") or int(text.get("hidden_size") or 0) // heads)
        if section is not None and sum(section) != head_dim // 2:
            raise UnsupportedError(f"{source}: {key} mrope_section {section} does not cover head_dim {head_dim} / 2")
        rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "default"}
        text[key] = rope
