"""What a target pass costs, and whether drafting pays: one cost protocol, one expected-speed formula.

Every decision to draft compares expected speeds, `expected_speed(tokens, pass_seconds, draft_seconds)`:
the tokens a round is expected to produce per second it takes, drafting included. An option pays when it is
`faster` than the alternative (a plain step, the round as it was). The adaptive controller picks the draft
length that is fastest (`best_draft_length`, also the lookup branch's), the tree planner the fastest prefix
of its node order (`best_prefix`), the batch decoder whether drafting can pay at its load and whether a round's drafts pay
for a slot pass.

Pass costs come from a `PassCostModel`: measured per number of verified tokens (`PassCosts`), fixed
(`FixedCosts`, seeded sampling: decisions then depend on the tokens only), or priced by a batch's load
(`LoadPricedCosts`). `SlotPassCosts` prices the batch decoder's slot passes by their rows.

The batch decoder's rounds (`BatchPricing`): a request that drafts leaves the shared pass for a pass of its own,
so its controller prices its plain step as its share of the batched pass (the measured time of a batched pass
over n rows, divided by n) and a draft of k by the measured time of a batch-1 pass over k + 1 rows. With one
request that is the single-stream controller; with many, a shared row costs a fraction of a pass and drafting
stops paying. With slot passes a draft instead adds rows to the shared pass, priced at the slot pass's cost per
row, and a round checks that its drafts pay for the switch to a slot pass (`BatchPricing.slot_round_pays`).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

MARGIN = 1e-4  # an option must be this much faster to be preferred (ties keep the plainer option)


def ema(previous: float | None, value: float, alpha: float) -> float:
    """The exponential moving average after `value` (weight `alpha`); `value` itself when there is none yet."""
    return value if previous is None else (1 - alpha) * previous + alpha * value


def expected_speed(tokens: float, pass_seconds: float, draft_seconds: float = 0.0) -> float:
    """Tokens per second of a round: `tokens` expected from a target pass of `pass_seconds` after
    `draft_seconds` of drafting."""
    return tokens / max(pass_seconds + draft_seconds, 1e-12)


def faster(speed: float, than: float) -> bool:
    """Whether `speed` beats `than` by more than the margin."""
    return speed > than * (1 + MARGIN)


def chain_tokens(acceptance: float, k: int) -> float:
    """Tokens a pass yields from a chain of k drafts, each accepted with probability `acceptance` after the
    previous one: E(k) = (1 - a^(k+1)) / (1 - a) (the accepted run plus the token the pass adds)."""
    a = min(max(acceptance, 1e-6), 1 - 1e-6)
    return (1 - a ** (k + 1)) / (1 - a)


class PassCostModel(Protocol):
    """Seconds of a target pass by the number of tokens it verifies."""

    @property
    def t1(self) -> float | None:
        """Seconds of a one-token pass; None until one was measured (a controller then takes a plain step)."""

    def seconds(self, q: int) -> float:
        """Expected seconds of a pass over q tokens."""

    def record(self, q: int, seconds: float) -> None:
        """The measured time of one pass over q tokens."""


def best_draft_length(acceptance: float, costs: PassCostModel, limit: int, draft_seconds: float = 0.0,
                      nodes: Callable[[int], int] | None = None) -> int:
    """The draft length k in [0, limit] with the highest expected speed (0: a plain step is fastest).

    A chain of k drafts yields `chain_tokens(acceptance, k)`; its pass verifies `nodes(k)` draft tokens (a tree
    of depth k; default k) plus the pending one, after k x `draft_seconds` of drafting."""
    best_k, best = 0, expected_speed(1.0, costs.seconds(1))
    for k in range(1, limit + 1):
        verified = k if nodes is None else nodes(k)
        speed = expected_speed(chain_tokens(acceptance, k), costs.seconds(verified + 1), k * draft_seconds)
        if faster(speed, best):
            best_k, best = k, speed
    return best_k


def best_prefix(rates: Sequence[float], depths: Sequence[int], costs: PassCostModel, level_seconds: float) -> int:
    """How many nodes of an order to draft (0: a plain step): the prefix with the highest expected speed, (1 + the
    sum of its acceptance `rates`) tokens from a pass over its nodes + 1 tokens, after drafting down to its
    deepest node (`depths`: each node's level) at `level_seconds` a level (the tree planner's choice)."""
    best, best_n, gain, depth = expected_speed(1.0, costs.seconds(1)), 0, 1.0, 0
    for n, (rate, level) in enumerate(zip(rates, depths), 1):
        gain += rate
        depth = max(depth, level)
        speed = expected_speed(gain, costs.seconds(n + 1), level_seconds * depth)
        if faster(speed, best):
            best, best_n = speed, n
    return best_n

@dataclass
class PassCosts(PassCostModel):
    """Measured seconds of one target pass by the number of tokens it verifies, for one engine.

    Kept per q (EMA) because the cost is a staircase (CPU GEMM kernels work on the verified rows in blocks),
    plus the line t1 + slope (q - 1) fitted to every pass for the q not measured yet, kept between the measured
    neighbours: t does not decrease with q. One instance can serve every generation of an engine (the runner
    shares it), so later prompts start from what earlier ones measured."""

    alpha: float = 0.08
    by_q: dict = field(default_factory=dict)  # q -> seconds of a pass over q tokens (EMA); change it through `set`
    slope: float | None = None  # extra seconds per extra verified token (EMA over all passes)
    _bounds: tuple | None = field(default=None, init=False, repr=False, compare=False)  # see `_neighbours`

    @property
    def t1(self) -> float | None:
        return self.by_q.get(1)

    def record(self, q: int, seconds: float) -> None:
        if q > 1 and self.t1 is not None:
            self.slope = ema(self.slope, max(0.0, (seconds - self.t1) / (q - 1)), self.alpha)
        self.set(q, ema(self.by_q.get(q), seconds, self.alpha))

    def set(self, q: int, seconds: float) -> None:
        """Take `seconds` as the cost of a pass over q tokens (a seed, or the EMA `record` keeps)."""
        self.by_q[q] = seconds
        self._bounds = None

    def line(self) -> tuple[float, float]:
        """(t1, slope) of the line fitted to every pass, with defaults until measured: t1 is at most the
        cheapest pass measured (a batched server may measure only passes over several tokens), 1 s before any."""
        t1 = self.t1 if self.t1 is not None else min(self.by_q.values(), default=1.0)
        return t1, self.slope if self.slope is not None else 0.05 * t1

    def _neighbours(self, q: int) -> tuple[float, float]:
        """(the dearest pass measured below q or 0, the cheapest measured above q or inf): from the measured q in
        order with their running max from below and running min from above, rebuilt after a change (the
        adaptive controller asks about a dozen q per step, `record` changes one)."""
        if self._bounds is None:
            qs = sorted(self.by_q)
            below, running = [], 0.0
            for k in qs:
                below.append(running)  # max over the measured q before k
                running = max(running, self.by_q[k])
            below.append(running)
            above, running = [], float("inf")
            for k in reversed(qs):
                running = min(running, self.by_q[k])
                above.append(running)
            above.reverse()
            above.append(float("inf"))  # min over the measured q from index i on
            self._bounds = (qs, below, above)
        qs, below, above = self._bounds
        i = bisect_left(qs, q)
        return below[i], above[i + 1 if i < len(qs) and qs[i] == q else i]

    def seconds(self, q: int) -> float:
        """Measured (at least what any narrower pass measured: timing noise must not make a wider pass look
        cheaper), else the line kept between the measured neighbours."""
        below, above = self._neighbours(q)
        if q in self.by_q:
            return max(self.by_q[q], below)
        t1, slope = self.line()
        return min(max(t1 + slope * (q - 1), below), above)


SEEDED_SLOPE = 0.06  # a verified token's share of a one-token pass, fused fp32 CPU graph and GPU graphs


@dataclass(frozen=True)
class FixedCosts(PassCostModel):
    """A pass over q tokens costs t1 (1 + slope (q - 1)); nothing measured changes it (seeded sampling: the
    choices, hence the random stream and the output, depend only on the tokens)."""

    t1: float = 1.0
    slope: float = SEEDED_SLOPE

    def seconds(self, q: int) -> float:
        return self.t1 * (1 + self.slope * (q - 1))

    def record(self, q: int, seconds: float) -> None:
        """Fixed: measurements are ignored."""


# The packed INT4/INT8 CPU graph (MatMulNBits at accuracy level 4): a one-row pass reads a quarter of fp32's bytes,
# but every extra row costs its integer dot products. SmolLM2-135M INT4, 1 thread (pass over q rows / one row,
# 2026-12-02): 1.10 (q=2), 1.48 (4), 2.31 (8), 3.9 (16): about 0.19 a row.
PACKED_CPU_SLOPE = 0.19


def seeded_costs(packed_cpu_graph: bool) -> "FixedCosts":
    """The fixed pass costs seeded sampling sizes drafts with (no timings: its choices depend on the tokens only),
    by the kind of target graph: what a verified token costs there relative to a one-token pass."""
    return FixedCosts(1.0, PACKED_CPU_SLOPE if packed_cpu_graph else SEEDED_SLOPE)


@dataclass
class LoadPricedCosts(PassCostModel):
    """The pass costs one request of a batch sees: a plain step is its share of the batched q = 1 pass;
    a step with a draft is a batch-1 pass of its own over the pending token + the draft (with slot passes:
    the draft's rows ride in the shared pass at `row_slope` seconds each)."""

    alone: PassCosts  # batch-1 passes by q (the runner's, shared with single-stream generations)
    shared_row: float | None  # seconds of one row of the batched plain pass at the current batch size (None: unmeasured)
    batched: PassCosts | None = None  # batched plain passes by rows: the estimate of a q-token pass until one ran
    row_slope: float | None = None  # slot passes: a draft's rows ride in the shared pass at this many seconds each

    @property
    def t1(self) -> float | None:
        """None until a plain pass was measured (the controller then takes a plain step first, as alone)."""
        return self.shared_row

    def seconds(self, q: int) -> float:
        if q == 1 and self.shared_row is not None:
            return self.shared_row
        if self.row_slope is not None and self.shared_row is not None:
            return self.shared_row + self.row_slope * (q - 1)
        if not self.alone.by_q and self.batched is not None and self.batched.by_q:
            return self.batched.seconds(q)  # a batch-1 pass over q tokens ~ a batched pass over q rows
        return self.alone.seconds(q)

    def record(self, q: int, seconds: float) -> None:
        self.alone.record(q, seconds)


@dataclass
class SlotPassCosts:
    """Seconds of a slot pass as a line in its rows (every slot's rows, dummies included): the slope, what one
    more draft row costs in the shared pass, is timed once (`calibrate`: passes of two sizes, when the decoder
    starts: `BatchDecoder.calibrate_slot_passes`); the level follows every pass (EMA). Fitting the slope online
    does not work: most rounds differ by a few rows, and timing noise then sets the slope (measured anywhere
    from 0 to 4 ms a row on SmolLM2)."""

    alpha: float = 0.1  # weight of the newest pass in the level
    row_seconds: float | None = None  # the slope (None: not calibrated)
    _base: float | None = None  # seconds of a pass minus row_seconds x its rows (EMA)
    _per_row: float | None = None  # before a calibration: seconds per row (EMA)

    def calibrate(self, rows: tuple[int, int], seconds: tuple[float, float]) -> None:
        """Two passes of different sizes, timed: their line."""
        self.row_seconds = max(0.0, (seconds[1] - seconds[0]) / (rows[1] - rows[0]))
        self._base = seconds[0] - self.row_seconds * rows[0]

    def record(self, rows: int, seconds: float) -> None:
        if self.row_seconds is not None:
            self._base = ema(self._base, seconds - self.row_seconds * rows, self.alpha)
        self._per_row = ema(self._per_row, seconds / rows, self.alpha)

    @property
    def measured(self) -> bool:
        return self._base is not None or self._per_row is not None

    def seconds(self, rows: int) -> float | None:
        """Expected seconds of a slot pass over `rows` rows (None before any)."""
        if self.row_seconds is not None and self._base is not None:
            return max(0.0, self._base + self.row_seconds * rows)
        return None if self._per_row is None else self._per_row * rows


@dataclass
class BatchPricing:
    """The measured costs of a batch decoder's passes: `alone` (batch-1 passes by q: the runner's, shared with
    single-stream generations), `batched` (batched plain passes by rows), `slots` (slot passes by rows)."""

    alone: PassCosts
    batched: PassCosts = field(default_factory=PassCosts)
    slots: SlotPassCosts = field(default_factory=SlotPassCosts)
    prior_row_share: float = 0.25  # a draft row's price before slot passes of different sizes were timed, x a shared row

    def shared_row_seconds(self, rows: int, slot_pass_slots: int | None = None) -> float | None:
        """Seconds of one row of a plain round over `rows` requests: its share of a slot pass over
        `slot_pass_slots` slots where every round is one (batch invariance), else of a batched pass (measured,
        else the line through the measured sizes; a batch of one is a batch-1 pass: its time seeds the line);
        None before any."""
        if slot_pass_slots is not None and self.slots.measured:
            return self.slots.seconds(slot_pass_slots) / rows
        if self.batched.t1 is None and self.alone.t1 is not None:
            self.batched.set(1, self.alone.t1)
        if not self.batched.by_q:
            return None
        return self.batched.seconds(rows) / rows

    def draft_row_seconds(self, shared_row: float | None) -> float | None:
        """What one draft row adds to a slot pass: as calibrated (`BatchDecoder.calibrate_slot_passes`), else a
        batch-1 pass's slope (the runner's), else a share of a plain row."""
        slope = self.slots.row_seconds
        if slope is None:
            slope = self.alone.slope
        if slope is None and shared_row is not None:
            slope = self.prior_row_share * shared_row
        return slope

    def request_costs(self, shared_row: float | None, slot_passes: bool) -> LoadPricedCosts:
        """The pass costs each request of a round sees (a draft's rows in the shared slot pass when `slot_passes`)."""
        slope = self.draft_row_seconds(shared_row) if slot_passes else None
        return LoadPricedCosts(self.alone, shared_row, self.batched, slope)

    def drafting_pays(self, shared_row: float | None, most: int, slot_passes: bool) -> bool:
        """Whether any draft of up to `most` positions could pay at this load: k drafts all accepted give k + 1
        tokens for a batch-1 pass over k + 1 rows (with slot passes: k rows more in the shared pass); a plain
        step gives one token for one shared row. Before a plain pass was measured: not yet."""
        if shared_row is None:
            return False
        costs = self.request_costs(shared_row, slot_passes)
        plain = expected_speed(1.0, shared_row)
        return any(faster(expected_speed(k + 1, costs.seconds(k + 1)), plain) for k in range(1, most + 1))

    def slot_round_pays(self, expected_tokens: float, planned: int, active: int, slot_rows: int) -> bool:
        """Whether a round's drafts pay for making it one slot pass of `slot_rows` rows: the tokens its `planned`
        requests expect from it (their controllers' estimates) per second of the slot pass, against one token per
        planned request in the time of a batched pass over the `active` ones (a slot pass runs one attention call
        per slot and layer, a batched pass one per layer). True until both kinds of pass were measured."""
        slot_seconds = self.slots.seconds(slot_rows)
        batched_seconds = self.batched.seconds(active) if self.batched.by_q else None
        if slot_seconds is None or batched_seconds is None:
            return True
        return faster(expected_speed(expected_tokens, slot_seconds), expected_speed(planned, batched_seconds))
