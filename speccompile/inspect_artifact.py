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
            "heads": cfg.get("num_attention_heads"),
            "kv_heads": cfg.get("num_key_value_heads"),
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


def _compact(specs: list[dict[str, Any]]) -> str:
    """Group past/present KV tensors so a 30-layer graph fits on a screen."""
    shown, kv = [], []
    for t in specs:
        if t["name"].startswith(("past_key_values.", "present.")):
            kv.append(t)
        else:
            shown.append(f"{t['name']} {t['dtype']}{t['shape']}")
    if kv:
        prefix = kv[0]["name"].split(".")[0]
        shown.append(f"{prefix}.{{0..{len(kv) // 2 - 1}}}.key/value {kv[0]['dtype']}{kv[0]['shape']}")
    return "\n".join(shown)


def print_summary(summary: dict[str, Any]) -> None:
    """Render the summary with rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    model = summary["model"]
    console.print(f"[bold]{summary['artifact']}[/bold]  (schema {summary['schema_version']}, {summary['created_by']})")
    console.print(
        f"model: {model['name']}  arch={model['architecture']} layers={model['layers']} hidden={model['hidden_size']} "
        f"heads={model['heads']}/{model['kv_heads']} vocab={model['vocab_size']}"
    )
    console.print(f"limits: {summary['limits']}")
    if summary["drafter"]:
        drafter = {k: v for k, v in summary["drafter"].items() if k != "config"}
        console.print(f"drafter: {drafter}")
    if summary["precision"]:
        console.print(f"precision: {summary['precision']}")
    if summary["engine"]:
        console.print(f"engine: {summary['engine']}")
    table = Table("graph", "role", "dtype", "size MB", "inputs", "outputs")
    for name, g in summary["graphs"].items():
        table.add_row(name, g["role"], g["dtype"], f"{g['size_mb']:.1f}", _compact(g["inputs"]), _compact(g["outputs"]))
    console.print(table)
    console.print(f"total: {summary['total_size_mb']:.1f} MB in {len(summary['files'])} files")
