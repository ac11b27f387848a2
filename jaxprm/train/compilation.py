"""Compilation: a process-wide meter of every XLA compilation, and JAX's persistent cache.

:data:`METER` adds up what ``jax.monitoring`` reports for each compiled program, in any thread (the
sampler compiles in the embedded server's engine thread): tracing, lowering and the backend compile
(a persistent-cache hit still reports a short backend "compile", its retrieval), and the loads and
saves of the engine's executable store (``jaxprm.serve.executables``). ``snapshot()``
gives running totals; the trainer takes differences around each phase, so the time a phase spent
compiling can be reported apart from its real work. ``by_function()`` splits the totals by the
traced function's name (``jit(_step)``, ``jit(update)``, ...), so a run can say which programs
its compile time went to.

``enable_persistent_cache(dir)`` turns on JAX's persistent compilation cache, so that a second run
on the same machine loads its programs instead of compiling them. :class:`PhaseTimes` attributes a
run's wall time to its phases, with compilation as a phase of its own.

:class:`BackgroundCompiler` compiles programs ahead of time in a low-priority thread, into the
persistent cache, while the run does other work (the trainer gives it the learner's neighbouring
shape buckets). Its compilations are metered apart (``METER.background()``): they overlap the
run's work, so they are not a phase of the wall time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import jax

from jaxprm.serve import executables

__all__ = ["BackgroundCompiler", "CompileTotals", "METER", "PhaseTimes", "Span", "enable_persistent_cache",
           "in_background"]

_BACKEND = "/jax/core/compile/backend_compile_duration"
# a program counts once: at its backend compile (a persistent-cache hit included) or at its load
# from the engine's executable store (no tracing, no lowering); saving it to the store is time only
_PROGRAM_EVENTS = (_BACKEND, executables.LOAD_EVENT)
_DURATIONS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              *_PROGRAM_EVENTS, executables.SAVE_EVENT)
_HITS = ("/jax/compilation_cache/cache_hits", executables.HIT_EVENT)
_THREAD = threading.local()  # .background: this thread is a BackgroundCompiler's


def in_background() -> bool:
    """Whether the calling thread is a :class:`BackgroundCompiler`'s."""
    return getattr(_THREAD, "background", False)


@dataclasses.dataclass(frozen=True)
class CompileTotals:
    """Programs compiled (``count``, cache hits included), of which ``cache_hits`` came from the
    persistent cache, and the seconds spent tracing, lowering and compiling them."""

    count: int = 0
    cache_hits: int = 0
    seconds: float = 0.0

    def __sub__(self, other: CompileTotals) -> CompileTotals:
        return CompileTotals(self.count - other.count, self.cache_hits - other.cache_hits,
                             self.seconds - other.seconds)


class _Meter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = CompileTotals()
        self._background = CompileTotals()
        self._by_fun: dict[str, CompileTotals] = {}
        self._installed = False

    def install(self) -> None:
        """Register the listeners (once per process)."""
        with self._lock:
            if self._installed:
                return
            self._installed = True
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, name: str, seconds: float, fun_name: str = "?", **_) -> None:
        if name in _DURATIONS:
            n = int(name in _PROGRAM_EVENTS)
            if in_background():
                with self._lock:
                    b = self._background
                    self._background = CompileTotals(b.count + n, b.cache_hits, b.seconds + seconds)
                return
            fun = fun_name[4:-1] if fun_name.startswith("jit(") and fun_name.endswith(")") else fun_name
            with self._lock:
                t = self._totals
                self._totals = CompileTotals(t.count + n, t.cache_hits, t.seconds + seconds)
                f = self._by_fun.get(fun, CompileTotals())
                self._by_fun[fun] = CompileTotals(f.count + n, f.cache_hits, f.seconds + seconds)

    def _on_event(self, name: str, **_) -> None:
        if name in _HITS:
            with self._lock:
                if in_background():
                    b = self._background
                    self._background = CompileTotals(b.count, b.cache_hits + 1, b.seconds)
                    return
                t = self._totals
                self._totals = CompileTotals(t.count, t.cache_hits + 1, t.seconds)

    def snapshot(self) -> CompileTotals:
        self.install()
        with self._lock:
            return self._totals

    def background(self) -> CompileTotals:
        """Running totals of the compilations done in :class:`BackgroundCompiler` threads (not in
        ``snapshot()``)."""
        self.install()
        with self._lock:
            return self._background

    def by_function(self) -> dict[str, CompileTotals]:
        """Running totals per traced function name (``jit(f)`` reported as ``f``), largest first;
        ``cache_hits`` is not split (JAX's hit event names no function)."""
        self.install()
        with self._lock:
            return dict(sorted(self._by_fun.items(), key=lambda kv: -kv[1].seconds))


#: The process-wide compilation meter.
METER = _Meter()


