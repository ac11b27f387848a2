"""Errors and request limits of the generation server: OpenAI-shaped error bodies, the exception
handlers, and the ASGI middleware for the body-size limit and the API key.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad input (400
validation / malformed JSON, 401 API key, 404 unknown model, 413 body too large); an unexpected
exception is a 500 with the same shape and never takes the server down.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "error_response", "install_error_handlers", "LimitsMiddleware"]

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             413: "RequestTooLargeError", 503: "ServiceUnavailableError",
                             504: "TimeoutError"}.get(status, "InternalServerError")


def error_response(status: int, message: str, *, param: str | None = None, type: str | None = None) -> JSONResponse:
    err = APIError(message, status=status, param=param, type=type)
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": status}}
    return JSONResponse(body, status_code=status)


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


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped answers for ``APIError``, request validation (400), HTTP errors and anything
    unexpected (500, logged)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, type=exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "json_invalid":
                parts.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            else:
                parts.append(f"{loc or 'body'}: {e.get('msg')}")
        param = None
        errs = exc.errors()
        if errs:
            loc = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
            param = ".".join(loc) or None
        return error_response(400, "; ".join(parts) or "invalid request", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
