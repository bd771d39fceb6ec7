"""Reading drafter heads from their published checkpoint layouts (models/heads.py describes each kind).

A checkpoint is a folder (config.json + *.safetensors, one file or shards; else pickled weights such as the EAGLE
authors' pytorch_model.bin or Medusa's medusa_lm_head.pt, read with ``torch.load(weights_only=True)`` only), one
weights file, or for MTP the target's own folder or GGUF file (llama.cpp's `blk.L.nextn.*` blocks). Its keys are mapped onto the head's module names (the EAGLE-3
and MTP layouts: eagle3_layouts.py, mtp_layouts.py), shapes are checked against its config and the target, and
the weights it shares with the target (embeddings, lm_head) are taken from the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..draft_config import HEAD_KINDS
from ..errors import InputError, with_article
from .config import ModelConfig
from .decoder import describe_key_mismatch
from .eagle3_layouts import read_eagle3
from .heads import (Eagle3Head, EagleHead, HeadConfig, MedusaHeads, MTPHead, TargetWeights, head_layer_config,
                    target_embed, target_lm_head)
from .mtp_layouts import is_mtp_weight, is_target_layer, mtp_layer_config, read_mtp


def load_head(kind: str, path: str | Path | None, target: ModelConfig, target_weights: TargetWeights,
              target_folder: Path | None = None) -> nn.Module:
    """Read a drafter checkpoint of `kind` for `target` and return the torch head (eval mode, fp32). An MTP head
    with no path is read from the target's own checkpoint `target_folder`, a folder or GGUF file (its MTP tensors only)."""
    if kind not in HEAD_KINDS:
        raise InputError(f"unknown head kind {kind!r} (expected one of {', '.join(HEAD_KINDS)})")
    if path is None:
        if kind != "mtp" or target_folder is None:
            raise InputError(f"drafter {kind} needs a path: {kind}:PATH", "drafter")
        raw, tensors, source, weights_format = _read_target_mtp(Path(target_folder), target)
    else:
        raw, tensors, source, weights_format = _read_checkpoint(Path(path), kind)
    if kind == "medusa":
        return _load_medusa(raw, tensors, source, target)
    if kind == "eagle":
        return _load_eagle(raw, tensors, source, target, target_weights)
    if kind == "eagle3":
        return _load_eagle3(raw, tensors, source, target, target_weights, weights_format)
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


def _load_eagle3(raw, tensors, source, target, target_weights, weights_format) -> Eagle3Head:
    cfg, state = read_eagle3(raw, tensors, source, target, weights_format)
    head = Eagle3Head(cfg)
    h, draft_vocab = cfg.layer.hidden_size, cfg.draft_vocab_size
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
    """Module 0 as the head; with several modules, the others (modules 1..N-1, chained) in its `chain` list."""
    style, modules = read_mtp(raw, tensors, source, target)
    heads = [_mtp_module(raw, renamed, style, len(modules), source, target, target_weights) for renamed in modules]
    heads[0].chain = heads[1:]
    return heads[0]


def _mtp_module(raw, renamed, style, count, source, target, target_weights) -> MTPHead:
    h = _shape(renamed, "eh_proj.weight", "mtp", source)[0]
    if h != target.hidden_size:
        raise InputError(f"{source}: mtp hidden size {h} differs from the target's {target.hidden_size}")
    layer_raw = raw.get("transformer_layer_config") or raw
    layer = mtp_layer_config(target) if is_target_layer(style, target) else head_layer_config(layer_raw, target, h)
    cfg = HeadConfig("mtp", layer, target.hidden_size, target.vocab_size, target.vocab_size,
                     has_embed="embed_tokens.weight" in renamed, mtp_style=style, mtp_modules=count,
                     layout=f"mtp/{style}")
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


TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def _read_checkpoint(path: Path, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path, str]:
    """(config.json contents or {}, tensors, source, "safetensors" | "torch") from a folder or one weights file.
    A folder's *.safetensors (one file or shards) are preferred; else its pickled torch files (the EAGLE
    authors' pytorch_model.bin, Medusa's medusa_lm_head.pt), read with torch.load(weights_only=True) only."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"drafter {kind}:{path}: no such file or directory", "drafter")
    folder = path if path.is_dir() else path.parent
    config = _read_config(folder)
    if path.is_file():
        files = [path]
    else:
        files = sorted(folder.glob("*.safetensors")) or sorted(f for f in folder.iterdir() if f.suffix in TORCH_SUFFIXES)
        if not files:
            raise InputError(f"drafter {kind}:{path}: no *.safetensors or pytorch_model.bin / *.pt weights", "drafter")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from .load import read_safetensors

            tensors.update(read_safetensors(file))
        elif file.suffix in TORCH_SUFFIXES:
            tensors.update(_torch_state_dict(file))
        else:
            raise InputError(f"{file}: expected a .safetensors, .bin or .pt weights file")
    weights_format = "safetensors" if all(f.suffix == ".safetensors" for f in files) else "torch"
    return config, tensors, folder, weights_format


def _read_config(folder: Path) -> dict[str, Any]:
    if not (folder / "config.json").is_file():
        return {}
    try:
        return json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{folder / 'config.json'}: not valid JSON ({exc})") from None


def _torch_state_dict(file: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict read with weights_only=True: tensors only, never code."""
    try:
        data = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors vary
        raise InputError(f"{file}: not a readable weights-only torch file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise InputError(f"{file}: expected a state dict of tensors, got {type(data).__name__}")
    return dict(data)


def _read_target_mtp(folder: Path, target: ModelConfig) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path, str]:
    """The MTP tensors inside a target's own checkpoint, a folder or a GGUF file (the others are never read)."""
    from .load import gguf_mtp_weights
    from .weights import SafetensorsSource, WeightSource

    source: WeightSource | None = None
    raw: dict[str, Any] = {}
    if folder.is_file() and folder.suffix.lower() == ".gguf":  # llama.cpp's nextn blocks (load.gguf_mtp_weights)
        raw, source = gguf_mtp_weights(folder)
    elif folder.is_dir() and sorted(folder.glob("*.safetensors")):
        raw, source = _read_config(folder), SafetensorsSource(sorted(folder.glob("*.safetensors")))
    names = [n for n in source.names() if is_mtp_weight(n, target.num_hidden_layers)] if source else []
    if not names:
        raise InputError(f"drafter mtp: the target {folder} carries no MTP weights (model.layers.N.* past its "
                         f"{target.num_hidden_layers} layers, blk.N.nextn.* in a GGUF, mtp.* or model.mtp_layers.*); "
                         "give one as mtp:PATH", "drafter")
    return raw, {n: source.torch_tensor(n) for n in names}, folder, "safetensors"


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

