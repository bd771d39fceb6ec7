"""Reading and writing DFlash drafters in their published layouts (models/dflash.py describes the drafter).

Two layouts are read, both a folder of config.json + *.safetensors:

* **z-lab** (``z-lab/*-DFlash*``, what vLLM's ``method: dflash`` and SGLang's ``DFLASH`` load): a flat Qwen3
  config (``architectures: [DFlashDraftModel]``) with ``block_size`` (top level, or in ``dflash_config`` in
  newer releases), ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``; the tap ids
  count *outputs* of target layers (z-lab reads ``hidden_states[id + 1]``). Weights ``layers.N.*``, ``fc``,
  ``hidden_norm``, ``norm``; embeddings and lm_head are the target's.
* **speculators** (``speculators_model_type: dflash``, vLLM's speculators library): a nested
  ``transformer_layer_config``, ``draft_vocab_size``, ``block_size``, ``aux_hidden_state_layer_ids`` (*inputs* of
  target layers), ``mask_token_id``, ``sample_from_anchor``; the same body plus its own ``lm_head`` [draft vocab,
  H], ``embed_tokens`` and ``d2t`` / ``t2d``. A DSpark checkpoint (``dspark``) is this drafter with
  ``sample_from_anchor``; its confidence head only sizes blocks and is not read; its vanilla Markov head
  (``markov_rank`` r > 0, ``markov_head_type: vanilla``: ``markov_head.markov_w1.weight`` [target vocab, r],
  ``markov_head.markov_w2.weight`` [draft vocab, r]; the bias W2 W1[previous token] added to each drafted
  position's logits) is read into ``DFlashDrafter.markov`` and applied by the runtime, token by token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, UnsupportedError
from .config import ModelConfig
from .dflash import DFlashConfig, DFlashDrafter, zlab_default_taps
from .head_loaders import _check_and_load, _read_checkpoint, _strip
from .heads import TargetWeights, head_layer_config, target_embed, target_lm_head

LAYOUTS = ("z-lab", "speculators")
_IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight", "t2d")  # training-only / derivable tensors


def load_dflash(path: str | Path, target: ModelConfig, target_weights: TargetWeights) -> DFlashDrafter:
    """Read a DFlash checkpoint (either layout) for `target`; eval mode, fp32."""
    raw, tensors, source, _ = _read_checkpoint(Path(path), "dflash")
    tensors = _strip(tensors, ("model.",))
    cfg = dflash_config(raw, tensors, source, target)
    drafter = DFlashDrafter(cfg)
    state = {k: v for k, v in tensors.items() if k not in _IGNORED and not k.startswith(("confidence_head.", "markov_head."))}
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = target_embed(target_weights)
    if "lm_head.weight" not in state:
        if cfg.draft_vocab_size != target.vocab_size:
            raise InputError(f"{source}: draft vocabulary {cfg.draft_vocab_size} != target {target.vocab_size} but no lm_head.weight")
        state["lm_head.weight"] = target_lm_head(target, target_weights)
    if "d2t" not in state:
        if cfg.draft_vocab_size != target.vocab_size:
            raise InputError(f"{source}: draft vocabulary {cfg.draft_vocab_size} != target {target.vocab_size} but no d2t mapping")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    mapped = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
    if int(mapped.min()) < 0 or int(mapped.max()) >= target.vocab_size:
        raise InputError(f"{source}: d2t maps draft ids outside the target vocabulary (0..{target.vocab_size - 1})")
    _check_and_load(drafter, state, "dflash", source)
    drafter.markov = _markov_head(raw, tensors, cfg, source)
    return drafter.eval()


def _markov_head(raw: dict[str, Any], tensors: dict[str, torch.Tensor], cfg: DFlashConfig, source: Path
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DSpark's vanilla Markov head (W1 [target vocab, r], W2 [draft vocab, r]), or None (markov_rank 0)."""
    rank = int(raw.get("markov_rank") or 0)
    if rank <= 0:
        return None
    want = {"markov_head.markov_w1.weight": (cfg.target_vocab_size, rank), "markov_head.markov_w2.weight": (cfg.draft_vocab_size, rank)}
    for name, shape in want.items():
        if name not in tensors:
            raise InputError(f"{source}: markov_rank {rank} but no {name}")
        if tuple(tensors[name].shape) != shape:
            raise InputError(f"{source}: {name} is {list(tensors[name].shape)}, expected {list(shape)}")
    return tuple(tensors[name].float() for name in want)  # type: ignore[return-value]


