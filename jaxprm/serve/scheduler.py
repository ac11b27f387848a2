"""Iteration-level scheduling of sequences over the paged KV pool (continuous batching).

Every engine iteration asks the ``Scheduler`` for a plan, runs it, and reports back:

1. **Decode memory.** Each decoding sequence gets the blocks its next ``k`` decode steps write
   (memory is handed out as sequences grow). If the pool runs dry the most recently admitted
   sequence is *preempted*: its blocks go back (the computed full blocks into the prefix cache) and
   it returns to the head of the queue with the tokens it generated so far; re-admitted, it
   prefills ``prompt + output`` (mostly from the cache) and continues, with the same tokens it
   would have produced (its ``j``-th token is still drawn with key ``fold_in(row_key, j)``).
2. **Admission** (first come, first served) while there is a free row (``max_seqs``) and memory
   for the sequence's prefill and first decode steps. A sequence looks its prompt up in the prefix
   cache and reuses the matched blocks; if the next block is being computed by another sequence
   right now it waits (the prompt is then prefilled once, not ``n`` times). Its own full prompt
   blocks enter the cache as "not ready" until computed.
3. **Chunked prefill:** up to ``prefill_chunk`` prompt tokens per sequence, ``max_prefill_tokens``
   in all (rows x padded chunk), oldest first; with ``cut_padded_chunks`` a row takes the largest
   chunk bucket below its pending tokens now and the rest later when that pads fewer slots.
   After that prefill, a second admission pass lets in the sequences that were waiting for the
   blocks it computed, with a prefill of their uncached tails.
4. **Decode:** every sequence whose prompt is in the pool takes ``k`` steps in one batch.

A sequence of ``L`` prompt tokens needs the KV of positions ``0..L-2`` before its first decode step,
which feeds token ``L-1`` at position ``L-1`` and samples the first output token; decode step ``j``
writes position ``L-1+j``. So a sequence with ``max_new`` tokens writes ``L + max_new - 1``
positions; one that could never fit in the pool is rejected when it is added (``ValueError``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import time
from typing import Any

import numpy as np

from jaxprm.serve.kv_pool import BlockPool
from jaxprm.serve.prefix_cache import PrefixCache
from jaxprm.serve.sampling import SamplingParams, bucket_for

__all__ = ["Status", "Sequence", "Scheduler", "PrefillPlan"]


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One generated row: its prompt, options, outputs so far and its KV blocks.

    ``num_computed`` positions (a prefix of ``prompt + output``) have their KV in ``blocks``.
    ``cached_tokens`` is the prompt length served from the prefix cache at first admission.
    ``versions[j]`` is the weight version that produced output token ``j``; ``kv_versions`` the
    versions whose weights computed the KV in ``blocks``.
    """

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    key_data: np.ndarray
    stop_ids: frozenset[int]
    owner: Any = None
    row: int = 0
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float, float]]] | None = None
    versions: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_token_id: int | None = None
    kv_versions: set[int] = dataclasses.field(default_factory=set)
    admitted: int = -1
    first_token_at: float | None = None
    num_preemptions: int = 0
    stop_array: np.ndarray | None = None  # the stop ids padded with -1 (decode input)
    noted: bool = False  # the engine counted its admission

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, n: int | None = None) -> list[int]:
        """The first ``n`` tokens of ``prompt + output`` (all by default)."""
        t = self.prompt + self.output
        return t if n is None else t[:n]

    @property
    def target(self) -> int:
        """Positions whose KV must exist before the next decode step (all tokens but the last)."""
        return self.num_tokens - 1

    @property
    def max_positions(self) -> int:
        """Positions this sequence writes in all: ``L + max_new - 1``."""
        return len(self.prompt) + self.params.max_new_tokens - 1

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass
class PrefillPlan:
    """Rows of one prefill call: ``(sequence, start position, number of tokens)``; ``chunk`` is
    the padded chunk length."""

    rows: list[tuple[Sequence, int, int]]
    chunk: int


