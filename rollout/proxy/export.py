"""Exported rows, reward discounting, process-reward scoring of claimed sessions, ``prm_stats``.

**Concat export** (one row per leaf; a leaf is a completed record of the trajectory with no child
in it). A leaf's row is its root-to-leaf chain: ``tokens = leaf.input_tokens + leaf.output_tokens``;
each record ``j`` of the chain generated ``tokens[s_j : s_j + n_j]`` (``s_j`` its prompt length):
there the row has loss mask 1, the sampler's log-probs, turn id ``j``, the record's weight version
and (with scorers) its process rewards; elsewhere mask 0, log-prob 0, turn id -1, version -1,
process reward 0. A chain record whose tokens are not where the chain says (its prompt does not
extend into the leaf's row) is left masked out and counted in ``masked_turns`` (a warning).
Records whose parent is outside the exported trajectory are roots (their prompt is context).

**Individual export** (no scorers): one row per record, ``tokens = input + output``, the record's
(discounted) reward as the outcome.

**Discount** (the reference system's rule): over the trajectory's records in creation order,
backwards, ``R_i = r_i + discount * R_{i+1}`` (an unset reward counts 0). A concat row's outcome is
its leaf's ``R``; the records keep their raw rewards for the scorers (``Interaction.reward``).

**JSON rows** (``ProxyRow.to_json``), one object per row, all arrays of length ``L``, token-aligned::

    {"session_id": str, "group_id": str, "trajectory_id": int, "leaf_id": str,
     "interaction_ids": [str], "tokens": [int], "loss_mask": [0|1], "logprobs": [float],
     "turn_ids": [int], "versions": [int], "process_rewards": [float] | null,
     "outcome_reward": float, "truncated": bool, "masked_turns": int}

``ProxyRow.to_row_data(group_id)`` gives the ``jaxprm.RowData`` that ``jaxprm.pad_rows`` turns into a
``Batch`` (the same path as tree rollouts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxprm.learner.batch import RowData
from rollout.proxy.sessions import Record
from rollout.types import Interaction, InteractionTree
from scorers.base import PRMMetricObservation, PRMTurnResult
from scorers.metrics import MetricsAccumulator, namespace_for
from scorers.runner import PRMRunner, SessionScores

__all__ = ["ProxyRow", "PRMStats", "discounted_rewards", "trajectory_tree", "concat_rows", "individual_rows",
           "score_sessions", "rows_from_json", "prm_stats_metrics"]


@dataclasses.dataclass(eq=False)
class ProxyRow:
    """One exported row (token-aligned numpy arrays of length ``L``) and where it came from."""

    session_id: str
    group_id: str
    trajectory_id: int
    leaf_id: str
    interaction_ids: tuple[str, ...]
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    turn_ids: np.ndarray
    versions: np.ndarray
    process_rewards: np.ndarray | None
    outcome_reward: float
    truncated: bool
    masked_turns: int = 0

    def to_row_data(self, group_id: int) -> RowData:
        """The learner row (``jaxprm.RowData``) with batch group ``group_id``."""
        return RowData(tokens=self.tokens, loss_mask=self.loss_mask, logprobs=self.logprobs,
                       outcome_reward=self.outcome_reward, group_id=group_id, process_rewards=self.process_rewards,
                       turn_ids=self.turn_ids, truncated=self.truncated)

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id, "group_id": self.group_id, "trajectory_id": self.trajectory_id,
            "leaf_id": self.leaf_id, "interaction_ids": list(self.interaction_ids),
            "tokens": self.tokens.tolist(), "loss_mask": self.loss_mask.astype(np.int32).tolist(),
            "logprobs": self.logprobs.tolist(), "turn_ids": self.turn_ids.tolist(),
            "versions": self.versions.tolist(),
            "process_rewards": None if self.process_rewards is None else self.process_rewards.tolist(),
            "outcome_reward": self.outcome_reward, "truncated": self.truncated, "masked_turns": self.masked_turns,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProxyRow:
        pr = d.get("process_rewards")
        return cls(session_id=d["session_id"], group_id=d["group_id"], trajectory_id=int(d["trajectory_id"]),
                   leaf_id=d["leaf_id"], interaction_ids=tuple(d["interaction_ids"]),
                   tokens=np.asarray(d["tokens"], np.int32), loss_mask=np.asarray(d["loss_mask"], np.float32),
                   logprobs=np.asarray(d["logprobs"], np.float32), turn_ids=np.asarray(d["turn_ids"], np.int32),
                   versions=np.asarray(d["versions"], np.int32),
                   process_rewards=None if pr is None else np.asarray(pr, np.float32),
                   outcome_reward=float(d["outcome_reward"]), truncated=bool(d["truncated"]),
                   masked_turns=int(d.get("masked_turns", 0)))


def rows_from_json(rows: Iterable[Mapping[str, Any]]) -> list[ProxyRow]:
    return [ProxyRow.from_json(r) for r in rows]


def discounted_rewards(records: Sequence[Record], discount: float) -> dict[str, float]:
    """``{record id: R}`` with ``R_i = r_i + discount * R_{i+1}`` over creation order (unset = 0)."""
    out: dict[str, float] = {}
    acc = 0.0
    for rec in sorted(records, key=lambda r: r.seq, reverse=True):
        acc = acc * discount + (rec.reward or 0.0)
        out[rec.id] = acc
    return out


def trajectory_tree(records: Sequence[Record]) -> InteractionTree:
    """The trajectory as an ``InteractionTree`` (parents outside it make roots); responses shared."""
    ids = {r.id for r in records}
    tree = InteractionTree()
    for rec in sorted(records, key=lambda r: r.seq):
        parent = rec.parent.id if rec.parent is not None and rec.parent.id in ids else None
        tree.add(Interaction(id=rec.id, parent_id=parent, messages=rec.messages,
                             output_messages=[rec.output_message], model_response=rec.response,
                             reward=rec.reward, env_state=rec.env_state))
    return tree


def concat_rows(session_id: str, group_id: str, trajectory_id: int, records: Sequence[Record], *,
                discount: float, token_rewards: Mapping[str, Mapping[str, np.ndarray]] | None) -> list[ProxyRow]:
    """One row per leaf of the trajectory (see the module docstring). ``token_rewards``:
    ``{leaf_id: {interaction_id: float32 [output_len]}}`` from the runner, or ``None``."""
    by_id = {r.id: r for r in records}
    tree = trajectory_tree(records)
    outcome = discounted_rewards(records, discount)
    rows = []
    for leaf in tree.leaves():
        chain = tree.branch(leaf.id)
        last = leaf.model_response
        tokens = np.concatenate([last.input_tokens, last.output_tokens]).astype(np.int32)
        L = tokens.shape[0]
        mask = np.zeros(L, np.float32)
        logprobs = np.zeros(L, np.float32)
        turn_ids = np.full(L, -1, np.int32)
        versions = np.full(L, -1, np.int32)
        proc = np.zeros(L, np.float32) if token_rewards is not None else None
        branch_rewards = token_rewards.get(leaf.id, {}) if token_rewards is not None else {}
        masked = 0
        for j, it in enumerate(chain):
            r = it.model_response
            s, n = r.input_len, r.output_len
            if s + n > L or not np.array_equal(tokens[s:s + n], r.output_tokens) \
                    or not np.array_equal(tokens[:s], r.input_tokens):
                masked += 1
                continue
            mask[s:s + n] = 1.0
            logprobs[s:s + n] = r.output_logprobs
            turn_ids[s:s + n] = j
            versions[s:s + n] = by_id[it.id].version
            if proc is not None and it.id in branch_rewards:
                pr = np.asarray(branch_rewards[it.id], np.float32).reshape(-1)
                if pr.shape[0] != n:
                    raise ValueError(f"process rewards for {it.id!r} have length {pr.shape[0]}, output_len is {n}")
                proc[s:s + n] = pr
        rows.append(ProxyRow(session_id=session_id, group_id=group_id, trajectory_id=trajectory_id, leaf_id=leaf.id,
                             interaction_ids=tuple(it.id for it in chain), tokens=tokens, loss_mask=mask,
                             logprobs=logprobs, turn_ids=turn_ids, versions=versions, process_rewards=proc,
                             outcome_reward=float(outcome[leaf.id]), truncated=last.truncated, masked_turns=masked))
    return rows


def individual_rows(session_id: str, group_id: str, trajectory_id: int, records: Sequence[Record], *,
                    discount: float) -> list[ProxyRow]:
    """One row per record, outcome = its discounted reward."""
    outcome = discounted_rewards(records, discount)
    rows = []
    for rec in sorted(records, key=lambda r: r.seq):
        r = rec.response
        tokens = np.concatenate([r.input_tokens, r.output_tokens]).astype(np.int32)
        L, s = tokens.shape[0], r.input_len
        mask = np.zeros(L, np.float32)
        mask[s:] = 1.0
        logprobs = np.zeros(L, np.float32)
        logprobs[s:] = r.output_logprobs
        turn_ids = np.full(L, -1, np.int32)
        turn_ids[s:] = 0
        versions = np.full(L, -1, np.int32)
        versions[s:] = rec.version
        rows.append(ProxyRow(session_id=session_id, group_id=group_id, trajectory_id=trajectory_id, leaf_id=rec.id,
                             interaction_ids=(rec.id,), tokens=tokens, loss_mask=mask, logprobs=logprobs,
                             turn_ids=turn_ids, versions=versions, process_rewards=None,
                             outcome_reward=float(outcome[rec.id]), truncated=r.truncated))
    return rows


# ----------------------------------------------------------------------------------- scoring


@dataclasses.dataclass
class PRMStats:
    """``prm_stats`` of an export: per successfully scored session, its typed turn results and
    per-branch scorer totals. ``metrics()`` records them (with their observation counts) into a
    ``scorers.MetricsAccumulator``, as the receiver of the HTTP answer does with
    :func:`prm_stats_metrics`."""

    namespace: str
    sessions: dict[str, SessionScores]

    def metrics(self) -> MetricsAccumulator:
        acc = MetricsAccumulator(self.namespace)
        for sc in self.sessions.values():
            acc.merge(sc.metrics)
        return acc

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for sid, sc in self.sessions.items():
            turns = [{"scorer": t.scorer_name, "interaction_id": t.interaction_id, "reward": t.reward,
                      "observations": [dataclasses.asdict(o) for o in t.observations]}
                     for leaf in sc.turn_results for t in sc.turn_results[leaf]]
            out[sid] = {"turn_results": turns, "branch_totals": sc.branch_totals}
        return {"namespace": self.namespace, "sessions": out}


def prm_stats_metrics(prm_stats: Mapping[str, Any]) -> MetricsAccumulator:
    """Rebuild the metrics of a JSON ``prm_stats`` (turn rewards, observations, branch totals)."""
    acc = MetricsAccumulator(prm_stats["namespace"])
    for sess in prm_stats["sessions"].values():
        turns = [PRMTurnResult(t["scorer"], t["interaction_id"], float(t["reward"]),
                               tuple(PRMMetricObservation(**{**o, "aggregations": tuple(o["aggregations"])})
                                     for o in t["observations"]))
                 for t in sess["turn_results"]]
        acc.record_turn_results(turns)
        for totals in sess["branch_totals"].values():
            acc.record_branch_totals(totals)
    return acc


async def score_sessions(runner: PRMRunner, trees: Mapping[str, InteractionTree], ctxs: Mapping[str, Mapping[str, Any]],
                         *, is_eval: bool) -> tuple[PRMStats, dict[str, BaseException]]:
    """Score every session's tree through ``PRMRunner.score_sessions`` (sessions concurrently,
    bounded by the runner's config, each within its timeout; branches of a session in order, on
    clones). Returns the scores of the sessions that succeeded and the rejection of each that did
    not; a failure never cancels the other sessions. Cancelling the caller cancels all of them.
    """
    sids = list(trees)
    results = await runner.score_sessions([(trees[sid], ctxs.get(sid), None) for sid in sids], is_eval=is_eval)
    ok: dict[str, SessionScores] = {}
    failed: dict[str, BaseException] = {}
    for sid, res in zip(sids, results):
        (failed if isinstance(res, BaseException) else ok)[sid] = res
    return PRMStats(namespace_for(is_eval), ok), failed
