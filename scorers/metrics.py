"""Process-reward metrics: names and a mergeable accumulator (layer 3, plain Python).

Metric keys (inside a namespace, ``rollout`` for training and ``eval-rollout`` for evaluation)::

    prm_turn_reward/<scorer>                                  mean over turns of the weighted
                                                              per-token contribution's mean
    prm_trajectory_reward/<scorer>                            mean over branches of the sum of
                                                              that branch's turn rewards
    prm_metric/<scope>/<scorer>/<metric>/<aggregation>        structured, unweighted observations

Scorer names and metric ids are URL-quoted so they never add path levels.

Each statistic keeps what merging needs: ``mean`` and ``rate`` keep ``(sum, count)`` so that
combining workers weights each by its number of observations; ``sum`` and ``count`` just add.
A session's metrics are built in a private accumulator and merged into a worker's only when every
branch of the session was scored (see ``PRMRunner.score_branches``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from scorers.base import PRMMetricObservation, PRMTurnResult

__all__ = [
    "EVAL_NAMESPACE",
    "NAMESPACES",
    "ROLLOUT_NAMESPACE",
    "MetricsAccumulator",
    "Stat",
    "metric_key",
    "namespace_for",
    "trajectory_reward_key",
    "turn_reward_key",
]

ROLLOUT_NAMESPACE = "rollout"
EVAL_NAMESPACE = "eval-rollout"
NAMESPACES = (ROLLOUT_NAMESPACE, EVAL_NAMESPACE)
STAT_KINDS = ("mean", "rate", "sum", "count")


def namespace_for(is_eval: bool) -> str:
    return EVAL_NAMESPACE if is_eval else ROLLOUT_NAMESPACE


def _seg(value: str) -> str:
    return quote(str(value), safe="-_.:")


def turn_reward_key(scorer: str) -> str:
    return f"prm_turn_reward/{_seg(scorer)}"


def trajectory_reward_key(scorer: str) -> str:
    return f"prm_trajectory_reward/{_seg(scorer)}"


def metric_key(scope: str, scorer: str, metric_id: str, aggregation: str) -> str:
    return f"prm_metric/{scope}/{_seg(scorer)}/{_seg(metric_id)}/{aggregation}"


@dataclasses.dataclass
class Stat:
    """One statistic. ``value``: mean/rate -> ``total / count`` (``nan`` when empty); sum/count -> ``total``."""

    kind: str
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if self.kind not in STAT_KINDS:
            raise ValueError(f"stat kind={self.kind!r}; allowed: {STAT_KINDS}")

    @property
    def value(self) -> float:
        if self.kind in ("mean", "rate"):
            return self.total / self.count if self.count else math.nan
        return self.total


class MetricsAccumulator:
    """A mergeable bag of named statistics within one namespace (``rollout`` or ``eval-rollout``).

    Not thread-safe; give each session or worker its own and ``merge`` them.
    """

    def __init__(self, namespace: str = ROLLOUT_NAMESPACE) -> None:
        if namespace not in NAMESPACES:
            raise ValueError(f"namespace={namespace!r}; allowed: {NAMESPACES}")
        self.namespace = namespace
        self._stats: dict[str, Stat] = {}

    # -- low-level adds -------------------------------------------------------------------------
    def _stat(self, key: str, kind: str) -> Stat:
        stat = self._stats.get(key)
        if stat is None:
            stat = self._stats[key] = Stat(kind)
        elif stat.kind != kind:
            raise ValueError(f"metric {key!r} is a {stat.kind} statistic, cannot add a {kind} value")
        return stat

    @staticmethod
    def _finite(key: str, value: float) -> float:
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"metric {key!r}: value must be finite, got {v}")
        return v

    def add_mean(self, key: str, value: float, count: int = 1, *, kind: str = "mean") -> None:
        """Add ``count`` observations whose mean is ``value`` (``kind`` ``mean`` or ``rate``)."""
        if kind not in ("mean", "rate"):
            raise ValueError(f"add_mean kind={kind!r}; allowed: ('mean', 'rate')")
        if count < 0:
            raise ValueError(f"metric {key!r}: count must be >= 0, got {count}")
        stat = self._stat(key, kind)
        stat.total += self._finite(key, value) * count
        stat.count += int(count)

    def add_sum(self, key: str, value: float, count: int = 1) -> None:
        stat = self._stat(key, "sum")
        stat.total += self._finite(key, value)
        stat.count += int(count)

    def add_count(self, key: str, n: int = 1) -> None:
        stat = self._stat(key, "count")
        stat.total += int(n)
        stat.count += 1

    # -- process-reward records -----------------------------------------------------------------
    def record_observation(self, scorer: str, obs: PRMMetricObservation) -> None:
        """One structured observation under each of its aggregations (unweighted)."""
        for agg in obs.aggregations:
            key = metric_key(obs.scope, scorer, obs.metric_id, agg)
            v = float(obs.value)
            if agg == "count":
                self.add_count(key, int(bool(obs.value)))
            elif agg == "rate":
                self.add_mean(key, v, kind="rate")
            elif agg == "sum":
                self.add_sum(key, v)
            else:
                self.add_mean(key, v)

    def record_turn_results(self, results: Iterable[PRMTurnResult]) -> None:
        """Weighted turn rewards and their observations."""
        for r in results:
            self.add_mean(turn_reward_key(r.scorer_name), r.reward)
            for obs in r.observations:
                self.record_observation(r.scorer_name, obs)

    def record_branch_totals(self, totals: Mapping[str, float]) -> None:
        """One branch's ``{scorer: sum of weighted turn rewards}``."""
        for scorer, total in totals.items():
            self.add_mean(trajectory_reward_key(scorer), total)

    # -- merge / export -------------------------------------------------------------------------
    def merge(self, *others: MetricsAccumulator) -> MetricsAccumulator:
        """Fold ``others`` into ``self`` (in place; returns ``self``). Namespaces must match."""
        for other in others:
            if other.namespace != self.namespace:
                raise ValueError(f"cannot merge namespace {other.namespace!r} into {self.namespace!r}")
            for key, s in other._stats.items():
                mine = self._stat(key, s.kind)
                mine.total += s.total
                mine.count += s.count
        return self

    def copy(self) -> MetricsAccumulator:
        return MetricsAccumulator(self.namespace).merge(self)

    def __len__(self) -> int:
        return len(self._stats)

    def __contains__(self, key: object) -> bool:
        return key in self._stats

    def stat(self, key: str) -> Stat:
        return self._stats[key]

    def summary(self, *, prefix: bool = True) -> dict[str, float]:
        """``{"<namespace>/<key>": value}`` (or bare keys with ``prefix=False``); empty stats skipped."""
        out = {}
        for key, s in sorted(self._stats.items()):
            if s.kind in ("mean", "rate") and s.count == 0:
                continue
            out[f"{self.namespace}/{key}" if prefix else key] = s.value
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able transport form that keeps counts (so a receiver can merge correctly)."""
        return {
            "namespace": self.namespace,
            "stats": {k: {"kind": s.kind, "total": s.total, "count": s.count} for k, s in self._stats.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetricsAccumulator:
        acc = cls(data["namespace"])
        for key, s in data["stats"].items():
            stat = Stat(s["kind"], float(s["total"]), int(s["count"]))
            if stat.count < 0:
                raise ValueError(f"metric {key!r}: count must be >= 0")
            acc._stats[key] = stat
        return acc

    def __repr__(self) -> str:
        return f"MetricsAccumulator({self.namespace!r}, {self.summary(prefix=False)})"
