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

import contextlib
from collections.abc import Sequence
from typing import Any

from jaxprm.inprocess import LoopServer
from rollout.chat import ChatTokenizer
from rollout.client import GenerationClient
from rollout.proxy.app import create_app
from rollout.proxy.config import ProxyConfig
from rollout.proxy.service import RecordingProxy
from scorers.base import BaseScorer

__all__ = ["ProxyServer"]


class ProxyServer:
    """A running proxy (see the module docstring). Build it with :meth:`start`."""

    def __init__(self, proxy: RecordingProxy, app: Any) -> None:
        self.proxy = proxy
        self.app = app
        self._http: LoopServer | None = None
        self.host: str | None = None
        self.port: int | None = None
        self.url: str | None = None  # http://host:port, once serving
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None

    @classmethod
    async def start(cls, config: ProxyConfig, tokenizer: ChatTokenizer, *, host: str = "127.0.0.1", port: int = 0,
                    scorers: Sequence[BaseScorer] | None = None, client: GenerationClient | None = None,
                    log_level: str = "warning") -> ProxyServer:
        """Start the proxy (client, runner) and serve it on ``host:port`` (0 = a free port)."""
        proxy = RecordingProxy(config, tokenizer, scorers=scorers, client=client)
        app = create_app(proxy)
        self = cls(proxy, app)
        self._lifespan = app.router.lifespan_context(app)
        await self._lifespan.__aenter__()
        try:
            self._http = await LoopServer.start(app, host=host, port=port, name="proxy-http", log_level=log_level,
                                                timeout_keep_alive=60)
            self.host, self.port, self.url = self._http.host, self._http.port, self._http.url
        except BaseException:
            await self.stop()
            raise
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI base URL agents use (``url + "/v1"``)."""
        return self.url + "/v1"

    async def stop(self) -> None:
        """Refuse new work, drain exports, stop serving, then run the app's lifespan shutdown
        (runner, then client). Idempotent."""
        self.proxy.begin_shutdown()
        await self.proxy.drain(self.proxy.config.drain_timeout_s)
        if self._http is not None:
            await self._http.stop()
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            await lifespan.__aexit__(None, None, None)

    async def __aenter__(self) -> ProxyServer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
