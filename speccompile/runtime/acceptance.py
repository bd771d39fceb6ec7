"""Acceptance estimates shared by the adaptive controller, the tree planner and the lookup branch.

Each keeps, per kind of proposal (a key: the n-gram match length, a tree node's choice path, ...), an
exponential moving average of how often drafts were accepted, starting from a prior until the key has been
observed, and a probe schedule: a key that has been left out `probe_every` times in a row is drafted once
anyway, so a rate that was too pessimistic can recover.
"""

from __future__ import annotations

from typing import Callable, Hashable

from .costs import ema

Prior = Callable[[Hashable], float]


def chain_update(rate: float, drafted: int, accepted: int, alpha: float) -> float:
    """The rate after `accepted` of `drafted` chain tokens were accepted (geometric model).

    The positions tried are the accepted ones plus the rejected one (none after a full accept); the
    update weighs in proportion to them."""
    tried = accepted + (1 if accepted < drafted else 0)
    return ema(rate, accepted / tried, min(1.0, 2 * alpha * tried))


class AcceptanceRates:
    """Per-key acceptance rate (EMA with weight `alpha`, `prior` until observed) plus a probe schedule."""

    def __init__(self, prior: float | Prior = 0.5, alpha: float = 0.08, probe_every: int = 8):
        self.prior: Prior = prior if callable(prior) else (lambda key, value=float(prior): value)
        self.alpha = alpha
        self.probe_every = probe_every
        self.observed: dict[Hashable, float] = {}
        self._idle: dict[Hashable, int] = {}

    def rate(self, key: Hashable = None) -> float:
        """Estimated acceptance of `key` (its prior until observed)."""
        return self.observed[key] if key in self.observed else self.prior(key)

    def observe(self, key: Hashable, accepted: float) -> None:
        """One draft of `key` was accepted (1.0) or not (0.0)."""
        self.observed[key] = ema(self.rate(key), accepted, self.alpha)

    def observe_chain(self, key: Hashable, drafted: int, accepted: int) -> None:
        """A chain of `drafted` tokens of `key` was verified; the first `accepted` were accepted."""
        if drafted > 0:
            self.observed[key] = chain_update(self.rate(key), drafted, accepted, self.alpha)

    def probe_due(self, key: Hashable = None, idle: bool = True, allowed: bool = True) -> bool:
        """Count one more step in which `key` was left out (`idle`) or used (not idle, resets the count);
        True on every `probe_every`-th idle step in a row: draft it once anyway. A probe that is due but not
        `allowed` now (a batched round where it would cost a pass of its own) stays due for the next step."""
        if not idle:
            self._idle[key] = 0
            return False
        count = min(self._idle.get(key, 0) + 1, self.probe_every)
        due = count >= self.probe_every
        self._idle[key] = 0 if due and allowed else count
        return due and allowed

    def forget(self) -> None:
        """Back to the priors (seeded sampling: decisions then depend on this generation only)."""
        self.observed.clear()
        self._idle.clear()
