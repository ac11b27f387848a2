"""Compile a server's programs ahead of its requests, in a background thread.

Every (batch, window) pair is a decode program and every (rows, chunk, window) a prefill program,
compiled the first time a step meets it (``jaxprm.serve.programs``). Met inside a request, a compile
lands in that request's latency and stalls every running one: on 2 CPU cores a SmolLM2-135M round
at concurrency 32 that met new prompt-length shapes ran at 77 tok/s against 175-186 once compiled.

``BackgroundWarmup(engine, max_len=...)`` compiles, while the engine serves, the programs a server
within these limits can meet: for each KV window bucket up to ``max_len`` (shortest first: a
conversation starts short), the decode programs of every batch bucket (the plain variant: no
top-n alternatives, no top-k/top-p filtering), then the prefill programs of every chunk and row
bucket, and the cascade decode programs of batches that share one prompt prefix (a chat template,
a system prompt) for the window pairs a request can reach. A program the engine needs while the thread compiles another is compiled by the engine
as before (each program at most once: ``jaxprm.serve.executables`` locks per program). The thread
runs at a lower CPU priority (``nice`` ``NICE``, Linux) so that on a machine with few cores the
requests being served go first; ``stop()`` ends it between two programs. Not compiled ahead:
cascade programs of several prefix groups and the top-n / filtering variants (more shapes than they
are worth ahead of time; the engine compiles them when met).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from jaxprm.serve.engine import MIN_SHARED_POSITIONS
from jaxprm.serve.sampling import bucket_for

__all__ = ["BackgroundWarmup", "warmup_plan", "NICE"]

log = logging.getLogger(__name__)

#: CPU priority (``nice`` increment) of the warm-up thread where the OS allows it (Linux threads).
NICE = 10


def _below(buckets, b: int, floor: int = 0) -> int:
    """The largest length that does not fit the bucket before ``b`` (``floor`` for the first)."""
    smaller = [x for x in buckets if x < b]
    return smaller[-1] if smaller else floor


def warmup_plan(engine, max_len: int | None = None) -> list[tuple]:
    """The programs to compile for requests of at most ``max_len`` positions (prompt + output;
    default the engine's longest), ordered by the shortest request that meets them (ties: decode,
    prefill, cascade): ``("decode", batch, window)`` for every batch bucket and
    ``("prefill", rows, chunk, window)`` for every chunk / row bucket the scheduler can form, per
    window bucket; with the engine's ``shared_prefix_attention``, ``("cascade", batch, own window,
    shared window)`` for batches of >= 2 rows that share one prefix (the chat template's or a
    system prompt: one group of all rows), for every pair of windows a request can reach. Cascade
    programs of several groups (GRPO groups of different prompts) are left to the engine."""
    top = engine.max_len if max_len is None else min(int(max_len), engine.max_len)
    if top < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    last = bucket_for(top, engine.window_buckets, "window")
    windows = [w for w in engine.window_buckets if w <= last]
    items = []
    for w in windows:
        reach = _below(engine.window_buckets, w) + 1
        items += [(reach, 0, ("decode", b, w)) for b in engine.batch_buckets]
        items += [(reach, 1, ("prefill", r, c, w)) for r, c in engine.prefill_shapes()]
    if engine.shared_prefix_attention:
        for sw in windows:
            shared = max(_below(engine.window_buckets, sw) + 1, MIN_SHARED_POSITIONS)
            for ow in engine.own_window_buckets:
                reach = shared + _below(engine.own_window_buckets, ow) + 1
                if reach <= top:
                    items += [(reach, 2, ("cascade", b, ow, sw)) for b in engine.batch_buckets if b > 1]
    return [item for *_, item in sorted(items, key=lambda x: (x[0], x[1]))]


class BackgroundWarmup:
    """A daemon thread compiling ``warmup_plan(engine, max_len)`` (see the module docstring).

    Attributes: ``total`` programs planned, ``done`` compiled or found (memory, disk store),
    ``seconds`` spent so far, ``error`` (the exception that ended it early, if any); ``finished``
    says the thread has ended, ``wait(timeout)`` waits for it.
    """

    def __init__(self, engine, *, max_len: int | None = None, nice: int = NICE):
        self.engine = engine
        self.plan = warmup_plan(engine, max_len)
        self.total = len(self.plan)
        self.done = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._nice = int(nice)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxprm-warmup", daemon=True)

    def start(self) -> BackgroundWarmup:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the program being compiled (if any); wait up to ``timeout`` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the whole plan (or a stop); True when the thread has ended."""
        if self._thread.ident is None:
            return False
        self._thread.join(timeout)
        return self.finished

    @property
    def finished(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def _run(self) -> None:
        if self._nice and hasattr(os, "setpriority"):
            try:  # on Linux a thread's priority is its own (its native id)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError:
                pass
        engine, t0 = self.engine, time.perf_counter()
        runner, steps = engine.runner, engine.decode_steps
        try:
            for item in self.plan:
                if self._stop.is_set():
                    break
                params, _ = engine.sampler.snapshot()
                if item[0] == "decode":
                    runner.compile_decode(params, item[1], item[2], steps=steps, top_n=0, filtering=False)
                elif item[0] == "cascade":
                    runner.compile_decode(params, item[1], item[2], steps=steps, top_n=0, filtering=False,
                                          shared_window=item[3], shared_groups=1, group_rows=item[1])
                else:
                    runner.compile_prefill(params, item[1], item[2], item[3])
                self.done += 1
                self.seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - reported, never fatal: the engine compiles on demand
            self.error = exc
            log.warning("background warm-up stopped after %d of %d programs: %r", self.done, self.total, exc)
        self.seconds = time.perf_counter() - t0
        log.info("warm-up: %d of %d programs ready in %.1f s", self.done, self.total, self.seconds)
