"""Asynchronous rollouts (``rollout.asynchronous``): the next steps' groups are rolled out while the
learner trains on the current one's.

A :class:`RolloutProducer` runs beside the training loop, in the same event loop. For step ``k`` it
waits until the learner's weight version (the last step whose weights were pushed to the server)
is at least ``k - 1 - max_staleness``, then rolls out, scores and filters the step's groups with the
weights the server has at that moment (``collect``, the synchronous step's first half) and queues
them. The learner takes step ``k``'s groups when it has pushed version ``k - 1``; weight updates
reach the server between its engine steps, so a request in flight may finish on newer weights
(each response reports its oldest token's version).

Staleness is counted in versions: a group's is the learner's version when it is learned from,
``k - 1``, minus the oldest version among its tokens (the version when its rollout started, for a
server that reports none). The wait bounds it by ``max_staleness``; a group found staler anyway
(a server whose weight loads lag) is dropped and counted. With ``max_staleness = 0`` the producer
starts step ``k``'s rollouts only after version ``k - 1`` is served: the synchronous loop. With
staleness, learn with ``ppo.decoupled`` (the proximal policy's ratio, the behaviour weight's cap).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["RolloutProducer", "group_version", "drop_stale"]


def group_version(group: Any, default: int) -> int:
    """The oldest weight version among the responses of ``group``'s interactions (``default`` when
    the server reported none)."""
    versions = [it.model_response.weight_version for it in group.tree
                if it.model_response is not None and it.model_response.weight_version is not None]
    return min(versions) if versions else default


def drop_stale(groups: Sequence[Any], *, served: int, learner_version: int,
               max_staleness: int) -> tuple[list, dict[str, float]]:
    """The groups at most ``max_staleness`` versions behind ``learner_version`` (a group's version:
    :func:`group_version`, ``served`` when the server reported none), and the row's stats:
    ``stale_dropped_groups``, ``staleness_mean`` / ``staleness_max`` over the kept groups."""
    lags = [learner_version - group_version(g, served) for g in groups]
    keep = [i for i, lag in enumerate(lags) if lag <= max_staleness]
    kept_lags = [lags[i] for i in keep]
    stats = {"stale_dropped_groups": len(groups) - len(keep),
             "staleness_mean": float(np.mean(kept_lags)) if kept_lags else 0.0,
             "staleness_max": float(max(kept_lags)) if kept_lags else 0.0}
    return [groups[i] for i in keep], stats


class RolloutProducer:
    """Rolls out steps ``first..last`` ahead of the learner (see the module docstring).

    ``collect(step) -> item`` does one step's rollouts; ``learner_version`` is the weight version
    the server has when the producer starts (the step the run starts from). :meth:`get` returns the
    items in step order; :meth:`served` tells the producer a new version is on the server."""

    def __init__(self, collect: Callable[[int], Awaitable[Any]], *, first: int, last: int, max_staleness: int,
                 learner_version: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = int(max_staleness)
        self.version = int(learner_version)
        self._collect = collect
        self._changed = asyncio.Condition()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(first, last), name="jaxprm-rollout-producer")

    async def _run(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            async with self._changed:  # step's groups may be learned from max_staleness versions late
                await self._changed.wait_for(lambda s=step: self.version >= s - 1 - self.max_staleness)
            await self._queue.put(await self._collect(step))

    async def get(self) -> Any:
        """The next step's item; the producer's error, if its rollouts failed."""
        if not self._queue.empty():
            return self._queue.get_nowait()
        getter = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        self._task.result()  # raises the rollouts' error
        raise RuntimeError("the rollout producer stopped before the learner's last step")

    async def served(self, version: int) -> None:
        """Version ``version`` of the weights is on the server (the learner's step ``version``)."""
        async with self._changed:
            self.version = int(version)
            self._changed.notify_all()

    @property
    def ahead(self) -> int:
        """Steps rolled out and waiting for the learner."""
        return self._queue.qsize()

    async def aclose(self) -> None:
        """Stop producing (a rollout in flight is cancelled)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
