"""Pure ASGI middleware: API keys and tenants, and the request body size limit.

Pure ASGI rather than Starlette's BaseHTTPMiddleware (`@app.middleware("http")`): that one
runs the route in a separate task behind its own receive channel, so a route never learns
that its client disconnected and a non-streamed request whose client left ran to the end.
These pass `receive` through (wrapped only to count bytes), so disconnects still reach routes.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass
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


DEFAULT_TENANT = "default"
TENANT_HEADER = b"x-tenant"
_TENANT = re.compile(rb"[A-Za-z0-9_.:@-]{1,64}")


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the routes see it (`request.state.caller`)."""

    tenant: str  # partitions the response cache
    admin: bool  # may act on every tenant (DELETE /v1/cache)


@dataclass(frozen=True)
class TenantLimits:
    """What the keys file says of a tenant: its weight in the fair scheduling policy (its share
    of the batch's seats, engine/waiting.py), and the most it may have in flight (accepted and
    not finished: requests, and their prompt tokens) before its new requests get 429."""

    weight: float = 1.0
    max_concurrent: int | None = None
    max_queued_tokens: int | None = None
    adapters: tuple[str, ...] | None = None  # the LoRA adapters it may use and sees in /v1/models; None: all

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


@dataclass(frozen=True)
class APIKeys:
    tenants: dict[str, str]  # key -> tenant
    limits: dict[str, TenantLimits]  # tenant -> its limits, for every tenant the file names

    @property
    def weights(self) -> dict[str, float]:
        return {tenant: limits.weight for tenant, limits in self.limits.items()}


_LIMIT_FIELDS = {"weight": float, "max_concurrent": int, "max_queued_tokens": int, "adapters": str}


def read_api_keys(path: str) -> APIKeys:
    """`KEY TENANT [weight=W] [max_concurrent=N] [max_queued_tokens=T] [adapters=A,B]` per line,
    `#` comments and blank lines skipped (adapters: the only LoRA adapters the tenant may use). A
    key listed twice is an error, and so are two lines of one tenant that disagree on its limits
    (a limit given on one line and left out on another agrees)."""
    tenants: dict[str, str] = {}
    given: dict[str, dict[str, float | int]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) < 2 or not _TENANT.fullmatch(fields[1].encode()):
                raise ValueError(f"{path}:{number}: expected `KEY TENANT [weight=W] [max_concurrent=N] "
                                 f"[max_queued_tokens=T] [adapters=A,B]` (a tenant of letters, digits and _.:@-, at "
                                 f"most 64), got {line.strip()!r}")
            key, tenant = fields[:2]
            if tenant == DEFAULT_TENANT:  # the tenant of api_key and admin_api_key: it would share their answers
                raise ValueError(f"{path}:{number}: the tenant name {DEFAULT_TENANT!r} is reserved")
            if key in tenants:
                raise ValueError(f"{path}:{number}: the key is listed twice")
            tenants[key] = tenant
            known = given.setdefault(tenant, {})
            for name, value in (_limit(path, number, field) for field in fields[2:]):
                if known.setdefault(name, value) != value:
                    raise ValueError(f"{path}:{number}: {name}={value} for tenant {tenant!r}, which an earlier "
                                     f"line gives {name}={known[name]}")
    return APIKeys(tenants, {tenant: TenantLimits(**values) for tenant, values in given.items()})


def _limit(path: str, number: int, field: str) -> tuple[str, float | int | tuple[str, ...]]:
    name, _, text = field.partition("=")
    kind = _LIMIT_FIELDS.get(name)
    if kind is None or not text:
        raise ValueError(f"{path}:{number}: expected weight=W, max_concurrent=N, max_queued_tokens=T or adapters=A,B "
                         f"after the tenant, got {field!r}")
    if kind is str:
        return name, tuple(sorted({a for a in text.split(",") if a}))
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{path}:{number}: {name} must be a {'number' if kind is float else 'whole number'} > 0, "
                         f"got {text!r}")
    return name, value


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` (the scheme in any case, as HTTP allows) on every route but
    the open ones, when keys are configured. Keys are compared in constant time.

    Every request gets a Caller (`request.state.caller`). With keys, its tenant is the key's,
    and nothing the client sends can change it; without keys, the X-Tenant header names it
    (default "default"), which is only as trustworthy as the clients: give each tenant a key
    where that matters. The admin key makes an admin caller; so does every request on a server
    with no keys at all."""

    def __init__(self, app: ASGIApp, keys: dict[str, str], admin_api_key: str | None, open_paths: set[str]):
        self.app, self.open_paths = app, open_paths
        self.keys = [(key.encode(), tenant) for key, tenant in keys.items()]
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            caller = self._caller(scope)
            if caller is None:
                await send_error(send, 401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                 "invalid_request_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                return
            if not self.keys and (tenant := _header(scope, TENANT_HEADER)) is not None:
                if not _TENANT.fullmatch(tenant):
                    await send_error(send, 400, "X-Tenant must be 1 to 64 letters, digits or _.:@-.",
                                     "invalid_request_error")
                    return
                caller = Caller(tenant.decode(), caller.admin)
            scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)

    def _caller(self, scope: Scope) -> Caller | None:
        """The caller a request's key makes it, or None if a key is needed and it has none that fits."""
        scheme, _, token = (_header(scope, b"authorization") or b"").strip().partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        if self.admin_api_key is not None and hmac.compare_digest(token, self.admin_api_key):
            return Caller(DEFAULT_TENANT, admin=True)
        tenant = None
        for key, key_tenant in self.keys:  # every key is compared, so the time taken names none of them
            if hmac.compare_digest(token, key):
                tenant = key_tenant
        if tenant is not None:
            return Caller(tenant, admin=False)
        if self.keys:
            return None
        return Caller(DEFAULT_TENANT, admin=self.admin_api_key is None)


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
