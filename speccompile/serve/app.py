"""The OpenAI-compatible HTTP API (FastAPI): request schemas and validation, responses, SSE streaming, errors.

`create_app(engine, served_model_name)` builds the app; `speccompile serve` runs it under uvicorn and
`serve --ray` deploys the same app on Ray Serve (one engine per replica).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InputError
from .engine import Engine, EngineBusy, EngineStopped, Finished, GenerationFailed, GenerationRequest, RequestHandle, TextDelta
from .metrics import ENDPOINTS

DEFAULT_MAX_BODY_BYTES = 1 << 20
REPLICA_HEADER = "x-speccompile-replica"
log = logging.getLogger("speccompile.serve")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _status_error(status: int, detail: str) -> APIError:
    kinds = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "service_unavailable_error"}
    return APIError(status, detail, kind=kinds.get(status, "server_error" if status >= 500 else "invalid_request_error"))


# --------------------------------------------------------------------------------------------
# Request schemas (OpenAI's fields; unknown fields are ignored, unsupported ones refused)
# --------------------------------------------------------------------------------------------


def _refuse_unless_off(value, info):
    """A field this server does not implement is accepted only at its 'off' value (null, false, 0, empty)."""
    if value not in (None, False, 0, [], {}):
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


def _only_one(value, info):
    """n and best_of: one choice per request."""
    if value not in (None, 1):
        raise ValueError(f"only {info.field_name}=1 is supported, got {value}")
    return value


class _StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1, description="extension: keep the k most likely tokens; 0 or -1 = off")
    seed: StrictInt | None = Field(None, ge=0)
    n: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    one_choice = field_validator("n")(_only_one)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    refuse_unsupported = field_validator("presence_penalty", "frequency_penalty", "logit_bias")(_refuse_unless_off)

    def request(self, prompt_ids: list[int], max_tokens: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    refuse_unsupported_here = field_validator("echo", "suffix", "logprobs")(_refuse_unless_off)

    one_candidate = field_validator("best_of")(_only_one)


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list | None = None
    response_format: dict | None = None

    refuse_unsupported_here = field_validator("logprobs", "tools")(_refuse_unless_off)

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict | None) -> dict | None:
        if value and value.get("type") != "text":
            raise ValueError("only response_format {\"type\": \"text\"} is supported")
        return value


# --------------------------------------------------------------------------------------------
# Response shapes
# --------------------------------------------------------------------------------------------


class _Shape:
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
                              usage=_usage(finished), speculative=finished.speculative)

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
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=_usage(finished))


def _usage(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens}}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _EventStream(StreamingResponse):
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


class _Observe:
    """ASGI middleware: counts requests by endpoint and status, and names the replica in a response header."""

    def __init__(self, app, metrics, headers: dict[str, str]):
        self.app = app
        self.metrics = metrics
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = [500]

        async def send_observed(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if self.raw_headers:
                    message = {**message, "headers": [*message.get("headers", []), *self.raw_headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------


def create_app(engine: Engine, served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The OpenAI-compatible app over `engine`; the app's lifespan starts the engine and drains it at shutdown."""
    model_name = served_model_name or engine.info.name
    started = int(time.time())
    metrics = engine.metrics
    replica_headers = {REPLICA_HEADER: engine.replica} if engine.replica else {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="speccompile", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InputError)
    async def _input_error(_request: Request, exc: InputError) -> JSONResponse:
        return APIError(400, str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _status_error(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    app.add_middleware(_Observe, metrics=metrics, headers=replica_headers)

    async def read_json(request: Request, schema: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"the request body is {declared} bytes; the limit is {max_body_bytes}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_body_bytes:
                raise APIError(413, f"the request body is over the limit of {max_body_bytes} bytes")
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            parsed = schema.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            message = first["msg"].removeprefix("Value error, ")
            raise APIError(400, f"{param}: {message}" if param else message, param=param) from None
        if parsed.model != model_name:
            raise APIError(404, f"the model `{parsed.model}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")
        return parsed

    def budget(prompt_ids: list[int], requested: int | None, default: int | None, prompt_param: str) -> int:
        """max_tokens after the context check: the prompt must leave room for what was asked (400 otherwise);
        unasked, `default` (None: the rest of the context)."""
        context = engine.info.max_context
        room = context - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {context} tokens",
                           param=prompt_param, code="context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(prompt_ids)} and "
                                f"max_tokens asks for {requested} more", param="max_tokens", code="context_length_exceeded")
        return requested if requested is not None else min(room, default or room)

    def submit(request: GenerationRequest) -> RequestHandle:
        try:
            return engine.submit(request)
        except EngineBusy as exc:
            raise APIError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), kind="service_unavailable_error") from None

    async def respond(request: Request, shape: _Shape, handle: RequestHandle, stream: bool, include_usage: bool) -> Response:
        if stream:
            return _EventStream(_stream(shape, handle, include_usage), handle)
        finished = await _until_disconnected(request, handle)
        if finished is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(shape.complete(finished))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.accepting:
            return _status_error(503, "the server is shutting down").response()
        return JSONResponse({"status": "ok", "queue_depth": engine.waiting, "running": engine.running})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "speccompile",
                "max_model_len": engine.info.max_context, "drafter": engine.info.drafter}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await read_json(request, CompletionRequest)
        prompt_ids = _prompt_ids(engine, body.prompt)
        max_tokens = budget(prompt_ids, body.max_tokens, 16, "prompt")  # 16: OpenAI's default for completions
        handle = submit(body.request(prompt_ids, max_tokens))
        return await respond(request, _Shape(False, model_name), handle, body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)
        try:
            prompt_ids = engine.encode_chat([m.as_template_message() for m in body.messages])
        except InputError as exc:
            raise APIError(400, str(exc), param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = budget(prompt_ids, requested, None, "messages")
        handle = submit(body.request(prompt_ids, max_tokens))
        return await respond(request, _Shape(True, model_name), handle, body.stream, body.include_usage)

    return app


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _prompt_ids(engine: Engine, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return engine.encode_text(prompt)
    bad = [t for t in prompt if not 0 <= t < engine.info.vocab_size]
    if bad:
        raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{engine.info.vocab_size - 1})",
                       param="prompt")
    return list(prompt)


async def _stream(shape: _Shape, handle: RequestHandle, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: a role chunk (chat), text chunks, a final chunk with finish_reason, usage, [DONE]."""
    try:
        if shape.chat:
            yield _sse(shape.chunk("", role=True))
        async for event in handle.events():
            if isinstance(event, TextDelta):
                yield _sse(shape.chunk(event.text))
            elif isinstance(event, Finished):
                yield _sse(shape.chunk(None if shape.chat else "", event.finish_reason, speculative=event.speculative))
                if include_usage:
                    yield _sse(shape.usage_chunk(event))
    except GenerationFailed as exc:
        status = 400 if exc.client_error else 500
        yield _sse(APIError(status, str(exc), kind="invalid_request_error" if exc.client_error else "server_error").body())
    finally:
        handle.cancel()  # a no-op after the end; stops the generation when the stream is abandoned
    yield _sse("[DONE]")


async def _until_disconnected(request: Request, handle: RequestHandle) -> Finished | None:
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
