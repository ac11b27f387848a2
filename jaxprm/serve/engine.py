"""The generation engine: continuous batching over a paged KV pool with a prefix cache.

One worker thread owns the device state (the KV pool, the compiled programs of
``jaxprm.serve.programs``) and loops over *iterations*; each one

1. takes in new requests and control messages (cancel, pause, continue, flush);
2. reads the sampler's current weights and version; a new version flushes the prefix cache (cached
   KV is only valid for the weights that computed it) and applies from this iteration on, without
   dropping running requests (each output token records the version that produced it);
3. asks the ``Scheduler`` for a plan (decode memory, preemption, admission, prefill rows);
4. runs one chunked-prefill call, then one decode call of ``decode_steps`` steps for every sequence
   whose prompt is in the pool (sequences join and leave the decode batch at these boundaries);
5. delivers new tokens to streaming consumers and completions to finished requests.

The rows of a request are independent sequences; a request resolves when all its rows finished.
Each row's tokens depend only on its prompt, seed (and choice index) and the weights: sampling
keys are per row and per token index, so batch composition, arrival order, the prefix cache and
preemption change nothing but float rounding (different compiled shapes).

Thread-safety: ``submit``, ``cancel``, ``pause``, ``resume``, ``flush_cache`` and ``stop`` may be
called from any thread; JAX releases the GIL while it computes, so an HTTP event loop stays
responsive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
import jax
import numpy as np

from jaxprm.models.paged import kv_bytes_per_token
from jaxprm.serve.cascade import group_slots, shared_prefix_groups
from jaxprm.serve.kv_pool import BlockPool
from jaxprm.serve.metrics import EngineMetrics
from jaxprm.serve.prefix_cache import PrefixCache
from jaxprm.serve.requests import EngineFuture, EngineStats, Request, RowDelta, completion
from jaxprm.serve.programs import ModelRunner, decode_arrays, prefill_arrays
from jaxprm.serve.sampler import Sampler
from jaxprm.serve.sampling import (MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, Completion, SamplingParams, bucket_for,
                                   buckets_up_to, row_key_data)
from jaxprm.serve.scheduler import Scheduler, Sequence as Seq, Status
from jaxprm.serve.threads import awaitable

__all__ = ["Engine", "EngineStats", "EngineFuture", "RowDelta", "BatchingEngine", "DEFAULT_KV_CACHE_BYTES"]

log = logging.getLogger(__name__)

#: Default KV memory budget (the pool is also capped at ``max_batch`` full-length sequences).
DEFAULT_KV_CACHE_BYTES = 1 << 30
#: ``decode_steps=None``: this many steps per decode call for models under ``SMALL_MODEL_PARAMS``.
AUTO_DECODE_STEPS = 8
SMALL_MODEL_PARAMS = 20_000_000
#: ``window_factor=None``: the KV window ladder's ratio for models under / from ``SMALL_MODEL_PARAMS``.
#: A larger model's decode step is long enough that padding costs more than compiling more programs
#: (SmolLM2-135M on 2 cores, batch 32: 132 ms a step at a 192 window against 151 ms at 256).
AUTO_WINDOW_FACTOR = (2.0, 1.5)
MIN_WINDOW_FACTOR = 1.25
#: Ratio of successive prefill row and chunk buckets (rows 1, r, r^2, ...; chunks 16, 16 r, ...) for
#: models under / from ``SMALL_MODEL_PARAMS``: a larger model's prefill is compute-bound, so padding
#: costs its full share (SmolLM2-135M on 2 cores, 16-token chunks at a 192 window: 32 rows 435 ms,
#: the same rows padded to 64 916 ms), while a small model's calls are cheaper than compiling more.
AUTO_PREFILL_BUCKET_FACTOR = (4, 2)
#: Shared-prefix decode attention needs at least this many positions of blocks common to a group.
MIN_SHARED_POSITIONS = 64
#: Most prompt prefixes one decode call gathers once each (groups beyond it read their own tables).
MAX_SHARED_GROUPS = 8


def _ladder(first: int, factor: int, below: int) -> tuple[int, ...]:
    """``first, first * factor, first * factor^2, ...`` while ``< below``."""
    out, b = [], int(first)
    while b < below:
        out.append(b)
        b *= int(factor)
    return tuple(out)


def _window_buckets(max_len: int, block_size: int, factor: float = 2) -> tuple[int, ...]:
    """Window sizes: 128, then each ``factor`` times the last rounded up to the block size, ... and
    the longest (``factor`` 2: 128, 256, 512, ...; 1.5: 128, 192, 288, 432, ...); a bucket within
    10% of the longest is left out."""
    if factor < MIN_WINDOW_FACTOR:
        raise ValueError(f"window_factor must be >= {MIN_WINDOW_FACTOR}, got {factor}")
    top = -(-max_len // block_size) * block_size
    out, w = [], max(128, block_size)
    w = -(-w // block_size) * block_size
    while w < top:
        out.append(w)
        w = -(-math.ceil(w * factor) // block_size) * block_size
    if len(out) > 1 and top < 1.1 * out[-1]:  # a bucket within 10% of the longest is not worth a program
        out.pop()
    return tuple(out) + (top,)


class Engine:
    """Continuous-batching generation over a ``Sampler``'s weights (see the module docstring).

    Args:
      sampler: holds the weights, their version and the request limits (vocabulary, context,
        largest prompt / output, EOS ids); ``update_params`` on it reaches the engine between steps.
      max_batch: most sequences running at once (default ``sampler.max_batch``); decode batches are
        padded to ``sampler.batch_buckets`` (extended up to ``max_batch``).
      block_size: positions per KV block (the prefix cache shares whole blocks).
      kv_cache_bytes / kv_cache_tokens: KV memory budget (tokens win if given). The pool is also
        capped at ``max_batch`` sequences of the longest length.
      decode_steps: decode steps per decode call (more: less host overhead, later joins/exits).
        ``None`` (auto): ``AUTO_DECODE_STEPS`` for models under ``SMALL_MODEL_PARAMS`` parameters
        (their step is shorter than a host round trip: 10x the throughput of single steps for the
        tiny model on 2 busy cores), else 1 (SmolLM2-135M on CPU: no gain).
      prefill_chunk / max_prefill_tokens: chunked prefill sizes (per row / per call, padded).
        Chunks are bucketed 16, 16 r, 16 r^2, ... up to ``prefill_chunk`` and rows 1, r, r^2, ...
        with ``prefill_bucket_factor`` r (``None``: ``AUTO_PREFILL_BUCKET_FACTOR``, 4 for models
        under ``SMALL_MODEL_PARAMS`` parameters, 2 from there); with the x2 ladder the scheduler
        cuts a prompt into bucket-sized chunks rather than pad it (``cut_padded_chunks``).
      enable_prefix_cache: reuse the KV of cached prompt prefixes.
      collect_window_s / max_collect_s: when idle, wait for more arrivals (a burst starts together):
        until none came for ``collect_window_s``, at most ``max_collect_s``.
      metrics: Prometheus metrics to update (default: a fresh ``EngineMetrics``).
      unroll_layers: decode programs run the layers unrolled over per-layer weight copies (faster
        on XLA:CPU, slower to compile, the layers' weight memory once more; see
        ``jaxprm.serve.programs``); ``None``: on the CPU backend.
      window_factor: ratio (>= 1.25) of successive KV window buckets (128, 128 * factor, ...,
        rounded up to the block size): every (batch, window) pair is a decode program and every
        (rows, chunk, window) a prefill program to compile, so a larger factor compiles fewer
        programs and pads attention more. ``None`` (auto): ``AUTO_WINDOW_FACTOR``, 2 for models
        under ``SMALL_MODEL_PARAMS`` parameters, 1.5 from there.
      shared_prefix_attention: cascade decode: when groups of a decode call's rows start with the
        same cached blocks (at least ``MIN_SHARED_POSITIONS`` positions: a GRPO group's prompt, a
        common system prompt), gather each group's prefix once for the batch instead of once per
        row, up to ``MAX_SHARED_GROUPS`` prefixes (``jaxprm.serve.cascade``,
        ``jaxprm.serve.programs``); the rows' own windows are then bucketed from 2 blocks up
        (``own_window_buckets``). More programs to compile (one per shared window and number of
        prefix slots 1, 2, 4, 8 too), less memory traffic per step. ``None``: on for models from
        ``SMALL_MODEL_PARAMS`` parameters.
    """

    def __init__(self, sampler: Sampler, *, max_batch: int | None = None, block_size: int = 16,
                 kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES, kv_cache_tokens: int | None = None,
                 decode_steps: int | None = None, prefill_chunk: int = 256, max_prefill_tokens: int = 1024,
                 enable_prefix_cache: bool = True, collect_window_s: float = 0.005, max_collect_s: float = 0.05,
                 metrics: EngineMetrics | None = None, unroll_layers: bool | None = None,
                 window_factor: float | None = None, prefill_bucket_factor: int | None = None,
                 shared_prefix_attention: bool | None = None):
        small = sum(int(x.size) for x in jax.tree.leaves(sampler.params)) < SMALL_MODEL_PARAMS
        if decode_steps is None:
            decode_steps = AUTO_DECODE_STEPS if small else 1
        if window_factor is None:
            window_factor = AUTO_WINDOW_FACTOR[0] if small else AUTO_WINDOW_FACTOR[1]
        self.shared_prefix_attention = (not small) if shared_prefix_attention is None else bool(shared_prefix_attention)
        if prefill_bucket_factor is None:
            prefill_bucket_factor = AUTO_PREFILL_BUCKET_FACTOR[0] if small else AUTO_PREFILL_BUCKET_FACTOR[1]
        if int(prefill_bucket_factor) < 2:
            raise ValueError(f"prefill_bucket_factor must be >= 2, got {prefill_bucket_factor}")
        r = int(prefill_bucket_factor)
        for name, value in (("block_size", block_size), ("decode_steps", decode_steps),
                            ("prefill_chunk", prefill_chunk), ("max_prefill_tokens", max_prefill_tokens)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.sampler = sampler
        self.max_batch = int(max_batch or sampler.max_batch)
        self.batch_buckets = buckets_up_to(sampler.batch_buckets, self.max_batch)
        self.block_size = int(block_size)
        self.decode_steps = int(decode_steps)
        self.max_len = min(sampler.max_context, sampler.prompt_buckets[-1] + sampler.new_token_buckets[-1])
        self.window_factor = float(window_factor)
        self.window_buckets = _window_buckets(self.max_len, self.block_size, self.window_factor)
        # a decode batch's own positions after a shared prefix: 2, 4, ... blocks, then the windows
        self.own_window_buckets = _ladder(2 * self.block_size, 2, self.window_buckets[0]) + self.window_buckets
        per_token = kv_bytes_per_token(sampler.config, sampler.cache_dtype or sampler.config.dtype)
        if kv_cache_tokens is None:
            if kv_cache_bytes is None:
                raise ValueError("give kv_cache_bytes or kv_cache_tokens")
            kv_cache_tokens = int(kv_cache_bytes) // per_token
        kv_cache_tokens = min(int(kv_cache_tokens), self.max_batch * self.window_buckets[-1])
        num_blocks = kv_cache_tokens // self.block_size + 1  # + the null block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens} is less than one block of {self.block_size}")
        # Coarse shape buckets (x r): every bucket is a program to compile.
        chunk_buckets = _ladder(16, r, int(prefill_chunk)) + (int(prefill_chunk),)
        self.runner = ModelRunner(sampler.graphdef, sampler.rest, sampler.config, num_blocks=num_blocks,
                                  block_size=self.block_size, cache_dtype=sampler.cache_dtype,
                                  unroll_layers=unroll_layers)
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache(self.pool, self.block_size, enabled=enable_prefix_cache,
                                 version=sampler.weight_version)
        max_rows = max(1, int(max_prefill_tokens) // chunk_buckets[0])
        self.prefill_row_buckets = _ladder(1, r, max_rows + 1)
        self.scheduler = Scheduler(self.pool, self.cache, max_seqs=self.max_batch, decode_steps=self.decode_steps,
                                   prefill_chunk=int(prefill_chunk), max_prefill_tokens=int(max_prefill_tokens),
                                   chunk_buckets=chunk_buckets, row_buckets=self.prefill_row_buckets,
                                   cut_padded_chunks=r < 4)
        self.collect_window_s = float(collect_window_s)
        self.max_collect_s = max(float(max_collect_s), self.collect_window_s)
        self.metrics = metrics or EngineMetrics()
        self.stats = EngineStats()
        self.kv_cache_tokens = (num_blocks - 1) * self.block_size
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._paused = False
        self._ids = itertools.count()
        self._version = sampler.weight_version

    # lifecycle ---------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxprm-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker; unfinished requests fail with ``RuntimeError("generation engine stopped")``."""
        if self._thread is None:
            return
        self._post(("stop",))
        self._thread.join(timeout)
        self._thread = None
        self._drain_after_stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def _post(self, msg) -> None:
        self._inbox.put(msg)

    # submission ------------------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], params: SamplingParams, *, where: str = "prompt") -> None:
        """``ValueError`` if this row can never be served (the sampler's limits, the KV pool size)."""
        self.sampler.check_request(prompt, params, where=where)
        try:
            self.scheduler.check_fits(len(prompt), params.max_new_tokens)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def submit(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
               choice_index: Sequence[int] | None = None, *,
               on_delta: Callable[[RowDelta], None] | None = None) -> EngineFuture:
        """Queue rows; the future resolves to ``list[Completion]`` in row order.

        ``on_delta`` (called from the engine thread) receives each row's new tokens after every
        decode call, and a last delta with the row's ``completion``. Raises ``ValueError`` for a row
        that can never be served and ``RuntimeError`` when the engine is not running.
        """
        if not self.running:
            raise RuntimeError("generation engine is not running")
        prompts = [list(map(int, p)) for p in prompts]
        params = list(params)
        choice_index = [0] * len(prompts) if choice_index is None else list(choice_index)
        if not (len(prompts) == len(params) == len(choice_index)):
            raise ValueError("prompts, params and choice_index must have the same length")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self.check(p, sp, where=f"prompt {i}")
        rid = uuid.uuid4().hex
        fut = EngineFuture(self, rid)
        now = time.perf_counter()
        eos = set(self.sampler.eos_token_ids)
        seqs = []
        for row, (p, sp, ch) in enumerate(zip(prompts, params, choice_index)):
            seed = sp.seed if sp.seed is not None else int.from_bytes(uuid.uuid4().bytes[:8], "little") >> 1
            stops = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(eos))
            stop_array = np.full((MAX_STOP_TOKEN_IDS,), -1, np.int32)
            stop_array[: len(stops)] = sorted(stops)
            seqs.append(Seq(seq_id=next(self._ids), prompt=p, params=sp, key_data=row_key_data(seed, ch),
                            stop_ids=stops, row=row, arrival=now, stop_array=stop_array))
        req = Request(fut, seqs, on_delta, now, [0] * len(seqs))
        for seq in seqs:
            seq.owner = req
        self._post(("submit", req))
        return fut

    async def generate(self, prompts, params, choice_index=None, *, timeout: float | None = None,
                       on_delta: Callable[[RowDelta], None] | None = None) -> list[Completion]:
        """Async ``submit``: awaits the completions; cancelling the await (or a timeout) cancels
        the request in the engine."""
        fut = self.submit(prompts, params, choice_index, on_delta=on_delta)
        try:
            return await asyncio.wait_for(awaitable(fut), timeout)
        except BaseException:
            fut.cancel()
            raise

    # control ---------------------------------------------------------------------------------------
    def _control(self, *msg) -> concurrent.futures.Future:
        if not self.running:
            raise RuntimeError("generation engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post((*msg, fut))
        return fut

    def pause(self, mode: str = "abort") -> concurrent.futures.Future:
        """Stop scheduling at the next step boundary. ``"in_place"`` keeps running sequences (and
        their KV) where they are; ``"abort"`` finishes every running and waiting sequence now with
        ``finish_reason="abort"`` and the tokens generated so far. New requests queue until
        ``resume``. The future resolves (to the number of sequences aborted) once paused."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"mode must be 'abort' or 'in_place', got {mode!r}")
        return self._control("pause", mode)

    def resume(self) -> concurrent.futures.Future:
        """Continue after ``pause``."""
        return self._control("resume")

    def flush_cache(self) -> concurrent.futures.Future:
        """Drop the prefix cache (blocks in use stay with their sequences); resolves to the number
        of cached blocks dropped."""
        return self._control("flush")

    def set_prefix_caching(self, enabled: bool) -> concurrent.futures.Future:
        """Turn the prefix cache on or off from the next step (either way it starts empty)."""
        return self._control("prefix_cache", bool(enabled))

    # worker ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._take_messages():
                    break
                if self._paused or self.scheduler.idle:
                    continue
                self._iteration()
            except Exception as exc:  # never let the worker die: fail what was in flight
                log.exception("generation engine iteration failed")
                self._fail_all(exc)
        self._fail_all(RuntimeError("generation engine stopped"))

    def _take_messages(self) -> bool:
        """Apply queued messages; block while there is nothing to run. False: stop."""
        block = self._paused or self.scheduler.idle
        first_at = None
        while True:
            try:
                if block:
                    msg = self._inbox.get()
                elif first_at is not None:
                    left = min(self.collect_window_s, first_at + self.max_collect_s - time.perf_counter())
                    if left <= 0:
                        return True
                    msg = self._inbox.get(timeout=left)
                else:
                    msg = self._inbox.get_nowait()
            except queue.Empty:
                return True
            kind = msg[0]
            if kind == "stop":
                return False
            if kind == "submit":
                if block and self.collect_window_s > 0 and not self._paused:
                    first_at = time.perf_counter()  # idle: gather a burst before starting
                self._add(msg[1])
            elif kind == "cancel":
                req = self._requests.get(msg[1].request_id)
                if req is not None:
                    self._abort_request(req)
            elif kind == "pause":
                self._paused = True
                n = self._abort_everything() if msg[1] == "abort" else 0
                msg[2].set_result(n)
            elif kind == "resume":
                self._paused = False
                msg[1].set_result(True)
            elif kind == "flush":
                msg[1].set_result(self.cache.flush())
            elif kind == "prefix_cache":
                self.cache.flush()
                self.cache.enabled = msg[1]
                msg[2].set_result(True)
            block = (self._paused or self.scheduler.idle) and first_at is None
            self._update_gauges()

    def _add(self, req: Request) -> None:
        if req.future.cancelled():
            return
        self._requests[req.future.request_id] = req
        for seq in req.seqs:
            if seq.params.max_new_tokens <= 0:
                seq.status = Status.FINISHED
                seq.finish_reason = "length"
                continue
            try:
                self.scheduler.add(seq)
            except ValueError as exc:  # checked in submit already; the pool cannot have shrunk
                self._fail_request(req, exc)
                return
        self._maybe_resolve(req)

    def _iteration(self) -> None:
        params, version = self.sampler.snapshot()
        if version != self.cache.version:
            self.cache.flush(version)
        self._version = version
        self.stats.iterations += 1
        n_pre = self.scheduler.num_preemptions
        plan = self.scheduler.schedule()
        if self.scheduler.num_preemptions != n_pre:
            self.stats.preemptions += self.scheduler.num_preemptions - n_pre
            self.metrics.preemptions.inc(self.scheduler.num_preemptions - n_pre)
        self._note_admissions()
        tokens = 0
        t0 = time.perf_counter()
        if plan is not None:
            tokens += self._prefill(params, version, plan)
            more = self.scheduler.admit_more()  # those that waited for the blocks just computed
            self._note_admissions()
            if more is not None:
                tokens += self._prefill(params, version, more)
        rows = self.scheduler.decode_rows()
        if rows:
            tokens += self._decode(params, version, rows)
        self.stats.busy_s += time.perf_counter() - t0
        if tokens:
            self.metrics.iteration_tokens.observe(tokens)
        self._update_gauges()

    def _note_admissions(self) -> None:
        now = time.perf_counter()
        for seq in self.scheduler.running:
            if seq.noted:
                continue
            seq.noted = True
            self.metrics.queue_time.observe(now - seq.arrival)
            self.metrics.prompt_tokens.inc(len(seq.prompt))
            self.metrics.cache_queries.inc(len(seq.prompt))
            self.metrics.cache_hits.inc(seq.cached_tokens or 0)
            self.stats.prompt_tokens += len(seq.prompt)
            self.stats.cached_tokens += seq.cached_tokens or 0

    def _prefill(self, params, version: int, plan) -> int:
        R = bucket_for(len(plan.rows), self.prefill_row_buckets, "prefill rows")
        W = bucket_for(max(start + n for _, start, n in plan.rows), self.window_buckets, "window")
        tokens, positions, tables = prefill_arrays(plan.rows, R, plan.chunk, W // self.block_size)
        self.runner.prefill(params, tokens, positions, tables)
        total = 0
        for seq, _, n in plan.rows:
            self.scheduler.prefilled(seq, n, version)
            total += n
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += total
        self.metrics.prefill_tokens.inc(total)
        return total

    def _decode(self, params, version: int, rows: list[Seq]) -> int:
        k = self.decode_steps
        B = bucket_for(len(rows), self.batch_buckets, "decode batch")
        end = max(s.num_computed + min(k, s.remaining) for s in rows)
        groups = self._shared_groups(rows)
        if groups:
            bs = self.block_size
            skip = [0] * len(rows)
            for members, blocks in groups:
                for i in members:
                    skip[i] = blocks * bs
            W = bucket_for(max(s.num_computed + min(k, s.remaining) - b for s, b in zip(rows, skip)),
                           self.own_window_buckets, "window")
            ns = bucket_for(max(skip), self.window_buckets, "shared window") // bs
            # one group: slots for the whole batch (one program per batch, window pair: the ones the
            # warm-up prepares); several: for the largest group
            R = B if len(groups) == 1 else min(B, group_slots(max(len(m) for m, _ in groups)))
            inp, top_n, filtering = decode_arrays(rows, B, W // bs, groups=groups, S=group_slots(len(groups)),
                                                  R=R, ns=ns, block_size=bs)
            self.stats.shared_prefix_calls += 1
        else:
            W = bucket_for(end, self.window_buckets, "window")
            inp, top_n, filtering = decode_arrays(rows, B, W // self.block_size)
        out = self.runner.decode(params, inp, steps=k, top_n=top_n, filtering=filtering)
        now = time.perf_counter()
        generated = 0
        fresh: dict[int, int] = {}
        for j in range(k):
            for i, s in enumerate(rows):
                if not out["valid"][j, i] or s.finished:
                    continue
                top = None
                if s.params.top_logprobs > 0:
                    n = s.params.top_logprobs
                    top = [(int(a), float(b), float(c)) for a, b, c in
                           zip(out["top_ids"][j, i, :n], out["top_raw"][j, i, :n], out["top_proc"][j, i, :n])]
                if s.first_token_at is None:
                    s.first_token_at = now
                    self.metrics.ttft.observe(now - s.arrival)
                fresh.setdefault(i, len(s.output))
                done = self.scheduler.decoded(s, int(out["token"][j, i]), float(out["logprob"][j, i]),
                                              float(out["sampling_logprob"][j, i]), version, top)
                generated += 1
                if done:
                    self._finished(s)
        self.stats.batches += 1
        self.stats.rows += len(rows)
        self.stats.tokens += generated
        self.stats.max_rows_in_batch = max(self.stats.max_rows_in_batch, len(rows))
        self.stats.recent_batch_rows.append(len(rows))
        self.metrics.batch_size.observe(len(rows))
        self.metrics.generation_tokens.inc(generated)
        for i, start in fresh.items():
            s = rows[i]
            if not s.finished:
                s.owner.send_delta(s)
        return generated

    def _shared_groups(self, rows: list[Seq]) -> list[tuple[list[int], int]]:
        """Groups of rows (indices, blocks) whose leading blocks are the same pool blocks (so the same
        KV), all computed before this call (never written by it), at least ``MIN_SHARED_POSITIONS``
        positions, at most ``MAX_SHARED_GROUPS`` (``jaxprm.serve.cascade``); none when off or for
        one row."""
        if not self.shared_prefix_attention or len(rows) < 2:
            return []
        bs = self.block_size
        return shared_prefix_groups([s.blocks[: s.num_computed // bs] for s in rows],
                                    min_blocks=-(-MIN_SHARED_POSITIONS // bs), max_groups=MAX_SHARED_GROUPS)

    # results ------------------------------------------------------------------------------------------
    def _finished(self, s: Seq) -> None:
        req: Request = s.owner
        self.metrics.finish(s.finish_reason or "length")
        self.metrics.e2e.observe(time.perf_counter() - s.arrival)
        req.send_delta(s, completion(s, self._version))
        self._maybe_resolve(req)

    def _maybe_resolve(self, req: Request) -> None:
        if not all(s.finished for s in req.seqs):
            return
        self._requests.pop(req.future.request_id, None)
        if req.future.done():
            return
        try:
            req.future.set_result([completion(s, self._version) for s in req.seqs])
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            pass

    def _abort_request(self, req: Request) -> None:
        """The request was cancelled: end its rows now and free their blocks."""
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s, "abort")
                self.metrics.finish("abort")
        self._requests.pop(req.future.request_id, None)

    def _abort_everything(self) -> int:
        n = 0
        for req in list(self._requests.values()):
            for s in req.seqs:
                if not s.finished:
                    self.scheduler.finish(s, "abort")
                    n += 1
                    self._finished(s)
        return n

    def _fail_request(self, req: Request, exc: BaseException) -> None:
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s, "abort")
        self._requests.pop(req.future.request_id, None)
        if not req.future.done():
            try:
                req.future.set_exception(exc)
            except concurrent.futures.InvalidStateError:
                pass

    def _fail_all(self, exc: BaseException) -> None:
        for req in list(self._requests.values()):
            self._fail_request(req, exc)

    def _drain_after_stop(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "submit" and not msg[1].future.done():
                msg[1].future.set_exception(RuntimeError("generation engine stopped"))
            elif msg[0] in ("pause", "resume", "flush", "prefix_cache") and not msg[-1].done():
                msg[-1].set_exception(RuntimeError("generation engine stopped"))

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.scheduler.num_running)
        m.waiting.set(self.scheduler.num_waiting)
        m.paused.set(1 if self._paused else 0)
        m.kv_usage.set(self.pool.num_referenced / self.pool.capacity)
        m.kv_cached_blocks.set(len(self.cache))
        m.weight_version.set(self._version)
        m.compilations.set(self.runner.num_compilations)

    # warm-up -------------------------------------------------------------------------------------
    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every ``(rows, chunk)`` bucket pair a prefill call can have (one row of any chunk, or
        rows x chunk within ``max_prefill_tokens``), chunk by chunk."""
        return [(r, c) for c in self.scheduler.chunk_buckets for r in self.prefill_row_buckets
                if r == 1 or r * c <= self.scheduler.max_prefill_tokens]

    def precompile(self, *, batch_sizes: Sequence[int] | None = None, windows: Sequence[int] | None = None,
                   top_logprobs: bool = False, filtering: bool = False, prefill: bool = True,
                   shared_windows: Sequence[int] = (), own_windows: Sequence[int] | None = None,
                   shared_groups: Sequence[int] = (1,), group_rows: Sequence[int] | None = None) -> float:
        """Compile ahead of time the decode programs for these batch buckets and windows (default:
        all) and, with ``prefill``, the prefill programs of every chunk / row bucket for them; with
        ``shared_windows`` (and ``shared_prefix_attention``), the shared-prefix decode programs of
        batches from 2 rows for each of those shared windows, ``own_windows`` (default: every
        own window up to the longest of ``windows``), number of prefixes in ``shared_groups`` (a
        batch holds at most half its rows' groups) and rows per group in ``group_rows`` (default:
        the batch). Returns the seconds spent."""
        params, _ = self.sampler.snapshot()
        t0 = time.perf_counter()
        bs = sorted({bucket_for(int(b), self.batch_buckets, "batch") for b in (batch_sizes or self.batch_buckets)})
        ws = sorted({bucket_for(int(w), self.window_buckets, "window") for w in (windows or self.window_buckets)})
        top_n = MAX_TOP_LOGPROBS if top_logprobs else 0
        for w in ws:
            for b in bs:
                self.runner.compile_decode(params, b, w, steps=self.decode_steps, top_n=top_n, filtering=filtering)
            if prefill:
                for r, c in self.prefill_shapes():
                    self.runner.compile_prefill(params, r, c, w)
        if self.shared_prefix_attention:
            for sw in sorted({bucket_for(int(w), self.window_buckets, "window") for w in shared_windows}):
                own = (o for o in self.own_window_buckets if o <= ws[-1]) if own_windows is None else sorted(
                    {bucket_for(int(o), self.own_window_buckets, "window") for o in own_windows})
                slots = sorted({group_slots(min(int(g), MAX_SHARED_GROUPS)) for g in shared_groups})
                for w in own:
                    for b in (b for b in bs if b > 1):
                        per_group = sorted({min(b, group_slots(int(r))) for r in (group_rows or [b])})
                        for g, r in ((g, r) for g in slots for r in per_group if 2 * g <= b and g * r >= 2):
                            self.runner.compile_decode(params, b, w, steps=self.decode_steps, top_n=top_n,
                                                       filtering=filtering, shared_window=sw, shared_groups=g,
                                                       group_rows=r)
        return time.perf_counter() - t0


#: The engine under its former name (the static batching engine it replaced).
BatchingEngine = Engine
