"""The serving engine: owns one model and runs the server's generations on one worker thread.

The HTTP app (app.py) sees only the `Engine` interface:

    ids = engine.encode_text(prompt) | engine.encode_chat(messages)   # on the event loop, before any work
    handle = engine.submit(GenerationRequest(ids, ...))                 # EngineBusy (429), EngineStopped (503)
    async for event in handle.events(): ...                             # TextDelta ..., then Finished
    handle.cancel()                                                     # stop at the next step, free the KV

`BatchedEngine` (batched_engine.py) is the one request lifecycle: its worker thread decodes up to
`max_concurrency` admitted requests together with the runtime's batch decoder (runtime/batch.py), on every
backend: shared passes over the fused CPU graph, else one pass per request each round (as many requests at once
as the backend holds KV caches; `--no-batching`: one). The runtime's `Runner` is single-threaded, so one worker
thread runs every pass. loader.py opens the runner and the engine. The server's calls into `speccompile.runtime`
are in these three modules, so the runtime's API can change in one place.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, SpecCompileError, check_at_least, check_one_of
from ..runtime.options import RunOptions
from .metrics import ServeMetrics
from .tools import FORMATS, TOOL_FORMATS, ToolFormat, detect_format, with_tools_prompt
from .requests import Cancelled, EngineBusy, EngineStopped, Failed, Finished, GenerationFailed, GenerationRequest, RequestHandle

log = logging.getLogger("speccompile.serve")


@dataclass(frozen=True)
class EngineOptions:
    """The runtime options of `speccompile run`, plus the engine's admission limits."""

    artifact: Path
    run: RunOptions = field(default_factory=RunOptions)  # backend, drafter, tree, ... as for `speccompile run`
    max_concurrency: int = 8  # requests admitted at once (decoding, or next in line for the worker)
    max_queue: int = 64  # requests waiting beyond those; more get EngineBusy
    batching: bool = True  # admitted requests decode together (False: one slot, one request at a time)
    max_model_len: int | None = None  # most tokens (prompt + completion) of one request [default: the artifact's context]
    prefix_caching: bool = True  # batched engine: reuse the KV rows of earlier prompts (runtime/prefix_cache.py)
    prefix_cache_mb: int = 512  # the prefix cache's memory bound
    slot_passes: str = "off"  # batched engine: steps as one slot pass: off | drafts | all (runtime/options.py SLOT_PASSES)
    engine_nice: int = 0  # Unix nice increment of the engine's threads (worker, ONNX Runtime's pools); the event loop keeps the process's
    tool_call_parser: str = "auto"  # how the model writes tool calls: auto (from its chat template) | hermes | llama3_json

    def validate(self) -> "EngineOptions":
        if self.max_model_len is not None:
            check_at_least("max_model_len", self.max_model_len, 2)
        for name, least in (("max_concurrency", 1), ("max_queue", 0), ("prefix_cache_mb", 1)):
            check_at_least(name, getattr(self, name), least)
        if not 0 <= self.engine_nice <= 19:
            raise InputError(f"engine_nice must be in 0..19, got {self.engine_nice}", "engine_nice")
        if self.engine_nice and os.name != "posix":
            raise InputError("engine_nice needs a Unix system (os.nice)", "engine_nice")
        check_one_of("tool_call_parser", self.tool_call_parser, TOOL_FORMATS)
        return self


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer needs to know about the model before it submits anything."""

    name: str  # the manifest's model name (the default served model name)
    max_context: int
    vocab_size: int
    drafter: str
    has_chat_template: bool


class Engine(abc.ABC):
    """The model, its tokenizer and admission accounting; subclasses decide how admitted requests are decoded."""

    batched = False  # whether admitted requests share target passes (set by the engine that decodes them)
    batch_mode: dict[str, str] | None = None  # the batch decoder's mode as it runs (RoundPasses.mode), when there is one

    def __init__(self, options: EngineOptions, runner, replica: str | None = None):
        self.options = options.validate()
        self.replica = replica
        self._runner = runner
        artifact = self._runner.artifact
        if options.max_model_len is not None and options.max_model_len > artifact.max_context:
            raise InputError(f"max_model_len {options.max_model_len} exceeds {options.artifact}'s context of "
                             f"{artifact.max_context} tokens", "max_model_len")
        self._tokenizer = artifact.tokenizer
        self.info = ModelInfo(
            name=str(artifact.manifest.model.get("name") or Path(options.artifact).name),
            max_context=options.max_model_len or artifact.max_context,
            vocab_size=self._tokenizer.vocab_size,
            drafter=self._runner.drafter_name,
            has_chat_template=bool(self._tokenizer.chat_template),
        )
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._accepting = False
        self.metrics = ServeMetrics(queue_depth=lambda: self._waiting, running=lambda: self._running)
        if runner.suffix_cache is not None:  # one store for every request (and slot) this engine decodes
            self.metrics.watch_suffix_cache(runner.suffix_cache.stats)

    # --- tokenization (on the event loop: cheap, and lets the app reject a prompt before any work) ---

    def encode_text(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt (with the tokenizer's special tokens, as `run --raw`)."""
        return self._tokenizer.prompt_ids(prompt, chat=False)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation through the model's chat template, ending in the assistant's turn. `tools`:
        function definitions, handed to the template's `tools` variable (or described in the system message when
        the template has none)."""
        import jinja2

        if not self.info.has_chat_template:
            raise InputError("messages: this model has no chat template; use /v1/completions with a raw prompt")
        if tools and not self._tokenizer.template_takes_tools:
            messages, tools = with_tools_prompt(messages, tools, self.tool_format), None
        try:
            text = self._tokenizer.render_messages(messages, tools or None)
        except jinja2.TemplateError as exc:
            raise InputError(f"messages: the model's chat template rejected them ({exc})") from None
        return self._tokenizer.encode(text, add_special_tokens=False)

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (`--tool-call-parser`, else what its chat template teaches)."""
        name = self.options.tool_call_parser
        return detect_format(self._tokenizer.chat_template) if name == "auto" else FORMATS[name]

    def compile_constraint(self, spec):
        """A ConstraintSpec compiled for this model (InputError, one line, when it is bad); any thread. The first
        one loads xgrammar (seconds): call it off the event loop."""
        with self._compile_lock:
            return self._runner.compile_constraint(spec)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (a completion prompt given as ids, echoed)."""
        return self._tokenizer.decode(ids)

    def token_text(self, token: int) -> str:
        """One token's text (logprobs)."""
        return self._tokenizer.decode([token], skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (logprobs: a byte-fallback token's byte, not the U+FFFD its text decodes to)."""
        return self._tokenizer.token_bytes(token)

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

    def check_drafting(self, request: GenerationRequest) -> None:
        """InputError (one line, naming the setting) unless this server can draft `request` as it asks: its drafter
        or none, at most the server's draft tokens, its drafter's settings, the server's suffix store size."""
        self._runner.check_drafting(request.drafter, request.num_draft_tokens, request.draft_tuning)
        store = self._runner.suffix_cache
        if request.cached_requests is not None and (store is None or request.cached_requests != store.max_requests):
            raise InputError(f"suffix_decoding_max_cached_requests {request.cached_requests}: this server's suffix store "
                             f"keeps {store.max_requests if store else 0} responses (--suffix-cache-requests); give that "
                             "or leave it out", "suffix_decoding_max_cached_requests")

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

    # --- a generation's outcome, one path for every backend ---

    def _score_prompt(self, handle: RequestHandle) -> None:
        """The prompt tokens' log-probabilities when the request asks for them (worker thread, before it generates)."""
        request = handle.request
        if request.prompt_logprobs:
            handle.prompt_entries = tuple(self._runner.prompt_logprobs(list(request.prompt_ids), request.logprobs or 0))

    def _cancelled(self, handle: RequestHandle, started: float) -> None:
        handle.emit(Cancelled())
        self.metrics.generations.labels("cancelled").inc()
        log.info("generation cancelled", extra={"fields": {"request": handle.id, "after_s": round(time.perf_counter() - started, 4)}})

    def _failed(self, handle: RequestHandle, exc: Exception) -> None:
        """Send a request's failure: a SpecCompileError is the request's fault (400), anything else the server's."""
        if isinstance(exc, SpecCompileError):
            handle.emit(Failed(GenerationFailed(str(exc), client_error=True)))
        else:
            log.error("generation failed", exc_info=exc)
            handle.emit(Failed(GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}", client_error=False)))
        self.metrics.generations.labels("failed").inc()

    def _finished(self, handle: RequestHandle, result, started: float, first_text_at: list[float]) -> None:
        """Send a finished generation's Finished event; record its metrics and log line."""
        finished_at = time.perf_counter()
        stats = result.stats
        drafter = handle.request.drafter or self.info.drafter  # "none": this request decoded without drafting
        speculative = {"drafter": drafter, "batched": self.batched, **stats.to_dict()}
        if self.batch_mode is not None:  # e.g. {"batch_mode": "gpu-slots", "slot_passes": "all"}
            speculative.update(batch_mode=self.batch_mode["passes"], slot_passes=self.batch_mode["slot_passes"])
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
            logprobs=None if handle.recorder is None else tuple(handle.recorder.entries[: stats.generated_tokens]),
            prompt_logprobs=handle.prompt_entries,
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


class WorkerEngine(Engine):
    """An engine whose one worker thread takes admitted requests from a queue (None: drain, then stop)."""

    worker_name = "speccompile-engine"

    def __init__(self, options: EngineOptions, runner, replica: str | None = None):
        super().__init__(options, runner, replica)
        self._jobs: queue.Queue[RequestHandle | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    def start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=niced(self.options.engine_nice, self._work), name=self.worker_name, daemon=True)
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


def generation_config(runner, handle: RequestHandle):
    """The runtime's GenerationConfig of a request: its sampling, penalties, stops, grammar and logprob recorder."""
    from ..runtime.penalties import LogitPenalties

    request = handle.request
    penalties = LogitPenalties(request.presence_penalty, request.frequency_penalty, request.repetition_penalty,
                               request.logit_bias)
    return runner.config(request.max_tokens, sampling_params(request), list(request.stop), request.drafter,
                         constraint=request.constraint, logprobs=handle.recorder,
                         penalties=penalties if penalties.active else None, user=request.user,
                         num_draft_tokens=request.num_draft_tokens, draft_tuning=request.draft_tuning)


def sampling_params(request: GenerationRequest):
    """The runtime's SamplingParams of a request (validated)."""
    from ..runtime.sampling import SamplingParams

    return SamplingParams(request.temperature, request.top_k, request.top_p, request.seed, request.min_p).validate()


def niced(increment: int, work: Callable[[], object]) -> Callable[[], object]:
    """`work`, run with the calling thread's nice value raised by `increment` first (Linux: per thread; threads
    it starts, ONNX Runtime's pools among them, inherit it)."""

    def run():
        if increment:
            os.nice(increment)
        return work()

    return run
