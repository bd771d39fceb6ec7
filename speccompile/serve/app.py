"""The OpenAI-compatible HTTP API (FastAPI): routes, request reading and validation before any work, errors.

`create_app(engine, served_model_name)` builds the app; `speccompile serve` runs it under uvicorn and
`serve --ray` deploys the same app on Ray Serve (one engine per replica). The request bodies are in schemas.py,
the response bodies and event streams in responses.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InputError, SpecCompileError
from ..runtime.constraints import ConstraintSpec
from .api_errors import APIError, status_error, validation_param
from .engine import Engine
from .observe import ObserveRequests
from .requests import EngineBusy, EngineStopped, GenerationRequest, RequestHandle
from .responses import Echo, EventStream, ResponseShape, stream_events, until_disconnected
from .schemas import ChatCompletionRequest, CompletionRequest, SPECULATIVE_NAMES

DEFAULT_MAX_BODY_BYTES = 1 << 20
REPLICA_HEADER = "x-speccompile-replica"
log = logging.getLogger("speccompile.serve")


class _Api:
    """The routes' work over one engine: read and validate a body, size the request, submit it, respond."""

    def __init__(self, engine: Engine, model_name: str, max_body_bytes: int):
        self.engine = engine
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.started = int(time.time())

    async def read_json(self, request: Request, schema: type[BaseModel]) -> Any:
        """The body parsed into `schema` (413 over the size limit, 400 when invalid, 404 for another model)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes")
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
            param = validation_param(first)
            message = first["msg"].removeprefix("Value error, ")
            raise APIError(400, f"{param}: {message}" if param else message, param=param) from None
        if parsed.model != self.model_name:
            raise APIError(404, f"the model `{parsed.model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        return parsed

    def budget(self, prompt_ids: list[int], requested: int | None, default: int | None, prompt_param: str) -> int:
        """max_tokens after the context check: the prompt must leave room for what was asked (400 otherwise);
        unasked, `default` (None: the rest of the context)."""
        context = self.engine.info.max_context
        room = context - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {context} tokens",
                           param=prompt_param, code="context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(prompt_ids)} and "
                                f"max_tokens asks for {requested} more", param="max_tokens", code="context_length_exceeded")
        return requested if requested is not None else min(room, default or room)

    def submit(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Submit every choice of a request (all or none: a refused one cancels those submitted before it)."""
        limit = self.engine.options.max_concurrency + self.engine.options.max_queue
        try:
            for request in requests[:1]:  # (every choice drafts alike)
                self.engine.check_drafting(request)
        except InputError as exc:
            names = SPECULATIVE_NAMES
            raise APIError(400, exc.naming(names), param=names.get(exc.field or "", "speculative_config")) from None
        if len(requests) > limit:
            raise APIError(400, f"n: {len(requests)} choices exceed this server's limit of {limit} requests in flight",
                           param="n")
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self.engine.submit(request))
        except (EngineBusy, EngineStopped) as exc:
            for handle in handles:
                handle.cancel()
            if isinstance(exc, EngineBusy):
                raise APIError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
            raise APIError(503, str(exc), kind="service_unavailable_error") from None
        return handles

    async def respond(self, request: Request, shape: ResponseShape, handles: list[RequestHandle], stream: bool,
                      include_usage: bool) -> Response:
        if stream:
            return EventStream(stream_events(shape, handles, include_usage), handles)
        finished = await until_disconnected(request, handles)
        if finished is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(shape.complete(finished))

    def check_logit_bias(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """Token ids of logit_bias inside the vocabulary (400 naming logit_bias)."""
        vocab = self.engine.info.vocab_size
        bad = [key for key in body.logit_bias or {} if int(key) >= vocab]
        if bad:
            raise APIError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="logit_bias")

    async def health(self) -> JSONResponse:
        if not self.engine.accepting:
            return status_error(503, "the server is shutting down").response()
        return JSONResponse({"status": "ok", "queue_depth": self.engine.waiting, "running": self.engine.running})

    async def prometheus(self) -> Response:
        return Response(self.engine.metrics.render(), media_type=self.engine.metrics.content_type)

    async def models(self) -> JSONResponse:
        info = self.engine.info
        card = {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "speccompile",
                "max_model_len": info.max_context, "drafter": info.drafter}
        return JSONResponse({"object": "list", "data": [card]})

    async def compile(self, spec: ConstraintSpec | None, param: str):
        """The request's grammar compiled off the event loop (400 naming `param` when it is bad)."""
        if spec is None:
            return None
        try:
            return await asyncio.to_thread(self.engine.compile_constraint, spec)
        except SpecCompileError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self.read_json(request, CompletionRequest)
        self.check_logit_bias(body)
        prompts = [self.prompt_ids(prompt) for prompt in body.prompts]
        budgets = [self.budget(ids, body.max_tokens, 16, "prompt") for ids in prompts]  # 16: OpenAI's default
        constraint = await self.compile(body.constraint_spec(), _constraint_param(body))
        scored = bool(body.echo) and body.logprobs is not None  # the prompt's logprobs too
        handles = self.submit([body.request(ids, max_tokens, constraint, body.logprobs, choice, scored)
                               for ids, max_tokens in zip(prompts, budgets) for choice in range(body.choices)])
        echo = None
        if body.echo:
            echo = [Echo(prompt if isinstance(prompt, str) else self.engine.decode(ids), tuple(ids), scored)
                    for prompt, ids in zip(body.prompts, prompts)]
        shape = ResponseShape(False, self.model_name, self.engine.token_text, token_bytes=self.engine.token_bytes,
                              n=body.choices, echo=echo)
        return await self.respond(request, shape, handles, body.stream, body.include_usage)

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self.read_json(request, ChatCompletionRequest)
        self.check_logit_bias(body)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.calls_tools else None
        try:
            prompt_ids = self.engine.encode_chat([m.as_template_message() for m in body.messages], tools)
        except InputError as exc:
            raise APIError(400, str(exc), param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self.budget(prompt_ids, requested, None, "messages")
        tool_format = self.engine.tool_format if tools else None
        tool_spec = body.tool_spec(tool_format) if tool_format is not None else None
        if tool_spec is not None:
            constraint = await self.compile(tool_spec, "tools")
        else:
            constraint = await self.compile(body.constraint_spec(), _constraint_param(body))
        handles = self.submit([body.request(prompt_ids, max_tokens, constraint, body.logprob_count, choice)
                               for choice in range(body.choices)])
        shape = ResponseShape(True, self.model_name, self.engine.token_text, tool_format, self.engine.token_bytes,
                              n=body.choices)
        return await self.respond(request, shape, handles, body.stream, body.include_usage)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.encode_text(prompt)
        vocab = self.engine.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        return list(prompt)


def create_app(engine: Engine, served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The OpenAI-compatible app over `engine`; the app's lifespan starts the engine and drains it at shutdown."""
    api = _Api(engine, served_model_name or engine.info.name, max_body_bytes)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="speccompile", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    app.add_middleware(ObserveRequests, metrics=engine.metrics,
                       headers={REPLICA_HEADER: engine.replica} if engine.replica else {})
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's shape: ours, the request's (InputError: 400), HTTP's, and anything else (500)."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InputError)
    async def _input_error(_request: Request, exc: InputError) -> JSONResponse:
        return APIError(400, str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return status_error(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()


def _constraint_param(body) -> str:
    return "structured_outputs" if body.structured_outputs is not None else "response_format"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
