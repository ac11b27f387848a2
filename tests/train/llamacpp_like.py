"""A loopback OpenAI-compatible server that refuses token-id prompts the way llama.cpp's server was
seen to (issue 12, item 13): ``/v1/completions`` answers a string prompt with text only (no token
ids, no log-probs) and a prompt of token ids with HTTP 500 and an OpenAI-style error body
(``{"error": {"code", "message", "type": "server_error"}}``), a validation error dressed as a server
error, so a client that retries 5xx would retry it.

``LlamaCppLike()`` starts uvicorn on ``127.0.0.1`` (free port) in a daemon thread; ``url`` is the
base URL; ``token_prompts`` / ``text_prompts`` count the completion requests of each kind.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from jaxprm.inprocess import ThreadedServer

REFUSAL = "[json.exception.type_error.302] type must be string, but is array"


class LlamaCppLike:
    def __init__(self) -> None:
        self.token_prompts = 0
        self.text_prompts = 0
        self.app = Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
        ])
        self._http: ThreadedServer | None = None

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "smollm2-135m-instruct", "object": "model"}]})

    async def _completions(self, request: Request) -> JSONResponse:
        body: dict[str, Any] = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            self.token_prompts += 1
            return JSONResponse({"error": {"code": 500, "message": REFUSAL, "type": "server_error"}}, status_code=500)
        self.text_prompts += 1
        return JSONResponse({
            "object": "text_completion", "model": "smollm2-135m-instruct", "created": int(time.time()),
            "choices": [{"index": 0, "text": " Right", "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })

    @property
    def url(self) -> str:
        return self._http.url

    def __enter__(self) -> LlamaCppLike:
        self._http = ThreadedServer(self.app, name="llamacpp-like", startup_timeout_s=10, log_level="error",
                                    timeout_graceful_shutdown=0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._http.stop(10)
