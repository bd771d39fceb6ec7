"""EAGLE-3 heads in every published layout, read into `heads.Eagle3Head` (docs/DESIGN.md, "Drafter checkpoint
formats").

* **speculators** (vLLM's library and the checkpoints it converts): ``speculators_model_type: eagle3``, the layer
  config nested under ``transformer_layer_config`` (Llama or Qwen3, with q/k norms), ``layers.{i}.*`` (layer 0 the
  Eagle-3 first layer, the others plain decoder layers), flags ``norm_before_residual``, ``norm_before_fc``
  (``input_norm``), ``fc_norm`` (``fc_norm.{i}``), ``norm_output``, ``embed_requires_grad``; taps
  ``eagle_aux_hidden_state_layer_ids`` counted as layer *inputs* (vLLM's convention; id L is the final
  pre-norm hidden state).
* **flat** (``LlamaForCausalLMEagle3``: the EAGLE authors' releases, SGLang SpecForge, TensorRT-LLM ModelOpt):
  the layer's sizes at the top level, ``midlayer.*``. Taps at the top level count inputs (vLLM); taps under
  ``eagle_config`` count layer *outputs* (SGLang adds one), so input id = output id + 1.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import InputError, UnsupportedError
from .config import ModelConfig, eagle3_tap_layers
from .heads import HeadConfig, head_layer_config

LAYER_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# speculators config keys that change nothing at inference (training, provenance, serialisation)
_INERT = {"speculators_model_type", "architectures", "auto_map", "draft_vocab_size", "dtype", "torch_dtype",
          "eagle_aux_hidden_state_layer_ids", "embed_requires_grad", "speculators_config", "speculators_version",
          "target_hidden_size", "tie_word_embeddings", "transformer_layer_config", "transformers_version",
          "has_no_defaults_at_init", "model_type", *FLAGS}
_DROPPED = ("verifier_lm_head.weight", "verifier_norm.weight")  # the target's, kept by some trainers


def eagle3_layout(raw: dict[str, Any], weights_format: str = "safetensors") -> str:
    """Which layout a config is written in, as `inspect` names it."""
    if "speculators_model_type" in raw:
        return "speculators"
    if weights_format != "safetensors":
        return "flat (EAGLE authors' pytorch_model.bin)"
    if _nested_ids(raw) is not None and raw.get("eagle_aux_hidden_state_layer_ids") is None:
        return "flat (taps as layer outputs: SGLang SpecForge, ModelOpt)"
    return "flat"


def eagle3_taps(raw: dict[str, Any], num_layers: int, source: Any) -> list[int]:
    """The target taps a head's config asks for, as sorted *input* ids (0 = embeddings, L = final pre-norm)."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = _nested_ids(raw)
    if top is not None and nested is not None and [int(i) for i in top] != [int(i) + 1 for i in nested]:
        raise InputError(f"{source}: eagle_aux_hidden_state_layer_ids {list(top)} (layer inputs, vLLM) and "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (layer outputs, SGLang) disagree")
    if top is not None:
        ids, key = [int(i) for i in top], "eagle_aux_hidden_state_layer_ids"
    elif nested is not None:
        ids, key = [int(i) + 1 for i in nested], "eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        return list(eagle3_tap_layers(num_layers))
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
        raise InputError(f"{source}: {key} {ids if key.startswith('eagle_aux') else nested} must be distinct layers "
                         f"of the {num_layers}-layer target")
    return sorted(ids)


def _nested_ids(raw: dict[str, Any]) -> list[int] | None:
    nested = raw.get("eagle_config")
    return nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None


def read_eagle3(raw: dict[str, Any], tensors: dict[str, torch.Tensor], source: Any, target: ModelConfig,
                weights_format: str) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """(head config, state dict in Eagle3Head's names) of an EAGLE-3 checkpoint in any published layout."""
    layout = eagle3_layout(raw, weights_format)
    layer_raw = check_eagle3_config(raw, source)
    state = _rename(tensors)
    h, width = _shape(state, "fc.weight", source)
    taps = eagle3_taps(raw, target.num_hidden_layers, source)
    if width != len(taps) * target.hidden_size:
        raise InputError(f"{source}: eagle3 fc.weight is {[h, width]}, expected [H, {len(taps)} taps x target hidden "
                         f"size {target.hidden_size}] for taps {taps}")
    num_layers = 1 + len({m.group(1) for k in state if (m := re.match(r"layers\.(\d+)\.", k))})
    declared = layer_raw.get("num_hidden_layers") if layout == "speculators" else None
    if declared is not None and int(declared) != num_layers:
        raise InputError(f"{source}: transformer_layer_config.num_hidden_layers is {declared} but the weights hold "
                         f"{num_layers} draft layers")
    layer_raw.setdefault("hidden_size", h)
    draft_vocab = _shape(state, "lm_head.weight", source)[0]
    cfg = HeadConfig("eagle3", head_layer_config(layer_raw, target, h), target.hidden_size, target.vocab_size,
                     draft_vocab, fc_bias=False, aux_layer_ids=taps, has_embed="embed_tokens.weight" in state,
                     num_layers=num_layers, layout=f"eagle3/{layout}",
                     **{flag: bool(raw.get(flag, False)) for flag in FLAGS})
    return cfg, state


def _rename(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published names -> Eagle3Head's: `layers.0.` is the first layer (`midlayer.`), `layers.i` the (i-1)-th plain one."""
    out = {}
    for key, value in tensors.items():
        key = key[len("model."):] if key.startswith("model.") else key
        if key in _DROPPED:
            continue
        m = re.match(r"layers\.(\d+)\.(.*)", key)
        if m:
            i = int(m.group(1))
            key = f"midlayer.{m.group(2)}" if i == 0 else f"layers.{i - 1}.{m.group(2)}"
        out[key] = value
    return out


def check_eagle3_config(raw: dict[str, Any], source: Any) -> dict[str, Any]:
    """The config's draft-layer settings, after checking every key and flag is one this loader understands."""
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise InputError(f"{source}: norm_before_fc and fc_norm are both set (they exclude each other)")
    prefix = ""
    if "speculators_model_type" in raw:
        _check_speculators_config(raw, source)
        raw, prefix = dict(raw.get("transformer_layer_config") or {}), "transformer_layer_config."
    _check_layer_config(raw, source, prefix)
    return dict(raw)


def _check_speculators_config(raw: dict[str, Any], source: Any) -> None:
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise UnsupportedError(f"{source}: speculators_model_type {kind!r} is not an EAGLE-3 head (expected 'eagle3')")
    unknown = [k for k, v in raw.items() if k not in _INERT and v not in (None, False, 0, "", [], {})]
    if unknown:
        raise UnsupportedError(f"{source}: speculators eagle3 config key {unknown[0]!r} is not understood "
                               f"(known flags: {', '.join(FLAGS)})")


def _check_layer_config(layer: dict[str, Any], source: Any, prefix: str) -> None:
    layer_type = str(layer.get("model_type") or "llama")
    if layer_type not in LAYER_TYPES:
        raise UnsupportedError(f"{source}: {prefix}model_type {layer_type!r} (draft layers supported: {', '.join(LAYER_TYPES)})")
    if layer.get("mlp_bias"):
        raise UnsupportedError(f"{source}: {prefix}mlp_bias true is not supported")
    if layer.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(f"{source}: {prefix}hidden_act {layer['hidden_act']!r} is not supported (silu only)")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise UnsupportedError(f"{source}: {prefix}layer_types has sliding_attention layers (full attention only)")


def _shape(tensors: dict[str, torch.Tensor], key: str, source: Any) -> tuple[int, ...]:
    if key not in tensors:
        raise InputError(f"{source}: not a eagle3 checkpoint in a published layout (missing keys: {key})")
    return tuple(tensors[key].shape)
