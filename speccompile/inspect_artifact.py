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


def _shape(shape: list[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _io_rows(specs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(name, dtype, shape) rows, with the per-layer past/present KV tensors folded into one row."""
    rows, kv = [], []
    for t in specs:
        if t["name"].startswith(("past_key_values.", "present.")):
            kv.append(t)
        else:
            rows.append((t["name"], t["dtype"], _shape(t["shape"])))
    if kv:
        prefix = kv[0]["name"].split(".")[0]
        rows.append((f"{prefix}.{{0..{len(kv) // 2 - 1}}}.key/value", kv[0]["dtype"], _shape(kv[0]["shape"])))
    return rows


def format_value(value: Any) -> str:
    """A manifest value as text a person reads: key=value pairs, bare lists, tree paths counted."""
    if isinstance(value, dict):
        return ", ".join(f"{k}=({format_value(v)})" if isinstance(v, dict) and v else f"{k}={format_value(v)}"
                         for k, v in value.items()) or "none"
    if isinstance(value, list):
        if value and all(isinstance(v, list) for v in value):
            return f"{len(value)} paths"
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def print_summary(summary: dict[str, Any], console=None) -> None:
    """Render the summary with rich tables (readable at 80 columns)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    model = summary["model"]
    console.print(Text(f"{summary['artifact']}", style="bold") + Text(f"  (schema {summary['schema_version']}, {summary['created_by']})"))
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column(overflow="fold")
    facts.add_row("model", Text(f"{model['name']}: {model['architecture']}, {model['layers']} layers, hidden {model['hidden_size']}, "
                           f"{model['heads']} heads / {model['kv_heads']} KV heads, vocab {model['vocab_size']}"))
    facts.add_row("limits", Text(format_value(summary["limits"])))
    sections = {"drafter": {k: v for k, v in (summary["drafter"] or {}).items() if k != "config"},
                "precision": summary["precision"] or {}, "engine": summary["engine"] or {}}
    for section, entries in sections.items():
        for key, value in entries.items():
            facts.add_row(section, Text(f"{key}: {format_value(value)}"))
            section = ""
    console.print(facts)
    for name, g in summary["graphs"].items():
        table = Table(title=Text(f"{name}: {g['file']} ({g['role']}, {g['dtype']}, {g['size_mb']:.1f} MB)"), title_justify="left")
        table.add_column("", no_wrap=True)
        table.add_column("tensor", no_wrap=True)
        table.add_column("dtype", no_wrap=True)
        table.add_column("shape", overflow="fold")
        for direction in ("inputs", "outputs"):
            for i, row in enumerate(_io_rows(g[direction])):
                table.add_row(direction[:-1] if i == 0 else "", *(Text(cell) for cell in row))
        console.print(table)
    console.print(f"total: {summary['total_size_mb']:.1f} MB in {len(summary['files'])} files")
