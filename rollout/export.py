"""Concat export: every leaf of every group becomes one row of a fixed-shape ``jaxprm.Batch`` (layer 4).

A row is the root-to-leaf token sequence, which (because every prompt extends the previous one) is
the last turn's prompt followed by its sampled tokens. Turn ``j`` of the branch generated the
tokens at ``[len(prompt_j), len(prompt_j) + output_len_j)``; there the row has loss mask 1, the
server's log-probs, turn id ``j`` and the scorers' process rewards (token-aligned); everything else
(prompt, env/tool text, end-of-turn tokens the client appended) has mask 0, log-prob 0, turn id -1.
``jaxprm.learner.batch.pad_rows`` then shifts the per-token fields once to prediction positions and pads
rows and length to buckets (padding rows have weight 0). Per turn the row also carries the tree
structure the tree-credit estimators read (``jaxprm.learner.tree_credit``): the interaction id
(rows that share a turn share it), the state the turn started from (``env_state["state"]``) and
the turn's reward.

``export_groups_packed`` (``rollout.export: tree_packed``) returns the same flat batch plus a
``jaxprm.PackedBatch``: each group's rows merged into one token trie, so a turn shared by several
leaves is forwarded once (``jaxprm.learner.packing``). Flat groups pack too: their leaves share the
prompt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import numpy as np

from jaxprm.learner.batch import DEFAULT_LEN_BUCKETS, DEFAULT_ROW_BUCKETS, Batch, RowData, pad_rows
from jaxprm.learner.packing import PackedBatch, pack_rows
from rollout.groups import GroupResult, LeafRecord, ProcessRewards  # noqa: F401  (re-exported)
from rollout.types import InteractionTree
from rollout.filters import (FILTER_COUNTERS, filter_mixed_or_penalized_all_wrong,
                             filter_mixed_or_penalized_all_wrong_mask_no_eos)

__all__ = ["ExportedRow", "leaf_row", "group_rows", "export_groups", "export_groups_packed", "filter_groups",
           "ProcessRewards", "FILTERS"]

"""``{leaf_id: {interaction_id: float32[output_len]}}`` as ``PRMRunner.score_branches`` returns."""

#: Group filters by name (``rollout.filter`` in the trainer): the spec's "mixed or penalized all-wrong".
FILTERS = {
    "mixed_or_penalized_all_wrong": filter_mixed_or_penalized_all_wrong,
    "mixed_or_penalized_all_wrong_mask_no_eos": filter_mixed_or_penalized_all_wrong_mask_no_eos,
}


@dataclasses.dataclass(frozen=True)
class ExportedRow:
    """Where a batch row came from."""

    row: int
    group: int
    group_key: str
    leaf_id: str
    status: str


def leaf_row(tree: InteractionTree, leaf: LeafRecord, group_id: int, *,
             process_rewards: Mapping[str, np.ndarray] | None = None) -> RowData:
    """One token-aligned ``RowData`` for the branch ending at ``leaf.leaf_id``.

    ``process_rewards`` maps interaction id -> per-token rewards ``[output_len]`` for this branch
    (missing ids get zeros). Raises ``ValueError`` if a turn's tokens are not where the prompt
    chain says (retokenization drift) or a reward array has the wrong length.
    """
    branch = tree.branch(leaf.leaf_id)
    last = branch[-1].model_response
    if last is None:
        raise ValueError(f"leaf {leaf.leaf_id!r} has no token-backed model response")
    tokens = np.concatenate([last.input_tokens, last.output_tokens]).astype(np.int32)
    L = tokens.shape[0]
    mask = np.zeros(L, np.float32)
    logprobs = np.zeros(L, np.float32)
    turn_ids = np.full(L, -1, np.int32)
    proc = np.zeros(L, np.float32) if process_rewards is not None else None
    for j, it in enumerate(branch):
        r = it.model_response
        if r is None:
            raise ValueError(f"interaction {it.id!r} has no token-backed model response")
        s, n = r.input_len, r.output_len
        if s + n > L or not np.array_equal(tokens[s:s + n], r.output_tokens) \
                or not np.array_equal(tokens[:s], r.input_tokens):
            raise ValueError(f"interaction {it.id!r}: its tokens are not a prefix of the leaf's sequence "
                             "(each prompt must extend the previous one)")
        mask[s:s + n] = 1.0
        logprobs[s:s + n] = r.output_logprobs
        turn_ids[s:s + n] = j
        if proc is not None and it.id in process_rewards:
            pr = np.asarray(process_rewards[it.id], np.float32).reshape(-1)
            if pr.shape[0] != n:
                raise ValueError(f"process rewards for {it.id!r} have length {pr.shape[0]}, output_len is {n}")
            proc[s:s + n] = pr
    turn_rewards = np.array([it.reward for it in branch], np.float32)
    turn_rewards[-1] += float(leaf.outcome_reward) - float(turn_rewards.sum())  # e.g. a pruned branch's forfeit
    return RowData(tokens=tokens, loss_mask=mask, logprobs=logprobs, outcome_reward=float(leaf.outcome_reward),
                   group_id=group_id, process_rewards=proc, turn_ids=turn_ids, truncated=bool(leaf.truncated),
                   turn_nodes=[it.id for it in branch], turn_states=_start_states(branch), turn_rewards=turn_rewards)


def _start_states(branch) -> list[str | None]:
    """Per turn, a key of the state it started from: the task's start for the first turn, then the
    previous step's ``env_state["state"]`` (``None`` where the env does not report one)."""
    keys: list[str | None] = ["start"]
    for it in branch[:-1]:
        state = (it.env_state or {}).get("state")
        keys.append(None if state is None else json.dumps(state, sort_keys=True))
    return keys


