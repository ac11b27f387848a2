"""The scorer contract: base classes, typed results and monitoring observations (layer 3).

A scorer turns one generated turn (an ``rollout.types.Interaction``) into an *unweighted* process
reward: a scalar (broadcast over the turn's ``output_len`` generated tokens) or a dense
``[output_len]`` array. ``None`` or an exception means "cannot score" and rejects the whole
trajectory; an intentional zero must be returned as ``0.0``. The runner (``scorers.runner``) applies
the configured weight, validates and adds the contributions.

Inputs are read-only by contract. The runner hands every call private copies (see
``scorers.runner``), so a scorer that mutates its input changes nothing outside that call. Scorers
may be shared by concurrent sessions: keep per-request state inside the coroutine, never on ``self``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np

from rollout.types import Interaction

__all__ = [
    "AGGREGATIONS",
    "BOOLEAN_AGGREGATIONS",
    "NUMERIC_AGGREGATIONS",
    "SCOPES",
    "VALUE_TYPES",
    "BaseScorer",
    "BaseTrajectoryScorer",
    "PRMMetricObservation",
    "PRMScorerResult",
    "PRMTurnResult",
    "RawReward",
    "ScorerUnavailable",
    "ScoringRejected",
]

SCOPES = ("turn", "trajectory")
VALUE_TYPES = ("boolean", "float")
BOOLEAN_AGGREGATIONS = ("count", "rate")
NUMERIC_AGGREGATIONS = ("sum", "mean")
AGGREGATIONS = BOOLEAN_AGGREGATIONS + NUMERIC_AGGREGATIONS

#: What ``evaluate`` may return: a real scalar, a dense ``[output_len]`` array, or ``None`` (reject).
RawReward = float | np.ndarray | None


class ScorerUnavailable(RuntimeError):
    """A scorer's server is known to be down (its circuit breaker is open, ``scorers.breaker``): the
    call failed at once, without trying. Rejects its trajectory with kind ``scorer_unavailable``."""


class ScoringRejected(Exception):
    """A trajectory (or a whole session) could not be scored; nothing was committed or published.

    Attributes:
      reason: human-readable reason (also ``str(exc)``).
      scorer: name of the scorer that failed, if one did.
      interaction_ids: the turns whose scoring failed (empty when not turn-specific).
      leaf_id: the leaf of the failed branch when raised by ``PRMRunner.score_branches``.
      kind: why, for counting: ``"failed"`` (a scorer raised or returned ``None``), ``"invalid"`` (a
        result failed validation), ``"out_of_range"`` (``process_weighted`` rewards outside [0, 1]),
        ``"timeout"`` (the session's scoring ran past its bound), ``"scorer_unavailable"`` (the
        scorer's server is down: its circuit breaker failed the call at once).
    The original exception, if any, is chained as ``__cause__``.
    """

    KINDS = ("failed", "invalid", "out_of_range", "timeout", "scorer_unavailable")

    def __init__(
        self,
        reason: str,
        *,
        scorer: str | None = None,
        interaction_ids: Sequence[str] = (),
        leaf_id: str | None = None,
        kind: str = "failed",
    ) -> None:
        super().__init__(reason)
        if kind not in self.KINDS:
            raise ValueError(f"ScoringRejected kind={kind!r}; allowed: {self.KINDS}")
        self.reason = reason
        self.scorer = scorer
        self.interaction_ids = tuple(interaction_ids)
        self.leaf_id = leaf_id
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class PRMMetricObservation:
    """One unweighted monitoring observation produced by a scorer.

    Attributes:
      metric_id: non-empty metric name (URL-quoted when it becomes a metric key).
      scope: ``"turn"`` (about one interaction; ``target_id`` must be that interaction's id) or
        ``"trajectory"`` (about the branch; any non-empty target such as the leaf id).
      target_id: what the observation is about.
      value: ``bool`` when ``value_type == "boolean"``, else a finite real number.
      value_type: ``"boolean"`` or ``"float"``.
      aggregations: non-empty, unique; boolean metrics allow ``count`` (number of ``True``) and
        ``rate`` (fraction ``True``), numeric metrics allow ``sum`` and ``mean``.
    """

    metric_id: str
    scope: Literal["turn", "trajectory"]
    target_id: str
    value: float | bool
    value_type: Literal["boolean", "float"]
    aggregations: tuple[str, ...]

    def __post_init__(self) -> None:
        for key in ("metric_id", "target_id"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"PRMMetricObservation.{key} must be a non-empty string, got {value!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"PRMMetricObservation.scope={self.scope!r}; allowed: {SCOPES}")
        if self.value_type not in VALUE_TYPES:
            raise ValueError(f"PRMMetricObservation.value_type={self.value_type!r}; allowed: {VALUE_TYPES}")
        if isinstance(self.aggregations, str):
            raise TypeError("PRMMetricObservation.aggregations must be a sequence of names, not a string")
        aggs = tuple(self.aggregations)
        object.__setattr__(self, "aggregations", aggs)
        if not aggs or len(set(aggs)) != len(aggs):
            raise ValueError(f"PRMMetricObservation.aggregations must be non-empty and unique, got {aggs}")
        allowed = BOOLEAN_AGGREGATIONS if self.value_type == "boolean" else NUMERIC_AGGREGATIONS
        bad = [a for a in aggs if a not in allowed]
        if bad:
            raise ValueError(
                f"PRMMetricObservation.aggregations {bad} not allowed for a {self.value_type} metric; "
                f"allowed: {allowed}"
            )
        if self.value_type == "boolean":
            if not isinstance(self.value, (bool, np.bool_)):
                raise TypeError(f"boolean observation {self.metric_id!r} needs a bool value, got {self.value!r}")
            object.__setattr__(self, "value", bool(self.value))
        else:
            if isinstance(self.value, (bool, np.bool_)) or not isinstance(self.value, numbers.Real):
                raise TypeError(f"float observation {self.metric_id!r} needs a real number, got {self.value!r}")
            value = float(self.value)
            if not math.isfinite(value):
                raise ValueError(f"float observation {self.metric_id!r} must be finite, got {value}")
            object.__setattr__(self, "value", value)

    @property
    def schema(self) -> tuple[str, tuple[str, ...]]:
        """``(value_type, aggregations)``: must stay the same for a scorer's ``(scope, metric_id)``."""
        return (self.value_type, self.aggregations)


@dataclasses.dataclass(frozen=True)
class PRMScorerResult:
    """A raw (unweighted) reward for one turn plus its unweighted observations."""

    reward: float | np.ndarray
    observations: tuple[PRMMetricObservation, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.observations, (str, bytes)) or not isinstance(self.observations, Sequence):
            raise TypeError(
                f"PRMScorerResult.observations must be a sequence of PRMMetricObservation, "
                f"got {type(self.observations).__name__}"
            )
        obs = tuple(self.observations)
        for o in obs:
            if not isinstance(o, PRMMetricObservation):
                raise TypeError(
                    f"PRMScorerResult.observations must hold PRMMetricObservation, got {type(o).__name__}"
                )
        object.__setattr__(self, "observations", obs)


@dataclasses.dataclass(frozen=True)
class PRMTurnResult:
    """What the runner committed for one (scorer, turn).

    Attributes:
      scorer_name: the scorer's ``name``.
      interaction_id: the scored turn.
      reward: the mean over the turn's tokens of the *weighted* contribution (a metric value).
      observations: the scorer's unweighted observations for this turn.
    """

    scorer_name: str
    interaction_id: str
    reward: float
    observations: tuple[PRMMetricObservation, ...] = ()


def _check_weight(weight: Any) -> float:
    if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, numbers.Real):
        raise TypeError(f"weight must be a real number, got {weight!r}")
    w = float(weight)
    if not math.isfinite(w):
        raise ValueError(f"weight must be finite, got {w}")
    return w


class BaseScorer:
    """Base class for per-turn process-reward scorers.

    Subclasses set a non-empty class attribute ``name`` (unique within a runner; it names the
    metrics) and, when they read one environment's recorded states, ``env_name`` (the trainer
    refuses the scorer with another ``env.name``), consume their own keyword arguments and pass ``weight`` / ``enabled`` to
    ``super().__init__``; leftover keyword arguments are rejected with their names. A constructor
    checks its arguments and may read files, but opens no connection and starts no work (open
    clients on first use): the trainer builds each configured scorer once when it loads the config,
    to report a bad argument with its key before anything starts.

    Override ``evaluate`` (and optionally ``prepare_result`` or ``evaluate_result`` to attach
    observations) and, when the scorer owns resources such as HTTP clients, ``aclose``.
    """

    name: ClassVar[str] = ""
    env_name: ClassVar[str | None] = None

    def __init__(self, weight: float = 1.0, enabled: bool = True, **kwargs: Any) -> None:
        cls = type(self).__name__
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"{cls} must define a non-empty class attribute `name`")
        if kwargs:
            raise TypeError(f"{cls} got unknown keyword arguments {sorted(kwargs)}")
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"{cls}: enabled must be a bool, got {enabled!r}")
        self.weight = _check_weight(weight)
        self.enabled = bool(enabled)

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> RawReward:
        """Unweighted reward for ``interaction``: a scalar, an ``[output_len]`` array, or ``None``.

        ``ctx["messages"]`` is the branch's full conversation; ``ctx["branch"]`` (when present) the
        branch's interactions, parent before child, including ``interaction`` itself.
        """
        raise NotImplementedError(f"{type(self).__name__}.evaluate is not implemented")

    def prepare_result(
        self, interaction: Interaction, result: Any, ctx: Mapping[str, Any]
    ) -> PRMScorerResult:
        """Map one raw ``evaluate`` result to a ``PRMScorerResult`` (default: no observations).

        Override to attach observations; a structured raw result can be unpacked here without
        keeping request state on the (shared) scorer instance.
        """
        del interaction, ctx
        if isinstance(result, PRMScorerResult):
            return result
        return PRMScorerResult(reward=result)

    async def evaluate_result(
        self, interaction: Interaction, ctx: Mapping[str, Any]
    ) -> PRMScorerResult | None:
        """``evaluate`` then ``prepare_result`` in the same task; ``None`` propagates (reject)."""
        result = await self.evaluate(interaction, ctx)
        if result is None:
            return None
        return self.prepare_result(interaction, result, ctx)

    @classmethod
    def reward_range(cls, **kwargs: Any) -> tuple[float, float] | None:
        """The range of the *unweighted* reward this scorer returns when built with ``kwargs``, or
        ``None`` if it is not known in advance (the default). Lets a config be checked at load time
        (``process_weighted`` needs the weighted sum in [0, 1])."""
        del kwargs
        return None

    async def aclose(self) -> None:
        """Release resources owned by the scorer (default: nothing). Bound any I/O in here."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, weight={self.weight}, enabled={self.enabled})"


class BaseTrajectoryScorer(BaseScorer):
    """Base class for scorers that judge a whole branch jointly.

    ``evaluate_trajectory(interactions, ctx)`` receives the turns parent-before-child and returns a
    mapping ``{interaction_id: raw reward}`` (values as for ``evaluate``, or ready
    ``PRMScorerResult``s). Ids left out get ``0.0``; an id that is not one of the turns rejects the
    trajectory; a ``None`` value rejects that turn; returning ``None`` rejects every turn.
    """

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> RawReward:
        raise RuntimeError(
            f"{type(self).__name__} is a trajectory scorer: the runner calls evaluate_trajectory()"
        )

    async def evaluate_trajectory(
        self, interactions: Sequence[Interaction], ctx: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        raise NotImplementedError(f"{type(self).__name__}.evaluate_trajectory is not implemented")
