"""The serving engine: owns one model and runs the server's generations on one worker thread.

Every call the server makes into `speccompile.runtime` is in this module, so the runtime's API can change in one
place. The HTTP app (app.py) sees only the `Engine` interface:

    ids = engine.encode_text(prompt) | engine.encode_chat(messages)   # on the event loop, before any work
    handle = engine.submit(GenerationRequest(ids, ...))                 # EngineBusy (429), EngineStopped (503)
    async for event in handle.events(): ...                             # TextDelta ..., then Finished
    handle.cancel()                                                     # stop at the next step, free the KV

`BatchedEngine` decodes up to `max_concurrency` admitted requests together on one worker thread (continuous
batching, runtime/batch.py); `SequentialEngine` decodes them one after another (artifacts whose graph has
batch 1 or that run on another backend than ort-cpu's fused graph, `--no-batching`). Both run on a single worker thread (the runtime's
`Runner` is single-threaded).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, SpecCompileError
from ..runtime.options import RunOptions
from .metrics import ServeMetrics

log = logging.getLogger("speccompile.serve")


class EngineBusy(Exception):
    """Every admission slot and queue place is taken (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is draining for shutdown or its worker has stopped (HTTP 503)."""


class GenerationFailed(Exception):
    """A generation raised inside the runtime; `client_error` when the request itself was at fault."""

    def __init__(self, message: str, client_error: bool):
        super().__init__(message)
        self.client_error = client_error


@dataclass(frozen=True)
class EngineOptions:
    """The runtime options of `speccompile run`, plus the engine's admission limits."""

    artifact: Path
    run: RunOptions = field(default_factory=RunOptions)  # backend, drafter, tree, ... as for `speccompile run`
    max_concurrency: int = 8  # requests admitted at once (decoding, or next in line for the worker)
    max_queue: int = 64  # requests waiting beyond those; more get EngineBusy
    batching: bool = True  # decode admitted requests together when the artifact allows (BatchedEngine)
    max_model_len: int | None = None  # most tokens (prompt + completion) of one request [default: the artifact's context]
    prefix_caching: bool = True  # batched engine: reuse the KV rows of earlier prompts (runtime/prefix_cache.py)
    prefix_cache_mb: int = 512  # the prefix cache's memory bound
    slot_passes: str = "off"  # batched engine: steps as one slot pass: off | drafts | all (runtime/options.py SLOT_PASSES)
    engine_nice: int = 0  # Unix nice increment of the engine's threads (worker, ONNX Runtime's pools); the event loop keeps the process's

    def validate(self) -> "EngineOptions":
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InputError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_concurrency < 1:
            raise InputError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_queue < 0:
            raise InputError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.prefix_cache_mb < 1:
            raise InputError(f"--prefix-cache-mb must be >= 1, got {self.prefix_cache_mb}")
        if not 0 <= self.engine_nice <= 19:
            raise InputError(f"--engine-nice must be in 0..19, got {self.engine_nice}")
        if self.engine_nice and os.name != "posix":
            raise InputError("--engine-nice needs a Unix system (os.nice)")
        return self


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer needs to know about the model before it submits anything."""

    name: str  # the manifest's model name (the default served model name)
    max_context: int
    vocab_size: int
    drafter: str
    has_chat_template: bool


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request: prompt token ids and sampling (temperature 0 = greedy)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """Newly generated text (stop strings are held back until they cannot match)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The end of a generation: its whole text, token counts and speculative statistics."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # OpenAI's: "stop" (eos or a stop string) or "length" (max_tokens or the context)
    speculative: dict
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class _Cancelled:
    """Terminal event of a generation stopped by `RequestHandle.cancel`."""


@dataclass(frozen=True)
class _Failed:
    error: GenerationFailed


class _Abort(Exception):
    """Raised inside the runtime's text callback to stop a cancelled generation (its KV cache goes with it)."""


@dataclass
class RequestHandle:
    """A submitted request: its events arrive on the event loop that submitted it."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    submitted_at: float = field(default_factory=time.perf_counter)
    opening: str | None = None  # text sent at submission (a cached prompt's first token: BatchedEngine._send_opening)
    opening_at: float | None = None
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the generation at its next step (or skip it if it has not started); safe from any thread."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, event: object) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    async def events(self) -> AsyncIterator[TextDelta | Finished]:
        """TextDelta events, then one Finished; ends early when cancelled; raises GenerationFailed."""
        while True:
            event = await self._events.get()
            if isinstance(event, _Cancelled):
                return
            if isinstance(event, _Failed):
                raise event.error
            yield event
            if isinstance(event, Finished):
                return

    async def result(self) -> Finished | None:
        """The Finished event (None when cancelled), skipping the text deltas."""
        async for event in self.events():
            if isinstance(event, Finished):
                return event
        return None


class Engine(abc.ABC):
    """The model, its tokenizer and admission accounting; subclasses decide how admitted requests are decoded."""

    batched = False  # whether admitted requests share target passes

    def __init__(self, options: EngineOptions, replica: str | None = None, runner=None):
        self.options = options.validate()
        self.replica = replica
        self._runner = runner if runner is not None else open_runner(options)
        artifact = self._runner.artifact
        if options.max_model_len is not None and options.max_model_len > artifact.max_context:
            raise InputError(f"--max-model-len {options.max_model_len} exceeds {options.artifact}'s context of "
                             f"{artifact.max_context} tokens")
        self._tokenizer = artifact.tokenizer
        self.info = ModelInfo(
            name=str(artifact.manifest.model.get("name") or Path(options.artifact).name),
            max_context=options.max_model_len or artifact.max_context,
            vocab_size=self._tokenizer.vocab_size,
            drafter=self._runner.drafter_name,
            has_chat_template=bool(self._tokenizer.chat_template),
        )
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._accepting = False
        self.metrics = ServeMetrics(queue_depth=lambda: self._waiting, running=lambda: self._running)

    # --- tokenization (on the event loop: cheap, and lets the app reject a prompt before any work) ---

    def encode_text(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt (with the tokenizer's special tokens, as `run --raw`)."""
        return self._tokenizer.prompt_ids(prompt, chat=False)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template, ending in the assistant's turn."""
        import jinja2

        if not self.info.has_chat_template:
            raise InputError("messages: this model has no chat template; use /v1/completions with a raw prompt")
        try:
            text = self._tokenizer.render_messages(messages)
        except jinja2.TemplateError as exc:
            raise InputError(f"messages: the model's chat template rejected them ({exc})") from None
        return self._tokenizer.encode(text, add_special_tokens=False)

    # --- admission ---

    @property
    def waiting(self) -> int:
        """Requests admitted but not started."""
        return self._waiting

    @property
    def running(self) -> int:
        """Requests being decoded now."""
        return self._running

    @property
    def accepting(self) -> bool:
        return self._accepting

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request (call on the event loop that will read its events)."""
        handle = RequestHandle(request, asyncio.get_running_loop())
        limit = self.options.max_concurrency + self.options.max_queue
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            if self._waiting + self._running >= limit:
                raise EngineBusy(f"the server is at its limit of {limit} requests in flight; retry later")
            self._waiting += 1
            self._enqueue(handle)
        return handle

    @abc.abstractmethod
    def _enqueue(self, handle: RequestHandle) -> None:
        """Hand an admitted request to the decoder (called under the admission lock)."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start decoding; submit() accepts requests from now on."""

    @abc.abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the admitted ones (drain), stop the decoder."""

    # --- one generation, shared by every engine that decodes with the Runner ---

    def _generate(self, handle: RequestHandle) -> None:
        """Run one request to its end, sending its events; a cancelled request stops at its next text callback."""
        request = handle.request
        if handle.cancelled:
            handle.emit(_Cancelled())
            self.metrics.generations.labels("cancelled").inc()
            return
        started = time.perf_counter()
        first_text_at: list[float] = []

        def on_text(delta: str) -> None:
            if handle.cancelled:
                raise _Abort
            if not first_text_at:
                first_text_at.append(time.perf_counter())
            handle.emit(TextDelta(delta))

        try:
            result = self._runner.generate_ids(list(request.prompt_ids), request.max_tokens, _sampling(request),
                                               list(request.stop), on_text)
        except _Abort:
            self._cancelled(handle, started)
            return
        except Exception as exc:  # the worker must survive any failure of one request
            self._failed(handle, exc)
            return
        self._finished(handle, result, started, first_text_at)

    def _cancelled(self, handle: RequestHandle, started: float) -> None:
        handle.emit(_Cancelled())
        self.metrics.generations.labels("cancelled").inc()
        log.info("generation cancelled", extra={"fields": {"request": handle.id, "after_s": round(time.perf_counter() - started, 4)}})

    def _failed(self, handle: RequestHandle, exc: Exception) -> None:
        """Send a request's failure: a SpecCompileError is the request's fault (400), anything else the server's."""
        if isinstance(exc, SpecCompileError):
            handle.emit(_Failed(GenerationFailed(str(exc), client_error=True)))
        else:
            log.error("generation failed", exc_info=exc)
            handle.emit(_Failed(GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}", client_error=False)))
        self.metrics.generations.labels("failed").inc()

    def _finished(self, handle: RequestHandle, result, started: float, first_text_at: list[float]) -> None:
        """Send a finished generation's Finished event; record its metrics and log line."""
        finished_at = time.perf_counter()
        stats = result.stats
        speculative = {"drafter": self.info.drafter, "batched": self.batched, **stats.to_dict()}
        if self.replica is not None:
            speculative["replica"] = self.replica
        ttft = (first_text_at[0] if first_text_at else finished_at) - handle.submitted_at
        speculative["time_to_first_token_s"] = round(ttft, 4)
        speculative["queue_s"] = round(started - handle.submitted_at, 4)
        handle.emit(Finished(
            text=result.text,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generated_tokens,
            finish_reason="stop" if result.finish_reason == "stop" else "length",
            speculative=speculative,
            cached_tokens=stats.cached_tokens,
        ))
        self.metrics.observe_generation(
            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens, target_passes=stats.target_passes,
            drafted=stats.drafted, accepted=stats.accepted, time_to_first_token=ttft,
            duration=finished_at - handle.submitted_at, cached_tokens=stats.cached_tokens,
        )
        log.info("generation finished", extra={"fields": {
            "request": handle.id, "prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
            "completion_tokens": stats.generated_tokens,
            "finish_reason": result.finish_reason, "ttft_s": round(ttft, 4), "total_s": round(finished_at - handle.submitted_at, 4),
            "tokens_per_pass": round(stats.mean_accepted_length, 3),
        }})


class _WorkerEngine(Engine):
    """An engine whose one worker thread takes admitted requests from a queue (None: drain, then stop)."""

    worker_name = "speccompile-engine"

    def __init__(self, options: EngineOptions, replica: str | None = None, runner=None):
        super().__init__(options, replica, runner)
        self._jobs: queue.Queue[RequestHandle | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    def start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=_niced(self.options.engine_nice, self._work), name=self.worker_name, daemon=True)
            self._worker.start()
        self._accepting = True

    def _enqueue(self, handle: RequestHandle) -> None:
        self._jobs.put(handle)

    @abc.abstractmethod
    def _work(self) -> None:
        """The worker thread's loop: decode what `_jobs` holds until its None."""

    def shutdown(self, timeout: float | None = None) -> None:
        with self._lock:
            self._accepting = False
            if self._worker is None:
                return
            self._jobs.put(None)  # after every admitted request: the worker drains them first
        self._worker.join(timeout)
        self._worker = None


class SequentialEngine(_WorkerEngine):
    """One worker thread decodes the admitted requests one after another, in arrival order (no prefix cache:
    `Runner.generate_ids` prefills every prompt)."""

    def _work(self) -> None:
        while True:
            handle = self._jobs.get()
            if handle is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                self._generate(handle)
            finally:
                with self._lock:
                    self._running -= 1


class BatchedEngine(_WorkerEngine):
    """One worker thread decodes up to `max_concurrency` requests together (runtime/batch.py): requests join
    between steps (their prefill runs alone), every step is one round for all of them, a finished or cancelled
    request leaves at once and frees its slot. Each request's tokens equal its tokens decoded alone.
    With `prefix_caching`, prompt rows are reused across requests where that is exact (runtime/prefix_cache.py)."""

    batched = True
    worker_name = "speccompile-batched-engine"

    def __init__(self, options: EngineOptions, replica: str | None = None, runner=None):
        super().__init__(options, replica, runner)
        self._prefix_cache = None
        if options.prefix_caching:
            from ..runtime.prefix_cache import PrefixCache

            self._prefix_cache = PrefixCache(options.prefix_cache_mb << 20)
            self.metrics.watch_prefix_cache(lambda: self._prefix_cache.bytes)
        self._decoder = self._new_decoder()
        self.metrics.watch_batch_passes(lambda: {"batched": self._decoder.batched_passes, "slot": self._decoder.slot_passes})
        log.info("KV cache allocated", extra={"fields": {
            "slots": self._decoder.slots, "rows_per_slot": self._decoder.rows,
            "slot_passes": self.options.slot_passes,
            "gib": round(self._decoder.kv_bytes / 2**30, 3)}})
        self._eos_ids = set(self._runner.artifact.eos_token_ids)
        self._draining = False
        self._live: dict[int, tuple[RequestHandle, object, float, list[float]]] = {}  # id(generation) -> request

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
        if self._prefix_cache is None:
            return
        try:
            config = self._runner.config(request.max_tokens, _sampling(request), list(request.stop))
        except Exception:  # the worker reports it when the request joins
            return
        logits = self._decoder.cached_prompt_logits(list(request.prompt_ids), config)
        text = None if logits is None else opening_text(self._tokenizer, self._eos_ids, config, logits)
        if text is not None:
            handle.opening, handle.opening_at = text, time.perf_counter()
            handle.emit(TextDelta(text))

    def _work(self) -> None:
        while True:
            self._join_all(self._take(wait=not self._live))
            if not self._live:
                if self._draining:
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
        decoder = self._runner.batch_decoder(self.options.max_concurrency, self.info.max_context,
                                             slot_passes=self.options.slot_passes)
        decoder.warm_up(self._runner.config(2))  # before the prefix cache joins: warm-up prompts are not kept
        decoder.prefix_cache = self._prefix_cache
        return decoder

    def _take(self, wait: bool) -> list[RequestHandle]:
        """Admitted requests for the free slots (waiting for the first one when `wait`); None ends the intake."""
        handles: list[RequestHandle] = []
        while len(handles) < self._decoder.free and not self._draining:
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
        """Start the requests in free slots (prompts prefilled together where they can be)."""
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
                config = self._runner.config(handle.request.max_tokens, _sampling(handle.request), list(handle.request.stop))
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
        handle.emit(TextDelta(delta))

    return on_text


def _sampling(request: GenerationRequest):
    """The runtime's SamplingParams of a request (validated)."""
    from ..runtime.sampling import SamplingParams

    return SamplingParams(request.temperature, request.top_k, request.top_p, request.seed).validate()


def open_runner(options: EngineOptions):
    """The runtime's Runner for a server: its event loop and (with slot passes) a second graph take turns with
    the target's passes on the same cores, so ONNX Runtime's threads busy-wait only within a run
    (`RunOptions.shared_cores`)."""
    import dataclasses

    from ..runtime.session import Runner

    return Runner(options.artifact, dataclasses.replace(options.run, shared_cores=True))


def _niced(increment: int, work: Callable[[], object]) -> Callable[[], object]:
    """`work`, run with the calling thread's nice value raised by `increment` first (Linux: per thread; threads
    it starts, ONNX Runtime's pools among them, inherit it)."""

    def run():
        if increment:
            os.nice(increment)
        return work()

    return run


def open_engine(options: EngineOptions, replica: str | None = None) -> Engine:
    """Load the artifact and return the engine that serves it (not started): the batched engine when the
    artifact's graph and drafter allow it and `options.batching`, else the sequential one.

    With `engine_nice` the engine is built on a thread of its own at that nice increment, so the thread pools
    of its ONNX Runtime sessions inherit it (as does the worker thread, which raises its own when it starts):
    the engine then yields the cores to the event loop, whose requests are parsed and streamed without waiting
    for a pass (docs/serving.md)."""
    if not options.validate().engine_nice:
        return _open_engine(options, replica)
    built: list = []
    thread = threading.Thread(target=_niced(options.engine_nice, lambda: built.append(_capture(_open_engine, options, replica))),
                              name="speccompile-engine-loader")
    thread.start()
    thread.join()
    if isinstance(built[0], Exception):
        raise built[0]
    return built[0]


def _capture(function: Callable, *args):
    """function(*args), or the exception it raised (to be raised again on the calling thread)."""
    try:
        return function(*args)
    except Exception as exc:
        return exc


def _open_engine(options: EngineOptions, replica: str | None) -> Engine:
    runner = open_runner(options)
    problem = runner.batch_problem() if options.batching else "batching is off"
    if problem is None:
        return BatchedEngine(options, replica, runner)
    log.info("requests are decoded one at a time", extra={"fields": {"reason": problem}})
    return SequentialEngine(options, replica, runner)
