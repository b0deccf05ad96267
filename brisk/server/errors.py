"""OpenAI-style errors: every failure is `{"error": {"message", "type", "param", "code"}}`.

FastAPI answers a malformed body with 422 and its own shape; OpenAI clients expect 400 and
this one, so validation errors are translated here too. Error bodies are written as ASCII JSON:
a message may quote what the client sent, and that may not even be encodable as UTF-8.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from brisk.transport.client import EngineDeadError
from brisk.engine.adapters import AdapterNotFound
from brisk.sample.params import SamplingError

logger = logging.getLogger("brisk.server")
_FIELD = re.compile(r"^\w+$")  # a field name or index, not the name of a union branch pydantic tried


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (documented in the OpenAPI schema)."""

    error: ErrorDetail


class _ASCIIJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _respond(error: APIError) -> JSONResponse:
    return _ASCIIJSONResponse(error_body(error.message, error.type, error.param, error.code),
                              status_code=error.status, headers=error.headers)


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    # A field of several shapes (a prompt: text, texts, ids) fails once per shape; the limit it
    # broke (129 prompts: "at most 128 items") says more than "should be a valid string".
    errors = exc.errors()
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0]) if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body" and _FIELD.match(str(part))]
    if first.get("type") == "json_invalid":  # its location is a character offset, not a field
        message = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        location = []
    elif first.get("type") == "extra_forbidden":
        message = (f"Unsupported field `{'.'.join(location)}`: brisk does not implement it, and ignoring it "
                   f"would silently change the answer (docs/api.md, 'Request fields', lists what is accepted).")
    else:
        where = ".".join(location) or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
    return _respond(APIError(400, message, param=location[0] if location else None))


class UnexpectedErrorMiddleware:
    """Answers an exception no handler took with an OpenAI-style 500, and keeps the connection.

    Starlette's own catch-all (a handler for `Exception`, which its ServerErrorMiddleware runs)
    sends the response and then raises the exception again, and the server then closes the
    kept-alive connection: the client's next request pays a new connection, and a pooled client
    may see it reset. Outermost of the app's own middleware, this one ends the request there. A
    response already started (a stream broken midway) cannot be answered again: that exception
    goes on, and closing the connection is what tells the client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            logger.error("unexpected error answering a request", exc_info=exc)
            response = _respond(APIError(500, f"Internal error: {type(exc).__name__}.", type="server_error"))
            await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, lambda _, exc: _respond(exc))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(SamplingError, lambda _, exc: _respond(APIError(400, str(exc), param=exc.param)))
    app.add_exception_handler(AdapterNotFound, lambda _, exc: _respond(APIError(
        404, str(exc), type="not_found_error", param=exc.param, code="model_not_found")))
    app.add_exception_handler(EngineDeadError, lambda _, exc: _respond(
        APIError(503, f"The engine is not running: {exc}", type="server_error")))
    app.add_exception_handler(StarletteHTTPException, lambda _, exc: _respond(
        APIError(exc.status_code, str(exc.detail), type="not_found_error" if exc.status_code == 404 else
                 "invalid_request_error", headers=getattr(exc, "headers", None))))
