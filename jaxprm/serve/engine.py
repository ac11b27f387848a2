"""Dynamic batching: concurrent generation requests are gathered into one sampler call.

A single worker thread owns the ``Sampler``. It blocks until a request arrives, then keeps
collecting while requests keep coming: it stops when no new request arrived for ``collect_window_s``,
when ``max_collect_s`` passed since the first one, or when ``max_batch`` rows are waiting. It then runs
one batched ``Sampler.generate`` over all gathered rows, and resolves each request's future with its
completions. Requests are never split across batches (a request with more rows than ``max_batch``
runs alone; the sampler splits it into compiled chunks). Cancelled requests are dropped before they
run. JAX releases the GIL while it computes, so the HTTP event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

from jaxprm.serve.sampler import Completion, Sampler, SamplingParams

__all__ = ["BatchingEngine", "EngineStats"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Request:
    prompts: list[list[int]]
    params: list[SamplingParams]
    choice_index: list[int]
    future: concurrent.futures.Future
    enqueued_at: float


@dataclasses.dataclass
class EngineStats:
    """Counters since start: batches run, rows generated, tokens generated, largest batch, and the
    sizes (rows) of the most recent batches."""

    batches: int = 0
    rows: int = 0
    tokens: int = 0
    max_rows_in_batch: int = 0
    busy_s: float = 0.0
    recent_batch_rows: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=1024))


class BatchingEngine:
    """Queue + background worker that batches requests for one ``Sampler``.

    Args:
      sampler: the sampler to run (the engine's worker is its only caller for generation).
      max_batch: most rows per batch (default ``sampler.max_batch``).
      collect_window_s: close the batch when no request arrived for this long.
      max_collect_s: close the batch at most this long after its first request arrived.
    """

    def __init__(self, sampler: Sampler, *, max_batch: int | None = None, collect_window_s: float = 0.005,
                 max_collect_s: float = 0.05):
        self.sampler = sampler
        self.max_batch = int(max_batch or sampler.max_batch)
        self.collect_window_s = float(collect_window_s)
        self.max_collect_s = max(float(max_collect_s), self.collect_window_s)
        self.stats = EngineStats()
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._pending: _Request | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> BatchingEngine:
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="jaxprm-batching-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker; requests still queued fail with ``RuntimeError``."""
        if self._thread is None:
            return
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                break
            if req is not None and not req.future.done():
                req.future.set_exception(RuntimeError("generation engine stopped"))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # submission --------------------------------------------------------------------------
    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        choice_index: Sequence[int] | None = None,
    ) -> concurrent.futures.Future:
        """Queue rows for generation; the future resolves to ``list[Completion]`` in row order."""
        if not self.running:
            raise RuntimeError("generation engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        prompts = [list(p) for p in prompts]
        params = list(params)
        choice_index = [0] * len(prompts) if choice_index is None else list(choice_index)
        if not (len(prompts) == len(params) == len(choice_index)):
            raise ValueError("prompts, params and choice_index must have the same length")
        self._queue.put(_Request(prompts, params, choice_index, fut, time.perf_counter()))
        return fut

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        choice_index: Sequence[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Completion]:
        """Async wrapper of ``submit``: awaits the result; cancelling the await cancels the request."""
        fut = self.submit(prompts, params, choice_index)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except BaseException:
            fut.cancel()
            raise

    # worker ------------------------------------------------------------------------------
    def _next_request(self, timeout: float | None) -> _Request | None:
        if self._pending is not None:
            req, self._pending = self._pending, None
            return req
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _collect(self) -> list[_Request]:
        first = self._next_request(timeout=None)
        if first is None:
            return []
        batch = [first]
        rows = len(first.prompts)
        hard_deadline = time.perf_counter() + self.max_collect_s
        while rows < self.max_batch:
            now = time.perf_counter()
            wait = min(self.collect_window_s, hard_deadline - now)
            req = self._next_request(timeout=wait) if wait > 0 else self._next_nowait()
            if req is None:
                break
            if rows + len(req.prompts) > self.max_batch:
                self._pending = req  # first in line for the next batch
                break
            batch.append(req)
            rows += len(req.prompts)
        return batch

    def _next_nowait(self) -> _Request | None:
        if self._pending is not None:
            return self._next_request(None)
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        while not self._stopping.is_set():
            batch = self._collect()
            live = []
            for req in batch:
                if req is None:
                    continue
                if req.future.set_running_or_notify_cancel():
                    live.append(req)
            if not live:
                continue
            prompts = [p for r in live for p in r.prompts]
            params = [sp for r in live for sp in r.params]
            choices = [c for r in live for c in r.choice_index]
            t0 = time.perf_counter()
            try:
                results = self.sampler.generate(prompts, params, choice_index=choices)
            except Exception:  # a failed batch fails only its bad requests, never the worker
                log.exception("batch generation failed; retrying its requests one by one")
                for r in live:
                    try:
                        r.future.set_result(self.sampler.generate(r.prompts, r.params, choice_index=r.choice_index))
                    except Exception as exc:
                        r.future.set_exception(exc)
                continue
            dt = time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.rows += len(prompts)
            self.stats.tokens += sum(len(c.token_ids) for c in results)
            self.stats.max_rows_in_batch = max(self.stats.max_rows_in_batch, len(prompts))
            self.stats.recent_batch_rows.append(len(prompts))
            self.stats.busy_s += dt
            i = 0
            for r in live:
                n = len(r.prompts)
                r.future.set_result(results[i : i + n])
                i += n
