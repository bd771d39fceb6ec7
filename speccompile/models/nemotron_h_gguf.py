"""llama.cpp's `nemotron_h` / `nemotron_h_moe` GGUF (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano) as the config.json
keys models/nemotron_h.py reads: the block pattern, the Mamba-2 sizes and the MoE keys.

llama.cpp's converter keeps one block a `blk.N` (`attn_norm` its norm): attention where `attention.head_count_kv` has
a nonzero entry, Mamba-2 where the block has `ssm_in` (A as -exp(A_log), D, the gated norm's gain and the conv kernel
reshaped as Granite 4.0-H's: models/mamba2_gguf.py), a MoE where it has a router (`ffn_gate_inp`), a plain MLP where
it has `ffn_up` (a MoE file writes a dense MLP block's feed_forward_length 0: its width is read from `ffn_up`). q / k
rows are in llama.cpp's order (`Family.gguf_llama_order`). The tensors are named as transformers' blocks
(`model.layers.N.norm` / `mixer.*`, an MLP or MoE block's under `mlp.*`) and grouped by models/nemotron_h.py
`blocks_view`. Refused in one line: an MTP block (`nextn_predict_layers`; the converter's --no-mtp leaves it out),
MLP blocks of different widths, a block of none of the four kinds.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from .linear_config import gguf_kv_heads


def _block_kinds(meta: dict[str, Any], p: str, tensors: dict[str, tuple[int, ...]], source: str) -> list[str]:
    """Each block's kind in transformers' `layers_block_type` words, from head_count_kv and the block's tensors."""
    kinds = []
    for b, kv in enumerate(gguf_kv_heads(meta, p)):
        kind = ("full_attention" if kv else "linear_attention" if f"blk.{b}.ssm_in.weight" in tensors
                else "moe" if f"blk.{b}.ffn_gate_inp.weight" in tensors else "mlp" if f"blk.{b}.ffn_up.weight" in tensors else "")
        if not kind:
            raise UnsupportedError(f"{source}: block {b} has neither {p}attention.head_count_kv nor blk.{b}.ssm_in / ffn_gate_inp / "
                                   "ffn_up (not a Nemotron-H block)")
        kinds.append(kind)
    return kinds


def _moe_keys(meta: dict[str, Any], p: str) -> dict[str, Any]:
    """Nemotron-H's MoE config keys (models/moe_config.py `_nemotron_h_moe`) from llama.cpp's `expert_*` metadata."""
    return {"n_routed_experts": int(meta[p + "expert_count"]), "num_experts_per_tok": int(meta[p + "expert_used_count"]),
            "moe_intermediate_size": int(meta[p + "expert_feed_forward_length"]),
            "moe_shared_expert_intermediate_size": int(meta[p + "expert_shared_feed_forward_length"]),
            "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", False)),
            "routed_scaling_factor": float(meta.get(p + "expert_weights_scale") or 1.0),
            "n_group": int(meta.get(p + "expert_group_count") or 1), "topk_group": int(meta.get(p + "expert_group_used_count") or 1)}


def nemotron_h_gguf_keys(meta: dict[str, Any], p: str, tensors: dict[str, tuple[int, ...]],
                         source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the metadata with one `feed_forward_length`: the MLP blocks' width, the config.json keys of nemotron_h) of a
    nemotron_h / nemotron_h_moe GGUF, or of a `mamba2` one (its blocks all Mamba-2: no attention head, no KV heads);
    `tensors`: its tensor names with their shapes (numpy's order)."""
    if meta.get("general.architecture") == "mamba2":  # Mamba2ForCausalLM: attention.head_count 0, no head_count_kv
        meta = {**meta, p + "attention.head_count": 1, p + "attention.head_count_kv": [0] * int(meta[p + "block_count"])}
    nextn = int(meta.get(p + "nextn_predict_layers") or 0)
    if nextn:
        raise UnsupportedError(f"{source}: {p}nextn_predict_layers {nextn} (Nemotron-H's MTP block) is not supported "
                               "(llama.cpp's converter leaves it out with --no-mtp)")
    kinds = _block_kinds(meta, p, tensors, source)
    widths = sorted({tensors[f"blk.{b}.ffn_up.weight"][0] for b, kind in enumerate(kinds) if kind == "mlp"})
    if len(widths) > 1:
        raise UnsupportedError(f"{source}: MLP blocks of widths {widths} (blk.N.ffn_up) are not supported (one intermediate_size)")
    ffn = meta.get(p + "feed_forward_length") or 0
    inner, heads = int(meta[p + "ssm.inner_size"]), int(meta[p + "ssm.time_step_rank"])
    data = {"layers_block_type": kinds, "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
            "n_groups": int(meta[p + "ssm.group_count"]), "ssm_state_size": int(meta[p + "ssm.state_size"]),
            "conv_kernel": int(meta[p + "ssm.conv_kernel"]), "use_conv_bias": any(n.endswith("ssm_conv1d.bias") for n in tensors),
            "use_bias": any(n.endswith(("ssm_in.bias", "ssm_out.bias")) for n in tensors),
            "mlp_bias": any(n.endswith(("ffn_up.bias", "ffn_down.bias")) for n in tensors),
            "moe_latent_size": meta.get(p + "moe_latent_size")}
    if "moe" in kinds:
        data.update(_moe_keys(meta, p))
    width = widths[0] if widths else max([int(f) for f in ffn] if isinstance(ffn, (list, tuple)) else [int(ffn)])
    return {**meta, p + "feed_forward_length": width}, data
