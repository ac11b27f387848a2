"""The small async environment interface the tree builder drives (layer 4).

An environment instance is one episode's state. ``reset(task)`` returns the first observation,
``step(action_text)`` consumes the assistant's text and returns a :class:`StepResult`.
``clone()`` copies the episode state so that PaTR children can continue from their parent's state
(without replaying actions). ``system_prompt(task)`` gives the system message (or ``None``).
An environment the supervised warm start can teach also has ``optimal_actions()``: the moves that
begin a shortest solution from the current state (empty when it cannot be solved).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol, runtime_checkable

__all__ = ["Env", "StepResult", "ACTIONS", "DELTAS", "parse_action"]

#: The grid games' moves (gymnasium's FrozenLake action ids 0..3) and their (row, column) steps.
ACTIONS = ("Left", "Down", "Right", "Up")
DELTAS = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
_FENCE = re.compile(r"```[ \t]*([A-Za-z]+)[ \t]*\n?```")
_LOOKUP = {a.lower(): a for a in ACTIONS}


def parse_action(text: str) -> str | None:
    """The grid games' answer format: the move in the last fenced block of ``text`` (```` ```Left``` ````;
    case-insensitive; returned in canonical case), or ``None``."""
    blocks = _FENCE.findall(text or "")
    if not blocks:
        return None
    return _LOOKUP.get(blocks[-1].strip().lower())


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step returns.

    Attributes:
      observation: the text of the next user/tool message.
      reward: the step reward (the outcome reward of a branch is the sum over its steps).
      done: the episode ended (goal, hole, turn limit ...).
      info: JSON-like details; recorded on ``Interaction.env_state``. ``info["action"]`` (the
        parsed action, or ``None``) is what the loop-stop rule compares.
      role: the role of the observation message (``"user"`` or ``"tool"``).
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any]
    role: str = "user"


@runtime_checkable
class Env(Protocol):
    async def reset(self, task: Any) -> str: ...

    async def step(self, action_text: str) -> StepResult: ...

    def clone(self) -> Env: ...

    def system_prompt(self, task: Any) -> str | None: ...
