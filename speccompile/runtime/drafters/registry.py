"""The runtime's drafter kinds, by name: the factory that builds each kind's `Drafter` for an opened artifact.

It mirrors export's registry (export/drafters.py: each kind's exporter); the kinds match export's and
`options.DRAFTER_CHOICES` (tests/test_drafter_registry.py). Built-in factories are imported on first use
(a drafter's code is not loaded before it runs); `register` adds another kind."""

from __future__ import annotations

from typing import Callable

from ...draft_config import HEAD_KINDS
from ...errors import InputError
from .base import Drafter, DrafterRequest


Factory = Callable[[DrafterRequest], Drafter]
BUILTIN_KINDS = ("ngram", "suffix", "draft-model", *HEAD_KINDS, "dflash")
_REGISTERED: dict[str, Factory] = {}


def register(kind: str, factory: Factory) -> None:
    """Add (or replace) a drafter kind."""
    _REGISTERED[kind] = factory


def kinds() -> list[str]:
    """Every known kind."""
    return sorted(set(BUILTIN_KINDS) | set(_REGISTERED))


def make_drafter(request: DrafterRequest) -> Drafter:
    """The drafter of `request.draft.kind`."""
    kind = request.draft.kind
    factory = _REGISTERED.get(kind) or _builtin(kind)
    if factory is None:
        raise InputError(f"drafter: unknown kind {kind!r} (expected one of: {', '.join(kinds())})", "drafter")
    return factory(request)


def _builtin(kind: str) -> Factory | None:
    """The built-in factory of `kind`, imported on first use."""
    if kind == "ngram":
        from .ngram import make_ngram

        return make_ngram
    if kind == "suffix":
        from .suffix import make_suffix

        return make_suffix
    if kind == "draft-model":
        from .draft_model import make_draft_model

        return make_draft_model
    if kind in HEAD_KINDS:
        from .heads_factory import make_head

        return make_head
    if kind == "dflash":
        from .dflash import make_dflash

        return make_dflash
    return None
