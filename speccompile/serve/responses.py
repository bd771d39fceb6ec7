"""Response bodies and server-sent event streams of the OpenAI API, from the engine's events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from .api_errors import APIError
from ..runtime.logprobs import TokenLogprob
from .requests import Finished, GenerationFailed, RequestHandle, TextDelta
from .tool_parsers import ContentDelta, ParserEvent, ToolCallStart, parse_whole
from .tools import ToolFormat


@dataclass(frozen=True)
class Echo:
    """A completion prompt as `echo` writes it before the answer: its text, its token ids, and whether the logprob
    columns list them (a request with logprobs)."""

    text: str
    tokens: tuple[int, ...]
    logprobs: bool = False


class ResponseShape:
    """How one endpoint words its responses and stream chunks. `token_text`, `token_bytes`: a token id's text and
    its own bytes (for logprobs; default: the text's UTF-8); `tool_format`: read the answer for tool calls in this
    format (chat with tools); `n`: choices per prompt (choice i answers prompt i // n); `echo`: each prompt's text and
    tokens, written before its choices' text (completions)."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] | None = None,
                 tool_format: ToolFormat | None = None, token_bytes: Callable[[int], bytes] | None = None,
                 n: int = 1, echo: Sequence[Echo] | None = None):
        self.chat = chat
        self.model = model
        self.token_text = token_text or str
        self.token_bytes = token_bytes or (lambda token: self.token_text(token).encode("utf-8"))
        self.tool_format = tool_format
        self.n = n
        self.echo = echo
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def echoed(self, index: int) -> Echo | None:
        """The prompt written before choice `index`'s text (None without echo)."""
        return None if self.echo is None else self.echo[index // self.n]

    def complete(self, finished: Sequence[Finished]) -> dict:
        """The response of every choice (in index order); usage summed (each prompt counted once)."""
        choices = [self._choice(i, f) for i, f in enumerate(finished)]
        for choice, f in zip(choices, finished):
            if len(finished) > 1:
                choice["speculative"] = f.speculative
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=usage(finished, self.n), speculative=finished[0].speculative)

    def _choice(self, index: int, finished: Finished) -> dict:
        logprobs = None if finished.logprobs is None else self.logprobs(finished.logprobs, self.echoed(index),
                                                                          prompt=finished.prompt_logprobs or ())
        if not self.chat:
            echo = self.echoed(index)
            text = finished.text if echo is None else echo.text + finished.text
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finished.finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": finished.text}
        finish_reason = finished.finish_reason
        if self.tool_format is not None:
            answer = parse_whole(self.tool_format.parser(), finished.text)
            message["content"] = answer.content
            if answer.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in answer.tool_calls]
                finish_reason = _tool_finish(finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, delta: dict | str | None, finish_reason: str | None = None, logprobs: dict | None = None,
              index: int = 0, **extra: Any) -> dict:
        """A stream chunk of choice `index`: chat, a `delta` dict (or its content text); completions, the text."""
        if self.chat:
            if not isinstance(delta, dict):
                delta = {} if delta is None else {"content": delta}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, finished: Sequence[Finished]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(finished, self.n))

    def logprobs(self, entries: Sequence[TokenLogprob], echo: Echo | None = None, offset: int = 0,
                 prompt: Sequence[TokenLogprob] = ()) -> dict:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: OpenAI's legacy columns from text
        offset `offset`, after the echoed prompt's tokens (`prompt`: the entries of its tokens 1..; the first is null)."""
        if self.chat:
            return {"content": [{**self._token(e.token, e.logprob), "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        lead = [] if echo is None else [None, *prompt]  # the prompt's first token has no context: null
        texts = [] if echo is None else [self.token_text(t) for t in echo.tokens]
        texts += [self.token_text(e.token) for e in entries]
        offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        columns = [*lead, *entries]
        return {"tokens": texts, "token_logprobs": [None if e is None else _finite(e.logprob) for e in columns],
                "top_logprobs": [None if e is None else {self.token_text(t): _finite(lp) for t, lp in e.top} for e in columns],
                "text_offset": offsets}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(self.token_bytes(token))}


def _finite(logprob: float) -> float:
    """-inf (a token the grammar, top-k or top-p excludes) as OpenAI writes it: JSON has no infinities."""
    return max(logprob, -9999.0)


def _tool_finish(reason: str) -> str:
    return "tool_calls" if reason == "stop" else reason


def usage(finished: Sequence[Finished], n: int = 1) -> dict:
    """Token counts of every choice: completion tokens summed, each prompt's tokens once (its first choice's; n
    choices per prompt), as OpenAI counts them."""
    prompts = finished[::n]
    prompt_tokens = sum(f.prompt_tokens for f in prompts)
    completion_tokens = sum(f.completion_tokens for f in finished)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in prompts)}}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that cancel the generations as soon as the client disconnects (not at the next write)."""

    def __init__(self, events: AsyncIterator[str], handles: Sequence[RequestHandle]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._handles = handles

    async def __call__(self, scope, receive, send) -> None:
        async def cancel_on_disconnect() -> None:
            await self.listen_for_disconnect(receive)
            _cancel(self._handles)

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        try:
            await self.stream_response(send)
        except OSError:  # the client went away while we wrote
            pass
        finally:
            watcher.cancel()
            _cancel(self._handles)


def _cancel(handles: Sequence[RequestHandle]) -> None:
    for handle in handles:
        handle.cancel()


class _ChoiceStream:
    """The chunks of one choice's events: text (or tool-call) deltas with their logprob entries, then the last
    chunk with its finish_reason. A delta's logprob entries ride on its first chunk (or, if it made none, on the
    next one)."""

    def __init__(self, shape: ResponseShape, index: int, handle: RequestHandle):
        self.shape, self.index, self.handle = shape, index, handle
        self.echoed = False
        self.parser = shape.tool_format.parser() if shape.tool_format is not None else None
        self.pending: list[TokenLogprob] = []
        self.sent, self.called = 0, False
        echo = shape.echoed(index)
        self.offset = 0 if echo is None else len(echo.text)  # text offsets of the logprob columns (completions)

    def opening(self) -> list[dict]:
        """The chunks before any generated text: the role (chat), the echoed prompt (completions with echo; with
        logprobs, once the prompt's entries are in: on the choice's first event)."""
        echo = self.shape.echoed(self.index)
        if self.shape.chat:
            return [self.shape.chunk({"role": "assistant", "content": ""}, index=self.index)]
        if echo is None or echo.logprobs:
            return []
        return [self.shape.chunk(echo.text, index=self.index)]

    def chunks(self, event: TextDelta | Finished) -> list[dict]:
        shape, parser = self.shape, self.parser
        out = []
        echo = shape.echoed(self.index)
        if echo is not None and echo.logprobs and not self.echoed:  # the worker scored the prompt before this event
            self.echoed = True
            logprobs = shape.logprobs([], echo, prompt=self.handle.prompt_entries or ())
            out.append(shape.chunk(echo.text, logprobs=logprobs, index=self.index))
        if isinstance(event, TextDelta):
            self.pending += event.logprobs
            deltas = [event.text] if parser is None else [_delta(e) for e in parser.feed(event.text)]
        else:
            deltas = [] if parser is None else [_delta(e) for e in parser.finish()]
        for delta in deltas:
            self.called = self.called or (isinstance(delta, dict) and "tool_calls" in delta)
            out.append(shape.chunk(delta, logprobs=self._logprobs(self.pending), index=self.index))
            self.sent, self.pending = self.sent + len(self.pending), []
            self.offset += len(delta) if isinstance(delta, str) else 0
        if isinstance(event, Finished):
            reason = _tool_finish(event.finish_reason) if self.called else event.finish_reason
            rest = list(event.logprobs[self.sent:]) if event.logprobs is not None else self.pending  # every entry, once
            out.append(shape.chunk(None if shape.chat else "", reason, self._logprobs(rest), index=self.index,
                                   speculative=event.speculative))
        return out

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        return self.shape.logprobs(entries, offset=self.offset) if entries else None


async def stream_events(shape: ResponseShape, handles: Sequence[RequestHandle], include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: per choice, a role chunk (chat) or the echoed prompt, content (or tool-call) chunks, a final
    chunk with finish_reason (choices interleaved as their text arrives); then usage, [DONE]."""
    events: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, handle, events)) for i, handle in enumerate(handles)]
    choices = [_ChoiceStream(shape, i, handle) for i, handle in enumerate(handles)]
    finished: list[Finished | None] = [None] * len(handles)
    failed = False
    try:
        for choice in choices:
            for chunk in choice.opening():
                yield sse(chunk)
        ended = 0
        while ended < len(handles) and not failed:
            index, event = await events.get()
            if event is None:
                ended += 1
            elif isinstance(event, GenerationFailed):
                status = 400 if event.client_error else 500
                kind = "invalid_request_error" if event.client_error else "server_error"
                yield sse(APIError(status, str(event), kind=kind).body())
                failed = True
            else:
                for chunk in choices[index].chunks(event):
                    yield sse(chunk)
                if isinstance(event, Finished):
                    finished[index] = event
        if include_usage and all(f is not None for f in finished):
            yield sse(shape.usage_chunk(finished))
    finally:
        for pump in pumps:
            pump.cancel()
        _cancel(handles)  # a no-op after the end; stops the generations when the stream is abandoned
    yield sse("[DONE]")


