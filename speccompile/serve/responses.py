"""Response bodies and server-sent event streams of the OpenAI API, from the engine's events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from .api_errors import APIError
from ..runtime.logprobs import TokenLogprob
from .requests import Finished, GenerationFailed, RequestHandle, TextDelta
from .tool_parsers import ContentDelta, ParserEvent, ToolCallStart, parse_whole
from .tools import ToolFormat


class ResponseShape:
    """How one endpoint words its responses and stream chunks. `token_text`, `token_bytes`: a token id's text and
    its own bytes (for logprobs; default: the text's UTF-8); `tool_format`: read the answer for tool calls in this
    format (chat with tools)."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] | None = None,
                 tool_format: ToolFormat | None = None, token_bytes: Callable[[int], bytes] | None = None):
        self.chat = chat
        self.model = model
        self.token_text = token_text or str
        self.token_bytes = token_bytes or (lambda token: self.token_text(token).encode("utf-8"))
        self.tool_format = tool_format
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def complete(self, finished: Finished) -> dict:
        logprobs = None if finished.logprobs is None else self.logprobs(finished.logprobs)
        if not self.chat:
            choice = {"index": 0, "text": finished.text, "logprobs": logprobs, "finish_reason": finished.finish_reason}
            return self._envelope("text_completion", [choice], usage=usage(finished), speculative=finished.speculative)
        message: dict[str, Any] = {"role": "assistant", "content": finished.text}
        finish_reason = finished.finish_reason
        if self.tool_format is not None:
            answer = parse_whole(self.tool_format.parser(), finished.text)
            message["content"] = answer.content
            if answer.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in answer.tool_calls]
                finish_reason = _tool_finish(finish_reason)
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion", [choice], usage=usage(finished), speculative=finished.speculative)

    def chunk(self, delta: dict | str | None, finish_reason: str | None = None, logprobs: dict | None = None,
              **extra: Any) -> dict:
        """A stream chunk: chat, a `delta` dict (or its content text); completions, the text."""
        if self.chat:
            if not isinstance(delta, dict):
                delta = {} if delta is None else {"content": delta}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, finished: Finished) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(finished))

    def logprobs(self, entries: Sequence[TokenLogprob]) -> dict:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: OpenAI's legacy columns."""
        if self.chat:
            return {"content": [{**self._token(e.token, e.logprob), "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        texts = [self.token_text(e.token) for e in entries]
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self.token_text(t): _finite(lp) for t, lp in e.top} for e in entries], "text_offset": offsets}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(self.token_bytes(token))}


def _finite(logprob: float) -> float:
    """-inf (a token the grammar, top-k or top-p excludes) as OpenAI writes it: JSON has no infinities."""
    return max(logprob, -9999.0)


def _tool_finish(reason: str) -> str:
    return "tool_calls" if reason == "stop" else reason


def usage(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens}}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that cancel the generation as soon as the client disconnects (not at the next write)."""

    def __init__(self, events: AsyncIterator[str], handle: RequestHandle):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._handle = handle

    async def __call__(self, scope, receive, send) -> None:
        async def cancel_on_disconnect() -> None:
            await self.listen_for_disconnect(receive)
            self._handle.cancel()

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        try:
            await self.stream_response(send)
        except OSError:  # the client went away while we wrote
            pass
        finally:
            watcher.cancel()
            self._handle.cancel()


async def stream_events(shape: ResponseShape, handle: RequestHandle, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: a role chunk (chat), content (or tool-call) chunks, a final chunk with finish_reason, usage,
    [DONE]. A delta's logprob entries ride on its first chunk (or, if it made none, on the next one)."""
    parser = shape.tool_format.parser() if shape.tool_format is not None else None
    pending: list[TokenLogprob] = []
    sent, called = 0, False
    try:
        if shape.chat:
            yield sse(shape.chunk({"role": "assistant", "content": ""}))
        async for event in handle.events():
            if isinstance(event, TextDelta):
                pending += event.logprobs
                deltas = [event.text] if parser is None else [_delta(e) for e in parser.feed(event.text)]
            else:
                deltas = [] if parser is None else [_delta(e) for e in parser.finish()]
            for delta in deltas:
                called = called or (isinstance(delta, dict) and "tool_calls" in delta)
                yield sse(shape.chunk(delta, logprobs=shape.logprobs(pending) if pending else None))
                sent, pending = sent + len(pending), []
            if isinstance(event, Finished):
                reason = _tool_finish(event.finish_reason) if called else event.finish_reason
                rest = list(event.logprobs[sent:]) if event.logprobs is not None else pending  # every entry, once
                logprobs = shape.logprobs(rest) if rest else None
                yield sse(shape.chunk(None if shape.chat else "", reason, logprobs, speculative=event.speculative))
                if include_usage:
                    yield sse(shape.usage_chunk(event))
    except GenerationFailed as exc:
        status = 400 if exc.client_error else 500
        yield sse(APIError(status, str(exc), kind="invalid_request_error" if exc.client_error else "server_error").body())
    finally:
        handle.cancel()  # a no-op after the end; stops the generation when the stream is abandoned
    yield sse("[DONE]")


def _delta(event: ParserEvent) -> dict:
    """A chat chunk's delta for one parser event: content, a tool call's start, or a piece of its arguments."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        call = {"index": event.index, "id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
    else:
        call = {"index": event.index, "function": {"arguments": event.text}}
    return {"tool_calls": [call]}


async def until_disconnected(request: Request, handle: RequestHandle) -> Finished | None:
    """The generation's result, or None (and the generation cancelled) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(handle.result())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not result.done():
            handle.cancel()
            result.cancel()
    if result.cancelled():
        return None
    try:
        return result.result()
    except GenerationFailed as exc:
        if exc.client_error:
            raise APIError(400, str(exc)) from None
        raise APIError(500, str(exc), kind="server_error") from None
