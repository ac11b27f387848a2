"""What each rollout strategy does to a group between its intervals (layer 4).

The group runner (``rollout.tree``) owns the loop every strategy shares: start
``initial_branches`` branches, advance the live ones ``interval`` turns, collect the ended ones,
hand the rest to :meth:`Strategy.between`, and, when none is left and slots are free, ask
:meth:`Strategy.refill` for more. One strategy instance serves one group (it may keep state, e.g.
PaTR's scored snapshots).

- :class:`FlatSamples` (``flat``, ``dapo``): ``group_size`` independent samples, each rolled out to
  its end in one interval; nothing between, no refill (DAPO's dynamic-sampling rounds and overlong
  shaping are the trainer's, ``jaxprm.train.dapo``).
- :class:`Checkpoints` (``tree_random``: :class:`TreeRandom`, ``patr``: :class:`PaTR`): every ``k``
  turns score the live branches, expand the ``top_k`` best by ``m`` children, prune those scoring
  below ``median - alpha``; refill from the best-scored snapshots.
- :class:`ARPOBranching` (``arpo``): after every turn each live branch may fork by ARPO's entropy
  rule; refill restarts one branch from the root.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
from typing import Any, Protocol

import numpy as np

from rollout.branches import Branch, gather
from rollout.client import Generated, SamplingParams
from rollout.groups import CheckpointStats, GroupRejected, GroupStats, RolloutError, TreeConfig
from rollout.types import InteractionTree, branch_messages
from scorers import BaseScorer, ScoringRejected, score_branch

__all__ = ["Strategy", "GroupRunner", "FlatSamples", "Checkpoints", "TreeRandom", "PaTR", "ARPOBranching",
           "strategy_for"]


class GroupRunner(Protocol):
    """What a strategy may use of the group runner it serves (``rollout.tree``)."""

    cfg: TreeConfig
    task: Any
    key: str
    group_seed: int
    tree: InteractionTree
    stats: GroupStats
    finished: list[Branch]

    def free_slots(self, n_active: int) -> int: ...
    def fork(self, parent: Branch, origin: str) -> Branch: ...
    async def root_branch(self, origin: str = "root") -> Branch: ...
    def collect(self, active: list[Branch]) -> list[Branch]: ...


class Strategy:
    """The flat default: ``group_size`` branches, each advanced ``max_turns`` turns (to its end) in
    one interval; nothing happens between intervals and nothing refills."""

    def __init__(self, cfg: TreeConfig) -> None:
        self.cfg = cfg

    @property
    def initial_branches(self) -> int:
        """Branches started from the root before the first interval."""
        return self.cfg.b0 if self.cfg.tree_mode else self.cfg.group_size

    @property
    def interval(self) -> int:
        """Turns each live branch advances between two :meth:`between` calls."""
        return self.cfg.max_turns

    @property
    def sampling(self) -> SamplingParams:
        """The sampling options of every request (its seed is set per request)."""
        return self.cfg.sampling

    def observe_turn(self, run: GroupRunner, branch: Branch, gen: Generated) -> None:
        """Called after each generated turn, before the env steps."""

    async def between(self, run: GroupRunner, active: list[Branch], index: int) -> list[Branch]:
        """The live branches after interval ``index`` -> the branches of the next interval (the ones
        dropped here must have been moved to ``run.finished``)."""
        return active

    async def refill(self, run: GroupRunner) -> list[Branch]:
        """New branches once every branch has ended and slots are free (``[]``: the group is done)."""
        return []

    def finish(self, stats: GroupStats) -> None:
        """Called once, after the last interval: strategy-specific totals into ``stats``."""


class FlatSamples(Strategy):
    """``flat`` and ``dapo``: independent samples (the default behaviour)."""


class Checkpoints(Strategy):
    """A tree with scored checkpoints every ``k`` turns (``tree_random`` and ``patr``; subclasses say
    how a branch is scored, :meth:`scores`).

    At a checkpoint (``theta_at="checkpoint"``: after ending the branches whose last ``theta``
    actions are identical) every live branch gets a score ``s_i`` in [0, 1]; the ``top_k`` best (ties
    by position) each fork into ``min(m, 1 + free)`` children while that is >= 2; of the others,
    those with ``s_i < median(s) - alpha`` are pruned (kept as negatives under ``keep_all``). Every
    scored survivor leaves a snapshot; a refill forks the best-scored snapshots round-robin, up to
    ``b0`` at a time (from the root while there is none)."""

    def __init__(self, cfg: TreeConfig) -> None:
        super().__init__(cfg)
        self.snapshots: list[tuple[float, int, Branch]] = []  # (score, order, frozen fork)

    @property
    def interval(self) -> int:
        return self.cfg.k

    async def scores(self, run: GroupRunner, active: list[Branch], index: int) -> list[float]:
        """One score in [0, 1] per branch of ``active`` at checkpoint ``index``."""
        raise NotImplementedError

    def _stop_loops(self, run: GroupRunner, active: list[Branch]) -> list[Branch]:
        for b in active:
            if b.loops(self.cfg.theta):
                b.stop("loop")
        return run.collect(active)

    async def between(self, run: GroupRunner, active: list[Branch], index: int) -> list[Branch]:
        cfg = self.cfg
        n_looped = 0
        if cfg.theta_at == "checkpoint":
            n_before = len(active)
            active = self._stop_loops(run, active)
            n_looped = n_before - len(active)
            if not active:
                run.stats.checkpoints.append(CheckpointStats(index=index, active=n_before, scores=[], expanded=0,
                                                             children=0, pruned=0, survived=0, loop_stopped=n_looped))
                return []
        scores = await self.scores(run, active, index)
        for b, s in zip(active, scores):
            b.score = s
        order = sorted(range(len(active)), key=lambda i: (-scores[i], i))
        free = run.free_slots(len(active))
        n_children: dict[int, int] = {}
        for i in order[: cfg.top_k]:
            n = int(min(cfg.m, 1 + free))
            if n < 2:
                break
            n_children[i] = n
            free -= n - 1
        med = statistics.median(scores)
        pruned = [i for i in range(len(active)) if i not in n_children and scores[i] < med - cfg.alpha]
        nxt: list[Branch] = []
        for i, b in enumerate(active):
            if i in pruned:
                b.stop("pruned")
                run.finished.append(b)
                continue
            self.snapshots.append((scores[i], len(self.snapshots), b.fork("snapshot", "refill")))
            if i in n_children:
                nxt.extend(run.fork(b, "child") for _ in range(n_children[i]))
            else:
                nxt.append(b)
        run.stats.expanded += len(n_children)
        run.stats.pruned += len(pruned)
        run.stats.checkpoints.append(CheckpointStats(
            index=index, active=len(active) + n_looped, scores=list(scores), expanded=len(n_children),
            children=sum(n_children.values()), pruned=len(pruned),
            survived=len(active) - len(n_children) - len(pruned), loop_stopped=n_looped))
        return nxt

    async def refill(self, run: GroupRunner) -> list[Branch]:
        n = min(int(run.free_slots(0)), self.cfg.b0)
        if not self.snapshots:
            return [await run.root_branch("refill") for _ in range(n)]
        best = sorted(self.snapshots, key=lambda s: (-s[0], s[1]))[: self.cfg.top_k]
        return [run.fork(best[j % len(best)][2], "refill") for j in range(n)]


class TreeRandom(Checkpoints):
    """``tree_random``: uniform scores from a generator seeded by (config seed, group seed,
    checkpoint index): PaTR's tree without its scorer."""

    async def scores(self, run: GroupRunner, active: list[Branch], index: int) -> list[float]:
        rng = np.random.default_rng([self.cfg.seed, run.group_seed, index])
        return [float(x) for x in rng.random(len(active))]


