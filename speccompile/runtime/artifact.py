"""Open an artifact directory for generation: manifest checks, tokenizer, backend sessions, drafters."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..manifest import GraphSpec, Manifest, read_manifest, variant_name
from .backends.base import Session, open_session
from .sampling import SamplingParams
from .tokenizer import TextTokenizer

DRAFTER_CHOICES = ("auto", "none", "ngram", "draft-model", "eagle", "eagle3", "medusa", "mtp")


@dataclass
class Artifact:
    directory: Path
    manifest: Manifest
    tokenizer: TextTokenizer
    target: Session
    backend: str
    threads: int | None
    fused: bool = True

    @property
    def max_context(self) -> int:
        return int(self.manifest.limits.get("max_context", 2048))

    @property
    def max_verify_tokens(self) -> int:
        return int(self.manifest.limits.get("max_verify_tokens", 64))

    @property
    def eos_token_ids(self) -> list[int]:
        ids = list(self.manifest.tokenizer.get("eos_token_ids") or [])
        return sorted(set(ids) | set(self.tokenizer.eos_token_ids))

    def session(self, graph: str) -> Session:
        """Open another graph of the artifact (a drafter) on the same backend."""
        return _open_graph(self.directory, self.manifest, graph, self.backend, self.threads, self.fused)

    def graph_spec(self, graph: str) -> GraphSpec:
        """The spec of the graph that runs as `graph` here: its ORT CPU variant when there is one and it applies."""
        return _runnable_spec(self.manifest, graph, self.backend, self.fused)


def open_artifact(directory: str | Path, backend: str = "ort-cpu", threads: int | None = None, fused: bool = True,
                  drafter: str = "auto") -> Artifact:
    """Verify the manifest (schema, sha256 of every file) and load the target graph + tokenizer.

    On `ort-cpu` the fused variant of a graph (`target.ort.onnx`, see export/ort_fused_graph.py) is used
    when the artifact has one and `fused` is set; otherwise the contract graph. `drafter` is the one
    that will run: when it has no graph of its own (n-gram, none) the target's threads may spin.
    """
    directory = Path(directory)
    manifest = read_manifest(directory, verify_files=True)
    tokenizer = TextTokenizer(directory, manifest.tokenizer.get("eos_token_ids"))
    resolved = _resolve_drafter(manifest, drafter)
    alone = resolved in ("ngram", "none")
    chains = resolved in ("ngram", "none", "draft-model")  # the GPU graph verifies chains only (causal attention)
    target = _open_graph(directory, manifest, "target", backend, threads, fused, spinning=alone, chains=chains)
    return Artifact(directory, manifest, tokenizer, target, backend, threads, fused)


def _open_graph(directory: Path, manifest: Manifest, graph: str, backend: str, threads: int | None, fused: bool,
                spinning: bool = False, chains: bool = False) -> Session:
    max_context = int(manifest.limits.get("max_context", 0)) or None
    spec = _runnable_spec(manifest, graph, backend, fused, chains)
    return open_session(directory, spec, backend, threads, max_context=max_context, spinning=spinning)


def _runnable_spec(manifest: Manifest, graph: str, backend: str, fused: bool, chains: bool = False) -> GraphSpec:
    variant = variant_name(graph)
    if fused and backend == "ort-cpu" and variant in manifest.graphs:
        return manifest.graph(variant)
    if fused and chains and backend == "ort-cuda" and variant_name(graph, "cuda") in manifest.graphs:
        return manifest.graph(variant_name(graph, "cuda"))
    return manifest.graph(graph)


def resolve_drafter_name(artifact: Artifact, name: str) -> str:
    """`auto` -> the drafter exported with the artifact, else n-gram lookup."""
    return _resolve_drafter(artifact.manifest, name)


def _resolve_drafter(manifest: Manifest, name: str) -> str:
    if name not in DRAFTER_CHOICES:
        raise InputError(f"--drafter must be one of {', '.join(DRAFTER_CHOICES)}, got {name}")
    if name == "auto":
        return (manifest.drafter or {}).get("kind") or "ngram"
    return name


def default_num_draft_tokens(artifact: Artifact, drafter: str) -> int:
    recorded = (artifact.manifest.drafter or {}).get("num_draft_tokens")
    if recorded and (artifact.manifest.drafter or {}).get("kind") == drafter:
        return int(recorded)
    return {"ngram": 12, "draft-model": 4}.get(drafter, 4)


def make_drafter(artifact: Artifact, name: str, sampling: SamplingParams, clock: list[float] | None = None, tree: str | None = None,
                 lookup_branch: bool = True, ngram_corpus=None):
    """Build the runtime drafter `name` for this artifact (None for plain decoding).

    `tree` (heads only) overrides the exported tree: a preset, a JSON file, `chain` or `dynamic[-D-K-N[-pP]]`;
    `lookup_branch` (heads only) adds the n-gram lookup continuation to every step's tree;
    `ngram_corpus` (an NgramCorpus; the n-gram drafter's, other drafters ignore it) is where lookup falls back
    to when the history has no match.
    """
    name = resolve_drafter_name(artifact, name)
    if name == "none":
        return None
    if tree is not None and name in ("ngram", "draft-model"):
        raise InputError(f"--tree: the {name} drafter drafts chains; trees need a head drafter (eagle, eagle3, medusa, mtp)")
    if name == "ngram":
        from .drafters.ngram import NgramDrafter

        return NgramDrafter(corpus=ngram_corpus)
    drafter_section = artifact.manifest.drafter or {}
    if drafter_section.get("kind") != name:
        raise InputError(
            f"--drafter {name}: this artifact was exported without it "
            f"(re-export with --drafter {name}:PATH; exported drafter: {drafter_section.get('kind') or 'none'})"
        )
    if name == "draft-model":
        from .drafters.draft_model import DraftModelDrafter
        from .generate import TimedSession

        session = artifact.session(drafter_section.get("graph", "draft"))
        if clock is not None:
            session = TimedSession(session, clock)
        seed = None if sampling.seed is None else sampling.seed + 1
        return DraftModelDrafter(session, sampling, np.random.default_rng(seed), artifact.max_context)
    from .drafters import heads_factory  # EAGLE / Medusa / MTP drafters

    override = None
    if tree is not None:
        from ..export.heads import resolve_tree  # pure: parses the tree spec, no torch

        override = heads_factory.tree_config({"kind": name, **resolve_tree(name, tree, None)})
    head = heads_factory.make(artifact, name, sampling, clock, tree=override)
    if not lookup_branch:
        return head
    from .drafters.lookup_branch import LookupBranchDrafter

    return LookupBranchDrafter(head, max_nodes=artifact.max_verify_tokens)
