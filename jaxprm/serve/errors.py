"""Errors and request limits of the generation server: OpenAI-shaped error bodies, the exception
handlers, and the ASGI middleware for the body-size limit, the API key and unexpected exceptions.

Errors are ``{"error": {"message", "type", "param", "code"}}`` (:class:`ErrorBody`) with a 4xx
status for bad input (400 validation / malformed JSON, 401 API key, 403 / 409 refused weight
loads, 404 unknown model or route, 405 method not allowed (with ``Allow``), 413 body too large);
an unexpected exception is a 500 with the same shape, the connection stays usable
(:class:`CatchAllMiddleware`) and the server stays up. Messages are always encodable: text from the
request that they quote is escaped (``\\ud800``) and cut.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxprm.serve.protocol import TextError

__all__ = ["APIError", "ErrorBody", "ErrorDetail", "error_response", "install_error_handlers", "LimitsMiddleware",
           "CatchAllMiddleware", "ERROR_TYPES"]

log = logging.getLogger(__name__)

#: The ``error.type`` of each status (OpenAI SDK exception names where the SDK has one).
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
               413: "RequestTooLargeError", 499: "ClientClosedRequestError", 500: "InternalServerError",
               503: "ServiceUnavailableError", 504: "TimeoutError"}
_MAX_MESSAGE = 2000


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(BaseModel):
    """The body of every error answer (OpenAI's shape)."""

    error: ErrorDetail


def _printable(text: str | None, limit: int = _MAX_MESSAGE) -> str | None:
    """``text`` as valid UTF-8 (lone surrogates escaped as ``\\udXXX``), cut to ``limit`` chars."""
    if text is None:
        return None
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


class APIError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "InternalServerError")


def error_response(status: int, message: str, *, param: str | None = None, type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI-shaped error answer (``ErrorBody``); message and param are made printable."""
    err = APIError(message, status=status, param=param, type=type)
    body = {"error": {"message": _printable(err.message), "type": err.type, "param": _printable(err.param, 200),
                      "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------
# ASGI middleware: request size limit and API key


class _TooLarge(Exception):
    """Raised from ``receive`` when a streamed request body passes the size limit."""


class LimitsMiddleware:
    """Reject bodies over ``max_body_bytes`` (413) and, if configured, missing/wrong API keys (401)."""

    def __init__(self, app, *, max_body_bytes: int, api_key: str | None, open_paths: Sequence[str] = ("/health",)):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.open_paths = set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") not in self.open_paths:
            auth = headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                resp = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
                return await resp(scope, receive, send)
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                return await error_response(400, "invalid Content-Length header")(scope, receive, send)
            if too_big:
                msg = f"request body of {length} bytes exceeds the limit of {self.max_body_bytes} bytes"
                return await error_response(413, msg)(scope, receive, send)
        received = 0
        limit = self.max_body_bytes
        too_large = False
        started = False
        msg = f"request body exceeds the limit of {self.max_body_bytes} bytes"

        async def limited_receive():
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    raise _TooLarge
            return message

        async def guarded_send(message):
            # A streamed body over the limit: whatever the app answers (it may catch the error while
            # parsing and reply 400), the client gets a 413.
            nonlocal started
            if too_large:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await error_response(413, msg)(scope, receive, send)
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _TooLarge:
            if not started:
                await error_response(413, msg)(scope, receive, send)


class CatchAllMiddleware:
    """Answer an exception that no handler took with a 500 in the error shape, log it, and return
    normally, so that the server keeps the (kept-alive) connection. (Starlette's outermost error
    middleware re-raises after answering, and the HTTP server then drops the connection.) A
    response already under way (a stream) cannot be answered any more: the exception goes on and
    the connection is closed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unhandled error in %s", scope.get("path"))
            if started:
                raise
            await error_response(500, f"internal error: {type(exc).__name__}: {exc}")(scope, receive, send)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message for pydantic's errors (the first few; a union reports each alternative) and the
    dotted location of the first."""
    parts, param = [], None
    for e in errors:
        err = (e.get("ctx") or {}).get("error")
        if isinstance(err, TextError):
            parts.append(str(err))
            param = param or err.param
            continue
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        param = param or loc or None
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {(e.get('ctx') or {}).get('error', e.get('msg'))}")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
    if len(parts) > 4:
        parts = parts[:4] + [f"({len(parts) - 4} more)"]
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped answers for ``APIError``, request validation (400), HTTP errors (405 with its
    ``Allow`` header) and anything unexpected (500, logged; see also :class:`CatchAllMiddleware`)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, type=exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405 and headers and "Allow" in headers:
            allow = ", ".join(sorted(m.strip() for m in headers["Allow"].split(",")))
            msg = f"method {request.method} is not allowed on {request.url.path} (allowed: {allow})"
            return error_response(405, msg, headers={**headers, "Allow": allow})
        return error_response(exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