def enable_persistent_cache(directory: str | Path, *, min_compile_time_s: float = 0.0) -> Path:
    """Use JAX's persistent compilation cache in ``directory`` (created; ``~`` expanded) for every
    program whose compilation takes at least ``min_compile_time_s``. Returns the directory."""
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class BackgroundCompiler:
    """Compile programs ahead of time in one low-priority daemon thread.

    ``submit(key, lower)``: ``lower()`` returns a ``jax.stages.Lowered`` (``jitted.lower(*specs)``
    with ``jax.ShapeDtypeStruct`` specs); the thread compiles it, which with the persistent cache on
    writes the program there, so the call that later meets that shape traces, lowers and loads it
    instead of compiling. A key is compiled at most once; a failed compilation is counted in
    ``errors`` and never raised (the real call will compile and report it). ``close()`` drops what
    is still queued and waits for the program being compiled (at most one).
    """

    def __init__(self, *, niceness: int = 10) -> None:
        self.niceness = niceness
        self.submitted = 0
        self.compiled = 0
        self.errors: list[str] = []
        self._seen: set[Hashable] = set()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._idle = threading.Condition()
        self._pending = 0

    def submit(self, key: Hashable, lower: Callable[[], object]) -> bool:
        """Queue ``lower`` under ``key``; False if the key was seen before or the compiler is closed."""
        if self._closed or key in self._seen:
            return False
        self._seen.add(key)
        self.submitted += 1
        with self._idle:
            self._pending += 1
        self._queue.put(lower)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="jaxprm-precompile", daemon=True)
            self._thread.start()
        return True

    def mark(self, key: Hashable) -> None:
        """Note ``key`` as compiled elsewhere (a shape the run met): it is not submitted again."""
        self._seen.add(key)

    def _work(self) -> None:
        _THREAD.background = True
        with contextlib.suppress(Exception):  # Linux: a thread's own niceness; elsewhere: as is
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.niceness)
        while True:
            lower = self._queue.get()
            if lower is None:
                return
            try:
                lower().compile()
                self.compiled += 1
            except Exception as e:  # noqa: BLE001 - the real call compiles and reports it
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                self._done(1)

    def _done(self, n: int) -> None:
        with self._idle:
            self._pending -= n
            self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty (for tests); True if it emptied in time."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending <= 0, timeout)

    def close(self) -> None:
        """Drop the queued programs and wait for the one being compiled."""
        self._closed = True
        if self._thread is None:
            return
        dropped = 0
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
                dropped += 1
        self._done(dropped)
        self._queue.put(None)
        self._thread.join()


@dataclasses.dataclass
class Span:
    """One timed phase: ``wall`` seconds in all, ``compile`` of them compiling (nested phases
    included); ``child_wall`` / ``child_compile``: the part of each that nested phases took."""

    wall: float = 0.0
    compile: float = 0.0
    child_wall: float = 0.0
    child_compile: float = 0.0


@contextlib.contextmanager
def measured() -> Iterator[Span]:
    """A :class:`Span` measured (wall and compile seconds) but not added to any :class:`PhaseTimes`:
    work that overlaps the accounted phases (asynchronous rollouts; the learner's wait for them is
    what the run's phases count)."""
    span = Span()
    t0, c0 = time.perf_counter(), METER.snapshot()
    try:
        yield span
    finally:
        span.wall, span.compile = time.perf_counter() - t0, (METER.snapshot() - c0).seconds


class PhaseTimes:
    """Where a run's time goes: wall seconds per phase with the compilation inside each phase moved
    to ``compile`` (measured by :data:`METER`). Phases may nest (a nested phase's time is its own,
    not its parent's). ``programs`` / ``cache_hits``: programs compiled / loaded from the cache."""

    ORDER = ("setup", "warm_start", "compile", "rollout", "score", "learn", "sync", "eval", "checkpoint",
             "export", "other")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.ORDER, 0.0)
        self.programs = 0
        self.cache_hits = 0
        self._stack: list[Span] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        span = Span()
        t0, c0 = time.perf_counter(), METER.snapshot()
        self._stack.append(span)
        try:
            yield span
        finally:
            self._stack.pop()
            dc = METER.snapshot() - c0
            span.wall, span.compile = time.perf_counter() - t0, dc.seconds
            own_wall = span.wall - span.child_wall
            # compilation inside this phase (not its children's), never more than the phase's own time
            own_compile = min(max(dc.seconds - span.child_compile, 0.0), own_wall)
            self.seconds[name] += own_wall - own_compile
            self.seconds["compile"] += own_compile
            if self._stack:
                self._stack[-1].child_wall += span.wall
                self._stack[-1].child_compile += dc.seconds
            else:
                self.programs += dc.count
                self.cache_hits += dc.cache_hits

    def account(self, wall_s: float) -> dict[str, float]:
        """Seconds per phase for a run of ``wall_s`` seconds, in :attr:`ORDER`, with ``other`` the
        time no phase measured (interpreter and JAX start-up, shutdown, log writing): the values are
        all >= 0 and sum to ``wall_s`` (unless the phases overran it, when ``other`` is 0)."""
        out = dict(self.seconds)
        out["other"] = max(wall_s - sum(v for k, v in out.items() if k != "other"), 0.0)
        return out
