"""A loopback OpenAI-compatible server that refuses token-id prompts the way llama.cpp's server was
seen to (issue 12, item 13): ``/v1/completions`` answers a string prompt with text only (no token
ids, no log-probs) and a prompt of token ids with HTTP 500 and an OpenAI-style error body
(``{"error": {"code", "message", "type": "server_error"}}``), a validation error dressed as a server
error, so a client that retries 5xx would retry it.

``LlamaCppLike()`` starts uvicorn on ``127.0.0.1`` (free port) in a daemon thread; ``url`` is the
base URL; ``token_prompts`` / ``text_prompts`` count the completion requests of each kind.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

REFUSAL = "[json.exception.type_error.302] type must be string, but is array"


class LlamaCppLike:
    def __init__(self) -> None:
        self.token_prompts = 0
        self.text_prompts = 0
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
        ])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off",
                                                     timeout_graceful_shutdown=0.05))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

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

    def __enter__(self) -> LlamaCppLike:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("llama.cpp-like server did not start")
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
