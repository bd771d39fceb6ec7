"""What a drafter exporter is asked for and what it returns (shared by the registry and the exporters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..manifest import GraphSpec


@dataclass
class DrafterExport:
    """What an exporter wrote: the graphs, the files and the drafter's manifest section."""

    graphs: dict[str, GraphSpec]
    files: list[str]
    manifest: dict[str, Any]


@dataclass
class DrafterRequest:
    """A parsed `--drafter` value plus the options that shape drafting."""

    kind: str
    path: str | None
    tree: str | None = None
    num_draft_tokens: int | None = None
    max_context: int = 0  # the artifact's context limit (set by the export pipeline)
    fused_cpu_graph: bool = True  # also write the fused ORT CPU variant of decoder graphs
    draft_cpu_weights: str = "int8"  # heads: weights of their ORT CPU variant (int8|int4|fp32 = none)
