"""Adaptive speculation: draft as many tokens as the measured acceptance and verify cost pay for.

With `deterministic=True` (seeded sampling) timings are not used: the cost model is fixed (a verify
pass over q tokens costs 1 + 0.06*(q-1) one-token passes, drafting `relative_draft_cost` per token), so
the choice of k, and therefore the random stream and the output, depends only on the tokens.

Model: with per-token acceptance rate a, a chain of k drafts yields E(k) = (1 - a^(k+1)) / (1 - a)
tokens per target pass. A pass over q tokens costs t(q), measured online per q (`PassCosts`): CPU GEMM
kernels work on the verified rows in blocks, so t(q) is closer to a staircase than to a line (SmolLM2-135M,
2 threads, passes timed in isolation: ~1.15 t1 for q = 2..6, then steps at q = 7 and q = 13), and a line
misprices the block edges. Where a q has not been measured yet, the line t1 + s*(q-1) fitted to all passes
stands in, kept between the measured neighbours (t does not decrease with q). Drafting costs d per drafted
token (measured). Speed of k drafts: E(k) / (t(k+1) + k*d). We pick the k in [0, max_k] that maximises it;
k = 0 is plain decoding. A tree drafter says how many nodes its tree has at depth k (`nodes(k)`): the pass
then verifies nodes(k) + 1 tokens, E(k) still counts accepted depths (measured per depth of the trees it
drafts), and d is the cost of drafting one level. While paused, every `probe_every` steps we draft once
anyway (with the drafter's proposal) so a workload that starts paying again is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

from .acceptance import AcceptanceRates


@dataclass
class PassCosts:
    """Measured seconds of one target pass by the number of tokens it verifies, for one engine.

    Kept per q (EMA) because the cost is a staircase, plus the line t1 + slope (q - 1) fitted to every pass
    for the q not measured yet. One instance can serve every generation of an engine (the runner shares it),
    so later prompts start from what earlier ones measured."""

    alpha: float = 0.08
    by_q: dict = field(default_factory=dict)  # q -> seconds of a pass over q tokens (EMA)
    slope: float | None = None  # extra seconds per extra verified token (EMA over all passes)

    @property
    def t1(self) -> float | None:
        return self.by_q.get(1)

    def record(self, q: int, seconds: float) -> None:
        """Time of one target pass over q tokens."""
        if q > 1 and self.t1 is not None:
            slope = max(0.0, (seconds - self.t1) / (q - 1))
            self.slope = slope if self.slope is None else (1 - self.alpha) * self.slope + self.alpha * slope
        previous = self.by_q.get(q)
        self.by_q[q] = seconds if previous is None else (1 - self.alpha) * previous + self.alpha * seconds

    def line(self) -> tuple[float, float]:
        """(t1, slope) of the line fitted to every pass, with defaults until measured: t1 is at most the
        cheapest pass measured (a batched server may measure only passes over several tokens), 1 s before any."""
        t1 = self.t1 if self.t1 is not None else min(self.by_q.values(), default=1.0)
        return t1, self.slope if self.slope is not None else 0.05 * t1

    def seconds(self, q: int) -> float:
        """Expected seconds of a pass over q tokens: measured, else the line kept between measured neighbours."""
        if q in self.by_q:
            return self.by_q[q]
        t1, slope = self.line()
        estimate = t1 + slope * (q - 1)
        below = [s for k, s in self.by_q.items() if k < q]
        above = [s for k, s in self.by_q.items() if k > q]
        if below:
            estimate = max(estimate, max(below))
        if above:
            estimate = min(estimate, min(above))
        return estimate


@dataclass
class AdaptiveController:
    """Chooses the draft length per step. `key` separates kinds of proposals with different reliability
    (for n-gram lookup: the length of the matched suffix), each with its own acceptance estimate."""

    max_k: int
    enabled: bool = True
    alpha: float = 0.08  # EMA weight of the newest observation
    probe_every: int = 8
    prior_acceptance: float = 0.5
    draft_cost: float = 0.0  # seconds per drafted token (EMA)
    deterministic: bool = False
    relative_draft_cost: float = 0.0
    costs: PassCosts = field(default_factory=PassCosts)
    probing: bool = True  # draft once after `probe_every` idle steps (off while a probe costs a pass of its own: it stays due)
    rates: AcceptanceRates = field(init=False)

    def __post_init__(self) -> None:
        self.rates = AcceptanceRates(self.prior_acceptance, self.alpha, self.probe_every)
        if self.deterministic:  # a fixed cost model of its own: choices depend on the tokens only
            self.costs = PassCosts(by_q={1: 1.0}, slope=0.06)
            self.draft_cost = self.relative_draft_cost

    def acceptance(self, key: Hashable = None) -> float:
        return self.rates.rate(key)

    def expected_tokens(self, k: int, key: Hashable = None) -> float:
        a = min(max(self.acceptance(key), 1e-6), 1 - 1e-6)
        return (1 - a ** (k + 1)) / (1 - a)

    def pass_cost(self, q: int) -> float:
        return self.costs.seconds(q)

    def relative_costs(self) -> tuple[float, float]:
        """(extra verify cost of one more token, drafting cost of one level), both in one-token passes."""
        t1, slope = self.costs.line()
        return slope / t1, self.draft_cost / t1

    def choose_k(self, key: Hashable = None, available: int | None = None, nodes: Callable[[int], int] | None = None) -> int:
        """Number of tokens (tree: depth) to draft this step (0 = plain step); `available` caps it (proposal
        length); `nodes(k)` is the number of draft tokens a tree of depth k verifies (default k: a chain)."""
        limit = self.max_k if available is None else min(self.max_k, available)
        if not self.enabled or limit <= 0:
            return limit
        if self.costs.t1 is None:
            return 0  # one plain pass first, to measure t(1)
        best_k, best_speed = 0, 1.0 / self.pass_cost(1)
        for k in range(1, limit + 1):
            verified = k if nodes is None else nodes(k)
            speed = self.expected_tokens(k, key) / (self.pass_cost(verified + 1) + k * self.draft_cost)
            if speed > best_speed * 1.0001:
                best_k, best_speed = k, speed
        if self.rates.probe_due(key, idle=best_k == 0, allowed=self.probing):
            return 1
        return best_k

    def record_pass(self, q: int, seconds: float) -> None:
        """Time of one target pass over q tokens."""
        if not self.deterministic:
            self.costs.record(q, seconds)

    def record_draft(self, drafted: int, accepted: int, seconds: float, key: Hashable = None, levels: int | None = None) -> None:
        """Outcome of one verified draft: acceptance per drafted position (geometric model); the drafting
        time is spread over `levels` drafter calls (default: one per drafted position)."""
        if drafted <= 0:
            return
        self.rates.observe_chain(key, drafted, accepted)
        levels = drafted if levels is None else levels
        if self.deterministic or levels <= 0:
            return
        per_token = seconds / levels
        self.draft_cost = per_token if self.draft_cost == 0 else (1 - self.alpha) * self.draft_cost + self.alpha * per_token
