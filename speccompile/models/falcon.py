"""Falcon (7B / 40B / 180B, transformers' `falcon`): where its config and checkpoint differ from the table's reading.

A Falcon layer runs attention and a plain MLP on the same input and adds both to the residual (`parallel_attn`), with
one LayerNorm for both (`input_layernorm`: Falcon-7B) or one each (`ln_attn` / `ln_mlp`: `new_decoder_architecture`,
Falcon-40B / 180B), or, without `parallel_attn`, one after the other (pre norms). Its fused `query_key_value` holds,
per KV group, the group's queries then its key and its value (`models/hf_layouts.py` shows it q | k | v): one group
under `multi_query` (7B), `num_kv_heads` groups in the new architecture, a group per head otherwise. ALiBi Falcons
(Falcon-RW) are refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import UnsupportedError
from .weights import WeightSource

_NORMS = {"ln_attn.": "input_layernorm.", "ln_mlp.": "post_attention_layernorm."}


def falcon_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json's keys as the table reads them: the MLP width (`ffn_hidden_size`, 4 x hidden by default), the KV heads (transformers' attention: `num_kv_heads` groups in
    the new architecture or without `multi_query`, else one), the placement (pre | parallel | parallel2: one norm or
    two); ALiBi and a new-architecture layer that is not parallel refused."""
    if data.get("alibi"):
        raise UnsupportedError(f"{source}: falcon with alibi is not supported (ALiBi position biases are not built)")
    new, parallel = bool(data.get("new_decoder_architecture")), bool(data.get("parallel_attn", True))
    norms = int(data.get("num_ln_in_parallel_attn") or (2 if new else 1))
    if new and not parallel and norms == 1:
        raise UnsupportedError(f"{source}: falcon with new_decoder_architecture, parallel_attn false and one norm is not supported")
    placement = "parallel2" if new and norms == 2 else "parallel" if parallel or new else "pre"
    heads = int(data["num_attention_heads"])
    kv = int(data.get("num_kv_heads") or heads) if new or not data.get("multi_query", True) else 1
    inner = int(data.get("ffn_hidden_size") or 4 * int(data["hidden_size"]))
    return {**data, "_placement": placement, "num_key_value_heads": kv, "intermediate_size": inner}


def falcon_view(source: WeightSource) -> WeightSource:
    """Falcon's `ln_attn` / `ln_mlp` under the names of the table's two norms of the same input."""
    return source.renamed({n: _renamed(n) for n in source.names() if _renamed(n) != n})


def _renamed(name: str) -> str:
    """A layer tensor's name with `ln_attn.` / `ln_mlp.` as the table's norms (any other name as it is)."""
    if not name.startswith("model.layers."):
        return name
    layer, rest = name[len("model.layers."):].split(".", 1)
    for old, new in _NORMS.items():
        if rest.startswith(old):
            return f"model.layers.{layer}.{new}{rest[len(old):]}"
    return name


def falcon_gguf_keys(data: dict[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json keys llama.cpp's `falcon` GGUF implies: its qkv already q | k | v (the converter regrouped
    it), two norms (`attn_norm_2`) iff the new architecture, one KV head iff multi-query; always parallel (llama.cpp's
    graph)."""
    kv = int(data["num_key_value_heads"])
    return {"new_decoder_architecture": "blk.0.attn_norm_2.weight" in tensors, "num_kv_heads": kv, "multi_query": kv == 1,
            "parallel_attn": True, "ffn_hidden_size": data["intermediate_size"]}


def falcon_gguf_names(block_names: dict[str, str], placement: str) -> dict[str, str]:
    """llama.cpp's block names for a Falcon file: with two norms (parallel2) its `attn_norm` is `ln_mlp` and its
    `attn_norm_2` `ln_attn` (gguf-py's mapping; its graph feeds attention from attn_norm_2), else `attn_norm` is the one."""
    if placement != "parallel2":
        return block_names
    return {**block_names, "attn_norm": "post_attention_layernorm", "attn_norm_2": "input_layernorm"}
