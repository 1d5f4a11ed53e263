"""OpenAI-shaped errors: the exception the endpoints raise and the handlers that render it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kdaserve.disagg.connector import FAILED_PREFIX
from kdaserve.engine.engine_errors import (
    EngineDeadError,
    EngineError,
    QueueFullError,
    RequestTimeoutError,
)
from kdaserve.request import RequestError
from kdaserve.server.protocol_responses import ErrorInfo, ErrorResponse

logger = logging.getLogger("kdaserve")
RETRY_AFTER_S = 1


class ServerDrainingError(EngineError):
    """The server is shutting down: the request was refused or its stream was ended."""

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 500: "internal_error", 504: "timeout_error",
                503: "service_unavailable_error"}


# ---- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        # a 503 says when to come back (1 s unless told otherwise)
        self.retry_after = retry_after if retry_after is not None else (
            RETRY_AFTER_S if status == 503 else None)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.error_type,
                                             param=self.param, code=self.code))

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        if self.retry_after is not None:
            headers = {**(headers or {}), "Retry-After": str(self.retry_after)}
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def bad_request(exc: ValueError) -> APIError:
    """A 400 for a request the server refused; `param` is the field a RequestError names."""
    return APIError(400, str(exc), param=exc.param if isinstance(exc, RequestError) else None)


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), code="request_timeout")
    if isinstance(exc, ServerDrainingError):
        return APIError(503, str(exc), code="shutting_down")
    if FAILED_PREFIX in str(exc):      # disaggregation: worth a retry elsewhere
        return APIError(503, str(exc), code="kv_transfer_failed")
    return APIError(500, str(exc), code="engine_error")


class ClientGone(Exception):
    """The client disconnected before the response; nobody will read what we send."""


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        why = errors[0].get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {why}").response()

    def where(err: Mapping[str, Any]) -> str:
        return ".".join(str(p) for p in err.get("loc", ()) if p != "body")

    message = "; ".join(f"{where(e) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:5])
    param = where(errors[0]) if errors else None
    return APIError(400, message or "invalid request", param=param or None).response()


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return APIError(exc.status_code, message).response(headers=exc.headers)


async def _on_client_gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, "internal server error").response()



def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_exception_handler(Exception, _on_unexpected)
