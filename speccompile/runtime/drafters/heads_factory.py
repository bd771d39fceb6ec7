"""Build the runtime drafter for an artifact exported with `--drafter eagle|eagle3|medusa|mtp:PATH`."""

from __future__ import annotations

from ..draft_config import DraftConfig
from ..timing import EngineClock, TimedSession


def open_head_session(artifact, graph: str, shared: bool = False):
    """The head graph on the artifact's backend, through the backend factory (its int8/int4 variant on ort-cpu);
    `shared`: the artifact's one session of it (drafters decoding side by side)."""
    return artifact.session(graph, shared)


def make(artifact, draft: DraftConfig, clock: EngineClock, shared_session: bool = False):
    """The head drafter of `draft.kind` (eagle, eagle3, medusa, mtp) for `artifact`, drafting `draft`'s tree."""
    section = artifact.manifest.drafter or {}
    session = TimedSession(open_head_session(artifact, section.get("graph", draft.kind), shared_session), clock)
    max_nodes = artifact.max_verify_tokens
    if draft.kind == "medusa":
        from .medusa import MedusaDrafter

        return MedusaDrafter(session, draft, section["head"]["medusa_num_heads"], max_nodes)
    from .eagle import HeadDrafter, load_draft_to_target

    d2t = load_draft_to_target(artifact.directory, section.get("draft_to_target"))
    return HeadDrafter(session, draft.kind, draft, max_nodes, d2t, max_context=artifact.max_context + 4 * max_nodes)