def group_rows(group: GroupResult, group_id: int) -> list[RowData]:
    """Rows for every leaf of ``group.leaves`` (the training group), with the group's process
    rewards when it carries them."""
    rows, process_rewards = [], group.process_rewards
    for leaf in group.leaves:
        pr = None
        if process_rewards is not None:
            if leaf.leaf_id not in process_rewards:
                raise KeyError(f"process rewards have no entry for leaf {leaf.leaf_id!r} of group {group.group_key!r}")
            pr = process_rewards[leaf.leaf_id]
        rows.append(leaf_row(group.tree, leaf, group_id, process_rewards=pr))
    return rows


def export_groups(groups: Sequence[GroupResult], *, row_buckets: Sequence[int] = DEFAULT_ROW_BUCKETS, len_buckets: Sequence[int] = DEFAULT_LEN_BUCKETS,
                  min_rows: int = 0, min_len: int = 0, max_len: int | None = None,
                  skip_empty: bool = True) -> tuple[Batch, list[ExportedRow]]:
    """Export groups to one bucketed ``Batch``; group ``i`` of the batch gets group id ``i``.

    Args:
    Each group's process rewards are the ones it carries (``GroupResult.process_rewards``).

      row_buckets / len_buckets / min_rows / min_len: passed to ``pad_rows`` (few distinct shapes).
      max_len: raise if a row is longer (rather than silently compile a huge shape).
      skip_empty: groups with no leaves (possible under ``best_n``) are skipped; else an error.

    Returns the batch and, per real row, where it came from.
    """
    rows, meta = _export_rows(groups, max_len, skip_empty)
    batch = pad_rows(rows, row_buckets=row_buckets, len_buckets=len_buckets, min_rows=min_rows, min_len=min_len)
    return batch, meta


def export_groups_packed(
    groups: Sequence[GroupResult], *, row_buckets: Sequence[int] = DEFAULT_ROW_BUCKETS, len_buckets: Sequence[int] = DEFAULT_LEN_BUCKETS,
    min_rows: int = 0, min_len: int = 0, max_len: int | None = None, skip_empty: bool = True,
    packed_row_buckets: Sequence[int] = DEFAULT_ROW_BUCKETS, packed_len_buckets: Sequence[int] = DEFAULT_LEN_BUCKETS,
    packed_min_rows: int = 0, trees_per_row: int | None = None,
) -> tuple[Batch, PackedBatch, list[ExportedRow]]:
    """``export_groups`` plus the tree-packed layout of the same rows (one trie per group).

    The flat batch is what ``compute_advantages`` reads; the ``PackedBatch`` (rows and length
    bucketed by ``packed_row_buckets`` / ``packed_len_buckets``, at least ``packed_min_rows`` rows,
    several groups per packed row when they fit unless ``trees_per_row`` caps it) is what the model
    forwards; its ``flat_index`` maps the flat batch's prediction positions to packed tokens.
    """
    rows, meta = _export_rows(groups, max_len, skip_empty)
    batch = pad_rows(rows, row_buckets=row_buckets, len_buckets=len_buckets, min_rows=min_rows, min_len=min_len)
    trees: dict[int, list[int]] = {}
    for m in meta:
        trees.setdefault(m.group, []).append(m.row)
    packed = pack_rows(rows, flat_shape=batch.shape, trees=list(trees.values()), row_buckets=packed_row_buckets,
                       len_buckets=packed_len_buckets, min_rows=packed_min_rows, trees_per_row=trees_per_row)
    return batch, packed, meta


def _export_rows(groups, max_len, skip_empty) -> tuple[list[RowData], list[ExportedRow]]:
    rows: list[RowData] = []
    meta: list[ExportedRow] = []
    gid = 0
    for g in groups:
        if not g.leaves:
            if skip_empty:
                continue
            raise ValueError(f"group {g.group_key!r} has no leaves")
        for leaf, row in zip(g.leaves, group_rows(g, gid)):
            if max_len is not None and len(row.tokens) > max_len:
                raise ValueError(f"leaf {leaf.leaf_id!r} has {len(row.tokens)} tokens > max_len={max_len}")
            meta.append(ExportedRow(row=len(rows), group=gid, group_key=g.group_key, leaf_id=leaf.leaf_id,
                                    status=leaf.status))
            rows.append(row)
        gid += 1
    if not rows:
        raise ValueError("nothing to export: every group is empty")
    return rows, meta


def filter_groups(groups: Sequence[GroupResult], name: str, counters: dict[str, int]) -> list[GroupResult]:
    """Apply the group filter ``name`` (a key of :data:`FILTERS`) to each group's training leaves:
    outcome reward, the branch's process rewards (its turns' arrays concatenated, from the rewards
    the group carries) and whether the last response was truncated. Returns the kept groups;
    ``counters`` gets the reference's counters (``scorers.FILTER_COUNTERS``, every one present, zero
    when unused)."""
    fn = FILTERS[name]
    for key in FILTER_COUNTERS:
        counters.setdefault(key, 0)
    kept = []
    for g in groups:
        pr, samples = g.process_rewards, []
        for lf in g.leaves:
            tr = None
            if pr is not None and lf.leaf_id in pr:
                parts = [np.asarray(v, np.float32) for v in pr[lf.leaf_id].values()]
                tr = np.concatenate(parts) if parts else None
            samples.append({"reward": lf.outcome_reward, "token_rewards": tr, "truncated": lf.truncated})
        if fn(samples, counters=counters):
            kept.append(g)
    return kept
