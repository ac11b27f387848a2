"""``PRMRunner``: builds and owns scorers, scores branches into per-token rewards (layer 3).

Scoring one branch (``run``), for each *enabled* scorer in order:

1. every turn is scored concurrently (a trajectory scorer is called once for the branch), each call
   on private inputs (``scorers._isolation``);
2. a ``None`` or an exception from any turn rejects the trajectory (``ScoringRejected``);
3. each result becomes ``float [output_len]`` (scalars broadcast; dense arrays must have exactly that
   shape), must be finite, is multiplied by the scorer's weight, must still be finite, and is added
   to the turn's running total (which must stay finite);
4. observations are checked (turn targets, duplicates, a stable schema per scorer and metric);
5. only when every turn of this scorer passed are its contributions and schemas committed.

The interactions' ``token_rewards`` are written only when *all* scorers succeeded, so a rejected run
leaves its inputs untouched. ``score_branches`` clones every root-to-leaf branch of a tree, scores
them in order and returns per-leaf token rewards plus metrics only when every branch succeeded.

Lifecycle: ``await PRMRunner.create(config)`` (startup rollback) or ``PRMRunner(config)`` (no
rollback); scorers built from config are *owned* and closed by ``aclose`` in reverse creation order
(disabled ones included); instances passed as ``scorers=`` are *borrowed* and never closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rollout.types import Interaction, InteractionTree, branch_messages
from scorers._isolation import BranchSnapshot
from scorers.base import BaseScorer, PRMMetricObservation, PRMTurnResult, ScoringRejected
from scorers.branch import describe, evaluate_branch, order_interactions, reject_failures, turn_rewards
from scorers.config import PRMConfig, as_prm_config, resolve_scorer_class
from scorers.metrics import MetricsAccumulator, namespace_for

__all__ = ["PRMRunner", "RunResult", "SessionScores"]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------


class RunResult(Mapping[str, np.ndarray]):
    """The outcome of one ``run``: a mapping ``{interaction_id: float32 [output_len]}`` of total
    weighted token rewards, plus

    Attributes:
      turn_results: committed ``PRMTurnResult``s in scorer order, turns parent-before-child.
      branch_totals: ``{scorer_name: sum over turns of the weighted turn reward}``.
    """

    def __init__(
        self,
        token_rewards: dict[str, np.ndarray],
        turn_results: tuple[PRMTurnResult, ...],
        branch_totals: dict[str, float],
    ) -> None:
        self.token_rewards = token_rewards
        self.turn_results = turn_results
        self.branch_totals = branch_totals

    def __getitem__(self, key: str) -> np.ndarray:
        return self.token_rewards[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.token_rewards)

    def __len__(self) -> int:
        return len(self.token_rewards)

    def __repr__(self) -> str:
        return f"RunResult(turns={list(self.token_rewards)}, totals={self.branch_totals})"


@dataclasses.dataclass
class SessionScores:
    """Everything ``score_branches`` produced for a session whose branches all succeeded.

    Attributes:
      token_rewards: ``{leaf_id: {interaction_id: float32 [output_len]}}`` branch-local rewards
        (a shared ancestor has one array per branch).
      turn_results: ``{leaf_id: (PRMTurnResult, ...)}``.
      branch_totals: ``{leaf_id: {scorer_name: total weighted reward of the branch}}``.
      metrics: a private ``MetricsAccumulator`` (namespace ``rollout`` or ``eval-rollout``) holding
        this session's metrics; merge it into a worker accumulator to publish.
    """

    token_rewards: dict[str, dict[str, np.ndarray]]
    turn_results: dict[str, tuple[PRMTurnResult, ...]]
    branch_totals: dict[str, dict[str, float]]
    metrics: MetricsAccumulator


# ----------------------------------------------------------------------------------------------
# runner
# ----------------------------------------------------------------------------------------------


class PRMRunner:
    """Owns (or borrows) scorers and turns branches into per-token process rewards.

    Args:
      config: ``PRMConfig`` or a mapping (``PRMConfig.from_dict``). With ``enabled: false`` nothing
        is built and scoring yields zeros. ``None`` means disabled, unless ``scorers`` are given.
      scorers: scorer *instances* to borrow (never closed by the runner). Give scorers either here
        or in ``config.scorers``, not both.

    The synchronous constructor builds owned scorers without rollback: if one fails, those already
    built are not closed. Async code should use ``await PRMRunner.create(...)``.
    """

    def __init__(self, config: PRMConfig | Mapping[str, Any] | None, scorers: Sequence[BaseScorer] | None = None):
        self._init_state(config, scorers)
        self._build(scorers)

    @classmethod
    async def create(
        cls, config: PRMConfig | Mapping[str, Any] | None, scorers: Sequence[BaseScorer] | None = None
    ) -> PRMRunner:
        """Build a runner; on any startup failure close the owned scorers already built (reverse
        order), then re-raise the original error. Ordinary cleanup failures are logged and added to
        the error as notes; cancellation during cleanup propagates. Borrowed scorers are untouched."""
        self = cls.__new__(cls)
        self._init_state(config, scorers)
        try:
            self._build(scorers)
        except Exception as err:
            await self._rollback(err)
            raise
        return self

    # -- construction ---------------------------------------------------------------------------
    def _init_state(self, config: PRMConfig | Mapping[str, Any] | None, borrowed: Sequence[BaseScorer] | None) -> None:
        # ``PRMRunner(None, scorers=[...])`` means "just these scorers"; a bare ``None`` means disabled.
        self.config = PRMConfig() if config is None and borrowed else as_prm_config(config)
        self._scorers: list[BaseScorer] = []
        self._owned: list[BaseScorer] = []
        self._closed: set[int] = set()
        self._schemas: dict[str, dict[tuple[str, str], tuple[str, tuple[str, ...]]]] = {}
        self._closing = False
        self._close_started = False
        self._close_done = asyncio.Event()

    def _build(self, borrowed: Sequence[BaseScorer] | None) -> None:
        borrowed = list(borrowed or ())
        if borrowed and self.config.scorers:
            raise ValueError("give scorers either in config.scorers (owned) or as scorers= instances (borrowed), not both")
        if not self.config.enabled:
            if borrowed:
                logger.info("PRM disabled (enabled: false): ignoring %d borrowed scorer(s)", len(borrowed))
            return
        for i, spec in enumerate(self.config.scorers):
            where = f"prm.scorers[{i}]"
            cls = resolve_scorer_class(spec.path, where=f"{where}.path")
            try:
                scorer = cls(weight=spec.weight, enabled=spec.enabled, **dict(spec.kwargs))
            except Exception as err:
                err.add_note(f"while constructing {where} ({spec.path})")
                raise
            self._owned.append(scorer)
            self._register(scorer, where)
        for j, scorer in enumerate(borrowed):
            if not isinstance(scorer, BaseScorer):
                raise TypeError(f"scorers[{j}] must be a BaseScorer instance, got {type(scorer).__name__}")
            self._register(scorer, f"scorers[{j}]")
        if not any(s.enabled for s in self._scorers):
            logger.info("PRMRunner has no enabled scorer: scoring yields zero rewards")

    def _register(self, scorer: BaseScorer, where: str) -> None:
        if any(s.name == scorer.name for s in self._scorers):
            raise ValueError(
                f"{where}: scorer name {scorer.name!r} is already used in this runner; names must be unique"
            )
        self._scorers.append(scorer)

    async def _close_owned(self) -> list[tuple[BaseScorer, Exception]]:
        """Close each owned scorer not closed yet, in reverse creation order, at most once.

        Ordinary failures are collected and returned; cancellation propagates."""
        failures: list[tuple[BaseScorer, Exception]] = []
        for scorer in reversed(self._owned):
            if id(scorer) in self._closed:
                continue
            self._closed.add(id(scorer))
            try:
                await scorer.aclose()
            except Exception as err:
                failures.append((scorer, err))
        return failures

    async def _rollback(self, err: BaseException) -> None:
        for scorer, cleanup_err in await self._close_owned():
            logger.error("closing scorer %r after a startup failure failed", scorer.name, exc_info=cleanup_err)
            err.add_note(f"cleanup of scorer {scorer.name!r} after the startup failure also failed: {describe(cleanup_err)}")
        self._closing = True
        self._close_started = True
        self._close_done.set()

    # -- introspection --------------------------------------------------------------------------
    @property
    def scorers(self) -> tuple[BaseScorer, ...]:
        """All scorers (owned then borrowed), including disabled ones."""
        return tuple(self._scorers)

    @property
    def active(self) -> bool:
        """True when at least one enabled scorer will run."""
        return any(s.enabled for s in self._scorers)

    @property
    def closing(self) -> bool:
        return self._closing

    def owns(self, scorer: BaseScorer) -> bool:
        return any(s is scorer for s in self._owned)

    # -- lifecycle ------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Close owned scorers (disabled ones too) in reverse creation order, each at most once.

        New ``run`` calls are refused from now on. A concurrent call waits for the same cleanup; a
        later call returns at once (no retry). Ordinary failures are logged, every owned scorer is
        still attempted, then they are raised together as an ``ExceptionGroup`` (to the caller
        that ran the cleanup). Cancellation propagates; interrupted hooks are not retried.
        """
        self._closing = True
        if self._close_started:
            await self._close_done.wait()
            return
        self._close_started = True
        errors: list[Exception] = []
        try:
            for scorer, err in await self._close_owned():
                logger.error("closing scorer %r failed", scorer.name, exc_info=err)
                errors.append(err)
        finally:
            self._close_done.set()
        if errors:
            raise ExceptionGroup(f"PRM scorer cleanup failed for {len(errors)} scorer(s)", errors)

    async def __aenter__(self) -> PRMRunner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("PRMRunner is closed (or closing): no new scoring runs are accepted")

    # -- scoring --------------------------------------------------------------------------------
    async def run(
        self,
        interactions: Iterable[Interaction],
        ctx: Mapping[str, Any] | None = None,
        *,
        is_eval: bool = False,
    ) -> RunResult:
        """Score the turns of one branch; returns ``{interaction_id: float32 [output_len]}``.

        Args:
          interactions: the branch's turns (any order; sorted parent-before-child). They receive the
            summed weighted rewards in ``token_rewards`` (added to what they already hold) only when
            every scorer succeeded.
          ctx: extra context for scorers. ``ctx["messages"]`` defaults to the last turn's
            conversation (its input plus output messages); the runner sets ``ctx["branch"]``,
            ``ctx["turn_index"]`` and ``ctx["is_eval"]``.
        Raises:
          ScoringRejected: a scorer returned ``None``, raised, or produced an invalid result.
          RuntimeError: the runner is closing.
          ValueError: malformed input (duplicate ids, non-token-backed turns, bad existing rewards).
        """
        self._check_open()
        ordered = order_interactions(interactions)
        base_ctx = dict(ctx or {})
        messages = base_ctx.get("messages")
        if messages is None:
            messages = branch_messages(ordered[-1:])
        base_ctx["is_eval"] = bool(is_eval)

        pending: dict[str, np.ndarray] = {}
        for it in ordered:
            if it.token_rewards is None:
                pending[it.id] = np.zeros((it.output_len,), dtype=np.float32)
            else:
                existing = np.asarray(it.token_rewards, dtype=np.float32)
                if existing.shape != (it.output_len,):
                    raise ValueError(
                        f"interaction {it.id!r} already holds token_rewards of shape {existing.shape}, "
                        f"expected ({it.output_len},)"
                    )
                if not np.isfinite(existing).all():
                    raise ValueError(f"interaction {it.id!r} already holds non-finite token_rewards")
                pending[it.id] = existing.copy()

        committed: list[PRMTurnResult] = []
        totals: dict[str, float] = {}
        if ordered:
            snapshot = BranchSnapshot(ordered, messages)
            for scorer in self._scorers:
                if not scorer.enabled:
                    continue
                results = await evaluate_branch(scorer, ordered, snapshot, base_ctx)
                reject_failures(scorer, ordered, results)
                turn_results = self._validate_and_commit(scorer, ordered, results, pending)
                committed.extend(turn_results)
                totals[scorer.name] = float(sum(r.reward for r in turn_results))

        out: dict[str, np.ndarray] = {}
        for it in ordered:
            it.token_rewards = pending[it.id]
            out[it.id] = pending[it.id].copy()
        return RunResult(out, tuple(committed), totals)

    def _validate_and_commit(
        self,
        scorer: BaseScorer,
        ordered: Sequence[Interaction],
        results: Sequence[Any],
        pending: dict[str, np.ndarray],
    ) -> list[PRMTurnResult]:
        name = scorer.name
        updates: list[tuple[str, np.ndarray]] = []
        turn_results: list[PRMTurnResult] = []
        seen: set[tuple[str, str, str]] = set()
        schemas: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        registered = self._schemas.get(name, {})
        for it, result in zip(ordered, results, strict=True):
            try:
                raw = turn_rewards(result, it.output_len)
                with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked below
                    contribution = raw * scorer.weight
                    contribution32 = contribution.astype(np.float32)
                    combined = pending[it.id] + contribution32
                if not (np.isfinite(contribution).all() and np.isfinite(contribution32).all()):
                    raise ValueError(f"reward is non-finite after weighting by {scorer.weight}")
                if not np.isfinite(combined).all():
                    raise ValueError("the summed token rewards became non-finite")
                for obs in result.observations:
                    self._check_observation(obs, it.id, seen, schemas, registered)
            except (TypeError, ValueError) as err:
                raise ScoringRejected(
                    f"scorer {name!r} gave an invalid result for turn {it.id!r}: {err}",
                    scorer=name,
                    interaction_ids=[it.id],
                    kind="invalid",
                ) from err
            updates.append((it.id, combined))
            turn_results.append(PRMTurnResult(name, it.id, float(contribution.mean()), result.observations))
        # Everything validated: commit contributions and bind newly seen metric schemas.
        bound = self._schemas.setdefault(name, {})
        for key, schema in schemas.items():
            bound.setdefault(key, schema)
        for iid, combined in updates:
            pending[iid] = combined
        return turn_results

    @staticmethod
    def _check_observation(
        obs: PRMMetricObservation,
        interaction_id: str,
        seen: set[tuple[str, str, str]],
        schemas: dict[tuple[str, str], tuple[str, tuple[str, ...]]],
        registered: Mapping[tuple[str, str], tuple[str, tuple[str, ...]]],
    ) -> None:
        if obs.scope == "turn" and obs.target_id != interaction_id:
            raise ValueError(
                f"turn observation {obs.metric_id!r} targets {obs.target_id!r}, expected its interaction {interaction_id!r}"
            )
        key = (obs.scope, obs.target_id, obs.metric_id)
        if key in seen:
            raise ValueError(f"duplicate observation {key}")
        seen.add(key)
        schema_key = (obs.scope, obs.metric_id)
        first = schemas.setdefault(schema_key, obs.schema)
        if first != obs.schema:
            raise ValueError(f"observation {schema_key} schema {obs.schema} differs from {first} in the same run")
        bound = registered.get(schema_key)
        if bound is not None and bound != obs.schema:
            raise ValueError(f"observation {schema_key} schema changed from {bound} to {obs.schema}")

    async def score_branches(
        self,
        tree: InteractionTree,
        ctx: Mapping[str, Any] | None = None,
        *,
        is_eval: bool = False,
        leaf_ids: Sequence[str] | None = None,
    ) -> SessionScores:
        """Score root-to-leaf branches of ``tree`` on clones, in leaf order: every leaf, or exactly
        ``leaf_ids`` (e.g. the leaves a trainer exports).

        The tree is never modified. Returns ``SessionScores`` only if every branch succeeded;
        otherwise raises ``ScoringRejected`` (with ``leaf_id``) for the whole session and publishes
        nothing. ``ctx["messages"]`` is set per branch to that branch's conversation. With
        ``advantage_shaping.mode == "process_weighted"`` a branch whose summed token rewards leave
        [0, 1] rejects the session (``kind="out_of_range"``): the learner would refuse the batch.
        """
        self._check_open()
        token_rewards: dict[str, dict[str, np.ndarray]] = {}
        turn_results: dict[str, tuple[PRMTurnResult, ...]] = {}
        totals: dict[str, dict[str, float]] = {}
        leaves = tree.leaves() if leaf_ids is None else [tree.get(i) for i in leaf_ids]
        weighted = self.config.advantage_shaping.mode == "process_weighted"
        for leaf in leaves:
            branch = tree.clone_branch(leaf.id)
            branch_ctx = dict(ctx or {})
            branch_ctx["messages"] = branch_messages(branch)
            branch_ctx["leaf_id"] = leaf.id
            try:
                result = await self.run(branch, branch_ctx, is_eval=is_eval)
                if weighted:
                    _check_unit_range(result)
            except ScoringRejected as err:
                raise ScoringRejected(
                    f"session rejected: branch ending at {leaf.id!r}: {err.reason}",
                    scorer=err.scorer,
                    interaction_ids=err.interaction_ids,
                    leaf_id=leaf.id,
                    kind=err.kind,
                ) from err
            token_rewards[leaf.id] = dict(result.token_rewards)
            turn_results[leaf.id] = result.turn_results
            totals[leaf.id] = result.branch_totals
        metrics = MetricsAccumulator(namespace_for(is_eval))
        for leaf_id in token_rewards:
            metrics.record_turn_results(turn_results[leaf_id])
            metrics.record_branch_totals(totals[leaf_id])
        return SessionScores(token_rewards, turn_results, totals, metrics)

    async def score_sessions(
        self,
        sessions: Sequence[tuple[InteractionTree, Mapping[str, Any] | None, Sequence[str] | None]],
        *,
        is_eval: bool = False,
    ) -> list[SessionScores | ScoringRejected]:
        """Score several sessions concurrently (at most ``config.max_concurrent_sessions`` at once),
        the branches of each in order (:meth:`score_branches`), each bounded by ``config.timeout_s``.

        ``sessions``: ``(tree, ctx, leaf_ids)`` per session. Returns, in the same order, each
        session's ``SessionScores`` or the ``ScoringRejected`` that rejected it (a timeout is one of
        ``kind="timeout"``; any other error of one session, e.g. malformed input, is a rejection of
        that session with the error as its cause). A failure never cancels the other sessions;
        cancelling the caller cancels them all.
        """
        self._check_open()
        limit = asyncio.Semaphore(self.config.max_concurrent_sessions)
        timeout = self.config.timeout_s

        async def one(tree, ctx, leaf_ids) -> SessionScores | ScoringRejected:
            async with limit:
                try:
                    async with asyncio.timeout(timeout):
                        return await self.score_branches(tree, ctx, is_eval=is_eval, leaf_ids=leaf_ids)
                except ScoringRejected as err:
                    return err
                except TimeoutError:
                    return ScoringRejected(f"session rejected: scoring took longer than {timeout} s", kind="timeout")
                except Exception as err:  # malformed input, a closing runner: this session only
                    rejected = ScoringRejected(f"session rejected: {type(err).__name__}: {err}")
                    rejected.__cause__ = err
                    return rejected

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(*s)) for s in sessions]
        return [t.result() for t in tasks]

    def __repr__(self) -> str:
        owned = {id(s) for s in self._owned}
        parts = [f"{s.name}{'' if id(s) in owned else '(borrowed)'}{'' if s.enabled else '(disabled)'}" for s in self._scorers]
        return f"PRMRunner([{', '.join(parts)}], closing={self._closing})"


def _check_unit_range(result: RunResult) -> None:
    """``process_weighted`` needs every token reward of the branch in [0, 1]."""
    for iid, rewards in result.token_rewards.items():
        bad = (rewards < 0.0) | (rewards > 1.0)
        if bad.any():
            raise ScoringRejected(
                f"turn {iid!r} has process rewards outside [0, 1] (min {rewards.min():g}, max {rewards.max():g}); "
                "prm.advantage_shaping.mode='process_weighted' needs them in [0, 1]",
                interaction_ids=[iid], kind="out_of_range",
            )
