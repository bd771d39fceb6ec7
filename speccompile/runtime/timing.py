"""Time spent inside engine calls, summed over every graph a generation runs (target and drafters)."""

from __future__ import annotations

import time

from .backends.base import Session, StepOutput


class EngineClock:
    """Seconds spent inside engine calls; one per runner, shared by its target and drafter sessions."""

    def __init__(self) -> None:
        self.seconds = 0.0


class TimedSession:
    """A Session whose `run` time is added to an EngineClock."""

    def __init__(self, session: Session, clock: EngineClock):
        self.session = session
        self.clock = clock
        self.spec = session.spec

    @property
    def row_invariant(self) -> bool:
        """The wrapped Session's (see backends/base.py)."""
        return self.session.row_invariant

    @property
    def max_caches(self) -> int | None:
        """The wrapped Session's (see backends/base.py)."""
        return self.session.max_caches

    def pass_rows(self, start: int) -> int:
        """The wrapped Session's (see backends/base.py)."""
        return self.session.pass_rows(start)

    def new_cache(self):
        return self.session.new_cache()

    def run(self, *args, **kwargs) -> StepOutput:
        """The session's `run`, timed."""
        start = time.perf_counter()
        try:
            return self.session.run(*args, **kwargs)
        finally:
            self.clock.seconds += time.perf_counter() - start