async def _pump(index: int, handle: RequestHandle, events: asyncio.Queue) -> None:
    """Forward one choice's events as (index, event), its failure as (index, GenerationFailed), its end as (index, None)."""
    try:
        async for event in handle.events():
            events.put_nowait((index, event))
    except GenerationFailed as exc:
        events.put_nowait((index, exc))
    finally:
        events.put_nowait((index, None))


def _delta(event: ParserEvent) -> dict:
    """A chat chunk's delta for one parser event: content, a tool call's start, or a piece of its arguments."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        call = {"index": event.index, "id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
    else:
        call = {"index": event.index, "function": {"arguments": event.text}}
    return {"tool_calls": [call]}


async def until_disconnected(request: Request, handles: Sequence[RequestHandle]) -> list[Finished] | None:
    """Every choice's result, or None (and the generations cancelled) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    results = asyncio.ensure_future(asyncio.gather(*(handle.result() for handle in handles)))
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not results.done():
            _cancel(handles)
            results.cancel()
    if results.cancelled():
        return None
    try:
        finished = results.result()
    except GenerationFailed as exc:
        _cancel(handles)
        if exc.client_error:
            raise APIError(400, str(exc)) from None
        raise APIError(500, str(exc), kind="server_error") from None
    return None if any(f is None for f in finished) else list(finished)
