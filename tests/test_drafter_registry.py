"""The runtime's drafter registry: the same kinds as export's and as the CLI's choices, and `register` works."""

from __future__ import annotations

import pytest

from speccompile.errors import InputError
from speccompile.draft_config import DraftConfig
from speccompile.runtime.drafters import registry
from speccompile.runtime.drafters.base import Draft, Drafter, DrafterRequest
from speccompile.runtime.options import DRAFTER_CHOICES
from speccompile.runtime.timing import EngineClock


def test_runtime_kinds_are_the_cli_choices_and_exports_kinds():
    from speccompile.export.drafters import parse_drafter

    assert registry.kinds() == sorted(set(DRAFTER_CHOICES) - {"auto", "none"})
    for kind in registry.kinds():  # export knows every kind the runtime drafts with
        assert parse_drafter(f"{kind}:some/path").kind == kind
    with pytest.raises(InputError, match="unknown kind"):
        parse_drafter("lookahead:x")


def test_a_registered_kind_is_built_by_its_factory():
    class Repeat(Drafter):
        name = "repeat"

        def propose(self, tokens, sizing):
            return Draft([tokens[-1]] * sizing.room)

    request = DrafterRequest(None, DraftConfig("repeat", 3), EngineClock())
    with pytest.raises(InputError, match="unknown kind 'repeat'"):
        registry.make_drafter(request)
    registry.register("repeat", lambda req: Repeat())
    try:
        assert isinstance(registry.make_drafter(request), Repeat) and "repeat" in registry.kinds()
    finally:
        registry._REGISTERED.pop("repeat")
