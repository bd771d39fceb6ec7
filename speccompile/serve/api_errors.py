"""Errors answered as OpenAI answers them: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


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


class ParamError(ValueError):
    """A request-wide check (a pydantic model validator) that is about one field: the 400 names it as `param`,
    as a field's own check does."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def validation_param(error: dict) -> str | None:
    """The `param` of one pydantic error: its location (messages.0.content), or the field a ParamError names."""
    where = ".".join(str(p) for p in error["loc"])
    raised = (error.get("ctx") or {}).get("error")
    return where or (raised.param if isinstance(raised, ParamError) else None)


def status_error(status: int, detail: str) -> APIError:
    kinds = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "service_unavailable_error"}
    return APIError(status, detail, kind=kinds.get(status, "server_error" if status >= 500 else "invalid_request_error"))
