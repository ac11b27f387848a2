"""``FrozenLakeProgressScorer``: a progress heuristic in [0, 1] for FrozenLake branches.

It reads only what the rollout records on each ``Interaction`` (it never imports the environment):

- ``interaction.reward``: the step reward of the turn;
- ``interaction.env_state`` after the turn: ``distance`` (BFS shortest-path length from the current
  cell to the goal with holes blocked, ``-1`` when unreachable or in a hole), ``start_distance``
  (the same from the start cell), ``in_hole`` and ``success`` (booleans; other keys such as
  ``position``, ``done``, ``action``, ``valid`` are not needed).

Score of a turn (``w = reward_weight``)::

    success                      -> 1.0
    in_hole                      -> hole_score                      (default 0.0)
    otherwise                       w * clip(R / max_reward, 0, 1) + (1 - w) * progress
      R        = sum of the step rewards on the branch from the root through this turn
      progress = clip(1 - distance / start_distance, 0, 1)   (0 when distance < 0;
                 1 when start_distance == 0, i.e. the start is the goal)

``progress`` is 0 at the start cell (or farther away) and approaches 1 next to the goal. With the
standard FrozenLake reward (1 only on reaching the goal) ``R`` is 0 before success, so an unfinished
branch scores in ``[0, 1 - w]`` and a finished one 1.0. A hole is terminal failure: default 0.0.

``mode="delta"`` scores a turn by how much it changed that score instead (potential-based shaping,
Ng et al. 1999): ``score(after this turn) - score(after the previous turn)``, with the start state
scoring 0 (so the first turn's delta is its score). A step toward the goal is positive, a step away
or into a hole negative, a bump into the edge or an invalid answer 0; values lie in ``[-1, 1]``.
This is the form to use as a per-turn process reward for the learner (credit for each action);
``level`` (the default) is the form PaTR ranks branches by.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from rollout.types import Interaction
from scorers._trajectory import branch_prefix
from scorers.base import BaseScorer

__all__ = ["FrozenLakeProgressScorer", "frozenlake_progress_score"]


def _unit(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def frozenlake_progress_score(
    env_state: Mapping[str, Any],
    accumulated_reward: float,
    *,
    reward_weight: float = 0.5,
    max_reward: float = 1.0,
    hole_score: float = 0.0,
) -> float:
    """The formula of the module docstring for one recorded state (pure function)."""
    for key in ("distance", "start_distance"):
        if key not in env_state:
            raise ValueError(
                f"env_state lacks {key!r}: the FrozenLake rollout must record distance, start_distance, "
                f"in_hole and success on each interaction (got keys {sorted(env_state)})"
            )
    if env_state.get("success", False):
        return 1.0
    if env_state.get("in_hole", False):
        return hole_score
    distance = env_state["distance"]
    start = env_state["start_distance"]
    for key, v in (("distance", distance), ("start_distance", start)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"env_state[{key!r}] must be an int, got {v!r}")
    if distance < 0:
        progress = 0.0
    elif start <= 0:
        progress = 1.0 if distance == 0 else 0.0
    else:
        progress = min(max(1.0 - distance / start, 0.0), 1.0)
    if not math.isfinite(accumulated_reward):
        raise ValueError(f"accumulated reward must be finite, got {accumulated_reward}")
    reward_term = min(max(accumulated_reward / max_reward, 0.0), 1.0)
    return reward_weight * reward_term + (1.0 - reward_weight) * progress


class FrozenLakeProgressScorer(BaseScorer):
    """Per-turn FrozenLake progress score in [0, 1] (see the module docstring for the formula).

    Kwargs: ``reward_weight`` (w in [0, 1], default 0.5), ``max_reward`` (> 0, the reward that
    counts as full, default 1.0), ``hole_score`` (in [0, 1], default 0.0), ``mode`` (``"level"``,
    default, or ``"delta"``: the change of the score over this turn, in [-1, 1]).
    The accumulated reward is summed over ``ctx["branch"]`` up to this turn (just this turn when
    no branch is given; in delta mode the turn is then taken to be the first).
    """

    name = "frozenlake_progress"
    env_name = "frozenlake"

    @classmethod
    def reward_range(cls, mode: str = "level", **kwargs: Any) -> tuple[float, float]:
        return (0.0, 1.0) if mode == "level" else (-1.0, 1.0)

    def __init__(
        self, reward_weight: float = 0.5, max_reward: float = 1.0, hole_score: float = 0.0,
        mode: str = "level", **kwargs: Any
    ) -> None:
        if mode not in ("level", "delta"):
            raise ValueError(f"mode must be 'level' or 'delta', got {mode!r}")
        self.mode = mode
        self.reward_weight = _unit("reward_weight", reward_weight)
        self.hole_score = _unit("hole_score", hole_score)
        if isinstance(max_reward, bool) or not isinstance(max_reward, numbers.Real) or not max_reward > 0:
            raise ValueError(f"max_reward must be a number > 0, got {max_reward!r}")
        self.max_reward = float(max_reward)
        super().__init__(**kwargs)

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> float:
        prefix = branch_prefix(interaction, ctx)
        accumulated = float(sum(float(it.reward) for it in prefix if it.reward is not None))
        score = self._score(interaction.env_state, accumulated)
        if self.mode == "level":
            return score
        if len(prefix) < 2:
            return score  # the start state scores 0
        last = float(interaction.reward) if interaction.reward is not None else 0.0
        return score - self._score(prefix[-2].env_state, accumulated - last)

    def _score(self, env_state: Mapping[str, Any], accumulated: float) -> float:
        return frozenlake_progress_score(
            env_state,
            accumulated,
            reward_weight=self.reward_weight,
            max_reward=self.max_reward,
            hole_score=self.hole_score,
        )
