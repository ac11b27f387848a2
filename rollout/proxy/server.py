"""``ProxyServer``: the proxy served in-process, on the caller's event loop (trainer, tests).

    async with await ProxyServer.start(config, tokenizer) as server:
        server.base_url            # http://127.0.0.1:PORT/v1  -> give it to openai.AsyncOpenAI
        server.proxy               # the RecordingProxy: start_session / set_reward / export in Python
    # leaving: refuse new work (503), drain exports, stop HTTP, close the runner, then the client

The app's own lifespan runs here (entered directly, so a startup failure raises its original
error to the caller); uvicorn serves with its lifespan off and without installing signal handlers
(the host process keeps its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from typing import Any

import uvicorn

from rollout.chat import ChatTokenizer
from rollout.client import GenerationClient
from rollout.proxy.app import create_app
from rollout.proxy.config import ProxyConfig
from rollout.proxy.service import RecordingProxy
from scorers.base import BaseScorer

__all__ = ["ProxyServer"]


class _QuietServer(uvicorn.Server):
    """uvicorn without signal handling (the embedding process owns its signals)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class ProxyServer:
    """A running proxy (see the module docstring). Build it with :meth:`start`."""

    def __init__(self, proxy: RecordingProxy, app: Any, sock: socket.socket, host: str) -> None:
        self.proxy = proxy
        self.app = app
        self._sock = sock
        self.host = host
        self.port = sock.getsockname()[1]
        self._server: _QuietServer | None = None
        self._task: asyncio.Task | None = None
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None

    @classmethod
    async def start(cls, config: ProxyConfig, tokenizer: ChatTokenizer, *, host: str = "127.0.0.1", port: int = 0,
                    scorers: Sequence[BaseScorer] | None = None, client: GenerationClient | None = None,
                    log_level: str = "warning") -> ProxyServer:
        """Start the proxy (client, runner) and serve it on ``host:port`` (0 = a free port)."""
        proxy = RecordingProxy(config, tokenizer, scorers=scorers, client=client)
        app = create_app(proxy)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        self = cls(proxy, app, sock, host)
        self._lifespan = app.router.lifespan_context(app)
        try:
            await self._lifespan.__aenter__()
        except BaseException:
            sock.close()
            raise
        try:
            cfg = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_keep_alive=60,
                                 timeout_graceful_shutdown=5, access_log=False)
            self._server = _QuietServer(cfg)
            self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"proxy-http-{self.port}")
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError("the proxy's HTTP server stopped during startup")
                await asyncio.sleep(0.005)
        except BaseException:
            await self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL agents use (``url + "/v1"``)."""
        return self.url + "/v1"

    async def stop(self) -> None:
        """Refuse new work, drain exports, stop serving, then run the app's lifespan shutdown
        (runner, then client). Idempotent."""
        self.proxy.begin_shutdown()
        await self.proxy.drain(self.proxy.config.drain_timeout_s)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
            self._server = self._task = None
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            await lifespan.__aexit__(None, None, None)

    async def __aenter__(self) -> ProxyServer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
