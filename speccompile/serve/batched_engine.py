"""The serving engine's request lifecycle: one worker thread decodes up to `max_concurrency` admitted requests
together with the runtime's batch decoder (runtime/batch.py), on every backend."""

from __future__ import annotations

import queue
import time

from .engine import EngineOptions, WorkerEngine, generation_config, log
from .requests import RequestHandle, TextDelta


class BatchedEngine(WorkerEngine):
    """One worker thread decodes up to `max_concurrency` requests together (runtime/batch.py): requests join
    between steps (their prefill runs alone), every step is one round for all of them, a finished or cancelled
    request leaves at once and frees its slot. Each request's tokens equal its tokens decoded alone.
    The decoder's mode (runtime/batch_passes.py) follows the artifact and backend: shared passes over the fused CPU
    graph, else one pass per request (as many slots as the backend holds KV caches); `batching=False`: one slot.
    With `prefix_caching`, prompt rows are reused across requests where that is exact (runtime/prefix_cache.py;
    shared passes only)."""

    worker_name = "speccompile-batched-engine"

    def __init__(self, options: EngineOptions, runner, replica: str | None = None):
        super().__init__(options, runner, replica)
        self._prefix_cache = None
        self._decoder = self._new_decoder()
        self.batched = self._decoder.passes.shares_passes
        self.batch_mode = self._decoder.passes.mode  # what runs, not what was asked (head_dim > 128 forces slot passes)
        if options.prefix_caching and self._decoder.keeps_prefixes:
            from ..runtime.prefix_cache import PrefixCache

            self._prefix_cache = PrefixCache(options.prefix_cache_mb << 20)
            self._decoder.prefix_cache = self._prefix_cache
            self.metrics.watch_prefix_cache(lambda: self._prefix_cache.bytes)
        self.metrics.watch_batch_passes(lambda: {"batched": self._decoder.batched_passes, "slot": self._decoder.slot_passes,
                                                 "prefill": self._decoder.passes.prefill_passes})
        log.info("KV cache allocated", extra={"fields": {
            "slots": self._decoder.slots, "rows_per_slot": self._decoder.rows, "mode": self.batch_mode["passes"],
            "slot_passes": self.batch_mode["slot_passes"], "slot_passes_asked": self.options.slot_passes,
            "gib": round(self._decoder.kv_bytes / 2**30, 3)}})
        self._eos_ids = set(self._runner.artifact.eos_token_ids)
        self._draining = False
        self._live: dict[int, tuple[RequestHandle, object, float, list[float]]] = {}  # id(generation) -> request
        self._held: list[RequestHandle] = []  # a prompt another request is prefilling: joins after it (`_hold_repeats`)

    def _enqueue(self, handle: RequestHandle) -> None:
        self._send_opening(handle)
        super()._enqueue(handle)

    def _send_opening(self, handle: RequestHandle) -> None:
        """A prompt whose logits the prefix cache holds needs no pass for its first token: send that token's
        text now (on the event loop), not after the pass the worker is in. The generation, when it joins,
        computes the same first token from the same logits (or, if the entry was evicted meanwhile, from a
        prefill: the same bits) and its first delta, this text, is not sent again (`_text_sender`).
        Greedy and seeded requests only (runtime/generate.py `opening_text`)."""
        from ..runtime.generate import opening_text

        request = handle.request
        if self._prefix_cache is None or request.constraint is not None or request.logprobs is not None:
            return  # (a grammar's mask and a logprob entry come with the generation)
        try:
            config = generation_config(self._runner, handle)
        except Exception:  # the worker reports it when the request joins
            return
        logits = self._decoder.cached_prompt_logits(list(request.prompt_ids), config)
        text = None if logits is None else opening_text(self._tokenizer, self._eos_ids, config, logits,
                                                                    request.prompt_ids)
        if text is not None:
            handle.opening, handle.opening_at = text, time.perf_counter()
            handle.emit(TextDelta(text))

    def _work(self) -> None:
        while True:
            self._join_all(self._take(wait=not self._live and not self._held))
            if not self._live:
                if self._draining and not self._held:
                    return
                continue
            self._drop_cancelled()
            try:
                finished = self._decoder.step(self._admit_waiting)
            except Exception as exc:  # a failed pass fails the requests in it; the worker goes on
                for handle, generation, _, _ in list(self._live.values()):
                    self._release(generation)
                    self._failed(handle, exc)
                self._decoder = self._new_decoder()
                continue
            for generation in finished:
                handle, _, started, first_text_at = self._live[id(generation)]
                self._release(generation)
                self._finish_generation(handle, generation, started, first_text_at)

    def _admit_waiting(self) -> None:
        """Between two passes of a round: admit the requests waiting for a free slot (their prefill advances
        between the next passes; they decode from the round after their first token), so time to first token
        waits for a pass, not a round."""
        self._join_all(self._take(wait=False))

    def _new_decoder(self):
        """The batch decoder: its KV pool (every slot for `max_model_len` tokens) is allocated here, once, and its
        largest passes run once (warm_up), so the server's memory does not grow with the requests it serves."""
        slots = self.options.max_concurrency if self.options.batching else 1
        decoder = self._runner.batch_decoder(slots, self.info.max_context, slot_passes=self.options.slot_passes,
                                             shared_passes=self.options.batching)
        decoder.warm_up(self._runner.config(2, drafter="none"))  # before the prefix cache joins: warm-up prompts are not kept (nor drafted from)
        decoder.prefix_cache = self._prefix_cache
        return decoder

    def _take(self, wait: bool) -> list[RequestHandle]:
        """Admitted requests for the free slots (waiting for the first one when `wait`); None ends the intake."""
        handles: list[RequestHandle] = []
        while len(handles) + len(self._held) < self._decoder.free and not self._draining:
            try:
                handle = self._jobs.get() if wait and not handles else self._jobs.get_nowait()
            except queue.Empty:
                break
            if handle is None:
                self._draining = True
            else:
                handles.append(handle)
        return handles

    def _join_all(self, handles: list[RequestHandle]) -> None:
        """Start the requests in free slots (prompts prefilled together where they can be); a request whose prompt
        another one is prefilling waits for that prefill (`_hold_repeats`)."""
        handles = self._hold_repeats(self._held + handles)
        starting = []
        for handle in handles:
            with self._lock:
                self._waiting -= 1
                self._running += 1
            started = time.perf_counter()
            if handle.cancelled:
                self._release_slotless(handle)
                self._cancelled(handle, started)
                continue
            first_text_at: list[float] = [handle.opening_at] if handle.opening_at is not None else []
            try:
                self._score_prompt(handle)
                config = generation_config(self._runner, handle)
            except Exception as exc:
                self._release_slotless(handle)
                self._failed(handle, exc)
                continue
            starting.append((handle, started, first_text_at, config))
        if not starting:
            return
        joined = self._decoder.join_many([(list(h.request.prompt_ids), config, _text_sender(h, first))
                                          for h, _, first, config in starting], prefill_together=False, defer_prefill=True)
        for (handle, started, first_text_at, _), generation in zip(starting, joined):
            if isinstance(generation, Exception):
                self._release_slotless(handle)
                self._failed(handle, generation)
            elif generation.done:
                self._release_slotless(handle)
                self._finish_generation(handle, generation, started, first_text_at)
            else:
                self._live[id(generation)] = (handle, generation, started, first_text_at)

    def _hold_repeats(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        """The handles to start now; the others (`_held`) repeat a prompt that an active generation, or an earlier
        handle here, is prefilling: they join once it is prefilled, from the prefix cache's whole-prompt entry
        instead of a prefill of their own (the n choices of one request share the prompt's prefill this way)."""
        if self._prefix_cache is None:
            return handles
        prefilling = {tuple(g.prompt_ids) for g in self._decoder.active if g.prefilling}
        self._held, starting = [], []
        for handle in handles:
            prompt = tuple(handle.request.prompt_ids)
            (self._held if prompt in prefilling else starting).append(handle)
            prefilling.add(prompt)
        return starting

    def _release_slotless(self, handle: RequestHandle) -> None:
        """A request that ended before decoding with the batch (refused, cancelled, or done at its first token)."""
        with self._lock:
            self._running -= 1

    def _drop_cancelled(self) -> None:
        for handle, generation, started, _ in list(self._live.values()):
            if handle.cancelled:
                self._decoder.leave(generation)
                self._release(generation)
                self._cancelled(handle, started)

    def _release(self, generation) -> None:
        del self._live[id(generation)]
        with self._lock:
            self._running -= 1

    def _finish_generation(self, handle: RequestHandle, generation, started: float, first_text_at: list[float]) -> None:
        try:
            result = generation.result()
        except Exception as exc:
            self._failed(handle, exc)
            return
        self._finished(handle, result, started, first_text_at)


def _text_sender(handle: RequestHandle, first_text_at: list[float]):
    """The text callback of a batched request: stream deltas, note the time of the first. The first delta
    repeats the opening sent at submission, if one was: it is checked and dropped."""
    opening = [handle.opening] if handle.opening is not None else []

    def on_text(delta: str) -> None:
        if opening:
            sent = opening.pop()
            if delta != sent:
                raise RuntimeError(f"the first token's text {delta!r} differs from the {sent!r} sent at submission")
            return
        if not first_text_at:
            first_text_at.append(time.perf_counter())
        handle.emit(handle.text_delta(delta))

    return on_text