class Scheduler:
    """Admission, memory, preemption and batch selection (see the module docstring).

    Args:
      pool / cache: the block bookkeeping and the prefix cache over it.
      max_seqs: most sequences admitted at once (the largest decode batch).
      decode_steps: decode steps per decode call (``k``).
      prefill_chunk: most prompt tokens of one sequence per prefill call.
      max_prefill_tokens: most padded tokens per prefill call (rows x chunk).
      chunk_buckets: allowed padded chunk lengths (ascending, the last >= ``prefill_chunk``).
      row_buckets: allowed padded row counts of a prefill call; a call's padded rows x chunk stays
        within ``max_prefill_tokens`` (a single row always fits).
      cut_padded_chunks: a row prefills the largest chunk bucket below its pending tokens now and
        the rest later when that pads fewer slots than one chunk of them all (more calls: for
        models whose prefill is compute-bound).
    """

    def __init__(self, pool: BlockPool, cache: PrefixCache, *, max_seqs: int, decode_steps: int = 1,
                 prefill_chunk: int = 256, max_prefill_tokens: int = 1024, chunk_buckets=(16, 64, 256),
                 row_buckets=(1, 4, 16, 64), cut_padded_chunks: bool = False):
        self.pool = pool
        self.cache = cache
        self.block_size = cache.block_size
        self.max_seqs = int(max_seqs)
        self.decode_steps = int(decode_steps)
        self.chunk_buckets = tuple(sorted(int(c) for c in chunk_buckets))
        self.prefill_chunk = min(int(prefill_chunk), self.chunk_buckets[-1])
        self.max_prefill_tokens = max(int(max_prefill_tokens), self.prefill_chunk)
        self.row_buckets = tuple(sorted(int(r) for r in row_buckets))
        self.cut_padded_chunks = bool(cut_padded_chunks)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        self.num_preemptions = 0

    # sizes -------------------------------------------------------------------------------------
    def blocks_for(self, positions: int) -> int:
        return math.ceil(max(0, positions) / self.block_size)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """``ValueError`` if a sequence this long could never fit in the pool, even alone."""
        need = self.blocks_for(prompt_len + max_new_tokens - 1)
        if need > self.pool.capacity:
            raise ValueError(
                f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} needs {need} KV blocks of "
                f"{self.block_size} tokens, but the whole KV pool has {self.pool.capacity} "
                f"({self.pool.capacity * self.block_size} tokens); raise kv_cache_bytes or shorten the request")

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # queue ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence (``ValueError`` if it can never fit)."""
        self.check_fits(len(seq.prompt), seq.params.max_new_tokens)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    # planning ------------------------------------------------------------------------------------
    def schedule(self) -> PrefillPlan | None:
        """Reserve decode memory (preempting if needed), admit waiting sequences, and pick the
        prefill rows of this iteration (``None``: no prefill). Decode rows: ``decode_rows()``."""
        preempted = self._reserve_decode_memory()
        if not preempted:
            self._admit()
        return self._plan_prefill(self.running)

    def admit_more(self) -> PrefillPlan | None:
        """A second admission pass after this iteration's prefill: sequences that waited for
        blocks another sequence was computing can start now; returns the prefill of the newly
        admitted ones (their uncached tails), so they decode in this iteration too."""
        if not self.waiting:
            return None
        return self._plan_prefill(self._admit())

    def decode_rows(self) -> list[Sequence]:
        """Sequences ready to decode (their prompt KV is complete), oldest first."""
        return [s for s in self.running if s.status is Status.DECODE]

    def _decode_positions(self, seq: Sequence) -> int:
        return min(seq.num_computed + self.decode_steps, seq.max_positions)

    def _reserve_decode_memory(self) -> bool:
        preempted = False
        for seq in list(self.running):
            if seq.status is not Status.DECODE or seq not in self.running:
                continue
            while True:
                need = self.blocks_for(self._decode_positions(seq)) - len(seq.blocks)
                if need <= 0:
                    break
                if self.pool.num_available >= need:
                    seq.blocks.extend(self.pool.allocate(need))
                    break
                victim = max(self.running, key=lambda s: s.admitted)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
        return preempted

    def _admit(self) -> list[Sequence]:
        deferred, admitted = [], []
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting.popleft()
            target = seq.target
            matched, pending = self.cache.match(seq.tokens(target), count=False)
            if pending:
                deferred.append(seq)
                continue
            need_positions = min(target + self.decode_steps, seq.max_positions)
            new = max(0, self.blocks_for(need_positions) - len(matched))
            reclaim = sum(1 for b in matched if self.pool.refcount(b) == 0)
            if self.pool.num_available - reclaim < new:
                self.waiting.appendleft(seq)
                break
            for b in matched:
                self.pool.incref(b)
            seq.blocks = list(matched) + self.pool.allocate(new)
            seq.num_computed = len(matched) * self.block_size
            if seq.cached_tokens is None:
                seq.cached_tokens = min(seq.num_computed, len(seq.prompt))
                self.cache.queries += len(seq.prompt)
                self.cache.hits += seq.cached_tokens
            if matched:
                seq.kv_versions.add(self.cache.version)
            seq.admitted = self._admissions
            self._admissions += 1
            seq.status = Status.PREFILL if seq.num_computed < target else Status.DECODE
            self.running.append(seq)
            admitted.append(seq)
            self.cache.insert(seq.tokens(target), seq.blocks, ready=False)
        for seq in reversed(deferred):
            self.waiting.appendleft(seq)
        return admitted

    def _plan_prefill(self, candidates: list[Sequence]) -> PrefillPlan | None:
        rows: list[tuple[Sequence, int, int]] = []
        chunk = 0
        for seq in candidates:
            if seq.status is not Status.PREFILL:
                continue
            n = self._chunk_tokens(min(seq.target - seq.num_computed, self.prefill_chunk))
            c = bucket_for(max(chunk, n), self.chunk_buckets, "prefill chunk")
            if rows:
                if len(rows) + 1 > self.row_buckets[-1]:
                    break
                if bucket_for(len(rows) + 1, self.row_buckets, "prefill rows") * c > self.max_prefill_tokens:
                    break
            rows.append((seq, seq.num_computed, n))
            chunk = c
        return PrefillPlan(rows, chunk) if rows else None

    def _chunk_tokens(self, n: int) -> int:
        """Tokens of a row's next chunk out of ``n`` pending: all ``n``, unless ``cut_padded_chunks``
        and the largest bucket ``b < n`` now plus the rest's bucket later pad fewer slots than
        ``n``'s own bucket (prefill is compute-bound: 150 tokens cost 128 + 32 slots, not 256)."""
        c = bucket_for(n, self.chunk_buckets, "prefill chunk")
        below = [b for b in self.chunk_buckets if b < n]
        if self.cut_padded_chunks and below and below[-1] + bucket_for(n - below[-1], self.chunk_buckets, "prefill chunk") < c:
            return below[-1]
        return n

    # results -------------------------------------------------------------------------------------
    def prefilled(self, seq: Sequence, n: int, version: int) -> None:
        """``n`` more prompt positions of ``seq`` were written with weights ``version``."""
        before = seq.num_computed // self.block_size
        seq.num_computed += n
        seq.kv_versions.add(version)
        for j in range(before, seq.num_computed // self.block_size):
            self.cache.mark_ready(seq.blocks[j])
        if seq.num_computed >= seq.target:
            seq.status = Status.DECODE

    def decoded(self, seq: Sequence, token: int, logprob: float, sampling_logprob: float, version: int,
                top: list[tuple[int, float, float]] | None = None) -> bool:
        """Record one sampled token (its feed wrote one more position); returns True when the
        sequence finished (stop token or ``max_new_tokens``)."""
        seq.num_computed += 1
        seq.kv_versions.add(version)
        seq.output.append(int(token))
        seq.logprobs.append(float(logprob))
        seq.sampling_logprobs.append(float(sampling_logprob))
        seq.versions.append(int(version))
        if top is not None:
            if seq.top is None:
                seq.top = []
            seq.top.append(top)
        if token in seq.stop_ids:
            self.finish(seq, "stop", stop_token_id=int(token))
            return True
        if seq.remaining <= 0:
            self.finish(seq, "length")
            return True
        return False

    def finish(self, seq: Sequence, reason: str, *, stop_token_id: int | None = None) -> None:
        """End ``seq`` (``stop``, ``length`` or ``abort``) and give its blocks back."""
        if seq.finished:
            return
        if seq in self.running:
            self._release(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_token_id = stop_token_id

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back at the head of the queue (it keeps its output)."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.kv_versions = set()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Cache the computed full blocks (if all their KV is from the cache's weight version),
        drop the uncomputed ones from the cache, and release every block, tail first."""
        full = seq.num_computed // self.block_size
        if full and seq.kv_versions == {self.cache.version}:
            self.cache.insert(seq.tokens(full * self.block_size), seq.blocks[:full], ready=True)
        self.cache.drop_unready(seq.blocks)
        for b in reversed(seq.blocks):
            self.pool.decref(b)
        seq.blocks = []
