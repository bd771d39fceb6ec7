"""ASGI middleware: requests counted by endpoint and status, the replica named in a response header."""

from __future__ import annotations

from .metrics import ENDPOINTS


class ObserveRequests:
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
