"""Export a `Decoder` (target or separate draft model) as a verify graph."""

from __future__ import annotations

from pathlib import Path

from ..manifest import GraphSpec
from ..models.decoder import Decoder, causal_mask
from .onnx_export import check_graph, export_module, graph_interface

DTYPES = ("fp32", "fp16", "bf16")


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def export_decoder(decoder: Decoder, path: Path, role: str, dtype: str = "fp32") -> GraphSpec:
    """Export `decoder` to `path` with all lengths dynamic; returns the graph's manifest entry."""
    import torch

    decoder = decoder.to(torch_dtype(dtype)).eval()
    cfg = decoder.config
    batch, q_len, past_len = 2, 5, 3  # sizes > 1 so the exporter keeps every axis dynamic
    ids = torch.randint(0, cfg.vocab_size, (batch, q_len))
    pos = torch.arange(past_len, past_len + q_len).unsqueeze(0).expand(batch, -1).contiguous()
    mask = causal_mask(q_len, past_len, batch).contiguous()
    past = [
        torch.zeros(batch, cfg.num_key_value_heads, past_len, cfg.head_dim, dtype=torch_dtype(dtype))
        for _ in range(2 * cfg.num_hidden_layers)
    ]
    seq_axes = {0: "batch", 1: "q_len"}
    output_axes = {
        "logits": seq_axes,
        "hidden_states": seq_axes,
        "aux_hidden_states": seq_axes,
    }
    export_module(
        decoder,
        (ids, pos, mask),
        past,
        [seq_axes, seq_axes, {0: "batch", 1: "q_len", 2: "total_len"}],
        decoder.input_names,
        decoder.output_names,
        output_axes,
        path,
    )
    check_graph(path)
    inputs, outputs = graph_interface(path)
    return GraphSpec(
        role=role,
        file=path.name,
        inputs=inputs,
        outputs=outputs,
        dtype=dtype,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_states=decoder.hidden_mode,
        extra={"aux_layers": list(decoder.aux_layers)} if decoder.hidden_mode == "eagle3" else {},
    )
