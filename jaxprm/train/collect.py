"""A training step's data, before learning: rollout -> process rewards -> filter (``rollout.source:
tree``).

:meth:`StepCollector.collect` takes the step's tasks from the task stream, rolls them out as
groups (``rollout.tree.run_groups``; in a distributed run each process its share, then the groups
are gathered), applies DAPO's overlong shaping, scores them with the process-reward runner
(``rollout.scoring.score_groups``; a rejected group is dropped, its reason counted; while a
scorer server is down the same groups are scored again, ``prm.unavailable_wait_s``), applies the
group filter and, with DAPO's dynamic sampling, repeats in rounds until enough mixed groups are
kept. It returns a :class:`Collected`: the kept groups (carrying their process rewards) and the
step's row so far. The drivers (``jaxprm.train.drivers``) learn from it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any

import numpy as np

from jaxprm.train import adapters, dapo, multihost
from jaxprm.train.compilation import PhaseTimes, Span, measured
from jaxprm.train.config import FLAT_STRATEGIES, TrainConfig
from jaxprm.train.setup import TaskStream, TrainError
from rollout.export import filter_groups
from rollout.groups import GroupRejected, GroupResult
from rollout.scoring import ScoredGroups, score_groups
from rollout.stats import describe_groups
from rollout.tree import run_groups

__all__ = ["Collected", "StepCollector"]


def _summed_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Row stats of several rounds (or processes): integer counters add up, means are averaged."""
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for p in parts for k in p):
        vals = [p[k] for p in parts if k in p]
        out[k] = sum(vals) if all(isinstance(v, int) for v in vals) else float(np.mean(vals))
    return out


def _summed_spans(spans: list[Span]) -> Span:
    """One span for phases run in several rounds (their wall and compile seconds added)."""
    return Span(wall=sum(s.wall for s in spans), compile=sum(s.compile for s in spans))


@dataclasses.dataclass
class Collected:
    """One step's rollouts, scored and filtered: the train row so far, the groups to learn from
    (carrying their process rewards), the weight version the server had as their rollouts started
    (``overlap.group_version``'s default), the task stream's position after the step's tasks, and
    the rollout and scoring spans."""

    step: int
    row: dict[str, Any]
    kept: list[GroupResult]
    served: int
    data_pos: int
    rollout: Span
    scoring: Span


@dataclasses.dataclass
class _Round:
    groups: list[GroupResult]
    kept: list[GroupResult]
    rejected: list[GroupRejected]
    stats: dict[str, Any]
    split: list[int]  # groups per process
    rollout: Span
    scoring: Span


