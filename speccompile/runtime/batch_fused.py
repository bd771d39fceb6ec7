"""The batch decoder's mode over the fused ONNX Runtime CPU graph with a batch axis (runtime/batch.py's docstring).

Every request's KV rows live in one slot of shared per-layer buffers [slots, kv_heads, rows, head_dim]; a round
runs the plain rows of every request in one batched q = 1 pass and each draft in a batch-1 pass on its own slot,
or (with a slotted graph, `slot_passes`) the whole round as one slot pass, as load-aware pricing decides
(runtime/costs.py `BatchPricing`).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from ..errors import UnsupportedError
from .backends.base import StepOutput
from .backends.ort import OrtBufferSession
from .backends.ort_slots import OrtSlotSession, SlotRows
from .batch_passes import Plans, RoundPasses
from .costs import BatchPricing, LoadPricedCosts, PassCosts
from .generate import Generation


class FusedGraphPasses(RoundPasses):
    """KV slots in shared buffers of the fused CPU graph; plain rows batched, drafts alone or in one slot pass.

    `rows`: KV rows per slot, allocated (and written, so the memory is taken) at once — a server's fixed KV pool,
    sized by the longest request it admits. Without it the buffers start with `initial_rows` rows per slot and
    double (up to the graph's rows) when a request needs more: memory follows the longest request so far.
    `pricing` collects the measured pass times (batched by rows, batch-1 by q: `alone_costs`, the runner's; slot
    passes by rows). `slot_session`: rounds with drafts as one slot pass (`batch_invariant`: every round of 2+
    requests; Runner.batch_decoder sets both)."""

    initial_rows = 512
    shares_passes = True
    keeps_prefixes = True
    slot_session: OrtSlotSession | None = None
    batch_invariant = False

    def __init__(self, session: OrtBufferSession, slots: int, alone_costs: PassCosts, rows: int | None = None):
        if not session.batches:
            raise UnsupportedError(f"{session.spec.file} has batch 1 only (re-export for a batch axis)")
        super().__init__(session)
        self.slots = slots
        self.pricing = BatchPricing(alone_costs)  # the measured costs of its passes, what a round pays for
        if rows is not None and rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self._rows = min(session.kv_rows, rows or self.initial_rows)  # KV rows per slot now
        self.fixed = rows is not None  # a pool allocated once: the slots never move (requests may join mid-round)
        self.buffers = session.new_batch_buffers(slots, self._rows)
        if rows is not None:
            for buffer in self.buffers:
                buffer.fill(0)  # commit the pages now: the pool's memory is taken at start, not as requests arrive
        self.batched_passes = 0
        self.slot_passes = 0

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def kv_bytes(self) -> int:
        """Bytes of the slot buffers (every layer's keys and values)."""
        return sum(buffer.nbytes for buffer in self.buffers)

    def cache(self, slot: int):
        return self.session.slot_cache(self.buffers, slot)

    @property
    def mode(self) -> dict[str, str]:
        """Fused passes; slot passes as set (head_dim > 128 forces "all": Runner._fused_passes)."""
        slot_passes = "off" if self.slot_session is None else ("all" if self.batch_invariant else "drafts")
        return {"passes": "fused", "slot_passes": slot_passes}

    @property
    def prefills_together(self) -> bool:
        """Prompts may share a prefill pass, except at head_dim > 128 (a batched prefill is not lifted as alone)."""
        return not self.session.wide_head_passes

    def prefill_batch(self, first_slot: int, prompts: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.prefill_batch(self.buffers, first_slot, prompts)

    def moved(self, generation: Generation, source: int, slot: int) -> None:
        rows = generation.cache.length
        for buffer in self.buffers:
            buffer[slot, :, :rows] = buffer[source, :, :rows]
        generation.cache.point_at([b[slot: slot + 1] for b in self.buffers])

    def make_room(self, active: Sequence[Generation], rows: int) -> None:
        """Grow every slot to hold `rows` KV rows (+ the slots attention's padding rows take, `pad_rows`;
        doubling, bounded by the graph's), keeping the active rows."""
        rows += self.session.pad_rows
        if rows <= self._rows:
            return
        self._rows = min(self.session.kv_rows, max(rows, 2 * self._rows))
        old, self.buffers = self.buffers, self.session.new_batch_buffers(self.slots, self._rows)
        for slot, generation in enumerate(active):
            length = generation.cache.length
            for new, previous in zip(self.buffers, old):
                new[slot, :, :length] = previous[slot, :, :length]
            generation.cache.point_at([b[slot: slot + 1] for b in self.buffers])

    def calibrate_slot_passes(self, rows_per_slot: int, token: int = 0, repeats: int = 3) -> None:
        """Time slot passes of one row and of `rows_per_slot` rows in every slot (scratch KV rows at the start of
        each slot, which the next requests overwrite): the price of a draft row (`SlotPassCosts.calibrate`).
        Call before any request joins, with a slot session."""
        if self.slot_session is None:
            raise RuntimeError("calibrate_slot_passes needs a slot session")
        rows_per_slot = max(2, min(rows_per_slot, self.rows - 1))
        caches = [self.session.slot_cache(self.buffers, b) for b in range(min(self.slots, self.slot_session.slots))]
        sizes, timings = [], []
        for q in (1, rows_per_slot):
            rows = [SlotRows(np.full(q, token, np.int64), np.arange(q), np.tril(np.ones((q, q), bool))) for _ in caches]
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                self.slot_session.run(self.buffers, self.session.past_names, rows, caches, pad_one_row=self.batch_invariant)
                best = min(best, time.perf_counter() - t0)
            sizes.append(sum([q] * len(caches)) + self.slot_session.slots - len(caches))
            timings.append(best)
        self.pricing.slots.calibrate((sizes[0], sizes[1]), (timings[0], timings[1]))

    def round(self, active: list[Generation], after_pass: Callable[[], None]) -> tuple[Plans, dict[int, StepOutput]]:
        """Plan every request at the batch's load, then run the round as one slot pass (when a slot graph is there
        and the drafts pay for it, or `batch_invariant`) or as one batched pass over the plain rows plus one pass
        per draft."""
        slot_capable = self._slot_capable(active)
        shared_row = self.shared_row_seconds(len(active), active)
        drafting = self.drafting_pays(shared_row, active)
        costs = self.pricing.request_costs(shared_row, slot_capable)  # one per round, the same for every request (seeded ones keep their own)
        probing = len(active) == 1  # batched, a probe waits for a slot round (`_probe_idle`)
        plans: Plans = []
        for generation in active:
            if generation.prefilling:  # no token to decode yet: its chunks run between the passes
                plans.append(None)
                continue
            plans.append(generation.plan_step(drafting or generation.paced_alone, slot_capable, costs, probing))
        slotted = slot_capable and any(p is not None for p in plans) and (
            self.batch_invariant or any(p is not None and p.draft.tokens for p in plans))
        if slotted and not self.batch_invariant and not self._slot_round_pays(active, plans):
            self._drop_drafts(active, plans)
            slotted = False
        outputs = {}
        if slotted:
            self._probe_idle(active, plans, costs)
            outputs.update(self._slot_pass(active, plans))
            after_pass()
            return plans, outputs
        plain = [i for i, p in enumerate(plans) if p is not None and not p.draft.tokens]
        if plain:
            outputs.update(self._batched_pass(active, plans, plain))
            after_pass()
        for i, planned in enumerate(plans):
            if planned is not None and planned.draft.tokens:
                outputs[i] = active[i].verify_pass(planned)
                after_pass()
        return plans, outputs

    def _batched_pass(self, active: list[Generation], plans: Plans, plain: list[int]) -> dict:
        """One q = 1 pass over slots 0..h (h: the last plain request); slots in between that draft or are
        done get a row too (their KV row lands past what they commit, their logits are dropped)."""
        rows = active[: plain[-1] + 1]
        one = np.ones((1, 1), dtype=bool)
        inputs = [(np.asarray([g.pending_token]), np.asarray([g.cache.length]), one) for g in rows]
        t0 = time.perf_counter()
        outs = self.session.run_batch(self.buffers, inputs, [g.cache for g in rows])
        seconds = time.perf_counter() - t0
        self.batched_passes += 1
        self.pricing.batched.record(len(rows), seconds)
        if len(rows) == 1:
            self.pricing.alone.record(1, seconds)
        active[0].charge_engine(seconds)
        for i in plain:
            active[i].shared_pass(seconds)
        return {i: outs[i] for i in plain}

    def _slot_capable(self, active: Sequence[Generation]) -> bool:
        """Whether a round may run as one slot pass: a slot graph and two or more requests (one runs alone)."""
        return self.slot_session is not None and len(active) >= 2

    def _slot_pass_rows(self, plans: Plans) -> int:
        """Rows of a slot pass whose first slots carry these plans (a request without one: a dummy row); every
        other slot gets a dummy row."""
        request_rows = [len(p.ids) if p is not None else 1 for p in plans]
        return sum(request_rows) + self.slot_session.slots - len(request_rows)

    def _slot_round_pays(self, active: list[Generation], plans: Plans) -> bool:
        """Whether this round's drafts pay for making it one slot pass (`BatchPricing.slot_round_pays`)."""
        expected = sum(generation.expected_tokens(planned) for generation, planned in zip(active, plans) if planned is not None)
        planned = sum(p is not None for p in plans)
        return self.pricing.slot_round_pays(expected, planned, len(active), self._slot_pass_rows(plans))

    def _drop_drafts(self, active: list[Generation], plans: Plans) -> None:
        """Plan every request that drafted this round again as a plain step (its draft is not verified)."""
        for i, (generation, planned) in enumerate(zip(active, plans)):
            if planned is not None and planned.draft.tokens:
                plans[i] = generation.plan_step(False, shadow=True)

    def _probe_idle(self, active: list[Generation], plans: Plans, costs: LoadPricedCosts) -> None:
        """A round that is one slot pass anyway: plan again every request without a draft, with probing on, so
        one whose probe is due drafts now (a few rows more in this pass, not a pass of its own)."""
        for i, (generation, planned) in enumerate(zip(active, plans)):
            if planned is None or planned.draft.tokens or generation.paced_alone:
                continue
            plans[i] = generation.plan_step(True, True, costs, probing=True)

    def _slot_pass(self, active: list[Generation], plans: Plans) -> dict:
        """Every request's rows, plain or with its draft, in one pass of the slotted graph (requests still
        prefilling and free slots get a dummy row). Draft rows compute the bits they get alone; a plain row too
        when `batch_invariant`, else it skips attention's padding row and computes the bits a batched pass gives
        it (bitwise: tests/test_ort_slots.py), so a plain step does not depend on which kind of round ran it."""
        rows = [SlotRows(p.ids, p.positions, p.new_mask) if p is not None else None for p in plans]
        t0 = time.perf_counter()
        outs = self.slot_session.run(self.buffers, self.session.past_names, rows, [g.cache for g in active],
                                     pad_one_row=self.batch_invariant)
        seconds = time.perf_counter() - t0
        self.pricing.slots.record(self._slot_pass_rows(plans), seconds)
        self.slot_passes += 1
        active[0].charge_engine(seconds)
        for i, planned in enumerate(plans):
            if planned is not None:
                active[i].shared_pass(seconds)
        return {i: out for i, out in enumerate(outs) if out is not None}

    def shared_row_seconds(self, rows: int, active: Sequence[Generation]) -> float | None:
        """Seconds of one row of a plain round over `rows` requests (`BatchPricing.shared_row_seconds`)."""
        every_round_a_slot_pass = self._slot_capable(active) and self.batch_invariant
        return self.pricing.shared_row_seconds(rows, self.slot_session.slots if every_round_a_slot_pass else None)

    def drafting_pays(self, shared_row: float | None, active: Sequence[Generation]) -> bool:
        """Whether any draft could pay at this load (`BatchPricing.drafting_pays`): when not, nobody drafts."""
        most = max(g.num_draft_tokens for g in active)
        return self.pricing.drafting_pays(shared_row, most, self._slot_capable(active))
