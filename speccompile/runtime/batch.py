"""Continuous batching of generations over the fused CPU graph: requests join and leave between steps.

Every request is a `Generation` of its own (its drafter, sampling RNG, adaptive controller, output and
stops) whose KV rows live in one slot of shared per-layer buffers [slots, kv_heads, rows, head_dim]. Its
prefill runs alone (a batch-1 pass on its slot). Each `step()` then does one round for every active request:

    planned = generation.plan_step()      each request drafts (or not) for itself
    one batched pass over the plain rows  every request with no draft: its pending token, q = 1, batch B
    one pass per request with a draft     its pending token + draft on its own slot, as when alone
    generation.complete_step(planned, out)  exact verification and commit, per request

Why not one pass over every request's draft: ONNX Runtime's GroupQueryAttention (the fused graph's attention)
accepts a batch only for one new token per sequence when there is a past ("batch_size must be 1 when
sequence_length > 1 and past context is given"). Packing several requests into one sequence would make
each row's attention run over other requests' masked rows, which changes its floating-point results
(measured ~1e-6 on the logits) and is bounded by the rotary table length. The design here keeps a row's
arithmetic as close to the request decoding alone as ONNX Runtime allows: prefill, speculative passes and the
plain passes of a lone request are batch-1 passes, the same bits as alone. A q = 1 row of a batch > 1 runs the
operator's one-row kernel (the padding row that makes a lone one-row pass compute like a multi-row pass,
export/ort_fused_graph.py, is refused at batch > 1): the same bits at every batch size > 1 and the same
function as alone (tests/test_batch.py), but not bitwise alone's, so a batched request's greedy output equal
to its output alone is tested and measured, not guaranteed by construction.

With slot passes (`Runner.batch_decoder(slot_passes="drafts"|"all")`: the slotted graph
`target.ort-slots.onnx`, `export --batch-slots`; backends/ort_slots.py) a round in which any request drafts
runs as one slot pass instead, where the drafts pay for it: every request's rows, plain or with its draft, in
one pass, each sequence's attention a GroupQueryAttention of its own, so a draft's rows compute the bits they
get alone and ride in the shared weight matmuls (a plain row there skips the padding row and computes what the
batched pass would: half the attention work, and a plain step's bits do not depend on the kind of round). A
round without drafts stays one batched pass (cheaper: one attention call per layer instead of one per slot)
unless `batch_invariant` ("all"; vLLM's term for a batch that does not change any request's bits): then every
round of two or more requests is a slot pass, every row padded as alone, and each request's logits are
bitwise its logits alone by construction.

Load-aware drafting (runtime/costs.py, `BatchPricing`): each round every request plans with the pass costs it sees at
the batch's load (`plan_step(costs=...)`), drafting stops when not even a fully accepted draft would beat a
plain row, and it turns back on as the probe steps measure that it pays. Seeded sampling keeps its fixed cost
model (choices depend only on tokens), so its output is the same batched or alone. With slot passes a request's
probe (a draft after idle steps) waits for a round that is a slot pass anyway, and a plain step still measures
a guessing drafter (`plan_step(shadow=True)`).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..errors import UnsupportedError
from .backends.ort import OrtBufferSession
from .backends.ort_slots import OrtSlotSession, SlotRows
from .costs import BatchPricing, LoadPricedCosts, PassCosts
from .generate import Generation, Generator, PlannedStep
from .options import GenerationConfig
from .prefix_cache import PREFIX_BLOCK, PrefixCache


class BatchDecoder:
    """Active generations in slots of shared KV buffers; `join`, `step`, `leave`.

    `rows`: KV rows per slot, allocated (and written, so the memory is taken) at once — a server's fixed KV pool,
    sized by the longest request it admits. Without it the buffers start with `initial_rows` rows per slot and
    double (up to the graph's rows) when a request needs more: memory follows the longest request so far.

    `new_generator()` returns a Generator for one request (its own drafter) over `session`; `pricing` collects the
    measured pass times (batched by rows, batch-1 by q: `alone_costs`, the runner's; slot passes by rows)."""

    initial_rows = 512
    prefix_cache: PrefixCache | None = None  # reuse prompt rows across requests (`join`; Runner.batch_decoder sets it)
    slot_session: OrtSlotSession | None = None  # rounds with drafts as one slot pass (Runner.batch_decoder sets it)
    batch_invariant = False  # with a slot session: every round of 2+ requests a slot pass (slot_passes="all")

    def __init__(self, session: OrtBufferSession, new_generator: Callable[[GenerationConfig], Generator],
                 slots: int, alone_costs: PassCosts, rows: int | None = None):
        if not session.batches:
            raise UnsupportedError(f"{session.spec.file} has batch 1 only (re-export for a batch axis)")
        self.session = session
        self.new_generator = new_generator
        self.slots = slots
        self.pricing = BatchPricing(alone_costs)  # the measured costs of its passes, what a round pays for
        if rows is not None and rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.rows = min(session.kv_rows, rows or self.initial_rows)  # KV rows per slot now
        self.fixed = rows is not None  # a pool allocated once: the slots never move (requests may join mid-round)
        self.buffers = session.new_batch_buffers(slots, self.rows)
        if rows is not None:
            for buffer in self.buffers:
                buffer.fill(0)  # commit the pages now: the pool's memory is taken at start, not as requests arrive
        self.active: list[Generation] = []  # active[i] lives in slot i
        self.batched_passes = 0
        self.slot_passes = 0  # rounds run as one slot pass

    @property
    def kv_bytes(self) -> int:
        """Bytes of the slot buffers (every layer's keys and values)."""
        return sum(buffer.nbytes for buffer in self.buffers)

    @property
    def free(self) -> int:
        return self.slots - len(self.active)

    def join(self, prompt_ids: list[int], config: GenerationConfig, on_text: Callable[[str], None] | None = None,
             defer_prefill: bool = False) -> Generation:
        """Prefill a new request in the next free slot (alone) and emit its first token; it decodes with the
        batch from the next `step()` unless it is already done. With a `prefix_cache`, the rows it holds of
        the prompt (whole blocks or prefill chunks, or the whole prompt) are copied into the slot instead of prefilled,
        and what the prefill computed is kept for later prompts (exact: runtime/prefix_cache.py).
        `defer_prefill`: take the slot now and prefill during the next steps, between passes (`_advance_prefills`:
        a prompt of one chunk at once, a longer one a chunk at a time, shortest remaining first)."""
        if not self.free:
            raise RuntimeError("every batch slot is taken")
        slot = len(self.active)
        generator = self.new_generator(config)
        self._ensure_rows(len(prompt_ids) + generator.max_verify_tokens)
        cache = self.session.slot_cache(self.buffers, slot)
        caching = self.prefix_cache is not None and generator.resumes_prefill
        hit = (self.prefix_cache.lookup(self.session, self._prefix_block(config), prompt_ids, partial=self.session.row_invariant)
               if caching and prompt_ids else None)
        if hit is not None:
            hit.copy_into(cache.arrays)
            cache.append([], range(hit.rows), hit.rows)
        generation = generator.start(prompt_ids, config, on_text, cache, hit and hit.logits, hit.rows if hit else 0,
                                     defer_prefill)
        if not generation.prefilling:
            self._prefilled(generation, hit is not None and hit.full)
        if not generation.done:
            self.active.append(generation)
        return generation

    def cached_prompt_logits(self, prompt_ids: list[int], config: GenerationConfig) -> np.ndarray | None:
        """The last logits of `prompt_ids` when the prefix cache holds the whole prompt for this decoder's graph
        (what `join` would start from), else None. Safe from another thread than the one that steps: it reads
        only the (locked) prefix cache."""
        if self.prefix_cache is None or not prompt_ids:
            return None
        return self.prefix_cache.whole_prompt_logits(self.session, self._prefix_block(config), prompt_ids)

    def _prefilled(self, generation: Generation, whole_prompt_hit: bool = False) -> None:
        """A prompt is prefilled: keep what it computed in the prefix cache."""
        if (self.prefix_cache is not None and generation.generator.resumes_prefill and not whole_prompt_hit
                and generation.prompt_logits is not None):  # (None: the graph's ArgMax chose the first token)
            self.prefix_cache.store(self.session, self._prefix_block(generation.config), generation.prompt_ids,
                                    generation.cache.arrays, generation.prompt_logits)

    def _prefix_block(self, config: GenerationConfig) -> int:
        """The prefix cache's granularity: blocks of PREFIX_BLOCK tokens where the graph computes a row alike
        in any pass (any cached prefix then stands in for a prefill), else whole prefill chunks."""
        return PREFIX_BLOCK if self.session.row_invariant else config.prefill_chunk

    def _advance_prefills(self) -> None:
        """Deferred prompts (`join(defer_prefill=True)`), shortest remaining first: every one that needs a
        single chunk more is finished (its first token now, as a prompt prefilled at join), then one chunk of
        the shortest longer one. A long prompt thus takes its chunks between other requests' passes, and a
        short prompt arriving meanwhile waits for one chunk of it, not for all of it."""
        waiting = sorted((g for g in self.active if g.prefilling), key=lambda g: g.prefill_remaining)
        last_chunk = [g for g in waiting if g.prefill_remaining <= g.config.prefill_chunk]
        longer = [g for g in waiting if g.prefill_remaining > g.config.prefill_chunk]
        for generation in last_chunk + longer[:1]:
            generation.prefill_next_chunk()
            if not generation.prefilling:
                self._prefilled(generation)

    def join_many(self, requests: list[tuple[list[int], GenerationConfig, Callable[[str], None] | None]],
                  prefill_together: bool = True, defer_prefill: bool = False) -> list:
        """Join several requests (at most `free`). `prefill_together`: prompts that fit one prefill chunk are
        prefilled together in one pass (bitwise the logits and KV of prefilling each alone), the others alone,
        in order (with a `prefix_cache`, every prompt joins alone: a padded pass's rows are not what a
        fresh prefill computes, so they are neither cached nor served from the cache; so does a request whose
        drafter reads the prompt's hidden states, which a batched prefill does not hand it). Returns, per request,
        its Generation or the exception that refused it.

        Prefill is compute-bound on a CPU: one pass over all prompts takes about as long as their passes one
        after another, so together every request waits for the whole batch, while one at a time (shortest
        first) the first ones start streaming early (lower median time to first token; the server does that)."""
        if len(requests) > self.free:
            raise RuntimeError("more requests than free batch slots")
        if defer_prefill:
            return [self._join_or_error(ids, config, on_text, True) for ids, config, on_text in requests]
        candidates = {i: self.new_generator(config) for i, (ids, config, _) in enumerate(requests)
                      if prefill_together and self.prefix_cache is None and self._prefills_together(ids, config)}
        together = [i for i, generator in candidates.items() if generator.resumes_prefill]  # (a head reads the prefill's hidden states)
        if len(together) < 2:
            together = []
        results: list = [None] * len(requests)
        if together:
            first = len(self.active)
            generators = [candidates[i] for i in together]
            self._ensure_rows(max(len(requests[i][0]) + g.max_verify_tokens for i, g in zip(together, generators)))
            t0 = time.perf_counter()
            logits = self.session.prefill_batch(self.buffers, first, [np.asarray(requests[i][0]) for i in together])
            generators[0].clock.seconds += time.perf_counter() - t0
            for slot, (i, generator, last) in enumerate(zip(together, generators, logits), start=first):
                ids, config, on_text = requests[i]
                cache = self.session.slot_cache(self.buffers, slot)
                cache.append([], range(len(ids)), len(ids))
                results[i] = generator.start(ids, config, on_text, cache, last)
                self.active.append(results[i])
            for generation in [g for g in results if isinstance(g, Generation) and g.done]:
                self.leave(generation)
        for i, (ids, config, on_text) in enumerate(requests):
            if i not in together:
                results[i] = self._join_or_error(ids, config, on_text)
        return results

    def _join_or_error(self, ids: list[int], config: GenerationConfig, on_text, defer_prefill: bool = False):
        try:
            return self.join(ids, config, on_text, defer_prefill)
        except Exception as exc:
            return exc

    def _prefills_together(self, ids: list[int], config: GenerationConfig) -> bool:
        """A valid request whose prompt is one prefill chunk (the others join alone, where errors are raised)."""
        try:
            config.validate()
        except Exception:
            return False
        return (0 < len(ids) <= config.prefill_chunk and len(ids) + 1 <= (self.session.max_context or len(ids) + 1)
                and not self.session.lifts_passes)  # head_dim > 128: a batched prefill is not lifted as alone

    def warm_up(self, config: GenerationConfig, token: int = 0) -> None:
        """Run the decoder's largest passes once — a whole prefill chunk, then batched steps over every slot — so
        ONNX Runtime's memory arena has its working size before the first request (a server's memory is then
        flat from the start, as vLLM's profiling run at startup). `config`: a short greedy generation config.
        Leaves the decoder empty."""
        if self.active:
            raise RuntimeError("warm_up needs an empty decoder")
        chunk = max(1, min(config.prefill_chunk, self.rows - config.max_tokens - self.new_generator(config).max_verify_tokens))
        prompts = [[token] * chunk] + [[token]] * (self.slots - 1)
        self.join_many([(ids, config, None) for ids in prompts], prefill_together=False)
        while self.active:
            self.step()

    def calibrate_slot_passes(self, rows_per_slot: int, token: int = 0, repeats: int = 3) -> None:
        """Time slot passes of one row and of `rows_per_slot` rows in every slot (scratch KV rows at the start of
        each slot, which the next requests overwrite): the price of a draft row (`SlotPassCosts.calibrate`).
        Needs an empty decoder with a slot session."""
        if self.active or self.slot_session is None:
            raise RuntimeError("calibrate_slot_passes needs an empty decoder with a slot session")
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

    def leave(self, generation: Generation) -> None:
        """Free a request's slot (finished or cancelled); the last slot's rows move into it (slots stay dense)."""
        slot = self.active.index(generation)
        last = self.active.pop()
        if last is generation:
            return
        rows = last.cache.length
        for buffer in self.buffers:
            buffer[slot, :, :rows] = buffer[len(self.active), :, :rows]
        last.cache.point_at([b[slot: slot + 1] for b in self.buffers])
        self.active[slot] = last

    def _ensure_rows(self, rows: int) -> None:
        """Grow every slot to hold `rows` KV rows (+ the slots attention's padding rows take, `pad_rows`;
        doubling, bounded by the graph's), keeping the active rows."""
        rows += self.session.pad_rows
        if rows <= self.rows:
            return
        self.rows = min(self.session.kv_rows, max(rows, 2 * self.rows))
        old, self.buffers = self.buffers, self.session.new_batch_buffers(self.slots, self.rows)
        for slot, generation in enumerate(self.active):
            length = generation.cache.length
            for new, previous in zip(self.buffers, old):
                new[slot, :, :length] = previous[slot, :, :length]
            generation.cache.point_at([b[slot: slot + 1] for b in self.buffers])

    def step(self, between_passes: Callable[[], None] | None = None) -> list[Generation]:
        """One round for every active request; returns (and removes) those that finished.

        `between_passes` (a fixed pool only) is called after each pass of the round: a server admits new
        requests there (`join`), so a newcomer waits for one pass rather than the whole round; it joins the
        rounds from the next one (the slots of this round's requests stay where they are). After each pass
        (after the hook) the deferred prefills advance (`join(defer_prefill=True)`, `_advance_prefills`), and in
        a round with nothing to decode too."""
        if not self.active:
            return []
        hook = between_passes if self.fixed else None

        def after_pass() -> None:
            if hook:
                hook()
            self._advance_prefills()

        self._ensure_rows(max(g.cache.length for g in self.active) + max(g.generator.max_verify_tokens for g in self.active))
        slot_capable = self._slot_capable()
        shared_row = self.shared_row_seconds(len(self.active))
        drafting = self.drafting_pays(shared_row)
        costs = self.pricing.request_costs(shared_row, slot_capable)  # one per round, the same for every request (seeded ones keep their own)
        probing = len(self.active) == 1  # batched, a probe waits for a slot round (`_probe_idle`)
        plans: list[PlannedStep | None] = []
        for generation in self.active:
            if generation.prefilling:  # no token to decode yet: its chunks run between the passes
                plans.append(None)
                continue
            controller = generation.controller
            plans.append(generation.plan_step(drafting or controller.deterministic or not generation.config.adaptive,
                                              slot_capable, costs, probing))
        slotted = slot_capable and any(p is not None for p in plans) and (
            self.batch_invariant or any(p is not None and p.draft.tokens for p in plans))
        if slotted and not self.batch_invariant and not self._slot_round_pays(plans):
            self._drop_drafts(plans)
            slotted = False
        outputs = {}
        if slotted:
            self._probe_idle(plans, costs)
            outputs.update(self._slot_pass(plans))
            after_pass()
        else:
            plain = [i for i, p in enumerate(plans) if p is not None and not p.draft.tokens]
            if plain:
                outputs.update(self._batched_pass(plans, plain))
                after_pass()
            for i, planned in enumerate(plans):
                if planned is not None and planned.draft.tokens:
                    outputs[i] = self.active[i].verify_pass(planned)
                    after_pass()
        if not outputs:
            self._advance_prefills()
        for i, out in outputs.items():
            self.active[i].complete_step(plans[i], out)
        finished = [g for g in self.active if g.done]
        for generation in finished:
            self.leave(generation)
        return finished

    def _batched_pass(self, plans: list[PlannedStep | None], plain: list[int]) -> dict:
        """One q = 1 pass over slots 0..h (h: the last plain request); slots in between that draft or are
        done get a row too (their KV row lands past what they commit, their logits are dropped)."""
        rows = self.active[: plain[-1] + 1]
        one = np.ones((1, 1), dtype=bool)
        inputs = [(np.asarray([g.tokens[-1]]), np.asarray([g.cache.length]), one) for g in rows]
        t0 = time.perf_counter()
        outs = self.session.run_batch(self.buffers, inputs, [g.cache for g in rows])
        seconds = time.perf_counter() - t0
        self.batched_passes += 1
        self.pricing.batched.record(len(rows), seconds)
        if len(rows) == 1:
            self.pricing.alone.record(1, seconds)
        self.active[0].generator.clock.seconds += seconds
        for i in plain:
            self.active[i].stats.time_verify += seconds
        return {i: outs[i] for i in plain}

    def _slot_capable(self) -> bool:
        """Whether a round may run as one slot pass: a slot graph and two or more requests (one runs alone)."""
        return self.slot_session is not None and len(self.active) >= 2

    def _slot_pass_rows(self, plans: list[PlannedStep | None]) -> int:
        """Rows of a slot pass whose first slots carry these plans (a request without one: a dummy row); every
        other slot gets a dummy row."""
        request_rows = [len(p.ids) if p is not None else 1 for p in plans]
        return sum(request_rows) + self.slot_session.slots - len(request_rows)

    def _slot_round_pays(self, plans: list[PlannedStep | None]) -> bool:
        """Whether this round's drafts pay for making it one slot pass (`BatchPricing.slot_round_pays`)."""
        expected = sum(self._expected_tokens(generation, planned)
                       for generation, planned in zip(self.active, plans) if planned is not None)
        planned = sum(p is not None for p in plans)
        return self.pricing.slot_round_pays(expected, planned, len(self.active), self._slot_pass_rows(plans))

    @staticmethod
    def _expected_tokens(generation: Generation, planned: PlannedStep) -> float:
        """Tokens a request expects from its planned step: 1 for a plain step, a carried chain's all (it was
        accepted once), else its controller's estimate for the draft's depth and kind."""
        draft = planned.draft
        if not draft.tokens:
            return 1.0
        if draft.carried:
            return 1.0 + len(draft.tokens)
        return generation.controller.expected_tokens(draft.depth, draft.key)

    def _drop_drafts(self, plans: list[PlannedStep | None]) -> None:
        """Plan every request that drafted this round again as a plain step (its draft is not verified)."""
        for i, (generation, planned) in enumerate(zip(self.active, plans)):
            if planned is not None and planned.draft.tokens:
                plans[i] = generation.plan_step(False, shadow=True)

    def _probe_idle(self, plans: list[PlannedStep | None], costs: LoadPricedCosts) -> None:
        """A round that is one slot pass anyway: plan again every request without a draft, with probing on, so
        one whose probe is due drafts now (a few rows more in this pass, not a pass of its own)."""
        for i, (generation, planned) in enumerate(zip(self.active, plans)):
            controller = generation.controller
            if planned is None or planned.draft.tokens or controller.deterministic or not generation.config.adaptive:
                continue
            plans[i] = generation.plan_step(True, True, costs, probing=True)

    def _slot_pass(self, plans: list[PlannedStep | None]) -> dict:
        """Every request's rows, plain or with its draft, in one pass of the slotted graph (requests still
        prefilling and free slots get a dummy row). Draft rows compute the bits they get alone; a plain row too
        when `batch_invariant`, else it skips attention's padding row and computes the bits a batched pass gives
        it (bitwise: tests/test_ort_slots.py), so a plain step does not depend on which kind of round ran it."""
        rows = [SlotRows(p.ids, p.positions, p.new_mask) if p is not None else None for p in plans]
        t0 = time.perf_counter()
        outs = self.slot_session.run(self.buffers, self.session.past_names, rows, [g.cache for g in self.active],
                                     pad_one_row=self.batch_invariant)
        seconds = time.perf_counter() - t0
        self.pricing.slots.record(self._slot_pass_rows(plans), seconds)
        self.slot_passes += 1
        self.active[0].generator.clock.seconds += seconds
        for i, planned in enumerate(plans):
            if planned is not None:
                self.active[i].stats.time_verify += seconds
        return {i: out for i, out in enumerate(outs) if out is not None}

    def shared_row_seconds(self, rows: int) -> float | None:
        """Seconds of one row of a plain round over `rows` requests (`BatchPricing.shared_row_seconds`)."""
        every_round_a_slot_pass = self._slot_capable() and self.batch_invariant
        return self.pricing.shared_row_seconds(rows, self.slot_session.slots if every_round_a_slot_pass else None)

    def drafting_pays(self, shared_row: float | None) -> bool:
        """Whether any draft could pay at this load (`BatchPricing.drafting_pays`): when not, nobody drafts."""
        most = max(g.config.num_draft_tokens for g in self.active)
        return self.pricing.drafting_pays(shared_row, most, self._slot_capable())