class PaTR(Checkpoints):
    """``patr``: each live branch scored by the branch scorer (the mean of its token rewards for the
    branch's last turn, through ``scorers.score_branch``), concurrently. A scorer error, a timeout
    (``score_timeout_s``) or a score outside [0, 1] rejects the group (:class:`GroupRejected`, the
    scorer's error chained)."""

    def __init__(self, cfg: TreeConfig, scorer: BaseScorer | None) -> None:
        super().__init__(cfg)
        if scorer is None:
            raise ValueError("strategy 'patr' needs a branch scorer (scorer=...)")
        self.scorer = scorer

    async def _score_one(self, run: GroupRunner, b: Branch) -> float:
        branch = run.tree.branch(b.last_id)  # score_branch works on private copies
        ctx = {"task": run.task, "branch_id": b.id}
        where = f"group {run.key!r}: branch {b.id} at turn {b.depth}"
        try:
            s = await asyncio.wait_for(score_branch(self.scorer, branch, messages=branch_messages(branch), ctx=ctx),
                                       self.cfg.score_timeout_s)
        except ScoringRejected as e:
            raise GroupRejected(f"{where}: {e.reason}", group_key=run.key, kind=e.kind) from e
        except TimeoutError:
            raise GroupRejected(f"{where}: the branch scorer took longer than {self.cfg.score_timeout_s} s",
                                group_key=run.key, kind="timeout") from None
        if not 0.0 <= s <= 1.0:
            raise GroupRejected(f"{where}: branch score {s} is outside [0, 1]", group_key=run.key, kind="out_of_range")
        return s

    async def scores(self, run: GroupRunner, active: list[Branch], index: int) -> list[float]:
        return await gather([self._score_one(run, b) for b in active])


