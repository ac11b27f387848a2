"""The one way this project serves an ASGI app in-process with uvicorn: bound to a loopback (or any)
port before it starts, so the port is known, either in a daemon thread (:class:`ThreadedServer`: the
generation server, test servers) or as a task on the caller's event loop (:class:`LoopServer`: the
recording proxy). Neither installs signal handlers: the embedding process keeps its own.
jax-free and project-free, so every layer may use it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import uvicorn

__all__ = ["LoopServer", "ThreadedServer"]


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port=0``: a free port; IPv6 when ``host`` has a colon)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn without signal handling."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _Bound:
    """A socket bound before serving: ``host``, ``port``, ``url`` (``http://host:port``)."""

    def __init__(self, app: Any, host: str, port: int, uvicorn_kwargs: dict[str, Any]) -> None:
        self._sock = _bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        kw = dict(log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=5)
        kw.update(uvicorn_kwargs)
        self._server = _Server(uvicorn.Config(app, **kw))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class ThreadedServer(_Bound):
    """``app`` served by uvicorn in a daemon thread; the constructor returns once it accepts
    connections (``RuntimeError`` if it died starting, ``TimeoutError`` past ``startup_timeout_s``).
    ``uvicorn_kwargs`` go to ``uvicorn.Config`` (defaults: lifespan off, log level warning, no access
    log, 5 s graceful shutdown). A context manager; :meth:`stop` is idempotent."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, name: str = "http",
                 startup_timeout_s: float = 60.0, **uvicorn_kwargs: Any) -> None:
        super().__init__(app, host, port, uvicorn_kwargs)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"{name}-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                self._close_socket()
                raise RuntimeError(f"{name} server on port {self.port} failed to start (see the log)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{name} server did not start within {startup_timeout_s} s")
            time.sleep(0.005)

    @property
    def alive(self) -> bool:
        """Serving: its thread runs and was not asked to stop."""
        return self._thread.is_alive() and not self._server.should_exit

    def stop(self, timeout: float = 30.0, *, force: bool = False) -> None:
        """Stop serving (``force``: without waiting for open connections) and close the socket."""
        if self._thread.is_alive():
            self._server.should_exit = True
            self._server.force_exit = force
            self._thread.join(timeout)
        self._close_socket()

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LoopServer(_Bound):
    """``app`` served by uvicorn as a task on the running event loop. Build it with
    ``await LoopServer.start(app, ...)``, which returns once it accepts connections (or re-raises
    why it stopped); ``await server.stop()`` is idempotent."""

    @classmethod
    async def start(cls, app: Any, *, host: str = "127.0.0.1", port: int = 0, name: str = "http",
                    **uvicorn_kwargs: Any) -> LoopServer:
        self = cls(app, host, port, uvicorn_kwargs)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name=f"{name}-{self.port}")
        try:
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError(f"{name} server on port {self.port} stopped during startup")
                await asyncio.sleep(0.005)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        task, self._task = getattr(self, "_task", None), None
        if task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await task
        self._close_socket()
