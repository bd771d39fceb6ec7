"""Adaptive speculation: draft as many tokens as the measured acceptance and pass costs pay for.

Model: with per-token acceptance rate a, a chain of k drafts yields E(k) = (1 - a^(k+1)) / (1 - a) tokens
per target pass; a pass over q tokens costs t(q) (runtime/costs.py: measured per q, since on a CPU t(q) is
closer to a staircase than a line), drafting d per drafted token (measured). The controller picks the k in
[0, num_draft_tokens] with the highest expected speed E(k) / (t(k + 1) + k d) (`costs.best_draft_length`); k = 0 is
plain decoding. A tree drafter says how many nodes its tree has at depth k (`nodes(k)`): the pass then
verifies nodes(k) + 1 tokens, E(k) still counts accepted depths, and d is the cost of one level. While
paused, every `probe_every` steps it drafts once anyway (a probe) so a workload that starts paying is noticed.

Seeded sampling (`deterministic=True`) does not use timings: a fixed cost model (`seeded_costs`, a `FixedCosts`:
a pass over q tokens costs 1 + s (q - 1) one-token passes, s by the kind of target graph: 0.06, or 0.19 on the
packed INT4/INT8 CPU graph; drafting the drafter's declared relative cost per token), so the choice of k, and
therefore the random stream and the output, depends only on the tokens (and the artifact).

What the controller learns outlives a generation: a Runner keeps one `AcceptanceRates` per sampling setting
(`learned_rates`) and every generation's controller continues it, so a request does not start from the prior
with what the previous ones measured thrown away (n-gram lookup on the copy workload: 2.5x -> 2.7x own plain
decoding, docs/benchmarks.md). Seeded sampling starts from the prior every time (its choices depend on its tokens only).

Each round the controller hands the drafter a `Sizing`: its `room` (the most it may draft this round: the
configured `num_draft_tokens` cut to what fits) and what pays this round (the round's pass costs: a batch
decoder prices them by its load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

from .acceptance import AcceptanceRates
from .costs import FixedCosts, PassCostModel, PassCosts, best_draft_length, chain_tokens, ema, seeded_costs

SEEDED_COSTS = seeded_costs(packed_cpu_graph=False)


@dataclass
class AdaptiveController:
    """Chooses the draft length per step. `key` separates kinds of proposals with different reliability
    (for n-gram lookup: the length of the matched suffix), each with its own acceptance estimate."""

    num_draft_tokens: int  # the configured most draft positions a round (chain tokens, tree depth)
    enabled: bool = True
    alpha: float = 0.08  # EMA weight of the newest observation
    probe_every: int = 8
    prior_acceptance: float = 0.5
    draft_cost: float = 0.0  # seconds per drafted token (EMA)
    deterministic: bool = False
    relative_draft_cost: float = 0.0
    costs: PassCostModel = field(default_factory=PassCosts)  # the pass costs when a round brings none of its own
    seeded: FixedCosts = SEEDED_COSTS  # the costs of seeded sampling (`deterministic`) on this target graph
    learned: AcceptanceRates | None = None  # estimates carried over from earlier generations (`learned_rates`)
    rates: AcceptanceRates = field(init=False)

    def __post_init__(self) -> None:
        carried = self.learned is not None and not self.deterministic
        self.rates = self.learned if carried else AcceptanceRates(self.prior_acceptance, self.alpha, self.probe_every)
        if self.deterministic:  # a fixed cost model of its own: choices depend on the tokens only
            self.costs = self.seeded
            self.draft_cost = self.relative_draft_cost * self.seeded.t1

    @classmethod
    def learned_rates(cls) -> AcceptanceRates:
        """Acceptance estimates for controllers to share across generations (`learned`): the prior, EMA weight
        and probe schedule a controller's own would have."""
        return AcceptanceRates(cls.prior_acceptance, cls.alpha, cls.probe_every)

    def acceptance(self, key: Hashable = None) -> float:
        return self.rates.rate(key)

    def expected_tokens(self, k: int, key: Hashable = None) -> float:
        return chain_tokens(self.acceptance(key), k)

    def pass_cost(self, q: int) -> float:
        return self.costs.seconds(q)

    def sizing(self, room: int, costs: PassCostModel | None = None, probing: bool = True) -> "Sizing":
        """What a drafter may draft this round: at most `room` positions, sized by `costs` (the round's pass
        costs; default the controller's own). `probing`: a due probe may draft now (a batch holds it back while
        a probe would cost a pass of its own). Seeded sampling keeps its fixed costs and probes, so its choices
        (and output) are the same in a batch as alone."""
        if self.deterministic:
            return Sizing(room, self if self.enabled else None, self.costs, True)
        return Sizing(room, self if self.enabled else None, self.costs if costs is None else costs, probing)

    def choose_k(self, key: Hashable = None, available: int | None = None, nodes: Callable[[int], int] | None = None,
                 costs: PassCostModel | None = None, probing: bool = True) -> int:
        """Number of tokens (tree: depth) to draft this step (0 = plain step); `available` caps it (proposal
        length); `nodes(k)` is the number of draft tokens a tree of depth k verifies (default k: a chain);
        `costs`: the round's pass costs (default: the controller's)."""
        most = self.num_draft_tokens if available is None else min(self.num_draft_tokens, available)
        if not self.enabled or most <= 0:
            return most
        costs = self.costs if costs is None else costs
        if costs.t1 is None:
            return 0  # one plain pass first, to measure t(1)
        best_k = best_draft_length(self.acceptance(key), costs, most, self.draft_cost, nodes)
        if self.rates.probe_due(key, idle=best_k == 0, allowed=probing):
            return 1
        return best_k

    def record_pass(self, q: int, seconds: float) -> None:
        """Time of one target pass over q tokens (ignored by the fixed model of seeded sampling)."""
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
        self.draft_cost = ema(self.draft_cost or None, seconds / levels, self.alpha)


@dataclass(frozen=True)
class Sizing:
    """How much a drafter may draft this round and what pays: what the loop hands `Drafter.propose`.

    `room`: the most draft positions this round may hold (chain tokens, tree depth; 0: none): the configured
    `num_draft_tokens` cut to what fits in the context and the verify pass and what max_tokens leaves;
    `controller`: the generation's adaptive controller (None: not adaptive, draft up to `room`); `costs`: this
    round's pass costs; `probing`: whether a due probe may draft now. `guess`: a plain step's one-token guess (`GUESS`),
    asked only of a drafter that declares `guesses`; no verdict on it follows."""

    room: int
    controller: AdaptiveController | None = None
    costs: PassCostModel = SEEDED_COSTS
    probing: bool = True
    guess: bool = False

    @property
    def adaptive(self) -> bool:
        return self.controller is not None

    @property
    def level_seconds(self) -> float:
        """Seconds of one drafter call (one draft level), as measured (seeded: the fixed relative cost)."""
        return self.controller.draft_cost if self.controller is not None else 0.0

    def choose_k(self, key: Hashable = None, available: int | None = None, nodes: Callable[[int], int] | None = None) -> int:
        """The controller's draft length for proposals of class `key` (`AdaptiveController.choose_k`), at most
        `room` and `available`; `room` (or `available`) when not adaptive."""
        cap = self.room if available is None else min(self.room, available)
        if self.controller is None or cap <= 0:
            return max(cap, 0)
        return self.controller.choose_k(key, cap, nodes, self.costs, self.probing)


GUESS = Sizing(1, guess=True)  # a plain step's one-token guess: one position, not adaptive
