"""The small async environment interface the tree builder drives (layer 4).

An environment instance is one episode's state. ``reset(task)`` returns the first observation,
``step(action_text)`` consumes the assistant's text and returns a :class:`StepResult`.
``clone()`` copies the episode state so that PaTR children can continue from their parent's state
(without replaying actions). ``system_prompt(task)`` gives the system message (or ``None``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

__all__ = ["Env", "StepResult"]


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
