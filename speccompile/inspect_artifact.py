"""`speccompile inspect`: a summary of an artifact directory (model, graphs, interfaces, sizes, limits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .manifest import read_manifest


def summarize(directory: str | Path) -> dict[str, Any]:
    """Collect the facts `inspect` shows, as plain data (also the --json output)."""
    directory = Path(directory)
    manifest = read_manifest(directory, verify_files=False)
    sizes = {name: (directory / name).stat().st_size for name in manifest.files if (directory / name).exists()}
    cfg = manifest.model.get("config", {})
    graphs = {}
    for name, graph in manifest.graphs.items():
        graph_bytes = sum(size for file, size in sizes.items() if file.startswith(graph.file))
        graphs[name] = {
            "role": graph.role,
            "file": graph.file,
            "dtype": graph.dtype,
            "size_mb": round(graph_bytes / 1e6, 2),
            "hidden_states": graph.hidden_states,
            "inputs": [{"name": t.name, "dtype": t.dtype, "shape": t.shape} for t in graph.inputs],
            "outputs": [{"name": t.name, "dtype": t.dtype, "shape": t.shape} for t in graph.outputs],
        }
    linear = (cfg.get("hybrid") or {}).get("linear") or []
    attention_free = bool(linear) and all(linear)  # every layer recurrent (pure Mamba-2): no attention heads
    return {
        "artifact": str(directory),
        "schema_version": manifest.schema_version,
        "created_by": manifest.created_by,
        "model": {
            "name": manifest.model.get("name"),
            "source": manifest.model.get("source"),
            "architecture": cfg.get("architecture"),
            "layers": cfg.get("num_hidden_layers"),
            "hidden_size": cfg.get("hidden_size"),
            "heads": 0 if attention_free else cfg.get("num_attention_heads"),
            "kv_heads": 0 if attention_free else cfg.get("num_key_value_heads"),
            "vocab_size": cfg.get("vocab_size"),
        },
        "limits": manifest.limits,
        "drafter": manifest.drafter,
        "precision": manifest.precision,
        "engine": manifest.engine,
        "graphs": graphs,
        "files": {name: {"bytes": size, "sha256": manifest.files[name]} for name, size in sizes.items()},
        "total_size_mb": round(sum(sizes.values()) / 1e6, 2),
    }
