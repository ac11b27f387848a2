"""``SokobanProgressScorer``: how much of a Sokoban level a branch has solved, in [0, 1].

It reads only what the rollout records on each ``Interaction`` (it never imports the environment):
``interaction.env_state`` after the turn holds ``distance`` (the solver's fewest moves left, ``-1``
once the level can no longer be solved), ``start_distance`` (the same at the start), ``dead`` and
``success`` (see ``rollout.envs.sokoban``). The environment's solver labels every state of a level
in one search, cached per level, so a repeated state costs a dictionary lookup and the scorer
itself computes nothing but the formula::

    success                  -> 1.0
    dead (distance < 0)      -> 0.0
    otherwise                   clip(1 - distance / start_distance, 0, 1)

The start state scores 0 and a state one move from the solution ``1 - 1 / start_distance``; along
an optimal plan the score rises by ``1 / start_distance`` a move. ``mode="delta"`` scores a turn by
the change of that score over the turn (potential-based shaping, with the start state at 0): a
move toward the solution is positive, one away from it or into a dead state negative, a blocked
move or an invalid answer 0; values lie in ``[-1, 1]``. ``level`` (the default) is the form PaTR
ranks branches by, ``delta`` the form to use as a per-turn process reward.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from rollout.types import Interaction
from scorers._trajectory import branch_prefix
from scorers.base import BaseScorer

__all__ = ["SokobanProgressScorer", "sokoban_progress_score"]


def sokoban_progress_score(env_state: Mapping[str, Any]) -> float:
    """The formula of the module docstring for one recorded state (pure function)."""
    for key in ("distance", "start_distance"):
        value = env_state.get(key)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(
                f"env_state[{key!r}] must be an int (the Sokoban rollout records distance, start_distance, dead "
                f"and success on each interaction), got {value!r} (keys {sorted(env_state)})")
    if env_state.get("success", False):
        return 1.0
    distance, start = int(env_state["distance"]), int(env_state["start_distance"])
    if distance < 0 or env_state.get("dead", False):
        return 0.0
    if start <= 0:
        return 1.0 if distance == 0 else 0.0
    return min(max(1.0 - distance / start, 0.0), 1.0)


class SokobanProgressScorer(BaseScorer):
    """Per-turn Sokoban progress (see the module docstring). Kwargs: ``mode`` (``"level"``, default,
    or ``"delta"``). In delta mode the previous state is the branch's turn before this one
    (``ctx["branch"]``; without one the turn is taken to be the first)."""

    name = "sokoban_progress"
    env_name = "sokoban"

    @classmethod
    def reward_range(cls, mode: str = "level", **kwargs: Any) -> tuple[float, float]:
        return (0.0, 1.0) if mode == "level" else (-1.0, 1.0)

    def __init__(self, mode: str = "level", **kwargs: Any) -> None:
        if mode not in ("level", "delta"):
            raise ValueError(f"mode must be 'level' or 'delta', got {mode!r}")
        self.mode = mode
        super().__init__(**kwargs)

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> float:
        score = sokoban_progress_score(interaction.env_state)
        if self.mode == "level":
            return score
        prefix = branch_prefix(interaction, ctx)
        if len(prefix) < 2:
            return score  # the start state scores 0
        return score - sokoban_progress_score(prefix[-2].env_state)
