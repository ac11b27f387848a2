"""What the engine keeps per request: the future, the rows, streaming deltas, statistics.

A request is one or more rows (``n`` choices, a batch of prompts), each a scheduler ``Sequence``;
it resolves when all its rows finished. ``RowDelta`` carries a row's new tokens to a streaming
consumer after every decode call, and its ``Completion`` when it ends.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxprm.serve.sampling import Completion
from jaxprm.serve.scheduler import Sequence

if TYPE_CHECKING:
    from jaxprm.serve.engine import Engine

__all__ = ["EngineStats", "RowDelta", "EngineFuture", "Request", "completion"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineStats:
    """Counters since start.

    ``batches`` decode calls, ``rows`` their rows summed, ``tokens`` generated, ``max_rows_in_batch``
    the largest decode batch, ``recent_batch_rows`` the rows of recent decode calls; prefill:
    ``prefill_calls``, ``prefill_tokens`` (computed), ``prompt_tokens`` and ``cached_tokens`` (of
    admitted prompts, from the prefix cache); ``preemptions``; ``busy_s`` time in programs;
    ``shared_prefix_calls`` decode calls that gathered a shared prompt prefix once for the batch.
    """

    batches: int = 0
    rows: int = 0
    tokens: int = 0
    max_rows_in_batch: int = 0
    busy_s: float = 0.0
    prefill_calls: int = 0
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    iterations: int = 0
    shared_prefix_calls: int = 0
    recent_batch_rows: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=1024))


@dataclasses.dataclass
class RowDelta:
    """New output of one row (streaming): tokens since the last delta and, when the row ended,
    its full ``completion``."""

    row: int
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float, float]]] | None
    versions: list[int]
    completion: Completion | None = None
    cached_tokens: int = 0


class EngineFuture(concurrent.futures.Future):
    """Resolves to ``list[Completion]`` (row order). ``cancel()`` also stops the rows in the engine
    (their blocks are freed at the next iteration boundary)."""

    def __init__(self, engine: Engine, request_id: str):
        super().__init__()
        self.request_id = request_id
        self._engine = engine

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._engine._post(("cancel", self))
        return cancelled


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted request: its future, rows, streaming callback and delivery state."""

    future: EngineFuture
    seqs: list[Sequence]
    on_delta: Callable[[RowDelta], None] | None
    arrival: float
    sent: list[int] = dataclasses.field(default_factory=list)  # tokens delivered per row (streaming)

    def send_delta(self, s: Sequence, done: Completion | None = None) -> None:
        """Give the streaming consumer row ``s``'s tokens since the last delta (and ``done``)."""
        if self.on_delta is None:
            return
        a = self.sent[s.row]
        self.sent[s.row] = len(s.output)
        delta = RowDelta(row=s.row, token_ids=s.output[a:], logprobs=s.logprobs[a:],
                         sampling_logprobs=s.sampling_logprobs[a:],
                         top_logprobs=s.top[a:] if (s.top is not None and s.params.top_logprobs > 0) else None,
                         versions=s.versions[a:], completion=done, cached_tokens=s.cached_tokens or 0)
        try:
            self.on_delta(delta)
        except Exception:  # a consumer's failure must not stop the engine
            log.exception("streaming callback failed")




def completion(s: Sequence, current_version: int) -> Completion:
    """The ``Completion`` record of a (finished) sequence."""
    return Completion(
        prompt_ids=list(s.prompt), token_ids=list(s.output), logprobs=list(s.logprobs),
        sampling_logprobs=list(s.sampling_logprobs),
        top_logprobs=(s.top or []) if s.params.top_logprobs > 0 else None,
        finish_reason=s.finish_reason or "length", stop_token_id=s.stop_token_id,
        weight_version=min(s.versions) if s.versions else current_version,
        output_token_versions=list(s.versions), cached_tokens=s.cached_tokens or 0)
