"""Pure ASGI middleware: API keys and the request body size limit.

Pure ASGI rather than Starlette's BaseHTTPMiddleware (`@app.middleware("http")`): that one
runs the route in a separate task behind its own receive channel, so a route never learns
that its client disconnected and a non-streamed request whose client left ran to the end.
These pass `receive` through (wrapped only to count bytes), so disconnects still reach routes.
"""

from __future__ import annotations

import hmac
import json
from typing import Awaitable, Callable

from brisk.server.errors import error_body

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, type: str, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, type, code=code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` (the scheme in any case, as HTTP allows) on every route but
    the open ones; admin routes take the admin key. Keys are compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None, open_paths: set[str],
                 admin_routes: set[tuple[str, str]]):
        self.app, self.open_paths, self.admin_routes = app, open_paths, admin_routes
        self.api_key = api_key.encode() if api_key else None
        self.admin_api_key = admin_api_key.encode() if admin_api_key else self.api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            admin = (scope["method"], scope["path"]) in self.admin_routes
            expected = self.admin_api_key if admin else self.api_key
            if expected is not None and not self._authorized(scope, expected):
                which = "the admin API key" if admin and expected != self.api_key else "the API key"
                await send_error(send, 401, f"Invalid or missing API key: send `Authorization: Bearer <key>` with "
                                            f"{which}.", "invalid_request_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _authorized(scope: Scope, expected: bytes) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over `max_bytes`: at once from Content-Length, or as soon
    as a chunked body passes the limit, without reading the rest into memory."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received, too_large = 0, False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            if not too_large:  # once over the limit, the 413 below is the only answer
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if too_large:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        await send_error(send, 413, f"The request body is larger than {self.max_bytes} bytes "
                                    f"(the server's max_request_body_mb).", "invalid_request_error",
                         code="request_too_large")
