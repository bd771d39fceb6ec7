"""The runtime's drafter kinds, by name: the factory that builds each kind's `Drafter` for an opened artifact.

It mirrors export's registry (export/drafters.py: each kind's exporter); the kinds match export's and
`options.DRAFTER_CHOICES` (tests/test_drafter_registry.py). Built-in factories are imported on first use
(a drafter's numpy code is not loaded before it runs); `register` adds another kind."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ...errors import InputError
from ..draft_config import HEAD_KINDS, DraftConfig
from ..sampling import SamplingParams
from ..timing import EngineClock
from .base import Drafter
from .ngram_corpus import NgramCorpus

if TYPE_CHECKING:
    from ..artifact import Artifact


@dataclass(frozen=True)
class DrafterRequest:
    """What a factory builds a drafter from: the opened artifact, what to draft (`draft.kind`, its tree and k),
    the generation's sampling (a draft model samples its own tokens) and the clock its graphs are timed on.
    `lookup_branch` (heads): add the n-gram lookup continuation to every tree; `ngram_corpus`: the n-gram
    drafter's fallback; `shared_session`: its graph runs in the artifact's shared session (`Artifact.session`)."""

    artifact: "Artifact"
    draft: DraftConfig
    sampling: SamplingParams
    clock: EngineClock
    lookup_branch: bool = True
    ngram_corpus: NgramCorpus | None = None
    shared_session: bool = False

    def exported_section(self) -> dict:
        """The artifact's drafter section; InputError when the artifact was exported without this kind."""
        section = self.artifact.manifest.drafter or {}
        kind = self.draft.kind
        if section.get("kind") != kind:
            raise InputError(f"--drafter {kind}: this artifact was exported without it (re-export with --drafter "
                             f"{kind}:PATH; exported drafter: {section.get('kind') or 'none'})")
        return section


Factory = Callable[[DrafterRequest], Drafter]
# the built-in kinds: module (of this package) and factory, imported when first used
BUILTIN: dict[str, tuple[str, str]] = {
    "ngram": ("ngram", "make_ngram"),
    "draft-model": ("draft_model", "make_draft_model"),
    **{kind: ("heads_factory", "make_head") for kind in HEAD_KINDS},
}
_REGISTERED: dict[str, Factory] = {}


def register(kind: str, factory: Factory) -> None:
    """Add (or replace) a drafter kind."""
    _REGISTERED[kind] = factory


def kinds() -> list[str]:
    """Every known kind."""
    return sorted(set(BUILTIN) | set(_REGISTERED))


def make_drafter(request: DrafterRequest) -> Drafter:
    """The drafter of `request.draft.kind`."""
    kind = request.draft.kind
    factory = _REGISTERED.get(kind)
    if factory is None and kind in BUILTIN:
        module, name = BUILTIN[kind]
        factory = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    if factory is None:
        raise InputError(f"--drafter: unknown kind {kind!r} (expected one of: {', '.join(kinds())})")
    return factory(request)