class StepCollector:
    """Rolls out, scores and filters training steps (see the module docstring).

    Args:
      cfg: the run's config. gen: the ``jaxprm.train.generation.Generation`` (client, prompts,
        context size, served weight version). env_factory: a fresh env per group. stream: the
        training tasks. prm: the process-reward runner (``None``: no process rewards). scorer:
        PaTR's branch scorer (``None`` for the other strategies). times: the run's phases.
      log: one-line messages (rejected groups). multi: a distributed run.
    """

    def __init__(self, cfg: TrainConfig, *, gen, env_factory, stream: TaskStream, prm, scorer, times: PhaseTimes,
                 log, multi: bool) -> None:
        self.cfg, self.gen, self.env_factory, self.stream = cfg, gen, env_factory, stream
        self.prm, self.scorer, self.times, self.log, self.multi = prm, scorer, times, log, multi
        self.example_tree: GroupResult | None = None  # the group with the most checkpoint activity (the tree plot)

    async def score_and_filter(self, groups: list[GroupResult],
                               scored: ScoredGroups | None = None) -> tuple[list[GroupResult], dict[str, float]]:
        """Process rewards per group (PRM active) and the group filter; returns the kept groups
        (carrying their process rewards) and the row's stats (rejections by reason, the spec's
        ``rollout/prm_...`` metrics of the scored groups, filter counters). ``scored``: the groups'
        scoring, already done (a distributed step scores each process's share, then gathers them)."""
        stats: dict[str, float] = {}
        if self.prm is not None:
            scored = scored if scored is not None else await score_groups(self.prm, groups)
            for key, reason in scored.reasons:
                self.log(f"process rewards rejected group {key}: {reason}")
            stats["prm_rejected_groups"] = sum(scored.rejected.values())
            stats.update({f"prm_rejected/{kind}": n for kind, n in scored.rejected.items()})
            stats.update(scored.metrics.summary())
            groups = scored.groups
        if self.cfg.rollout.filter != "none":
            counters: dict[str, int] = {}
            groups = filter_groups(groups, self.cfg.rollout.filter, counters)
            stats.update({f"filter/{k}": v for k, v in counters.items()})
        return groups, stats

    async def _score_waiting(self, step: int, groups: list[GroupResult]) -> tuple[ScoredGroups, int, float]:
        """``score_groups``, and while a scorer server is down (groups refused as
        ``scorer_unavailable``, and no other rejection than that or ``failed`` calls) the refused
        groups scored again, pausing 0.5 s doubling to 5 s, for up to ``prm.unavailable_wait_s``
        (then :class:`TrainError`). A first scoring whose calls all failed is repeated once at once:
        they may have opened a breaker. Returns ``(scoring, waits, seconds waited)``."""
        scored = await score_groups(self.prm, groups)
        limit = self.cfg.prm.unavailable_wait_s
        t0, pause, waits = time.monotonic(), 0.5, 0
        order = {g.group_key: i for i, g in enumerate(groups)}

        def refused_only(s: ScoredGroups) -> bool:  # rejections, all by failed or refused calls
            return bool(s.rejected) and set(s.rejected) <= {"scorer_unavailable", "failed"}

        def down(s: ScoredGroups) -> bool:  # ... one of them refused by an open breaker
            return refused_only(s) and "scorer_unavailable" in s.rejected

        def again(s: ScoredGroups) -> list[GroupResult]:
            done = {g.group_key for g in s.groups}
            return [g for g in groups if g.group_key not in done]

        async def rescore(s: ScoredGroups) -> ScoredGroups:
            new = await score_groups(self.prm, again(s))
            s.metrics.merge(new.metrics)
            return ScoredGroups(groups=sorted(s.groups + new.groups, key=lambda g: order[g.group_key]),
                                metrics=s.metrics, rejected=new.rejected, reasons=new.reasons)

        if limit is not None and refused_only(scored) and not scored.groups and not down(scored):
            scored = await rescore(scored)
        while limit is not None and down(scored):
            waited = time.monotonic() - t0
            if waited >= limit:
                raise TrainError(
                    f"step {step}: a scorer server has been unavailable for {waited:.0f} s (prm.unavailable_wait_s="
                    f"{limit:g}): {scored.reasons[-1][1] if scored.reasons else 'groups refused'}. Restart it "
                    "and --resume, or set prm.unavailable_wait_s: null to skip such groups")
            if waits == 0:
                self.log(f"step {step}: the scoring of {len(again(scored))} of {len(groups)} groups was refused (a "
                         f"scorer server is down); scoring them again until it answers (prm.unavailable_wait_s={limit:g})")
            await asyncio.sleep(min(pause, max(0.0, limit - waited)))
            pause, waits = min(2 * pause, 5.0), waits + 1
            scored = await rescore(scored)
        return scored, waits, (time.monotonic() - t0) if waits else 0.0

    async def _round(self, step: int, rnd: int, phase, n_tasks: int) -> _Round:
        """One round of a step's rollouts: the next ``n_tasks`` tasks rolled out (this process's
        share), overlong shaping, process rewards and the filter, gathered over the processes."""
        cfg = self.cfg
        # every process takes the same tasks and rolls out its share (all of them in one process);
        # group i of the step keeps its seed whichever process runs it
        offset, tasks = multihost.process_share(self.stream.take(n_tasks))
        rejected: list[GroupRejected] = []
        with phase("rollout") as rollout:
            groups = await run_groups(tasks, env_factory=self.env_factory, client=self.gen.client,
                                      prompts=self.gen.prompts,
                                      config=adapters.tree_config(cfg, max_context=self.gen.max_context),
                                      scorer=self.scorer, rejected=rejected,
                                      group_seed=step * 10_000 + rnd * cfg.rollout.tasks_per_step + offset)
            groups, stats = dapo.shape_overlong(groups, cfg.rollout.max_new_tokens, dapo.overlong_buffer(cfg),
                                                cfg.rollout.dapo.overlong_factor)
        with phase("score") as scoring:
            scored = None
            if self.prm is not None:
                scored, waits, wait_s = await self._score_waiting(step, groups)
                if waits:
                    stats.update(scorer_waits=waits, scorer_wait_s=wait_s)
            split = [len(groups)]
            if self.multi:  # every process gets every process's groups (and scoring), in task order
                parts = multihost.allgather_objects((groups, rejected, scored, stats))
                groups = [g for p in parts for g in p[0]]
                rejected = [r for p in parts for r in p[1]]
                scored = ScoredGroups.concat([p[2] for p in parts]) if scored is not None else None
                split = [len(p[0]) for p in parts]
                stats = _summed_stats([p[3] for p in parts])
            kept, fstats = await self.score_and_filter(groups, scored)
        return _Round(groups, kept, rejected, {**stats, **fstats}, split, rollout, scoring)

    async def collect(self, step: int, *, timed: bool = True) -> Collected:
        """Rollout -> scoring -> filter for step ``step`` (``timed``: as phases of the run; the
        asynchronous producer's overlap them and are measured only). With dynamic sampling (DAPO)
        groups of equal outcome rewards are dropped and more tasks rolled out, up to
        ``rollout.dapo.max_rounds`` rounds of ``tasks_per_step``; the row counts every round."""
        cfg = self.cfg
        phase = self.times.phase if timed else (lambda name: measured())
        served = self.gen.version  # the weights the server has as the rollouts start
        dynamic = dapo.dynamic_sampling(cfg)
        want = cfg.rollout.tasks_per_step
        groups: list[GroupResult] = []
        kept: list[GroupResult] = []
        rejected: list[GroupRejected] = []
        rounds: list[_Round] = []
        tasks_so_far, capped = 0, False
        while not rounds or (dynamic and len(kept) < want and len(rounds) < cfg.rollout.dapo.max_rounds):
            n_tasks = dapo.round_tasks(want, tasks_so_far=tasks_so_far, max_tokens=cfg.rollout.dapo.max_tokens_per_step,
                                       tokens_so_far=sum(g.stats.generated_tokens for g in groups))
            capped = n_tasks < want
            if n_tasks == 0:  # the step's token cap is spent
                break
            r = await self._round(step, len(rounds), phase, n_tasks)
            tasks_so_far += n_tasks
            groups += r.groups
            rejected += r.rejected
            if dynamic:
                mixed = [g for g in r.kept if dapo.is_mixed(g)]
                r.stats["dynamic_dropped_groups"] = len(r.kept) - len(mixed)
                r.kept = mixed
            kept += r.kept
            rounds.append(r)
        fstats = _summed_stats([r.stats for r in rounds])
        if dynamic:
            kept = kept[:want]
            fstats["dynamic_rounds"] = len(rounds)
            fstats["dynamic_token_capped"] = float(capped)
        for r in rejected:
            cause = f" [cause: {' <- '.join(r.causes)}]" if r.causes else ""
            self.log(f"branch scorer rejected group {r.group_key}: {r}{cause}")
        self._keep_example_tree(groups)
        row = {**self._row(groups, rejected), "kept_groups": len(kept), **fstats}
        if self.multi:  # how the step's groups were split over the processes
            row["process_groups"] = [sum(parts) for parts in zip(*(r.split for r in rounds))]
        return Collected(step, row, kept, served, self.stream.pos, _summed_spans([r.rollout for r in rounds]),
                         _summed_spans([r.scoring for r in rounds]))

    @staticmethod
    def _row(groups: list[GroupResult], rejected: list[GroupRejected]) -> dict[str, Any]:
        """The row's rollout metrics over every group rolled out, and the branch scorer's rejections
        by kind and by innermost cause (the scorer's own error: ScorerHTTPError, ConnectionError, ...)."""
        desc = describe_groups(groups)
        row: dict[str, Any] = {
            "reward": float(np.mean([lf.outcome_reward for g in groups for lf in g.leaves] or [0.0])),
            "success": desc["success_rate"], "groups_with_success": desc["groups_with_success"],
            "mixed_groups": desc["mixed_groups"], "trajectories": desc["trajectories"],
            "sampled_actions": desc["sampled_actions"], "invalid_rate": desc["invalid_rate"],
            "expanded": desc["expanded"], "pruned": desc["pruned"], "checkpoints": desc["checkpoints"],
            "loop_stopped": desc["loop_stopped"], "refills": desc["refills"],
            "generated_tokens": desc["generated_tokens"],
        }
        if rejected:
            row["branch_rejected_groups"] = len(rejected)
            row.update({f"branch_rejected/{k}": n for k, n in collections.Counter(r.kind for r in rejected).items()})
            row.update({f"branch_rejected_cause/{k}": n for k, n in
                        collections.Counter(r.causes[-1] for r in rejected if r.causes).items()})
        return row

    def _keep_example_tree(self, groups: list[GroupResult]) -> None:
        """Remember the group with the most checkpoint activity so far, for the PaTR tree plot."""
        if self.cfg.rollout.strategy in FLAT_STRATEGIES or not groups:
            return
        activity = lambda g: (g.stats.expanded + g.stats.pruned, g.stats.successes)  # noqa: E731
        cand = max(groups, key=activity)
        if self.example_tree is None or activity(cand)[0] >= activity(self.example_tree)[0]:
            self.example_tree = cand
