"""Exporting a DFlash block drafter: `--drafter dflash:PATH` (models/dflash.py describes the graph).

Writes `dflash.onnx` (+ `.data`), its int8/int4 ONNX Runtime CPU variant (`dflash.ort.onnx`, as the heads get)
and, for a draft vocabulary, `dflash_d2t.npy`. The target graph exports the taps the drafter reads
(`dflash_taps`: the inputs of the checkpoint's tap layers, concatenated as `aux_hidden_states`). The manifest's
drafter section records the drafter config and k (the drafted positions used per block; the block itself
is always run whole, as the drafter was trained).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..draft_config import DraftConfig
from ..manifest import GraphSpec
from ..models.load import LoadedModel
from .drafter_types import DrafterExport, DrafterRequest
from .heads import save_draft_to_target, source_digests


def dflash_taps(path: str | Path, target_layers: int) -> tuple[int, ...]:
    """The target layers (inputs of) a DFlash checkpoint reads, from its config.json alone (before the export)."""
    import json

    from ..errors import InputError
    from ..models.dflash import zlab_default_taps

    config = Path(path) / "config.json" if Path(path).is_dir() else Path(path).with_name("config.json")
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"drafter dflash:{path}: cannot read {config.name} ({exc})", "drafter") from None
    if raw.get("speculators_model_type"):
        return tuple(int(i) for i in raw.get("aux_hidden_state_layer_ids") or ())
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids")
    if ids is None:
        ids = zlab_default_taps(int(raw.get("num_target_layers") or target_layers), int(raw.get("num_hidden_layers") or 1))
    return tuple(int(i) + 1 for i in ids)


def export_dflash(request: DrafterRequest, target: LoadedModel, out_dir: Path, dtype: str,
                  digests: dict[str, str]) -> DrafterExport:
    """Load the checkpoint (either published layout), trace its block pass and describe it in the manifest."""
    from ..models.decoder import bound_positions
    from ..models.dflash_io import load_dflash
    from .cpu_draft_weights import add_quantized_head_variant
    from .onnx_export import torch_dtype

    drafter = load_dflash(request.path, target.config, target.weights).to(torch_dtype(dtype)).eval()
    bound_positions(drafter, request.max_context or target.config.max_position_embeddings)
    cfg = drafter.head_config
    draft = DraftConfig.parse("dflash", request.tree, request.num_draft_tokens or (None if request.tree else cfg.drafts_per_block))
    if draft.num_draft_tokens > cfg.drafts_per_block:
        from ..errors import InputError

        raise InputError(f"num_draft_tokens {draft.num_draft_tokens}: a block of {cfg.block_size} drafts at most "
                         f"{cfg.drafts_per_block} positions", ("num_draft_tokens", "tree"))
    spec = export_dflash_graph(drafter, out_dir / "dflash.onnx", dtype, digests)
    files = ["dflash.onnx", "dflash.onnx.data"]
    graphs = {"dflash": spec}
    if request.fused_cpu_graph:
        files += add_quantized_head_variant("dflash", graphs, out_dir, request.draft_cpu_weights, digests=digests)
    section: dict[str, Any] = {"kind": "dflash", "graph": "dflash", **draft.to_manifest(), "head": cfg.to_dict(),
                               "source": str(request.path)}
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        save_draft_to_target(drafter.draft_to_target().numpy(), "dflash", out_dir, files, section)
    if getattr(drafter, "markov", None) is not None:  # DSpark's Markov head: the runtime adds W2 W1[previous token]
        import numpy as np

        section["markov"] = {}
        for name, weight in zip(("w1", "w2"), drafter.markov):
            np.save(out_dir / f"dflash_markov_{name}.npy", weight.float().numpy(), allow_pickle=False)
            files.append(f"dflash_markov_{name}.npy")
            section["markov"][name] = f"dflash_markov_{name}.npy"
    section["source_sha256"] = source_digests(Path(request.path))
    return DrafterExport(graphs=graphs, files=[f for f in files if (out_dir / f).exists()], manifest=section)


def export_dflash_graph(drafter, path: Path, dtype: str = "fp32", digests: dict[str, str] | None = None) -> GraphSpec:
    """Trace `drafter` to `path` with dynamic batch / block / context / past axes."""
    import torch

    from .onnx_export import check_graph, export_module, graph_interface, torch_dtype

    cfg = drafter.head_config
    tdt = torch_dtype(dtype)
    digests = {} if digests is None else digests
    batch, block, ctx, past_len = 2, cfg.block_size, 3, 4
    ids = torch.randint(0, cfg.target_vocab_size, (batch, block))
    pos = torch.arange(past_len + ctx, past_len + ctx + block).expand(batch, -1).contiguous()
    mask = torch.ones(batch, block, past_len + ctx + block, dtype=torch.bool)
    aux = torch.randn(batch, ctx, len(cfg.tap_layers) * cfg.target_hidden_size, dtype=tdt)
    seq = {0: "batch", 1: "block"}
    axes = [seq, seq, {0: "batch", 1: "block", 2: "total_len"}, {0: "batch", 1: "context"}]
    presents = {n: {0: "batch", 2: "cached_len"} for n in drafter.output_names[1:]}
    digests.update(export_module(drafter, (ids, pos, mask, aux), drafter.empty_past(batch, past_len, tdt), axes,
                                 drafter.input_names, drafter.output_names, {"logits": {0: "batch", 1: "drafts"}, **presents}, path))
    check_graph(path)
    inputs, outputs = graph_interface(path)
    layer = cfg.layer
    return GraphSpec(role="dflash", file=path.name, inputs=inputs, outputs=outputs, dtype=dtype, num_layers=cfg.num_layers,
                     num_kv_heads=layer.num_key_value_heads, head_dim=layer.head_dim,
                     extra={"hidden_size": layer.hidden_size, "target_hidden_size": cfg.target_hidden_size,
                            "draft_vocab_size": cfg.draft_vocab_size, "block_size": cfg.block_size})
