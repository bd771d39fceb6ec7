"""Response bodies and server-sent event streams of the OpenAI API, from the engine's events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from .api_errors import APIError
from .requests import Finished, GenerationFailed, RequestHandle, TextDelta


class ResponseShape:
    """How one endpoint words its responses and stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def complete(self, finished: Finished) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": finished.text}, "logprobs": None,
                      "finish_reason": finished.finish_reason}
        else:
            choice = {"index": 0, "text": finished.text, "logprobs": None, "finish_reason": finished.finish_reason}
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice],
                              usage=usage(finished), speculative=finished.speculative)

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False, **extra: Any) -> dict:
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, finished: Finished) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(finished))


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
    """The SSE body: a role chunk (chat), text chunks, a final chunk with finish_reason, usage, [DONE]."""
    try:
        if shape.chat:
            yield sse(shape.chunk("", role=True))
        async for event in handle.events():
            if isinstance(event, TextDelta):
                yield sse(shape.chunk(event.text))
            elif isinstance(event, Finished):
                yield sse(shape.chunk(None if shape.chat else "", event.finish_reason, speculative=event.speculative))
                if include_usage:
                    yield sse(shape.usage_chunk(event))
    except GenerationFailed as exc:
        status = 400 if exc.client_error else 500
        yield sse(APIError(status, str(exc), kind="invalid_request_error" if exc.client_error else "server_error").body())
    finally:
        handle.cancel()  # a no-op after the end; stops the generation when the stream is abandoned
    yield sse("[DONE]")


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
