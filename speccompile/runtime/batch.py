"""Continuous batching of generations: requests join and leave between steps, on every backend.

`BatchDecoder` owns the request lifecycle (join, step, leave, deferred prefills); how a round's target passes run,
and where each request's KV rows live, is its `RoundPasses` (runtime/batch_passes.py): `FusedGraphPasses`
(batch_fused.py, the fused ONNX Runtime CPU graph with a batch axis, described below) or `OnePassPerRequest` (any
backend: each request its own KV cache and its own pass each round, the bits it gets alone).

In the fused mode every request is a `Generation` of its own (its drafter, sampling RNG, adaptive controller, output and
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

from .batch_passes import RoundPasses
from .generate import Generation, Generator
from .options import GenerationConfig
from .prefix_cache import PREFIX_BLOCK, PrefixCache


class BatchDecoder:
    """Active generations decoding together; `join`, `step`, `leave`. `passes` decides where their KV rows live
    and which target passes a round runs (runtime/batch_passes.py); `new_generator(config)` returns a Generator
    for one request (its own drafter)."""

    prefix_cache: PrefixCache | None = None  # reuse prompt rows across requests (`join`; Runner.batch_decoder sets it)

    def __init__(self, passes: RoundPasses, new_generator: Callable[[GenerationConfig], Generator]):
        self.passes = passes
        self.session = passes.session
        self.new_generator = new_generator
        self.slots = passes.slots
        self.active: list[Generation] = []  # active[i] lives in slot i

    @property
    def rows(self) -> int:
        """KV rows one request may hold now."""
        return self.passes.rows

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV memory the decoder holds for its slots."""
        return self.passes.kv_bytes

    @property
    def batched_passes(self) -> int:
        return self.passes.batched_passes

    @property
    def slot_passes(self) -> int:
        return self.passes.slot_passes

    @property
    def keeps_prefixes(self) -> bool:
        """Whether a prefix cache serves (and learns from) this decoder's prompts."""
        return self.passes.keeps_prefixes

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
        self.passes.make_room(self.active, len(prompt_ids) + generator.max_verify_tokens)
        cache = self.passes.cache(slot)
        try:
            caching = self._caching() and generator.resumes_prefill
            hit = (self.prefix_cache.lookup(self.session, self._prefix_block(config.prefill_chunk), prompt_ids, partial=self.session.row_invariant)
                   if caching and prompt_ids else None)
            if hit is not None:
                hit.copy_into(cache.arrays)
                cache.append([], range(hit.rows), hit.rows)
            generation = generator.start(prompt_ids, config, on_text, cache, hit and hit.logits, hit.rows if hit else 0,
                                         defer_prefill)
            if not generation.prefilling:
                self._prefilled(generation, hit is not None and hit.full)
        except BaseException:
            self.passes.release(cache)
            raise
        if generation.done:
            self.passes.release(cache)
        else:
            self.active.append(generation)
        return generation

    def cached_prompt_logits(self, prompt_ids: list[int], config: GenerationConfig) -> np.ndarray | None:
        """The last logits of `prompt_ids` when the prefix cache holds the whole prompt for this decoder's graph
        (what `join` would start from), else None. Safe from another thread than the one that steps: it reads
        only the (locked) prefix cache."""
        if not self._caching() or not prompt_ids:
            return None
        return self.prefix_cache.whole_prompt_logits(self.session, self._prefix_block(config.prefill_chunk), prompt_ids)

    def _prefilled(self, generation: Generation, whole_prompt_hit: bool = False) -> None:
        """A prompt is prefilled: keep what it computed in the prefix cache."""
        kept = generation.prompt_to_keep() if self._caching() and not whole_prompt_hit else None
        if kept is not None:
            prompt_ids, logits, prefill_chunk = kept
            self.prefix_cache.store(self.session, self._prefix_block(prefill_chunk), prompt_ids, generation.cache.arrays,
                                    logits)

    def _caching(self) -> bool:
        """Whether prompts go through the prefix cache: one is set and this decoder's mode keeps prefixes."""
        return self.prefix_cache is not None and self.passes.keeps_prefixes

    def _prefix_block(self, prefill_chunk: int) -> int:
        """The prefix cache's granularity: blocks of PREFIX_BLOCK tokens where the graph computes a row alike
        in any pass (any cached prefix then stands in for a prefill), else whole prefill chunks."""
        return PREFIX_BLOCK if self.session.row_invariant else prefill_chunk

    def _advance_prefills(self) -> None:
        """Deferred prompts (`join(defer_prefill=True)`), shortest remaining first: every one that needs a
        single chunk more is finished (its first token now, as a prompt prefilled at join), then one chunk of
        the shortest longer one. A long prompt thus takes its chunks between other requests' passes, and a
        short prompt arriving meanwhile waits for one chunk of it, not for all of it. Where prompts share prefill
        passes (`RoundPasses.shares_prefill`: the GPU slot form) every waiting prompt takes its next chunk, together."""
        waiting = sorted((g for g in self.active if g.prefilling), key=lambda g: g.prefill_remaining)
        if not self.passes.shares_prefill:  # (shared passes: every waiting prompt's next chunk, together)
            waiting = [g for g in waiting if g.prefill_last_chunk] + [g for g in waiting if not g.prefill_last_chunk][:1]
        if not waiting:
            return
        self.passes.prefill(waiting)
        for generation in waiting:
            if not generation.prefilling:
                self._prefilled(generation)

    def join_many(self, requests: list[tuple[list[int], GenerationConfig, Callable[[str], None] | None]],
                  prefill_together: bool = True, defer_prefill: bool = False) -> list:
        """Join several requests (at most `free`). `prefill_together`: prompts that fit one prefill chunk are
        prefilled together in one pass (bitwise the logits and KV of prefilling each alone), the others alone
        (where passes share prefill, `RoundPasses.shares_prefill`, every prompt's chunks share passes),
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
        if prefill_together and self.passes.shares_prefill:  # (the GPU slot form): deferred, then in shared passes
            results = [self._join_or_error(ids, config, on_text, True) for ids, config, on_text in requests]
            while any(g.prefilling for g in self.active):
                self._advance_prefills()
            for generation in [g for g in results if isinstance(g, Generation) and g.done]:
                self.leave(generation)
            return results
        candidates = {i: self.new_generator(config) for i, (ids, config, _) in enumerate(requests)
                      if prefill_together and self.passes.prefills_together and not self._caching()
                      and self._prefills_together(ids, config)}
        together = [i for i, generator in candidates.items() if generator.resumes_prefill]  # (a head reads the prefill's hidden states)
        if len(together) < 2:
            together = []
        results: list = [None] * len(requests)
        if together:
            first = len(self.active)
            generators = [candidates[i] for i in together]
            self.passes.make_room(self.active, max(len(requests[i][0]) + generator.max_verify_tokens for i, generator in zip(together, generators)))
            t0 = time.perf_counter()
            logits = self.passes.prefill_batch(first, [np.asarray(requests[i][0]) for i in together])
            generators[0].clock.seconds += time.perf_counter() - t0
            for slot, (i, generator, last) in enumerate(zip(together, generators, logits), start=first):
                ids, config, on_text = requests[i]
                cache = self.passes.cache(slot)
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
        return 0 < len(ids) <= config.prefill_chunk and len(ids) + 1 <= (self.session.max_context or len(ids) + 1)

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

    def leave(self, generation: Generation) -> None:
        """Free a request's slot (finished or cancelled); the last slot's request moves into it (slots stay dense)."""
        slot = self.active.index(generation)
        self.passes.release(generation.cache)
        last = self.active.pop()
        if last is generation:
            return
        self.passes.moved(last, len(self.active), slot)
        self.active[slot] = last

    def step(self, between_passes: Callable[[], None] | None = None) -> list[Generation]:
        """One round for every active request; returns (and removes) those that finished.

        `between_passes` (a fixed pool only) is called after each pass of the round: a server admits new
        requests there (`join`), so a newcomer waits for one pass rather than the whole round; it joins the
        rounds from the next one (the slots of this round's requests stay where they are). After each pass
        (after the hook) the deferred prefills advance (`join(defer_prefill=True)`, `_advance_prefills`), and in
        a round with nothing to decode too."""
        if not self.active:
            return []
        hook = between_passes if self.passes.fixed else None

        def after_pass() -> None:
            if hook:
                hook()
            self._advance_prefills()

        self.passes.make_room(self.active, max(g.rows_wanted for g in self.active))
        plans, outputs = self.passes.round(self.active, after_pass if self.passes.passes_within_round else lambda: None)
        for i, out in outputs.items():
            self.active[i].complete_step(plans[i], out)
        if outputs and not self.passes.passes_within_round:
            after_pass()
        elif not outputs:
            self._advance_prefills()
        finished = [g for g in self.active if g.done]
        for generation in finished:
            self.leave(generation)
        return finished

