"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

User mistakes are 4xx (400 bad request, 401 bad key, 404 unknown model or route, 429 full queue);
a 5xx means a bug in kvsplice (500) or an engine that is shutting down or broken (503).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsplice.errors import InvalidRequestError, PromptTooLongError

logger = logging.getLogger(__name__)


class BadRequest(InvalidRequestError):
    """An InvalidRequestError that also names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_invalid_request(exc: InvalidRequestError) -> APIError:
    code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
    return APIError(400, str(exc), param=getattr(exc, "param", None), code=code)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Pydantic's errors as one readable 400 (not FastAPI's 422 list)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {message}")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'request'}: {message}{more}", param=param)


def install_handlers(app: FastAPI, count: Callable[[int], None]) -> None:
    """Answer every error in OpenAI's shape; `count` is told each error's status."""

    def respond(error: APIError) -> JSONResponse:
        count(error.status)
        return error.response()

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return respond(exc)

    async def on_invalid_request(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidRequestError)
        return respond(from_invalid_request(exc))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ValidationError | RequestValidationError)
        return respond(from_validation_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return respond(APIError(exc.status_code, str(exc.detail), headers=headers))

    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return respond(APIError(500, f"internal error: {exc!r}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(InvalidRequestError, on_invalid_request)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_bug)


def _default_type(status: int) -> str:
    if status == 400:
        return "invalid_request_error"
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return "error"
