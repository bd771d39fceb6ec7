"""Reading drafter heads from their published checkpoint layouts (models/heads.py describes each kind).

A checkpoint is a folder (config.json + *.safetensors; Medusa's legacy medusa_lm_head.pt through
``torch.load(weights_only=True)``) or one weights file. Its keys are mapped onto the head's module names, shapes
are checked against its config and the target, and the weights it shares with the target (embeddings, lm_head)
are taken from the target.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..draft_config import HEAD_KINDS
from ..errors import InputError, UnsupportedError, with_article
from .config import ModelConfig
from .decoder import describe_key_mismatch, eagle3_tap_layers
from .heads import (Eagle3Head, EagleHead, HeadConfig, MedusaHeads, MTPHead, TargetWeights, head_layer_config,
                    target_embed, target_lm_head)


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
    cfg = HeadConfig("eagle", head_layer_config(raw, target, out_h), target.hidden_size, target.vocab_size, target.vocab_size,
                     fc_bias=bias, has_embed="embed_tokens.weight" in tensors)
    head = EagleHead(cfg)
    state = dict(tensors)
    state.setdefault("embed_tokens.weight", target_embed(target_weights))
    state["lm_head.weight"] = target_lm_head(target, target_weights)
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
    cfg = HeadConfig("eagle3", head_layer_config(layer_raw, target, h), t_hidden, target.vocab_size, draft_vocab,
                     fc_bias=False, norm_before_residual=bool(raw.get("norm_before_residual", False)),
                     aux_layer_ids=ids, has_embed="embed_tokens.weight" in tensors)
    head = Eagle3Head(cfg)
    state = dict(tensors)
    if "embed_tokens.weight" not in state:
        if h != target.hidden_size:
            raise InputError(f"{source}: eagle3 head of width {h} needs its own embed_tokens.weight")
        state["embed_tokens.weight"] = target_embed(target_weights)
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
    cfg = HeadConfig("mtp", head_layer_config(raw, target, h), target.hidden_size, target.vocab_size, target.vocab_size,
                     has_embed="embed_tokens.weight" in renamed)
    head = MTPHead(cfg)
    renamed.setdefault("embed_tokens.weight", target_embed(target_weights))
    renamed.setdefault("shared_head.head.weight", target_lm_head(target, target_weights))
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
    cfg = HeadConfig("medusa", head_layer_config({}, target), target.hidden_size, target.vocab_size, target.vocab_size,
                     medusa_num_heads=num_heads, medusa_num_layers=int(num_layers))
    module = MedusaHeads(cfg)
    # nn.Sequential names the projection `medusa_head.{i}.{L}.weight`, exactly the published layout
    _check_and_load(module, tensors, "medusa", source)
    return module.eval()


def _read_checkpoint(path: Path, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """(config.json contents or {}, tensors, source) from a folder or a single weights file."""
    from .load import read_safetensors

    path = Path(path)
    if not path.exists():
        raise InputError(f"drafter {kind}:{path}: no such file or directory", "drafter")
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
                f"drafter {kind}:{path}: no *.safetensors weights"
                + (" (or legacy medusa_lm_head.pt)" if kind == "medusa" else "")
                + "; pickled .bin checkpoints are not loaded for safety", "drafter"
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
        raise InputError(f"{source}: not {with_article(kind)} checkpoint in the published layout ({describe_key_mismatch(missing, unexpected)})")
    bad = [f"{k} {tuple(v.shape)} (expected {tuple(expected[k].shape)})" for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        raise InputError(f"{source}: {kind} checkpoint shapes do not match its config: {', '.join(bad[:4])}")
    dtype = next((v.dtype for k, v in expected.items() if v.is_floating_point()), torch.float32)
    module.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v.to(expected[k].dtype)) for k, v in state.items()}, strict=False)


def _shape(tensors, key, kind, source):
    if key not in tensors:
        raise InputError(f"{source}: not {with_article(kind)} checkpoint in the published layout (missing keys: {key})")
    return tuple(tensors[key].shape)

