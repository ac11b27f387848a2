"""The FastAPI application: OpenAI / vLLM / SGLang compatible endpoints over the generation ``Engine``.

This module only wires the server together: the lifespan (the engine starts and stops with the
app), the middleware (body-size limit, API key, unexpected errors), the error handlers, the OpenAPI
document (``/openapi.json``, ``jaxprm.serve.openapi``), ``/health`` and ``/metrics`` (Prometheus
text format, ``jaxprm.serve.metrics``). The routes live in one router per dialect
(``jaxprm.serve.openai_routes``, ``jaxprm.serve.sglang_routes``) over the shared request handling
of ``jaxprm.serve.serving``; request bodies are in ``jaxprm.serve.protocol``, response bodies in
``jaxprm.serve.responses`` and errors in ``jaxprm.serve.errors``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from jaxprm.serve.errors import APIError, CatchAllMiddleware, LimitsMiddleware, install_error_handlers
from jaxprm.serve.metrics import CONTENT_TYPE_LATEST
from jaxprm.serve.openai_routes import openai_router
from jaxprm.serve.openapi import errors, install_openapi
from jaxprm.serve.responses import Health
from jaxprm.serve.sampler import Sampler
from jaxprm.serve.serving import ServeConfig, Serving
from jaxprm.serve.sglang_routes import sglang_router
from jaxprm.serve.warmup import BackgroundWarmup

__all__ = ["ServeConfig", "APIError", "create_app", "API_DESCRIPTION"]

API_DESCRIPTION = (
    "OpenAI / vLLM and SGLang compatible generation. Request types are strict: an `integer` is a JSON "
    "integer written without a fraction or exponent (`1`, not `1.0`), a `number` any JSON number, booleans "
    "and strings are never converted, and every string must be valid Unicode (no lone surrogate escapes). "
    "Errors are `{\"error\": {message, type, param, code}}` with status 400 for invalid requests. Reported "
    "log-probs lie in [-9999, 0] (-9999 stands for -inf: a token that top-k / top-p excluded).")


def create_app(
    sampler: Sampler,
    tokenizer,
    config: ServeConfig | None = None,
    *,
    load_fn: Callable[[str], tuple[Any, Any]] | None = None,
) -> FastAPI:
    """Build the FastAPI app; the generation engine starts and stops with the app's lifespan.

    Args:
      sampler: the ``jaxprm.serve.sampler.Sampler`` holding the weights.
      tokenizer: a ``jaxprm.models.Tokenizer`` (encode, decode, apply_chat_template).
      config: ``ServeConfig`` (defaults).
      load_fn: ``path -> (model, tokenizer)`` for ``/update_weights_from_disk`` (default
        ``jaxprm.models.load_model``).
    """
    config = config or ServeConfig()
    srv = Serving(sampler, tokenizer, config, load_fn)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.engine.start()
        if config.warmup:
            srv.warmup = BackgroundWarmup(srv.engine, max_len=config.warmup_max_len).start()
        try:
            yield
        finally:
            if srv.warmup is not None:
                srv.warmup.stop(timeout=30)  # mid-compile: the daemon thread finishes that program alone
            srv.engine.stop()

    app = FastAPI(title="jaxprm generation server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description=API_DESCRIPTION)
    app.state.server = srv
    app.add_middleware(LimitsMiddleware, max_body_bytes=config.max_body_bytes, api_key=config.api_key)
    app.add_middleware(CatchAllMiddleware)  # outermost: a 500 keeps the connection
    install_error_handlers(app)
    install_openapi(app, api_key=config.api_key is not None)

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
              "description": "Prometheus text format"}, **errors(500)})
    async def metrics():
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "engine stopped"},
                                                          **errors(500)})
    async def health():
        ok = srv.engine.running
        body = {"status": "ok" if ok else "engine stopped", "weight_version": srv.sampler.weight_version}
        if srv.warmup is not None:
            body["warmup_programs"] = [srv.warmup.done, srv.warmup.total]
        return JSONResponse(body, status_code=200 if ok else 503)

    app.include_router(openai_router(srv))
    app.include_router(sglang_router(srv))
    return app
