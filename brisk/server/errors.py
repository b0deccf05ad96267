"""OpenAI-style errors: every failure is `{"error": {"message", "type", "param", "code"}}`.

FastAPI answers a malformed body with 422 and its own shape; OpenAI clients expect 400 and
this one, so validation errors are translated here too.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from brisk.engine.async_engine import EngineDeadError
from brisk.sampling_params import SamplingError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _respond(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param, error.code), status_code=error.status,
                        headers=error.headers)


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        message = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    else:
        where = ".".join(location) or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
    return _respond(APIError(400, message, param=location[0] if location else None))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, lambda _, exc: _respond(exc))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(SamplingError, lambda _, exc: _respond(APIError(400, str(exc), param=exc.param)))
    app.add_exception_handler(EngineDeadError, lambda _, exc: _respond(
        APIError(503, f"The engine is not running: {exc}", type="server_error")))
    app.add_exception_handler(StarletteHTTPException, lambda _, exc: _respond(
        APIError(exc.status_code, str(exc.detail), type="not_found_error" if exc.status_code == 404 else
                 "invalid_request_error", headers=getattr(exc, "headers", None))))