def dflash_config(raw: dict[str, Any], tensors: dict[str, torch.Tensor], source: Path, target: ModelConfig) -> DFlashConfig:
    """The drafter's config from either layout's config.json (and the weights' shapes)."""
    model_type = raw.get("speculators_model_type")
    if model_type is not None and model_type not in ("dflash", "dspark"):
        raise InputError(f"{source}: speculators_model_type {model_type!r} is not a DFlash drafter (expected dflash or dspark)")
    if "fc.weight" not in tensors:
        raise InputError(f"{source}: not a dflash checkpoint in the published layout (missing keys: fc.weight)")
    speculators = model_type is not None
    layer_raw = dict(raw.get("transformer_layer_config") or {}) if speculators else dict(raw)
    _refuse_unsupported(raw, layer_raw, source)
    rope = layer_raw.get("rope_parameters") or {}  # transformers 5 writes rope_theta / scaling here
    layer_raw.setdefault("rope_theta", rope.get("rope_theta"))
    if rope.get("rope_type", "default") != "default":
        layer_raw.setdefault("rope_scaling", rope)
    layers = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.split(".")[1].isdigit()), default=-1)
    if layers < 1:
        raise InputError(f"{source}: not a dflash checkpoint in the published layout (no layers.N.* tensors)")
    if int(layer_raw.get("num_hidden_layers", layers)) != layers:
        raise InputError(f"{source}: num_hidden_layers {layer_raw['num_hidden_layers']} but the weights hold {layers} layers")
    h, fc_in = tuple(tensors["fc.weight"].shape)
    layer_raw.setdefault("hidden_size", h)
    layer = head_layer_config(layer_raw, target, h)
    layer = ModelConfig.from_dict({**layer.to_dict(), "architecture": "qwen3", "qk_norm": True, "num_hidden_layers": layers,
                                   "attention_bias": bool(layer_raw.get("attention_bias", False))})
    taps = _taps(raw, speculators, source, target, layers)
    if fc_in != len(taps) * target.hidden_size:
        raise InputError(f"{source}: fc.weight is {[h, fc_in]}, expected [H, {len(taps)} taps x {target.hidden_size}] "
                         f"for target layers {taps}")
    if max(taps) > target.num_hidden_layers or min(taps) < 0:
        raise InputError(f"{source}: tap layers {taps} (inputs of those layers) outside the target's 0..{target.num_hidden_layers}")
    extra = raw.get("dflash_config") or {}
    block = raw.get("block_size") or extra.get("block_size")
    mask = extra.get("mask_token_id", raw.get("mask_token_id"))
    if block is None or int(block) < 2:
        raise InputError(f"{source}: config.json needs block_size >= 2 (top level or in dflash_config), got {block}")
    if mask is None or not 0 <= int(mask) < target.vocab_size:
        raise InputError(f"{source}: config.json needs a mask_token_id in 0..{target.vocab_size - 1} "
                         f"(dflash_config.mask_token_id or mask_token_id), got {mask}")
    draft_vocab = int(tuple(tensors["lm_head.weight"].shape)[0]) if "lm_head.weight" in tensors else target.vocab_size
    anchor = raw.get("sample_from_anchor", model_type == "dspark")
    return DFlashConfig(layer, target.hidden_size, target.vocab_size, draft_vocab, int(block), int(mask), taps,
                        sample_from_anchor=bool(anchor), has_embed="embed_tokens.weight" in tensors,
                        has_lm_head="lm_head.weight" in tensors, layout="speculators" if speculators else "z-lab")


def _refuse_unsupported(raw: dict[str, Any], layer_raw: dict[str, Any], source: Path) -> None:
    """One line naming the key this drafter does not implement."""
    head_type = str(raw.get("markov_head_type") or "vanilla")
    if int(raw.get("markov_rank") or 0) > 0 and head_type != "vanilla":
        raise UnsupportedError(f"{source}: DSpark markov_head_type {head_type} (its bias reads the drafter's hidden states); "
                               "only the vanilla Markov head is read")
    kinds = layer_raw.get("layer_types") or []
    if "sliding_attention" in kinds or layer_raw.get("use_sliding_window"):
        raise UnsupportedError(f"{source}: sliding-window draft layers (layer_types {kinds}) are not supported")


