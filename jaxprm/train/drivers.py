"""How the training loop drives its steps: each driver's ``step(k)`` gets step ``k``'s data, learns
from it, checks the sampler, pushes the new weights and logs the train row.

- :class:`SyncSteps` (the default): collect (``jaxprm.train.collect``), then learn.
- :class:`AsyncSteps` (``rollout.asynchronous``): the step's groups come from a
  ``jaxprm.train.overlap.RolloutProducer`` that rolled them out while earlier steps learned; the
  stale ones are dropped and the learner runs in a worker thread, so the producer's rollouts go on.
- :class:`AgentSteps` (``rollout.source: agent``): OpenAI-SDK agents through the recording proxy
  (scored on export) give rows, not groups.

The shared body (:class:`StepDriver`): learn (``jaxprm.train.learner.Learner``; a step with nothing
to learn from is skipped and counted), mark the step's tasks consumed (what a checkpoint records),
check that the sampler served the learner's policy, push the weights, log the row.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from jaxprm.train.collect import Collected, StepCollector
from jaxprm.train.compilation import PhaseTimes, Span
from jaxprm.train.health import process_health
from jaxprm.train.learner import Learner
from jaxprm.train.overlap import RolloutProducer, drop_stale
from jaxprm.train.rundir import MetricsLog
from jaxprm.train.setup import TaskStream, TrainError

__all__ = ["StepDriver", "SyncSteps", "AsyncSteps", "AgentSteps"]


class StepDriver:
    """The step body every driver shares (see the module docstring).

    Args:
      learner: the run's learner. gen: the generation server and client (``check_behavior``,
        ``sync``). metrics: the metrics log. times: the run's phases. stream: the training tasks
        (its ``consumed`` position is set as a step learns). clock: seconds since the loop started
        (the rows' ``loop_s``).
    """

    def __init__(self, *, learner: Learner, gen, metrics: MetricsLog, times: PhaseTimes, stream: TaskStream,
                 clock: Callable[[], float]) -> None:
        self.learner, self.gen, self.metrics, self.times, self.stream, self.clock = (
            learner, gen, metrics, times, stream, clock)

    async def step(self, step: int) -> dict[str, Any]:
        """Run training step ``step``; returns its row (already logged)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop whatever the driver runs beside the loop."""

    def _learn_or_skip(self, step: int, learn: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        """``learn()``'s metrics, or (nothing to learn from: it returned ``None``) a skipped step."""
        out = learn()
        if out is None:
            self.learner.skip_step()
            return {"skipped": True}
        return out

    async def _learn_groups(self, c: Collected, t0: float, spans: tuple[Span, ...], *,
                            in_thread: bool = False) -> dict[str, Any]:
        """Learn from a collected step, then :meth:`_finish` (``spans``: the phases before learning
        whose compile time the row counts)."""

        def learn() -> dict[str, Any]:
            return self._learn_or_skip(c.step, lambda: self.learner.learn_groups(c.kept, c.step) if c.kept else None)

        with self.times.phase("learn") as learning:
            c.row.update(await asyncio.to_thread(learn) if in_thread else learn())
        self.stream.consumed = c.data_pos
        return await self._finish(c.step, c.row, t0, c.rollout, (*spans, learning))

    async def _finish(self, step: int, row: dict[str, Any], t0: float, rollout: Span,
                      spans: tuple[Span, ...]) -> dict[str, Any]:
        """Check that the sampler was the learner's policy, push the new weights, log the row."""
        learning = spans[-1]
        row.update(rollout_s=rollout.wall - rollout.compile, learn_s=learning.wall - learning.compile)
        try:  # before the new weights are pushed: a sampler that is not the learner's policy stops the run
            self.gen.check_behavior(step, row)
        except TrainError:
            self.metrics.log(step, "train", row)
            raise
        with self.times.phase("sync") as sync:
            await self.gen.sync(step)
        row.update(compile_s=sum(sp.compile for sp in (*spans, sync)), step_s=time.perf_counter() - t0,
                   loop_s=self.clock(), **process_health(), **self.gen.server_health())
        self.metrics.log(step, "train", row)
        return row


class SyncSteps(StepDriver):
    """Rollout -> scoring -> filter -> learn -> weight sync, one step after the other."""

    def __init__(self, collector: StepCollector, **shared: Any) -> None:
        super().__init__(**shared)
        self.collector = collector

    async def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        c = await self.collector.collect(step)
        return await self._learn_groups(c, t0, (c.rollout, c.scoring))


class AsyncSteps(StepDriver):
    """``rollout.asynchronous``: steps ``first..last`` rolled out ahead by a producer, at most
    ``rollout.max_staleness`` weight versions behind the learner (``learner_version``: the step the
    run starts from). The wait for a step's groups is its rollout phase."""

    def __init__(self, collector: StepCollector, *, first: int, last: int, max_staleness: int,
                 learner_version: int, **shared: Any) -> None:
        super().__init__(**shared)
        self.producer = RolloutProducer(lambda k: collector.collect(k, timed=False), first=first, last=last,
                                        max_staleness=max_staleness, learner_version=learner_version)

    async def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.times.phase("rollout") as waiting:
            c = await self.producer.get()
        assert c.step == step, (c.step, step)
        c.kept, stale = drop_stale(c.kept, served=c.served, learner_version=step - 1,
                                   max_staleness=self.producer.max_staleness)
        c.row.update(stale, kept_groups=len(c.kept), rollout_wait_s=waiting.wall, rollouts_ahead=self.producer.ahead)
        row = await self._learn_groups(c, t0, (waiting,), in_thread=True)
        await self.producer.served(step)
        return row

    async def aclose(self) -> None:
        await self.producer.aclose()


class AgentSteps(StepDriver):
    """``rollout.source: agent``: the step's tasks run as agents through the recording proxy
    (``jaxprm.train.agent_rollouts.AgentRollouts``, scored on export) -> learn from their rows."""

    def __init__(self, agents, tasks_per_step: int, **shared: Any) -> None:
        super().__init__(**shared)
        self.agents, self.tasks_per_step = agents, tasks_per_step

    async def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        tasks = self.stream.take(self.tasks_per_step)
        with self.times.phase("rollout") as rollout:
            res = await self.agents.rollout(tasks, step)
        row = dict(res.stats)
        row.update(res.prm_metrics.summary())  # the exports' prm_stats, recorded after they returned
        with self.times.phase("learn") as learning:
            row.update(self._learn_or_skip(step, lambda: self.learner.learn_rows(res.rows, step) if res.rows else None))
        self.stream.consumed = self.stream.pos
        return await self._finish(step, row, t0, rollout, (rollout, learning))
