"""What the batch decoder's rounds cost, and whether drafting pays at its load (runtime/batch.py).

A request that drafts leaves the shared pass for a pass of its own, so its controller prices its plain step as
its share of the batched pass (`LoadPricedCosts`: the measured time of a batched pass over n rows, divided by n)
and a draft of k by the measured time of a batch-1 pass over k + 1 rows. With one request that is the
single-stream controller; with many, a shared row costs a fraction of a pass and drafting stops paying. With
slot passes a draft instead adds rows to the shared pass, priced at the slot pass's cost per row
(`SlotPassCosts`), and a round checks that its drafts pay for the switch to a slot pass (`slot_round_pays`).
Every comparison is the one expected-speed formula of runtime/costs.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import LoadPricedCosts, PassCosts, SlotPassCosts, expected_speed, faster


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