class ARPOBranching(Strategy):
    """``arpo``: entropy-adaptive branching after every turn (a tool-call boundary).

    A turn's entropy is the mean of the per-token entropies of its response's first
    ``arpo.entropy_tokens`` tokens (the server's top ``arpo.top_logprobs`` renormalised; requests
    ask for them). After round ``index`` each live branch in order, while slots remain, draws
    ``u ~ U(0, 1)`` (generator seeded by (config seed, group seed, index)) and forks
    ``min(beam_size - 1, free)`` children, placed right after it, when
    ``clip(u - entropy_weight * (H_now - H_init), 0, 1) <= branch_probability``. A refill restarts
    one branch from the root (ARPO restarts a finished sample from its prompt)."""

    def __init__(self, cfg: TreeConfig) -> None:
        super().__init__(cfg)
        self.entropies: list[float] = []  # every turn's entropy

    @property
    def interval(self) -> int:
        return 1

    @property
    def sampling(self) -> SamplingParams:
        return dataclasses.replace(self.cfg.sampling, top_logprobs=self.cfg.arpo.top_logprobs)

    def observe_turn(self, run: GroupRunner, branch: Branch, gen: Generated) -> None:
        """The turn's entropy becomes ``branch.h_now``, and ``branch.h_init`` when it is the
        lineage's first (a turn without listed alternatives has no entropy: ``h_now = None``)."""
        if gen.entropies is None:
            raise RolloutError(f"group {run.key!r}: strategy 'arpo' needs per-token entropies, but the server "
                               "answered without top logprobs (vLLM logprobs: n / SGLang top_logprobs_num)")
        head = [h for h in gen.entropies[: self.cfg.arpo.entropy_tokens] if math.isfinite(h)]
        if not head:
            branch.h_now = None
            return
        branch.h_now = sum(head) / len(head)
        self.entropies.append(branch.h_now)
        if branch.h_init is None:
            branch.h_init = branch.h_now

    async def between(self, run: GroupRunner, active: list[Branch], index: int) -> list[Branch]:
        arpo = self.cfg.arpo
        rng = np.random.default_rng([self.cfg.seed, run.group_seed, index])
        free = int(run.free_slots(len(active)))
        nxt: list[Branch] = []
        for b in active:
            nxt.append(b)
            if free <= 0:
                continue
            run.stats.branch_decisions += 1
            p = min(max(float(rng.random()) - arpo.entropy_weight * b.entropy_delta(), 0.0), 1.0)
            if p > arpo.branch_probability:
                continue
            n = min(arpo.beam_size - 1, free)
            nxt.extend(run.fork(b, "child") for _ in range(n))
            free -= n
            run.stats.expanded += 1
        return nxt

    async def refill(self, run: GroupRunner) -> list[Branch]:
        return [await run.root_branch("refill")]

    def finish(self, stats: GroupStats) -> None:
        if self.entropies:
            stats.entropy_mean = math.fsum(self.entropies) / len(self.entropies)  # order-independent


def strategy_for(cfg: TreeConfig, scorer: BaseScorer | None = None) -> Strategy:
    """A fresh strategy for one group of ``cfg.strategy`` (``scorer``: PaTR's branch scorer)."""
    if cfg.strategy == "patr":
        return PaTR(cfg, scorer)
    if cfg.strategy == "tree_random":
        return TreeRandom(cfg)
    if cfg.strategy == "arpo":
        return ARPOBranching(cfg)
    return FlatSamples(cfg)
