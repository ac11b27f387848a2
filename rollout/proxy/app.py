"""The proxy's FastAPI app: routes, keys, error answers and the lifespan (layer 4).

Routes (``Authorization: Bearer <key>``; docs/design.md restates the proxy):

=============================  =======  ===================================================================
``POST /rl/start_session``     admin    ``{task_id, group_size=1, api_key?, group_id?, seed?}`` -> 201
                                        ``{group_id, sessions: [{session_id, session_api_key}]}``
``POST /v1/chat/completions``  session  OpenAI chat request (``stream`` allowed) -> OpenAI answer, recorded;
(and ``/chat/completions``)             the admin key records into ``__hitl__``; no / an unknown key: 401
                                        (forwarded unrecorded when the proxy passes through)
``POST /v1/responses``         session  OpenAI Responses request (``stream``, function tools, ``previous_response_id``
(and ``/responses``)                    within the session) -> ``response`` object, recorded like a chat turn
``POST /rl/set_reward``        session  ``{interaction_id?, reward?, rewards?: {id: r}, env_states?: {id: {}}}``
                                        -> ``{interaction_count, session_id, trajectory_id, trajectory_ready,
                                        ready_transition}``
``POST /rl/end_session``       session  (v1) binds what is pending into a ready trajectory; later calls 410
``POST /export_trajectories``  admin    ``{session_ids, group_id?, trajectory_id?, discount=1, style="concat",
                                        remove_session=true, discard_trajectory=false, is_eval=false}`` ->
                                        ``{rows: [...], prm_stats?, rejected?, discarded?}``
``GET /health``, ``/v1/models`` none    status / the served model id
``GET /rl/stats[?reset=1]``    admin    counters and the proxy's own time per turn (``reset``: clear those samples)
=============================  =======  ===================================================================

Errors use the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}`` so that the
official SDK raises with the message. The chat route is the hot path (one call per agent turn): it
is a plain ASGI callable that the app dispatches to before FastAPI's routing, dependency resolution
and middleware stack (:class:`ChatEndpoint`); every other route is an ordinary FastAPI route. A rejected group is not an error: 200 with empty ``rows`` and
``rejected: {reason, session_ids, message}``. Lifespan: ``RecordingProxy.startup`` (upstream client,
then the PRMRunner) and ``shutdown`` (drain exports, close the runner, then the client).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rollout.proxy.chat import chat_answer, parse_chat_request, stream_chunks
from rollout.proxy.config import ProxyError
from rollout.proxy.service import RecordingProxy
from rollout.proxy.sessions import Session
from rollout.responses_api import response_events

__all__ = ["create_app", "ChatEndpoint", "CHAT_PATHS", "MAX_CHAT_BODY_BYTES"]

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "method_not_allowed", 409: "conflict_error", 410: "session_ended",
          413: "request_too_large", 502: "upstream_error",
          503: "service_unavailable"}


CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
MAX_CHAT_BODY_BYTES = 64 * 1024 * 1024


def _error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": status}}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param), status_code=status)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if not auth:
        return None
    scheme, _, token = auth.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ProxyError(400, f"the request body is not valid JSON: {e}") from None


def create_app(proxy: RecordingProxy) -> FastAPI:
    """The HTTP face of ``proxy``; its lifespan starts and stops the proxy."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.startup()
        try:
            yield
        finally:
            await proxy.shutdown()

    app = _ProxyApp(ChatEndpoint(proxy), title="jaxprm recording proxy", lifespan=lifespan, docs_url=None,
                    redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    store = proxy.store

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError):
        return _error(exc.status, exc.message, exc.param)

    def admin(request: Request) -> None:
        key = _bearer(request)
        if key is None:
            raise ProxyError(401, "missing Authorization: Bearer <admin key>")
        if not store.is_admin(key):
            raise ProxyError(403 if store.session_for_key(key) is not None else 401,
                             "this route needs the admin key")

    def session_of(request: Request) -> Session:
        key = _bearer(request)
        s = store.session_for_key(key)
        if s is None:
            raise ProxyError(401, "missing Authorization: Bearer <session key>" if key is None
                             else "unknown or expired session key")
        return s

    @app.post("/rl/start_session", status_code=201)
    async def start_session(request: Request):
        admin(request)
        body = await _json(request)
        if not isinstance(body, dict):
            raise ProxyError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - {"task_id", "group_size", "api_key", "group_id", "seed"})
        if unknown:
            raise ProxyError(400, f"unknown fields {unknown}; allowed: task_id, group_size, api_key, group_id, seed",
                             param=unknown[0])
        gid, sessions = proxy.start_session(body.get("task_id"), body.get("group_size", 1),
                                            api_key=body.get("api_key"), group_id=body.get("group_id"),
                                            seed=body.get("seed"))
        out: dict[str, Any] = {"group_id": gid,
                               "sessions": [{"session_id": s.id, "session_api_key": s.api_key} for s in sessions]}
        if len(sessions) == 1:  # the v1 shape
            out.update(session_id=sessions[0].id, api_key=sessions[0].api_key)
        return JSONResponse(out, status_code=201)

    @app.post("/rl/set_reward")
    async def set_reward(request: Request):
        session = session_of(request)
        return JSONResponse(proxy.set_reward(session, await _json(request)))

    @app.post("/rl/end_session")
    async def end_session(request: Request):
        return JSONResponse(session_of(request).end())

    async def export_trajectories(request: Request):
        admin(request)
        result = await proxy.export(await _json(request))
        return JSONResponse(result.to_json())

    app.add_api_route("/export_trajectories", export_trajectories, methods=["POST"])
    app.add_api_route("/rl/export_trajectories", export_trajectories, methods=["POST"])

    @app.get("/health")
    async def health():
        if proxy.closing or not proxy.started:
            return JSONResponse({"status": "shutting down" if proxy.closing else "starting"}, status_code=503)
        return JSONResponse({"status": "ok", "sessions": len(store), "scoring": proxy.scoring})

    async def models():
        return JSONResponse({"object": "list", "data": [{"id": proxy.config.model_name, "object": "model",
                                                          "created": 0, "owned_by": "jaxprm"}]})

    async def responses(request: Request):
        """``POST /v1/responses`` (``RecordingProxy.respond``): the session key as for chat; a
        streamed answer is the finished turn's events in one body, as the chat route sends them."""
        session = proxy.session_for_turn(_bearer(request))
        body = await _json(request)
        out = await proxy.respond(session, body)
        if isinstance(body, dict) and body.get("stream"):
            return Response(b"".join(response_events(out)), media_type="text/event-stream",
                            headers={"cache-control": "no-cache"})
        return JSONResponse(out)

    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/responses", responses, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/models", models, methods=["GET"])

    @app.get("/rl/stats")
    async def stats(request: Request):
        admin(request)
        out = proxy.stats()
        if request.query_params.get("reset") in ("1", "true"):
            proxy.overhead_s.clear()
        return JSONResponse(out)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception):
        return _error(404, f"no route {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc: Exception):
        return _error(405, f"method {request.method} is not allowed on {request.url.path}")

    return app


class _ProxyApp(FastAPI):
    """FastAPI with the chat route dispatched first, as a plain ASGI callable."""

    def __init__(self, chat: ChatEndpoint, **kw: Any) -> None:
        super().__init__(**kw)
        self.chat_endpoint = chat

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in CHAT_PATHS:
            await self.chat_endpoint(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class ChatEndpoint:
    """``POST /v1/chat/completions`` (and ``/chat/completions``) as a plain ASGI callable.

    Reads the body (at most :data:`MAX_CHAT_BODY_BYTES`, else 413), resolves the bearer key to its
    session (401 / 410 as the other routes), records the turn through ``RecordingProxy.chat`` and
    answers with the ``chat.completion`` JSON, or server-sent events when ``stream`` is true.
    ``ProxyError`` becomes its status with the OpenAI error shape; anything else a logged 500.
    The proxy's own time (from the complete request body to the built answer, minus the upstream
    wait) goes to ``RecordingProxy.overhead_s``.
    """

    def __init__(self, proxy: RecordingProxy) -> None:
        self.proxy = proxy

    async def __call__(self, scope, receive, send) -> None:
        if scope["method"] != "POST":
            await self._answer(send, 405, _error_body(405, f"method {scope['method']} is not allowed on "
                                                           f"{scope['path']}"))
            return
        try:
            raw = await _read_body(receive)
            t0 = time.perf_counter()
            out, upstream_s = await self._chat(scope, raw)
        except ProxyError as e:
            await self._answer(send, e.status, _error_body(e.status, e.message, e.param))
            return
        except Exception:
            logger.exception("chat completion failed")
            await self._answer(send, 500, _error_body(500, "internal error in the recording proxy (see its log)"))
            return
        if isinstance(out, dict):
            payload = json.dumps(out, separators=(",", ":")).encode()
            self.proxy.overhead_s.append(time.perf_counter() - t0 - upstream_s)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_JSON_HEADERS, (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        chunks = b"".join(out)  # a finished record: every event is ready now
        self.proxy.overhead_s.append(time.perf_counter() - t0 - upstream_s)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        await send({"type": "http.response.body", "body": chunks})

    async def _chat(self, scope, raw: bytes):
        proxy = self.proxy
        session = proxy.session_for_turn(_scope_bearer(scope))
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ProxyError(400, f"the request body is not valid JSON: {e}") from None
        req = parse_chat_request(body)
        rid, resp, message, upstream_s = await proxy.chat(session, req, owned=True)  # parsed from this body
        model = proxy.config.model_name
        if req.stream:
            return stream_chunks(rid, model, resp, message, logprobs=req.logprobs, include_usage=req.include_usage,
                                 token_text=proxy.token_text), upstream_s
        return chat_answer(rid, model, resp, message, logprobs=req.logprobs, token_text=proxy.token_text), upstream_s

    @staticmethod
    async def _answer(send, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [*_JSON_HEADERS, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive) -> bytes:
    """The whole request body (413 past :data:`MAX_CHAT_BODY_BYTES`)."""
    parts = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ProxyError(400, "the client disconnected before the request body was complete")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_CHAT_BODY_BYTES:
            raise ProxyError(413, f"the request body is larger than {MAX_CHAT_BODY_BYTES} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _scope_bearer(scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() or None if scheme.lower() == "bearer" else None
    return None
