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
from collections.abc import Callable, Hashable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Env", "StepResult", "ACTIONS", "DELTAS", "OPPOSITE", "parse_action", "GridGame", "INVALID_ANSWER", "draw_tasks"]

#: The grid games' moves (gymnasium's FrozenLake action ids 0..3) and their (row, column) steps.
ACTIONS = ("Left", "Down", "Right", "Up")
DELTAS = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
OPPOSITE = {"Left": "Right", "Right": "Left", "Up": "Down", "Down": "Up"}
_FENCE = re.compile(r"```[ \t]*([A-Za-z]+)[ \t]*\n?```")
_LOOKUP = {a.lower(): a for a in ACTIONS}
INVALID_ANSWER = "Invalid answer. Reply with exactly one move in a fenced block: ```Left```, ```Down```, ```Right``` or ```Up```."


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
    """An episode. Optional: ``forfeit_reward() -> float``, the reward charged when a rollout stops
    the episode before it ended (``rollout.branches.Branch.stop``; 0 when absent); ``info["state"]``
    of a step, a JSON value that identifies the state it reached (turns that start from equal
    states form an anchor-state step group; without it a turn has no step group)."""

    async def reset(self, task: Any) -> str: ...

    async def step(self, action_text: str) -> StepResult: ...

    def clone(self) -> Env: ...

    def system_prompt(self, task: Any) -> str | None: ...


class GridGame:
    """What the grid games' episodes share: the system prompt, the invalid-answer rule, the turn
    count and how a step ends. A subclass's ``reset`` sets ``task`` (with ``max_turns``) and calls
    :meth:`_start`; its ``step`` calls :meth:`_next_turn`, plays the move and :meth:`_end_turn`;
    :meth:`_observation` is the board and the question shown while the episode goes on.

    ``invalid_ends_episode``: an answer without a valid fenced move ends the episode instead of
    being a no-op turn."""

    def __init__(self, system_prompt: str | None, *, invalid_ends_episode: bool = False) -> None:
        self._system_prompt = system_prompt
        self.invalid_ends_episode = invalid_ends_episode
        self.task: Any = None
        self.turn = 0
        self.done = False
        self.start_distance = -1

    def system_prompt(self, task: Any) -> str | None:
        return self._system_prompt

    def forfeit_reward(self) -> float:
        """The reward charged when the episode is stopped now, before it ended (a rollout prunes
        the branch, stops a loop, runs out of context): what playing out the turns left without
        progress would earn. 0 here (no step penalty); games with one override it."""
        return 0.0

    def _start(self, task: Any, task_type: type) -> None:
        if not isinstance(task, task_type):
            raise TypeError(f"task must be a {task_type.__name__}, got {type(task).__name__}")
        self.task, self.turn, self.done = task, 0, False

    def _copy_into(self, other: GridGame) -> GridGame:
        """``other`` (a fresh episode of the same game) with this episode's turn state."""
        other.task, other.turn, other.done, other.start_distance = self.task, self.turn, self.done, self.start_distance
        return other

    def _next_turn(self) -> None:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.turn += 1

    def _observation(self) -> str:
        raise NotImplementedError

    def _end_turn(self, msg: str, action: str | None, *, ended: bool) -> tuple[str, bool]:
        """Close a turn whose move ``ended`` the episode (or not): an invalid answer may end it too,
        and the turn limit truncates it. Returns the observation text and ``truncated``."""
        ended_invalid = action is None and self.invalid_ends_episode
        truncated = not (ended or ended_invalid) and self.turn >= self.task.max_turns
        self.done = ended or ended_invalid or truncated
        if not self.done:
            msg += f"\n{self._observation()}"
        elif truncated:
            msg += " Out of turns."
        elif ended_invalid:
            msg += " The episode is over."
        return msg, truncated


def draw_tasks(generate: Callable[[], Hashable], make: Callable[[Any, str, int], Any], n_train: int, n_eval: int,
               what: str) -> tuple[list[Any], list[Any]]:
    """Train and held-out task lists of distinct layouts: ``generate()`` draws a layout,
    ``make(layout, split, index)`` builds its task; the held-out ones are drawn first and never
    reappear in the train list. ``what`` describes the layouts in the error when they run out."""
    if n_train < 0 or n_eval < 0:
        raise ValueError(f"n_train={n_train}, n_eval={n_eval}; must be >= 0")
    seen: set[Hashable] = set()

    def draw(n: int, split: str) -> list[Any]:
        out: list[Any] = []
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > 100 * (n + 10):
                raise RuntimeError(f"cannot draw {n} distinct {split} {what}")
            layout = generate()
            if layout in seen:
                continue
            seen.add(layout)
            out.append(make(layout, split, len(out)))
        return out

    eval_tasks = draw(n_eval, "eval")
    return draw(n_train, "train"), eval_tasks
