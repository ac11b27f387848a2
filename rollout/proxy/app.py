"""The proxy's FastAPI app: routes, keys, error answers and the lifespan (layer 4).

Routes (``Authorization: Bearer <key>``; PROXY.md has the full table):

=============================  =======  ===================================================================
``POST /rl/start_session``     admin    ``{task_id, group_size=1, api_key?, group_id?}`` -> 201
                                        ``{group_id, sessions: [{session_id, session_api_key}]}``
``POST /v1/chat/completions``  session  OpenAI chat request (``stream`` allowed) -> OpenAI answer, recorded;
(and ``/chat/completions``)             the admin key records into ``__hitl__``; no / an unknown key: 401
                                        (forwarded unrecorded when the proxy passes through)
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
official SDK raises with the message. A rejected group is not an error: 200 with empty ``rows`` and
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
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.proxy.chat import chat_answer, parse_chat_request, stream_chunks
from rollout.proxy.config import ProxyError
from rollout.proxy.service import RecordingProxy
from rollout.proxy.sessions import Session

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 410: "session_ended", 502: "upstream_error",
          503: "service_unavailable"}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                                   "code": status}}, status_code=status)


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

    app = FastAPI(title="jaxprm recording proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
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
        unknown = sorted(set(body) - {"task_id", "group_size", "api_key", "group_id"})
        if unknown:
            raise ProxyError(400, f"unknown fields {unknown}; allowed: task_id, group_size, api_key, group_id",
                             param=unknown[0])
        gid, sessions = proxy.start_session(body.get("task_id"), body.get("group_size", 1),
                                            api_key=body.get("api_key"), group_id=body.get("group_id"))
        out: dict[str, Any] = {"group_id": gid,
                               "sessions": [{"session_id": s.id, "session_api_key": s.api_key} for s in sessions]}
        if len(sessions) == 1:  # the v1 shape
            out.update(session_id=sessions[0].id, api_key=sessions[0].api_key)
        return JSONResponse(out, status_code=201)

    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        key = _bearer(request)
        session = store.session_for_key(key)
        if session is None and not proxy.config.passthrough:
            raise ProxyError(401, "missing Authorization: Bearer <session key>" if key is None
                             else "unknown or expired session key (start one with /rl/start_session)")
        if session is not None:
            session.check_open()
        req = parse_chat_request(await _json(request))
        rid, resp, message, upstream_s = await proxy.chat(session, req)
        model = proxy.config.model_name
        if req.stream:
            out = StreamingResponse(stream_chunks(rid, model, resp, message, logprobs=req.logprobs,
                                                  include_usage=req.include_usage, token_text=proxy.token_text),
                                    media_type="text/event-stream")
        else:
            out = JSONResponse(chat_answer(rid, model, resp, message, logprobs=req.logprobs, token_text=proxy.token_text))
        proxy.overhead_s.append(time.perf_counter() - t0 - upstream_s)
        return out

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/chat/completions", chat_completions, methods=["POST"])

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
