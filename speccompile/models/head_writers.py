"""A fresh drafter head for a target (training, tests), and writing a head in its kind's published layout
(config.json + model.safetensors that vLLM, SGLang, TensorRT-LLM and TensorRT Edge-LLM read)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import ModelConfig
from .decoder import eagle3_tap_layers
from .heads import HEAD_CLASSES, HeadConfig, TargetWeights, head_layer_config, target_embed, target_lm_head, target_tensor


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
    the layer's sizes at the top level, `draft_vocab_size`, `target_hidden_size` and the tap layers: at the top
    level and as `target_layer_ids` (TensorRT Edge-LLM) counted as layer inputs (vLLM, `eagle3_tap_layers`), under
    `eagle_config` counted as layer outputs (SGLang, TensorRT-LLM's ModelOpt heads: input id - 1)."""
    taps = list(cfg.aux_layer_ids)
    nested = {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps]} if min(taps) >= 1 else {}
    return {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": taps,
        "eagle_config": {**nested, "use_aux_hidden_state": True,
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
    layer = head_layer_config(raw, target)
    v = target.vocab_size
    cfg = HeadConfig(kind, layer, target.hidden_size, v, draft_vocab_size or v, fc_bias=fc_bias,
                     aux_layer_ids=list(eagle3_tap_layers(target.num_hidden_layers)) if kind == "eagle3" else [],
                     medusa_num_heads=medusa_num_heads if kind == "medusa" else 0, medusa_num_layers=medusa_num_layers)
    head = HEAD_CLASSES[kind](cfg)
    if target_weights is not None:
        with torch.no_grad():
            if hasattr(head, "embed_tokens"):
                head.embed_tokens.weight.copy_(target_embed(target_weights))
            if kind == "eagle":
                head.lm_head.weight.copy_(target_lm_head(target, target_weights))
            elif kind == "mtp":
                head.shared_head.head.weight.copy_(target_lm_head(target, target_weights))
                head.shared_head.norm.weight.copy_(target_tensor(target_weights, "model.norm.weight"))
            elif kind == "eagle3" and cfg.draft_vocab_size == v:
                head.lm_head.weight.copy_(target_lm_head(target, target_weights))
                head.norm.weight.copy_(target_tensor(target_weights, "model.norm.weight"))
            elif kind == "medusa":
                for sub in head.medusa_head:
                    sub[-1].weight.copy_(target_lm_head(target, target_weights))
                    for block in list(sub)[:-1]:
                        block.linear.weight.zero_()
                        block.linear.bias.zero_()
    return head.eval()
