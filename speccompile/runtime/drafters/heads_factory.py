"""Build the runtime drafter for an artifact exported with `--drafter eagle|eagle3|medusa|mtp:PATH`."""

from __future__ import annotations

from typing import Any

from ...errors import ArtifactError


def open_head_session(artifact, graph: str):
    """The head graph on the artifact's backend, through the backend factory (its int8/int4 variant on ort-cpu)."""
    return artifact.session(graph)


def tree_config(section: dict[str, Any]) -> dict[str, Any]:
    tree = section.get("tree")
    if tree == "dynamic":
        return {"tree": "dynamic", "dynamic": dict(section.get("dynamic") or {})}
    if not isinstance(tree, list) or not tree:
        raise ArtifactError(f"manifest drafter section of {section.get('kind')} has no tree (got {tree!r})")
    return {"tree": tree}


def make(artifact, name: str, sampling=None, clock: list[float] | None = None, tree: dict[str, Any] | None = None):
    """The drafter `name` (eagle, eagle3, medusa, mtp) for `artifact`; `tree` overrides the exported tree."""
    section = artifact.manifest.drafter or {}
    session = open_head_session(artifact, section.get("graph", name))
    if clock is not None:
        from ..generate import TimedSession

        session = TimedSession(session, clock)
    tree = tree or tree_config(section)
    max_nodes = artifact.max_verify_tokens
    if name == "medusa":
        from .medusa import MedusaDrafter

        return MedusaDrafter(session, tree, section["head"]["medusa_num_heads"], max_nodes)
    from .eagle import HeadDrafter, load_draft_to_target

    d2t = load_draft_to_target(artifact.directory, section.get("draft_to_target"))
    return HeadDrafter(session, name, tree, max_nodes, d2t, max_context=artifact.max_context + 4 * max_nodes)
