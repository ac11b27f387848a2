"""Process rewards for rolled-out groups (layer 4): every group is one scoring session.

``score_groups`` scores the exported leaves of each group with a ``scorers.PRMRunner`` (groups
concurrently, bounded by the runner's ``max_concurrent_sessions``; the branches of a group in order;
each group bounded by its ``timeout_s``) and returns, in group order, the groups whose every branch
was scored, each carrying its per-leaf token rewards (``GroupResult.process_rewards``), the
metrics of exactly those groups, and the rejected groups counted by reason. A rejected group is dropped as a whole (the spec's rule): none of its
branches is trained and none of its observations is published.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from rollout.groups import GroupResult
from scorers import MetricsAccumulator, PRMRunner, ScoringRejected, namespace_for

__all__ = ["ScoredGroups", "score_groups"]


@dataclasses.dataclass
class ScoredGroups:
    """``groups``: the groups kept, each carrying its process rewards; ``metrics``: their scoring
    metrics; ``rejected``: ``{kind: count}`` of the dropped groups; ``reasons``: ``(group_key, reason)``."""

    groups: list[GroupResult]
    metrics: MetricsAccumulator
    rejected: collections.Counter
    reasons: list[tuple[str, str]]

    @classmethod
    def concat(cls, parts: Sequence[ScoredGroups]) -> ScoredGroups:
        """The scoring of several shares of the groups as one (in order; metrics merged): what
        ``score_groups`` gives for their concatenation."""
        out = cls(groups=[], metrics=MetricsAccumulator(parts[0].metrics.namespace),
                  rejected=collections.Counter(), reasons=[])
        for p in parts:
            out.groups += p.groups
            out.metrics.merge(p.metrics)
            out.rejected.update(p.rejected)
            out.reasons += p.reasons
        return out


async def score_groups(runner: PRMRunner, groups: Sequence[GroupResult], *, is_eval: bool = False) -> ScoredGroups:
    """Score the training leaves (``group.leaves``, exactly what the export trains on) of every
    group; see the module docstring. Groups without leaves are passed over."""
    todo = [g for g in groups if g.leaves]
    results = await runner.score_sessions(
        [(g.tree, {"task": g.task}, [lf.leaf_id for lf in g.leaves]) for g in todo], is_eval=is_eval)
    out = ScoredGroups(groups=[], metrics=MetricsAccumulator(namespace_for(is_eval)),
                       rejected=collections.Counter(), reasons=[])
    for g, res in zip(todo, results, strict=True):
        if isinstance(res, ScoringRejected):
            out.rejected[res.kind] += 1
            out.reasons.append((g.group_key, res.reason))
            continue
        out.groups.append(g.with_process_rewards(res.token_rewards))
        out.metrics.merge(res.metrics)
    return out
