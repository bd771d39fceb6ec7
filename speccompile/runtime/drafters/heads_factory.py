"""Build the runtime drafter for an artifact exported with `--drafter eagle|eagle3|medusa|mtp:PATH`."""

from __future__ import annotations

from ...errors import UnsupportedError
from ..draft_config import DraftConfig
from ..timing import EngineClock, TimedSession


def open_head_session(artifact, graph: str):
    """The head graph on the artifact's backend (ONNX Runtime EPs only, for now); its int8/int4 variant on ort-cpu."""
    spec = artifact.graph_spec(graph)
    if not artifact.backend.startswith("ort-"):
        raise UnsupportedError(f"--backend {artifact.backend}: drafter heads run on ONNX Runtime backends only (ort-cpu, ort-cuda, ort-trt)")
    if spec.role == "medusa":
        from .medusa import MedusaSession

        return MedusaSession(artifact.directory, spec, artifact.backend, artifact.threads)
    from .eagle import HeadSession

    return HeadSession(artifact.directory, spec, artifact.backend, artifact.threads)


def make(artifact, draft: DraftConfig, clock: EngineClock):
    """The head drafter of `draft.kind` (eagle, eagle3, medusa, mtp) for `artifact`, drafting `draft`'s tree."""
    section = artifact.manifest.drafter or {}
    session = TimedSession(open_head_session(artifact, section.get("graph", draft.kind)), clock)
    max_nodes = artifact.max_verify_tokens
    if draft.kind == "medusa":
        from .medusa import MedusaDrafter

        return MedusaDrafter(session, draft, section["head"]["medusa_num_heads"], max_nodes)
    from .eagle import HeadDrafter, load_draft_to_target

    d2t = load_draft_to_target(artifact.directory, section.get("draft_to_target"))
    return HeadDrafter(session, draft.kind, draft, max_nodes, d2t, max_context=artifact.max_context + 4 * max_nodes)
