"""A real scripted HTTP server (FastAPI + uvicorn on 127.0.0.1, free port) for the HTTP scorers.

Endpoints: ``POST /v1/chat/completions`` (OpenAI-compatible) and ``POST /pooling`` (vLLM style).
Each request pops the next scripted action for its endpoint (or uses the default):

- ``{"content": str}``            200 with a chat completion whose message content is ``str``
- ``{"values": list}``            200 with a pooling body ``{"data": [{"data": values}]}``
- ``{"status": int}``             that status with a small JSON error body
- ``{"raw": str}``                200 with ``str`` as the (JSON-typed) body, e.g. malformed JSON
- ``{"json": obj}``               200 with ``obj`` as the body
- ``{"delay": s, **then}``        sleep ``s`` seconds, then act on the rest
For pooling, with no scripted action, ``pooling_fn(input_ids)`` computes the values.
Every request body is recorded in ``requests[endpoint]``.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxprm.inprocess import ThreadedServer


class ScriptedServer:
    def __init__(self) -> None:
        self.scripts: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.defaults: dict[str, dict[str, Any]] = {"chat": {"content": '{"score": 0.5}'}, "pooling": {}}
        self.requests: dict[str, list[Any]] = collections.defaultdict(list)
        self.pooling_fn: Callable[[list[int]], Any] = lambda ids: [0.0 for _ in ids]
        self.app = self._make_app()
        self._http: ThreadedServer | None = None
        self.port: int | None = None

    def reset(self) -> None:
        self.scripts.clear()
        self.requests.clear()
        self.defaults = {"chat": {"content": '{"score": 0.5}'}, "pooling": {}}
        self.pooling_fn = lambda ids: [0.0 for _ in ids]

    def script(self, endpoint: str, *actions: dict[str, Any]) -> None:
        self.scripts[endpoint].extend(actions)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _act(self, endpoint: str, body: Any) -> Response:
        self.requests[endpoint].append(body)
        queue = self.scripts[endpoint]
        action = dict(queue.popleft()) if queue else dict(self.defaults[endpoint])
        if "delay" in action:
            await asyncio.sleep(action.pop("delay"))
        if "status" in action:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=action["status"])
        if "raw" in action:
            return Response(action["raw"], media_type="application/json")
        if "json" in action:
            return JSONResponse(action["json"])
        if endpoint == "chat":
            content = action.get("content", '{"score": 0.5}')
            return JSONResponse(
                {
                    "id": "chatcmpl-test",
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
        values = action["values"] if "values" in action else self.pooling_fn(list(body["input"]))
        return JSONResponse({"object": "list", "model": body.get("model"), "data": [{"index": 0, "object": "pooling", "data": values}]})

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._act("chat", await request.json())

        @app.post("/pooling")
        async def pooling(request: Request) -> Response:
            return await self._act("pooling", await request.json())

        return app

    def start(self) -> ScriptedServer:
        self._http = ThreadedServer(self.app, name="scorer-test", startup_timeout_s=20, timeout_graceful_shutdown=1)
        self.port = self._http.port
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop(10)
