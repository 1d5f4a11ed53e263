"""ASGI middleware: the API key check and the request body limit."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kdaserve.server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 << 20
OPEN_PATHS = frozenset({"/health"})   # reachable without the API key (and /metrics, if public)


class AuthMiddleware:
    """Bearer-token check for everything but the open paths."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS
                 ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._expected):
                err = APIError(401, "missing or invalid API key", code="invalid_api_key")
                await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length and by the bytes actually received."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        too_big = APIError(413, f"the request body is larger than {self.max_bytes} bytes",
                           code="request_too_large")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await APIError(400, "invalid Content-Length").response()(scope, receive, send)
                return
            if declared > self.max_bytes:
                await too_big.response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return                       # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_big.response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

