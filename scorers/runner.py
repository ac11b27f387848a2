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
import importlib
import logging
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rollout.types import Interaction, InteractionTree, branch_messages
from scorers._isolation import BranchSnapshot
from scorers.base import (
    BaseScorer,
    BaseTrajectoryScorer,
    PRMMetricObservation,
    PRMScorerResult,
    PRMTurnResult,
    ScoringRejected,
)
from scorers.config import PRMConfig, as_prm_config
from scorers.metrics import MetricsAccumulator, namespace_for

__all__ = [
    "PRMRunner",
    "RunResult",
    "SessionScores",
    "order_interactions",
    "resolve_scorer_class",
    "score_branch",
    "to_token_rewards",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def resolve_scorer_class(path: str, *, where: str = "scorer path") -> type[BaseScorer]:
    """Import ``package.module.Class`` (or ``package.module:Class``) and check it is a scorer."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{where} must be a non-empty dotted import path, got {path!r}")
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{where}={path!r} must look like package.module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        err.add_note(f"while resolving {where}={path!r}")
        raise
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{where}={path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, type) or not issubclass(obj, BaseScorer):
        raise TypeError(f"{where}={path!r} resolved to {obj!r}, which is not a BaseScorer subclass")
    return obj


def order_interactions(interactions: Iterable[Interaction]) -> list[Interaction]:
    """Stable parent-before-child order; checks ids are unique strings and turns are token-backed.

    Turns whose parent is not among ``interactions`` count as roots. Raises ``ValueError`` for a
    duplicate id, a missing model response (not token-backed) or a parent cycle, and
    ``ScoringRejected`` for a turn without output tokens (nothing to attach a reward to).
    """
    items = list(interactions)
    by_id: dict[str, Interaction] = {}
    for it in items:
        if not isinstance(it, Interaction):
            raise TypeError(f"expected rollout.types.Interaction, got {type(it).__name__}")
        if not isinstance(it.id, str) or not it.id:
            raise ValueError(f"interaction id must be a non-empty string, got {it.id!r}")
        if it.id in by_id:
            raise ValueError(f"duplicate interaction id {it.id!r}")
        if it.model_response is None:
            raise ValueError(
                f"interaction {it.id!r} has no model_response: process rewards need token-backed interactions"
            )
        by_id[it.id] = it
    for it in items:
        if it.output_len <= 0:
            raise ScoringRejected(
                f"interaction {it.id!r} has no output tokens to attach a process reward to",
                interaction_ids=[it.id],
            )
    ordered: list[Interaction] = []
    placed: set[str] = set()
    remaining = items
    while remaining:
        progressed = False
        rest = []
        for it in remaining:
            if it.parent_id is None or it.parent_id not in by_id or it.parent_id in placed:
                ordered.append(it)
                placed.add(it.id)
                progressed = True
            else:
                rest.append(it)
        if not progressed:
            raise ValueError(f"interaction parent links contain a cycle among {[it.id for it in rest]}")
        remaining = rest
    return ordered


def to_token_rewards(reward: Any, output_len: int) -> np.ndarray:
    """A raw scorer reward as ``float64 [output_len]``: scalars broadcast, arrays must match.

    Booleans are refused (return ``1.0`` / ``0.0``) so that a misplaced flag is not taken as a score.
    """
    if isinstance(reward, (bool, np.bool_)):
        raise TypeError(f"reward must be a real number or an array, got bool {reward!r} (return 1.0 / 0.0)")
    if isinstance(reward, numbers.Real):
        return np.full((output_len,), float(reward), dtype=np.float64)
    if reward is None or isinstance(reward, (str, bytes, Mapping)):
        raise TypeError(f"reward must be a real number or an array, got {type(reward).__name__}")
    try:
        arr = np.asarray(reward, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"reward must be a real number or an array, got {type(reward).__name__}: {err}") from None
    if arr.ndim == 0:
        return np.full((output_len,), float(arr), dtype=np.float64)
    if arr.shape != (output_len,):
        raise ValueError(f"dense reward has shape {arr.shape}, expected ({output_len},) (one per output token)")
    return arr.copy()


class _Failure:
    __slots__ = ("reason", "exc")

    def __init__(self, reason: str, exc: BaseException | None = None) -> None:
        self.reason = reason
        self.exc = exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _reject_failures(scorer: BaseScorer, ordered: Sequence[Interaction], results: Sequence[Any]) -> None:
    failed = [(it.id, r) for it, r in zip(ordered, results) if isinstance(r, _Failure)]
    if not failed:
        return
    details = "; ".join(f"{iid}: {f.reason}" for iid, f in failed[:5])
    more = f" (+{len(failed) - 5} more)" if len(failed) > 5 else ""
    cause = next((f.exc for _, f in failed if f.exc is not None), None)
    raise ScoringRejected(
        f"scorer {scorer.name!r} could not score {len(failed)}/{len(results)} turns: {details}{more}",
        scorer=scorer.name,
        interaction_ids=[iid for iid, _ in failed],
    ) from cause


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
            err.add_note(f"cleanup of scorer {scorer.name!r} after the startup failure also failed: {_describe(cleanup_err)}")
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
                if isinstance(scorer, BaseTrajectoryScorer):
                    results = await self._score_trajectory(scorer, ordered, snapshot, base_ctx)
                else:
                    results = await self._score_turns(scorer, ordered, snapshot, base_ctx)
                _reject_failures(scorer, ordered, results)
                turn_results = self._validate_and_commit(scorer, ordered, results, pending)
                committed.extend(turn_results)
                totals[scorer.name] = float(sum(r.reward for r in turn_results))

        out: dict[str, np.ndarray] = {}
        for it in ordered:
            it.token_rewards = pending[it.id]
            out[it.id] = pending[it.id].copy()
        return RunResult(out, tuple(committed), totals)

    async def _score_turns(
        self,
        scorer: BaseScorer,
        ordered: Sequence[Interaction],
        snapshot: BranchSnapshot,
        base_ctx: Mapping[str, Any],
    ) -> list[Any]:
        async def one(index: int) -> Any:
            try:
                interaction, call_ctx = snapshot.turn_inputs(index, base_ctx)
                result = await scorer.evaluate_result(interaction, call_ctx)
            except Exception as err:
                return _Failure(_describe(err), err)
            if result is None:
                return _Failure("returned None")
            return result

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i)) for i in range(len(ordered))]
        return [_Failure("scoring call was cancelled") if t.cancelled() else t.result() for t in tasks]

    async def _score_trajectory(
        self,
        scorer: BaseTrajectoryScorer,
        ordered: Sequence[Interaction],
        snapshot: BranchSnapshot,
        base_ctx: Mapping[str, Any],
    ) -> list[Any]:
        clones, call_ctx = snapshot.trajectory_inputs(base_ctx)
        ids = [it.id for it in clones]
        try:
            mapping = await scorer.evaluate_trajectory(clones, call_ctx)
        except Exception as err:
            raise ScoringRejected(
                f"trajectory scorer {scorer.name!r} raised {_describe(err)}", scorer=scorer.name, interaction_ids=ids
            ) from err
        if mapping is None:
            raise ScoringRejected(
                f"trajectory scorer {scorer.name!r} returned None for the whole trajectory",
                scorer=scorer.name,
                interaction_ids=ids,
            )
        if not isinstance(mapping, Mapping):
            raise ScoringRejected(
                f"trajectory scorer {scorer.name!r} must return a mapping {{interaction_id: reward}}, "
                f"got {type(mapping).__name__}",
                scorer=scorer.name,
            )
        known = set(ids)
        unknown = [k for k in mapping if k not in known]
        if unknown:
            raise ScoringRejected(
                f"trajectory scorer {scorer.name!r} returned unknown interaction ids {sorted(map(str, unknown))}",
                scorer=scorer.name,
            )
        results: list[Any] = []
        for it in clones:
            raw = mapping.get(it.id, 0.0)
            if raw is None:
                results.append(_Failure("returned None"))
                continue
            try:
                results.append(scorer.prepare_result(it, raw, call_ctx))
            except Exception as err:
                results.append(_Failure(_describe(err), err))
        return results

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
                if not isinstance(result, PRMScorerResult):
                    raise TypeError(
                        f"evaluate_result/prepare_result must give a PRMScorerResult or None, got {type(result).__name__}"
                    )
                raw = to_token_rewards(result.reward, it.output_len)
                if not np.isfinite(raw).all():
                    raise ValueError("reward has non-finite values")
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
    ) -> SessionScores:
        """Score every root-to-leaf branch of ``tree`` on clones, in leaf order.

        The tree is never modified. Returns ``SessionScores`` only if every branch succeeded;
        otherwise raises ``ScoringRejected`` (with ``leaf_id``) for the whole session and publishes
        nothing. ``ctx["messages"]`` is set per branch to that branch's conversation.
        """
        self._check_open()
        token_rewards: dict[str, dict[str, np.ndarray]] = {}
        turn_results: dict[str, tuple[PRMTurnResult, ...]] = {}
        totals: dict[str, dict[str, float]] = {}
        for leaf in tree.leaves():
            branch = tree.clone_branch(leaf.id)
            branch_ctx = dict(ctx or {})
            branch_ctx["messages"] = branch_messages(branch)
            branch_ctx["leaf_id"] = leaf.id
            try:
                result = await self.run(branch, branch_ctx, is_eval=is_eval)
            except ScoringRejected as err:
                raise ScoringRejected(
                    f"session rejected: branch ending at {leaf.id!r}: {err.reason}",
                    scorer=err.scorer,
                    interaction_ids=err.interaction_ids,
                    leaf_id=leaf.id,
                ) from err
            token_rewards[leaf.id] = dict(result.token_rewards)
            turn_results[leaf.id] = result.turn_results
            totals[leaf.id] = result.branch_totals
        metrics = MetricsAccumulator(namespace_for(is_eval))
        for leaf_id in token_rewards:
            metrics.record_turn_results(turn_results[leaf_id])
            metrics.record_branch_totals(totals[leaf_id])
        return SessionScores(token_rewards, turn_results, totals, metrics)

    def __repr__(self) -> str:
        owned = {id(s) for s in self._owned}
        parts = [f"{s.name}{'' if id(s) in owned else '(borrowed)'}{'' if s.enabled else '(disabled)'}" for s in self._scorers]
        return f"PRMRunner([{', '.join(parts)}], closing={self._closing})"


async def score_branch(
    scorer: BaseScorer,
    branch: Sequence[Interaction],
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    ctx: Mapping[str, Any] | None = None,
) -> float:
    """One scalar score for a (partial) branch, e.g. for PaTR expansion and pruning.

    Calls ``scorer.evaluate(branch[-1], ctx)`` on private copies with ``ctx["messages"]`` (default:
    the branch conversation) and ``ctx["branch"]``. A dense result is averaged over its tokens. The
    built-in scorers return values in [0, 1]. ``None``, an exception or a non-finite value raise
    ``ScoringRejected``; cancellation propagates. Trajectory scorers are not supported here.
    """
    if not branch:
        raise ValueError("branch must hold at least one interaction")
    if isinstance(scorer, BaseTrajectoryScorer):
        raise TypeError(f"{type(scorer).__name__} is a trajectory scorer; score_branch needs a per-turn scorer")
    base_ctx = dict(ctx or {})
    msgs = list(messages) if messages is not None else branch_messages(branch[-1:])
    snapshot = BranchSnapshot(list(branch), msgs)
    interaction, call_ctx = snapshot.turn_inputs(len(branch) - 1, base_ctx)
    try:
        raw = await scorer.evaluate(interaction, call_ctx)
    except Exception as err:
        raise ScoringRejected(f"scorer {scorer.name!r} raised {_describe(err)}", scorer=scorer.name) from err
    if raw is None:
        raise ScoringRejected(f"scorer {scorer.name!r} returned None", scorer=scorer.name)
    try:
        if isinstance(raw, (bool, np.bool_)):
            raise TypeError("got a bool (return 1.0 / 0.0)")
        value = float(np.mean(np.asarray(raw, dtype=np.float64)))
    except (TypeError, ValueError) as err:
        raise ScoringRejected(f"scorer {scorer.name!r} gave an invalid score: {err}", scorer=scorer.name) from err
    if not math.isfinite(value):
        raise ScoringRejected(f"scorer {scorer.name!r} gave a non-finite score {value}", scorer=scorer.name)
    return value
