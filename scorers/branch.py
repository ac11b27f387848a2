"""Scoring one branch: the single path every caller goes through (layer 3).

Two callers score branches: the runner at export time (``PRMRunner.run``: every turn of a finished
branch becomes per-token process rewards) and PaTR at its checkpoints (:func:`score_branch`: one
number in [0, 1] for a partial branch). Both use the functions here, so both get the same
guarantees:

- **isolation**: every scorer call works on private inputs (``scorers._isolation``), so a scorer
  that mutates what it was given changes nothing outside its call;
- **validation**: a result must be a ``PRMScorerResult`` (or a raw reward the scorer's
  ``prepare_result`` accepts) whose reward is a real scalar or a dense ``[output_len]`` array of
  finite values (booleans refused); ``None`` or an exception is a failure;
- **commit after validate**: callers see numbers only after every requested turn validated.
"""

from __future__ import annotations

import asyncio
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rollout.types import Interaction, branch_messages
from scorers._isolation import BranchSnapshot
from scorers.base import BaseScorer, BaseTrajectoryScorer, PRMScorerResult, ScorerUnavailable, ScoringRejected

__all__ = [
    "TurnFailure",
    "describe",
    "evaluate_branch",
    "order_interactions",
    "reject_failures",
    "score_branch",
    "to_token_rewards",
    "turn_rewards",
]


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
                interaction_ids=[it.id], kind="invalid",
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


class TurnFailure:
    """A turn whose scorer call failed: ``reason`` (text) and the exception, if one was raised."""

    __slots__ = ("reason", "exc")

    def __init__(self, reason: str, exc: BaseException | None = None) -> None:
        self.reason = reason
        self.exc = exc


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def evaluate_branch(
    scorer: BaseScorer,
    ordered: Sequence[Interaction],
    snapshot: BranchSnapshot,
    base_ctx: Mapping[str, Any],
    *,
    indices: Sequence[int] | None = None,
) -> list[PRMScorerResult | TurnFailure | Any]:
    """Call ``scorer`` on private copies of the turns ``indices`` (default all) of one branch.

    A per-turn scorer is called once per requested turn, concurrently
    (``evaluate_result(interaction, ctx)``); a trajectory scorer once for the whole branch
    (``evaluate_trajectory``), its per-turn values mapped by ``prepare_result``. Returns one entry per
    requested turn: the scorer's result, or a :class:`TurnFailure` for ``None`` / an exception.
    Raises ``ScoringRejected`` when a trajectory scorer fails as a whole.
    """
    idx = list(range(len(ordered))) if indices is None else list(indices)
    if isinstance(scorer, BaseTrajectoryScorer):
        return await _evaluate_trajectory(scorer, ordered, snapshot, base_ctx, idx)

    async def one(index: int) -> Any:
        try:
            interaction, call_ctx = snapshot.turn_inputs(index, base_ctx)
            result = await scorer.evaluate_result(interaction, call_ctx)
        except Exception as err:
            return TurnFailure(describe(err), err)
        if result is None:
            return TurnFailure("returned None")
        return result

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(i)) for i in idx]
    return [TurnFailure("scoring call was cancelled") if t.cancelled() else t.result() for t in tasks]


async def _evaluate_trajectory(
    scorer: BaseTrajectoryScorer,
    ordered: Sequence[Interaction],
    snapshot: BranchSnapshot,
    base_ctx: Mapping[str, Any],
    idx: Sequence[int],
) -> list[Any]:
    clones, call_ctx = snapshot.trajectory_inputs(base_ctx)
    ids = [it.id for it in clones]
    try:
        mapping = await scorer.evaluate_trajectory(clones, call_ctx)
    except Exception as err:
        raise ScoringRejected(
            f"trajectory scorer {scorer.name!r} raised {describe(err)}", scorer=scorer.name, interaction_ids=ids
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
            scorer=scorer.name, kind="invalid",
        )
    known = set(ids)
    unknown = [k for k in mapping if k not in known]
    if unknown:
        raise ScoringRejected(
            f"trajectory scorer {scorer.name!r} returned unknown interaction ids {sorted(map(str, unknown))}",
            scorer=scorer.name, kind="invalid",
        )
    results: list[Any] = []
    for i in idx:
        it = clones[i]
        raw = mapping.get(it.id, 0.0)
        if raw is None:
            results.append(TurnFailure("returned None"))
            continue
        try:
            results.append(scorer.prepare_result(it, raw, call_ctx))
        except Exception as err:
            results.append(TurnFailure(describe(err), err))
    return results