def _taps(raw: dict[str, Any], speculators: bool, source: Path, target: ModelConfig, layers: int) -> list[int]:
    """Tap layers in *input-of-layer* numbering (speculators' ids as they are, z-lab's + 1)."""
    if speculators:
        ids = raw.get("aux_hidden_state_layer_ids")
        if not ids:
            raise InputError(f"{source}: config.json has no aux_hidden_state_layer_ids")
        return [int(i) for i in ids]
    extra = raw.get("dflash_config") or {}
    ids = extra.get("target_layer_ids")
    if ids is None:
        ids = zlab_default_taps(int(raw.get("num_target_layers") or target.num_hidden_layers), layers)
    if int(raw.get("num_target_layers") or target.num_hidden_layers) != target.num_hidden_layers:
        raise InputError(f"{source}: drafter trained for a {raw['num_target_layers']}-layer target, this one has "
                         f"{target.num_hidden_layers} layers")
    return [int(i) + 1 for i in ids]


# ----------------------------------------------------------------------------------------------
# Writing (train-draft, tests)


def new_dflash(target: ModelConfig, target_weights: TargetWeights | None = None, *, block_size: int = 8,
               mask_token_id: int | None = None, tap_layers: list[int] | None = None, num_layers: int = 1,
               intermediate_size: int | None = None, sample_from_anchor: bool = False, seed: int = 0) -> DFlashDrafter:
    """A freshly initialised drafter for `target`; the target's embeddings, lm_head and final norm copied in."""
    from .config import eagle3_tap_layers

    torch.manual_seed(seed)
    raw = {"intermediate_size": intermediate_size} if intermediate_size else {}
    layer = head_layer_config(raw, target)
    layer = ModelConfig.from_dict({**layer.to_dict(), "architecture": "qwen3", "qk_norm": True, "num_hidden_layers": num_layers})
    taps = list(tap_layers or eagle3_tap_layers(target.num_hidden_layers))
    mask = target.vocab_size - 1 if mask_token_id is None else mask_token_id
    cfg = DFlashConfig(layer, target.hidden_size, target.vocab_size, target.vocab_size, block_size, mask, taps,
                       sample_from_anchor=sample_from_anchor)
    drafter = DFlashDrafter(cfg)
    if target_weights is not None:
        from .heads import target_tensor

        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target_embed(target_weights))
            drafter.lm_head.weight.copy_(target_lm_head(target, target_weights))
            drafter.norm.weight.copy_(target_tensor(target_weights, "model.norm.weight"))
    return drafter.eval()


def _layer_json(cfg: DFlashConfig) -> dict[str, Any]:
    c = cfg.layer
    return {"model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": cfg.target_vocab_size, "attention_bias": c.attention_bias, "hidden_act": "silu",
            "tie_word_embeddings": False}


def dflash_config_json(cfg: DFlashConfig, layout: str, num_target_layers: int) -> dict[str, Any]:
    """config.json of `cfg` in `layout` (z-lab: what vLLM / SGLang load; speculators: its library's)."""
    if layout == "z-lab":
        return {**_layer_json(cfg), "architectures": ["DFlashDraftModel"], "block_size": cfg.block_size,
                "num_target_layers": num_target_layers,
                "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": [t - 1 for t in cfg.tap_layers]}}
    return {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
            "transformer_layer_config": {**_layer_json(cfg), "architectures": ["Qwen3ForCausalLM"]},
            "draft_vocab_size": cfg.draft_vocab_size, "block_size": cfg.block_size,
            "target_hidden_size": cfg.target_hidden_size, "aux_hidden_state_layer_ids": list(cfg.tap_layers),
            "mask_token_id": cfg.mask_token_id, "sample_from_anchor": cfg.sample_from_anchor}


def save_dflash(drafter: DFlashDrafter, out: str | Path, num_target_layers: int, layout: str = "z-lab",
                extra_config: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors in `layout` (the z-lab one leaves out what the target holds)."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout}", "layout")
    cfg = drafter.head_config
    if layout == "z-lab" and (cfg.draft_vocab_size != cfg.target_vocab_size or cfg.sample_from_anchor):
        raise InputError("layout z-lab: a draft vocabulary or sample_from_anchor needs the speculators layout", "layout")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in drafter.state_dict().items()}
    if layout == "z-lab":
        for name in ("embed_tokens.weight", "lm_head.weight", "d2t"):
            state.pop(name)
    elif cfg.draft_vocab_size == cfg.target_vocab_size:
        state.pop("d2t")
    save_file(state, str(out / "model.safetensors"))
    config = dflash_config_json(cfg, layout, num_target_layers)
    config.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
