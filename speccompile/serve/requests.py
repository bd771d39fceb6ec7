"""What the HTTP layer and the engine exchange: a validated request, its handle, its events and the engine's refusals."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..runtime.logprobs import LogprobRecorder, TokenLogprob
from ..runtime.options import DraftTuning


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
class GenerationRequest:
    """One validated request: prompt token ids and sampling (temperature 0 = greedy)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: Any = None  # a CompiledConstraint (runtime/constraints.py): the answer must match it
    logprobs: int | None = None  # record each token's log-probability with this many alternatives (None: off)
    drafter: str | None = None  # "none": plain decoding for this request (A/B measurements); None: the server's drafter
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    prompt_logprobs: bool = False  # also the prompt tokens' log-probabilities (`echo` with `logprobs`), `logprobs` alternatives
    user: str | None = None  # the client's `user`: whose earlier responses the suffix drafter may draft from
    num_draft_tokens: int | None = None  # fewer draft positions a round than the server's (num_speculative_tokens)
    draft_tuning: DraftTuning | None = None  # this request's own drafter settings (speculative_config)
    cached_requests: int | None = None  # the suffix store size the client expects (must be the server's)


@dataclass(frozen=True)
class TextDelta:
    """Newly generated text (stop strings are held back until they cannot match) and the logprob entries of the
    tokens generated since the last delta (with logprobs)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The end of a generation: its whole text, token counts and speculative statistics."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # OpenAI's: "stop" (eos or a stop string) or "length" (max_tokens or the context)
    speculative: dict
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    logprobs: tuple[TokenLogprob, ...] | None = None  # every output token's entry (with logprobs)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.. (`GenerationRequest.prompt_logprobs`)


@dataclass(frozen=True)
class Cancelled:
    """Terminal event of a generation stopped by `RequestHandle.cancel`."""


@dataclass(frozen=True)
class Failed:
    error: GenerationFailed


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
    recorder: LogprobRecorder | None = None  # the generation's logprob entries (with logprobs)
    prompt_entries: tuple[TokenLogprob, ...] | None = None  # the prompt's (set by the worker before it generates)
    _logprobs_sent: int = 0

    def __post_init__(self) -> None:
        if self.request.logprobs is not None:
            self.recorder = LogprobRecorder(self.request.logprobs)

    def text_delta(self, text: str) -> TextDelta:
        """A TextDelta of `text` with the logprob entries recorded since the last one (worker thread)."""
        if self.recorder is None:
            return TextDelta(text)
        entries = self.recorder.entries
        new, self._logprobs_sent = tuple(entries[self._logprobs_sent:]), len(entries)
        return TextDelta(text, new)

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
            if isinstance(event, Cancelled):
                return
            if isinstance(event, Failed):
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
