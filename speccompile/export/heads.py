"""Exporters for drafter heads: `--drafter eagle:PATH | eagle3:PATH | medusa:PATH | mtp:PATH`.

Each writes `<kind>.onnx` (+ `.data`) next to the target graph, plus `<kind>.ort.onnx`, the same head
with int8 (default) or int4 weights for ONNX Runtime CPU (export/cpu_draft_weights.py; drafts change,
outputs do not). EAGLE-3 also writes `eagle3_d2t.npy`
(draft id -> target id). An MTP checkpoint with several modules also writes `mtp{i}.onnx` for module i >= 1
(same interface; `module_graphs` in the section lists them all, module 0 first). The manifest's drafter section
records the graph, the head config, and the tree and k as `draft_config.DraftConfig` writes them (the `--tree`
grammar lives there too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..manifest import GraphSpec, sha256_of
from ..models.load import LoadedModel
from ..draft_config import DraftConfig
from .cpu_draft_weights import add_quantized_head_variant
from .drafter_types import DrafterExport, DrafterRequest


def export_head(request: DrafterRequest, target: LoadedModel, out_dir: Path, dtype: str,
                digests: dict[str, str]) -> DrafterExport:
    """Trace the head (one layer); of the target it reads only the tables it shares (embedding, lm_head, norm),
    one tensor at a time from the target's lazy weights."""
    from ..models.decoder import bound_positions
    from ..models.head_loaders import load_head
    from .onnx_export import torch_dtype

    kind = request.kind
    draft = DraftConfig.parse(kind, request.tree, request.num_draft_tokens)
    head = load_head(kind, request.path, target.config, target.weights, target.source).to(torch_dtype(dtype)).eval()
    for module in [head, *getattr(head, "chain", [])]:  # (MTP modules 1..N-1: a plain list, not submodules)
        bound_positions(module, request.max_context or target.config.max_position_embeddings)
    spec = export_head_graph(head, out_dir / f"{kind}.onnx", dtype, digests)
    files = [f"{kind}.onnx", f"{kind}.onnx.data"]
    graphs = {kind: spec}
    if request.fused_cpu_graph:
        files += add_quantized_head_variant(kind, graphs, out_dir, request.draft_cpu_weights, digests=digests)
    modules = [kind]
    for i, module in enumerate(getattr(head, "chain", []), start=1):  # MTP modules 1..N-1, chained after module 0
        name = f"{kind}{i}"
        modules.append(name)
        graphs[name] = export_head_graph(module.to(torch_dtype(dtype)).eval(), out_dir / f"{name}.onnx", dtype, digests)
        files += [f"{name}.onnx", f"{name}.onnx.data"]
        if request.fused_cpu_graph:
            files += add_quantized_head_variant(name, graphs, out_dir, request.draft_cpu_weights, digests=digests)
    cfg = head.head_config
    section: dict[str, Any] = {
        "kind": kind,
        "graph": kind,
        **draft.to_manifest(),
        "layout": cfg.layout,
        "head": cfg.to_dict(),
        "source": str(request.path or target.source),
    }
    if len(modules) > 1:
        section["module_graphs"] = modules  # the chain's graphs, module 0 first (runtime/drafters/mtp_chain.py)
    if kind == "eagle3":
        save_draft_to_target(head.draft_to_target().numpy(), "eagle3", out_dir, files, section)
        section["target_taps"] = list(cfg.aux_layer_ids)  # inputs of these target layers (L: the final hidden state)
    if request.path is not None:  # (an MTP head inside the target: the target's digests are the model's)
        section["source_sha256"] = source_digests(Path(request.path))
    return DrafterExport(graphs=graphs, files=[f for f in files if (out_dir / f).exists()], manifest=section)


def save_draft_to_target(d2t, prefix: str, out_dir: Path, files: list[str], section: dict[str, Any]) -> None:
    """Write a drafter's draft-to-target vocabulary map as `{prefix}_d2t.npy` and name it in its manifest section."""
    import numpy as np

    name = f"{prefix}_d2t.npy"
    np.save(out_dir / name, np.asarray(d2t).astype(np.int64), allow_pickle=False)
    files.append(name)
    section["draft_to_target"] = name


def source_digests(src: Path) -> dict[str, str]:
    """sha256 of a drafter checkpoint's weight files (safetensors, else torch files; or the one file given)."""
    from ..models.head_loaders import TORCH_SUFFIXES

    weights = (sorted(src.glob("*.safetensors")) or sorted(f for f in src.iterdir() if f.suffix in TORCH_SUFFIXES)
               if src.is_dir() else [src])
    return {w.name: sha256_of(w) for w in weights if w.is_file()}


def export_head_graph(head, path: Path, dtype: str = "fp32", digests: dict[str, str] | None = None) -> GraphSpec:
    """Export a head module to `path` with dynamic batch / q_len / past_len axes (file sha256 into `digests`)."""
    import torch

    from .onnx_export import check_graph, export_module, graph_interface, torch_dtype

    cfg = head.head_config
    tdt = torch_dtype(dtype)
    digests = {} if digests is None else digests
    batch, q_len, past_len = 2, 5, 3
    seq = {0: "batch", 1: "q_len"}
    if cfg.kind == "medusa":
        hidden = torch.randn(batch, q_len, cfg.target_hidden_size, dtype=tdt)
        digests.update(export_module(head, (hidden,), [], [seq], head.input_names, head.output_names, {"logits": seq}, path))
        check_graph(path)
        inputs, outputs = graph_interface(path)
        return GraphSpec(role="medusa", file=path.name, inputs=inputs, outputs=outputs, dtype=dtype,
                         extra={"num_heads": cfg.medusa_num_heads})
    layer = cfg.layer
    ids = torch.randint(0, cfg.target_vocab_size, (batch, q_len))
    pos = torch.arange(past_len, past_len + q_len).unsqueeze(0).expand(batch, -1).contiguous()
    from ..models.decoder import causal_mask

    mask = causal_mask(q_len, past_len, batch).contiguous()
    hidden = torch.randn(batch, q_len, layer.hidden_size, dtype=tdt)
    examples = [ids, pos, mask]
    axes = [seq, seq, {0: "batch", 1: "q_len", 2: "total_len"}]
    if cfg.kind == "eagle3":
        examples.append(torch.randn(batch, q_len, len(cfg.aux_layer_ids or (0, 0, 0)) * cfg.target_hidden_size, dtype=tdt))
        axes.append(seq)
    examples.append(hidden)
    axes.append(seq)
    past = head.empty_past(batch, past_len, tdt)
    digests.update(export_module(head, tuple(examples), past, axes, head.input_names, head.output_names,
                                 {"logits": seq, "draft_hidden_states": seq}, path))
    check_graph(path)
    inputs, outputs = graph_interface(path)
    return GraphSpec(role=cfg.kind, file=path.name, inputs=inputs, outputs=outputs, dtype=dtype, num_layers=head.num_layers,
                     num_kv_heads=layer.num_key_value_heads, head_dim=layer.head_dim,
                     extra={"hidden_size": layer.hidden_size, "target_hidden_size": cfg.target_hidden_size,
                            "draft_vocab_size": cfg.draft_vocab_size})
