"""The head drafters of an artifact exported with `--drafter eagle|eagle3|medusa|mtp:PATH` (registered kinds)."""

from __future__ import annotations

from ...errors import ArtifactError
from ..timing import TimedSession
from .base import Drafter, DrafterRequest


def make_head(request: DrafterRequest) -> Drafter:
    """The head drafter of `request.draft.kind` drafting its tree, its graph on the artifact's backend (the
    int8/int4 variant on ort-cpu); with `lookup_branch`, under the n-gram lookup branch."""
    artifact, draft = request.artifact, request.draft
    section = request.exported_section()
    graph = artifact.session(section.get("graph", draft.kind), request.shared_session)
    session = TimedSession(graph, request.clock)
    max_nodes = artifact.verify_rows
    if draft.kind == "medusa":
        from .medusa import MedusaDrafter

        head: Drafter = MedusaDrafter(session, draft, section["head"]["medusa_num_heads"], max_nodes)
    else:
        from .eagle import HeadDrafter, load_draft_to_target

        check_target_taps(section, artifact.manifest.graphs["target"].extra.get("aux_layers"))
        d2t = load_draft_to_target(artifact.directory, section.get("draft_to_target"))
        max_context = artifact.max_context + 4 * max_nodes
        modules = section.get("module_graphs") or []
        if draft.kind == "mtp" and len(modules) > 1:  # chained MTP modules (runtime/drafters/mtp_chain.py)
            from .mtp_chain import MTPChainDrafter

            others = [TimedSession(artifact.session(g, request.shared_session), request.clock) for g in modules[1:]]
            head = MTPChainDrafter(session, others, draft, max_nodes, d2t, max_context=max_context)
        else:
            head = HeadDrafter(session, draft.kind, draft, max_nodes, d2t, max_context=max_context)
    if not request.lookup_branch:
        return head
    from .lookup_branch import LookupBranchDrafter

    return LookupBranchDrafter(head, max_nodes=max_nodes)


def check_target_taps(section: dict, exported: list[int] | None) -> None:
    """An EAGLE-3 head reads the taps its target graph returns: the same layers (manifest `target_taps` vs the
    target graph's `aux_layers`), else ArtifactError."""
    wanted = section.get("target_taps")
    if wanted is not None and list(wanted) != list(exported or []):
        raise ArtifactError(f"the eagle3 head reads the inputs of target layers {list(wanted)} but the target graph "
                            f"returns {exported}; re-export the artifact")