def reject_failures(scorer: BaseScorer, ordered: Sequence[Interaction], results: Sequence[Any]) -> None:
    """Raise ``ScoringRejected`` (naming the failed turns, the first exception chained) if any
    entry of ``results`` (aligned with ``ordered``) is a :class:`TurnFailure`."""
    failed = [(it.id, r) for it, r in zip(ordered, results) if isinstance(r, TurnFailure)]
    if not failed:
        return
    details = "; ".join(f"{iid}: {f.reason}" for iid, f in failed[:5])
    more = f" (+{len(failed) - 5} more)" if len(failed) > 5 else ""
    cause = next((f.exc for _, f in failed if f.exc is not None), None)
    down = any(isinstance(f.exc, ScorerUnavailable) for _, f in failed)
    raise ScoringRejected(
        f"scorer {scorer.name!r} could not score {len(failed)}/{len(results)} turns: {details}{more}",
        scorer=scorer.name,
        interaction_ids=[iid for iid, _ in failed],
        kind="scorer_unavailable" if down else "failed",
    ) from cause


def turn_rewards(result: Any, output_len: int) -> np.ndarray:
    """The validated raw (unweighted) reward of one turn as ``float64 [output_len]``.

    ``result`` must be a ``PRMScorerResult`` whose reward is a real scalar (broadcast) or a dense
    array of exactly ``[output_len]`` finite values. Raises ``TypeError`` / ``ValueError``.
    """
    if not isinstance(result, PRMScorerResult):
        raise TypeError(
            f"evaluate_result/prepare_result must give a PRMScorerResult or None, got {type(result).__name__}"
        )
    raw = to_token_rewards(result.reward, output_len)
    if not np.isfinite(raw).all():
        raise ValueError("reward has non-finite values")
    return raw


async def score_branch(
    scorer: BaseScorer,
    branch: Sequence[Interaction],
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    ctx: Mapping[str, Any] | None = None,
) -> float:
    """One scalar for a (partial) branch, for PaTR expansion and pruning:
    ``mean_t r_t`` over the output tokens of the branch's last turn, ``r`` the scorer's validated
    unweighted reward for that turn (:func:`turn_rewards`).

    Goes through the same path as export-time scoring (:func:`evaluate_branch` on private copies,
    then validation), with ``ctx["messages"]`` (default: the branch conversation) and
    ``ctx["branch"]``. A trajectory scorer is called on the whole branch and its value for the last
    turn is used. ``None``, an exception, a bool, a wrong shape or a non-finite value raise
    ``ScoringRejected``; cancellation propagates. Range checks (PaTR needs [0, 1]) are the caller's.
    """
    ordered = order_interactions(branch)
    if not ordered:
        raise ValueError("branch must hold at least one interaction")
    msgs = list(messages) if messages is not None else branch_messages(ordered[-1:])
    snapshot = BranchSnapshot(ordered, msgs)
    last = len(ordered) - 1
    (result,) = await evaluate_branch(scorer, ordered, snapshot, dict(ctx or {}), indices=[last])
    reject_failures(scorer, ordered[last:], [result])
    try:
        raw = turn_rewards(result, ordered[last].output_len)
    except (TypeError, ValueError) as err:
        raise ScoringRejected(f"scorer {scorer.name!r} gave an invalid score: {err}", scorer=scorer.name,
                              interaction_ids=[ordered[last].id], kind="invalid") from err
    return float(raw.mean())
