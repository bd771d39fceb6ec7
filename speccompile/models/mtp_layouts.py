"""Multi-token prediction (MTP) modules in the layouts models ship them, read into `heads.MTPHead`'s names.

* **deepseek** (DeepSeek-V3, GLM-4.5): ``model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,
  embed_tokens}`` + one decoder block (``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``),
  ``num_nextn_predict_layers`` modules after the target's L layers;
* **qwen3_next** (Qwen3-Next, Qwen3.5): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.layers.{i}.*``, ``mtp.norm``; its norms are zero-centred (the stored weight is gain - 1), as in those models;
* **mimo** (MiMo): ``model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`` + the block,
  the hidden state first in the concatenation, the embedding of position 0 zeroed;
* **speculators** (``speculators_model_type: mtp``, the layer config under ``transformer_layer_config``): MiMo's
  names under ``mtp_layers.{i}``, the embedding first, fed back normed.

A checkpoint may hold several modules, chained as in DeepSeek-V3's training: module i reads module i-1's output
feature (module 0: the target's) and the embedding of the token one further ahead; all are read (shared tensors,
e.g. Qwen3-Next's `mtp.fc` / `mtp.norm`, go to every module) and each is exported as its own graph.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from .config import ModelConfig

if TYPE_CHECKING:
    import torch

_BLOCK = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
_QWEN3_NEXT = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
               "norm.": "shared_head.norm."}
_MIMO = {"token_layernorm.": "enorm.", "hidden_layernorm.": "hnorm.", "input_proj.": "eh_proj.",
         "final_layernorm.": "shared_head.norm."}
_PATTERNS = {
    "qwen3_next": re.compile(r"(?:model\.)?mtp\.(?:layers\.(\d+)\.)?(.*)"),
    "mimo": re.compile(r"(?:model\.)?mtp_layers\.(\d+)\.(.*)"),
    "deepseek": re.compile(r"(?:model\.)?layers\.(\d+)\.(.*)"),
}


def is_mtp_weight(name: str, num_layers: int) -> bool:
    """A tensor of an MTP module inside a target checkpoint of `num_layers` decoder layers."""
    m = _PATTERNS["deepseek"].fullmatch(name)
    if m:
        return int(m.group(1)) >= num_layers
    return bool(_PATTERNS["qwen3_next"].fullmatch(name) or _PATTERNS["mimo"].fullmatch(name))


def mtp_weights(names: list[str], num_layers: int, raw: dict[str, Any]) -> set[str]:
    """The MTP tensors of a target checkpoint (DeepSeek-style layers past the L decoder layers count only when
    the config declares `num_nextn_predict_layers`)."""
    declared = bool(raw.get("num_nextn_predict_layers"))
    return {n for n in names if is_mtp_weight(n, num_layers) and (declared or not _PATTERNS["deepseek"].fullmatch(n))}


def mtp_style(tensors: dict[str, torch.Tensor]) -> str:
    """Which naming the MTP tensors use."""
    if any(k.startswith(("mtp.", "model.mtp.")) for k in tensors):
        return "qwen3_next"
    if any(_PATTERNS["mimo"].fullmatch(k) for k in tensors):
        return "mimo"
    return "deepseek"


def read_mtp(raw: dict[str, Any], tensors: dict[str, torch.Tensor], source: Any, target: ModelConfig
             ) -> tuple[str, list[dict[str, torch.Tensor]]]:
    """(style, every module's tensors in MTPHead's names, in module order) of an MTP checkpoint."""
    style = "speculators" if raw.get("speculators_model_type") == "mtp" else mtp_style(tensors)
    modules: dict[int, dict[str, torch.Tensor]] = {}
    shared: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key in ("verifier_lm_head.weight", "verifier_norm.weight"):  # the target's (speculators keeps a copy)
            continue
        m = _PATTERNS["mimo" if style == "speculators" else style].fullmatch(key)
        if not m:  # not an MTP name: left as is, named among the unexpected keys by the loader
            shared[key] = value
            continue
        index, rest = m.group(1), m.group(2)
        if index is None:  # qwen3_next: mtp.fc / mtp.norm / ... belong to every module
            shared[_renamed(rest, style)] = value
        else:
            modules.setdefault(int(index), {})[_renamed(rest, style)] = value
    if not modules:
        raise InputError(f"{source}: no MTP module weights (expected model.layers.N.*, mtp.layers.N.* or model.mtp_layers.N.*)")
    declared = raw.get("num_nextn_predict_layers")
    if declared is not None and int(declared) != len(modules):
        raise InputError(f"{source}: num_nextn_predict_layers is {declared} but the weights hold {len(modules)} MTP modules")
    if sorted(modules) != list(range(min(modules), min(modules) + len(modules))):
        raise InputError(f"{source}: MTP module indices {sorted(modules)} are not consecutive")
    out = []
    for index in sorted(modules):
        one = {**shared, **modules[index]}
        if style == "qwen3_next":  # zero-centred RMSNorm gains
            one = {k: (v + 1 if k.endswith("norm.weight") else v) for k, v in one.items()}
        out.append(one)
    return style, out


def _renamed(key: str, style: str) -> str:
    table = _QWEN3_NEXT if style == "qwen3_next" else _MIMO if style in ("mimo", "speculators") else {}
    if style == "mimo" and key.startswith("mtp_block."):
        key = key[len("mtp_block."):]
    for old, new in table.items():
        if key.startswith(old):
            return new + key[len(old):]
    return "block." + key if key.startswith(_BLOCK) else key


def is_target_layer(style: str, target: ModelConfig) -> bool:
    """Whether a module's block is the target's own decoder layer: DeepSeek-style MTP on a multi-head latent
    attention or MoE target (DeepSeek-V3, GLM-4.5: layer L is one more of the target's MoE layers), and Qwen3-Next /
    Qwen3.5's on their hybrid targets (one more gated full-attention layer, with the target's MoE when it has one)."""
    if style == "qwen3_next":
        return target.hybrid is not None
    return style == "deepseek" and (target.mla or target.moe is not None)


def mtp_layer_config(target: ModelConfig) -> ModelConfig:
    """The one-layer config of an MTP block that is the target's own layer (`is_target_layer`): its attention
    (latent, one cached latent head, on DeepSeek-V3; GLM-4.5's partial rope, q/k norms and biases; a hybrid's
    gated full attention, never a recurrent layer) and its MoE MLP when the target has one, as layer L of those
    models. A hybrid's zero-centred gains arrive as gains (`read_mtp` adds the 1), so its norms take them plain."""
    moe = dataclasses.replace(target.moe, dense_layers=()) if target.moe is not None else None
    if target.hybrid is not None:
        return dataclasses.replace(target, num_hidden_layers=1, moe=moe, hybrid=None, norm_offset=0.0)
    return dataclasses.replace(target, num_hidden_layers=1, moe=moe)
