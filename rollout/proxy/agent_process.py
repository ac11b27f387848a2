"""Agents in a process of their own (layer 4): ``agent.processes`` workers for the trainer.

An agent's turn is mostly Python: the SDK builds its request (the OpenAI SDK transforms the whole
message list on every call), sends it, parses the answer. In the trainer's process that work shares
one interpreter lock with the recording proxy and the embedded engine's scheduler. An
:class:`AgentProcess` runs workflows in a child process instead, on the child's own event loop and
HTTP client; the agents still talk to the proxy over HTTP, so what is recorded does not change.

    proc = await AgentProcess.start("rollout.agents.frozenlake_chat:run", concurrency=64)
    result = await proc(task, base_url, api_key, None, **kwargs)   # a Workflow: same call, same result
    await proc.close()

The instance is itself a :data:`~rollout.proxy.workflow.Workflow` (its ``http_client`` argument is
ignored: the child has its own), so ``run_agent_group`` takes it unchanged; timeouts and the
concurrency limit stay with the caller. Cancelling a call cancels the agent in the child. The task,
the kwargs and the workflow's result cross the process boundary by pickle. An exception in the
workflow is raised in the caller as :class:`AgentError` naming the original type and message; a
child that dies fails every pending call and every later one with :class:`AgentProcessDied`.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from typing import Any

__all__ = ["AgentError", "AgentProcess", "AgentProcessDied"]


class AgentError(RuntimeError):
    """A workflow raised in the agent process: ``TypeName: message``."""


class AgentProcessDied(RuntimeError):
    """The agent process is gone (killed, crashed, or closed)."""


def _child(conn, workflow: str, concurrency: int, timeout_s: float) -> None:
    """The child's main: resolve the workflow, then run ``("run", id, args)`` messages as tasks on one
    event loop until ``("close",)`` or the parent goes away."""
    import httpx
    from httpx_aiohttp import HttpxAiohttpClient

    from rollout.proxy.workflow import resolve_workflow

    try:
        fn = resolve_workflow(workflow)
    except BaseException as e:  # reported to the parent's start()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return

    async def main() -> None:
        loop = asyncio.get_running_loop()
        send_lock = threading.Lock()
        running: dict[int, asyncio.Task] = {}
        done = asyncio.Event()

        def send(msg: tuple) -> None:
            with send_lock:
                try:
                    conn.send(msg)
                except (OSError, EOFError):  # the parent is gone
                    loop.call_soon_threadsafe(done.set)

        async def run_one(call_id: int, task: Any, base_url: str, api_key: str, kwargs: dict) -> None:
            try:
                result = await fn(task, base_url, api_key, http, **kwargs)
            except asyncio.CancelledError:
                send(("cancelled", call_id))
            except BaseException as e:
                send(("error", call_id, f"{type(e).__name__}: {e}"))
            else:
                try:
                    send(("ok", call_id, result))
                except Exception as e:  # not picklable
                    send(("error", call_id, f"the workflow's result cannot be sent back: {type(e).__name__}: {e}"))
            finally:
                running.pop(call_id, None)

        def dispatch(msg: tuple) -> None:
            if msg[0] == "run":
                _, call_id, task, base_url, api_key, kwargs = msg
                running[call_id] = loop.create_task(run_one(call_id, task, base_url, api_key, kwargs))
            elif msg[0] == "cancel" and msg[1] in running:
                running[msg[1]].cancel()
            elif msg[0] == "close":
                done.set()

        def reader() -> None:
            while True:
                try:
                    msg = conn.recv()
                except (OSError, EOFError):
                    msg = ("close",)
                loop.call_soon_threadsafe(dispatch, msg)
                if msg[0] == "close":
                    return

        http = HttpxAiohttpClient(timeout=httpx.Timeout(timeout_s),
                                  limits=httpx.Limits(max_connections=concurrency,
                                                      max_keepalive_connections=concurrency))
        threading.Thread(target=reader, name="agent-process-reader", daemon=True).start()
        send(("ready",))
        try:
            await done.wait()
            for t in list(running.values()):
                t.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
        finally:
            await http.aclose()

    asyncio.run(main())


class AgentProcess:
    """Workflows run in one child process (see the module docstring). Build with :meth:`start`."""

    def __init__(self, workflow: str) -> None:
        self.workflow = workflow
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._send_lock = threading.Lock()
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def start(cls, workflow: str, *, concurrency: int = 64, timeout_s: float = 600.0,
                    start_timeout_s: float = 120.0) -> AgentProcess:
        """Spawn the child and wait until its workflow is imported (``ImportError`` / ``TypeError``
        from a bad ``workflow`` spec are raised here, with the child's message)."""
        self = cls(workflow)
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # no fork: the parent holds threads and an XLA runtime
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(child_conn, workflow, concurrency, timeout_s),
                                   name="jaxprm-agents", daemon=True)
        self.process.start()
        child_conn.close()
        try:
            first = await asyncio.wait_for(self._loop.run_in_executor(None, self._recv_first), start_timeout_s)
        except asyncio.TimeoutError:
            first = ("failed", f"not ready within {start_timeout_s:g} s")
        if first[0] != "ready":
            await self.close()
            raise ImportError(f"agent process: workflow {workflow!r}: {first[1]}")
        self._reader = threading.Thread(target=self._read, name="agent-process-results", daemon=True)
        self._reader.start()
        return self

    def _recv_first(self) -> tuple:
        try:
            return self._conn.recv()
        except (OSError, EOFError):
            return ("failed", f"the process exited (code {self.process.exitcode}) before it was ready")

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (OSError, EOFError):
                msg = None
            try:
                self._loop.call_soon_threadsafe(self._fail_all if msg is None else self._resolve, *([] if msg is None else [msg]))
            except RuntimeError:  # the caller's loop is closed: nobody is waiting
                return
            if msg is None:
                return

    def _resolve(self, msg: tuple) -> None:
        fut = self._pending.pop(msg[1], None)
        if fut is None or fut.done():
            return
        if msg[0] == "ok":
            fut.set_result(msg[2])
        elif msg[0] == "error":
            fut.set_exception(AgentError(msg[2]))
        else:  # "cancelled" without our asking (the child is closing)
            fut.set_exception(AgentProcessDied("the agent process cancelled the run (it is closing)"))

    def _fail_all(self) -> None:
        self._dead = self._dead or f"the agent process exited (code {self.process.exitcode})"
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(AgentProcessDied(self._dead))

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    @property
    def alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    async def __call__(self, task: Any, base_url: str, api_key: str, http_client: Any = None, **kwargs: Any) -> Any:
        """Run the workflow once in the child; returns its result (``http_client`` is ignored)."""
        if self._dead is not None:
            raise AgentProcessDied(self._dead)
        call_id = next(self._ids)
        fut = self._loop.create_future()
        self._pending[call_id] = fut
        try:
            self._send(("run", call_id, task, base_url, api_key, kwargs))
        except (OSError, EOFError) as e:
            self._pending.pop(call_id, None)
            raise AgentProcessDied(f"the agent process is gone: {e}") from None
        try:
            return await fut
        except asyncio.CancelledError:
            self._pending.pop(call_id, None)
            if self._dead is None:
                try:
                    self._send(("cancel", call_id))
                except (OSError, EOFError):
                    pass
            raise

    async def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to stop (its running agents are cancelled), then end it. Idempotent."""
        if self._dead is None or self.process.is_alive():
            self._dead = self._dead or "the agent process was closed"
            try:
                self._send(("close",))
            except (OSError, EOFError):
                pass
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, timeout_s)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.get_running_loop().run_in_executor(None, self.process.join, timeout_s)
        self._conn.close()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(AgentProcessDied(self._dead))
