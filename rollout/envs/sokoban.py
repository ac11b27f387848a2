"""Text Sokoban: push every box onto a target, one fenced move per turn (layer 4).

The rules are gym-sokoban's (see :mod:`rollout.envs.sokoban_rules`): a move steps the player, pushes
a box ahead of it one cell if that cell is free, and is a no-op into a wall or a blocked box. The
reward of a step is gym-sokoban's: -0.1, +1 for a box pushed onto a target, -1 for one pushed off,
+10 when every box is on a target (the episode then ends). An episode also ends after
``max_turns`` steps. A box pushed into a corner off a target makes the level unsolvable, many turns
before the episode ends.

The model sees the room one row per line, one character a cell (as FrozenLake's map): ``#`` wall,
``.`` floor, ``O`` target, ``X`` box, ``*`` box on a target, ``P`` player, ``S`` player on a target
(RAGEN's symbols, with ``*`` for its non-ASCII box on target and ``.`` for its ``_`` floor: the
tiny tokenizer merges ``__`` into one token, so rows with runs of floor no longer had one token a
cell). The answer format is FrozenLake's: the move in the last fenced block (```` ```Up``` ````);
an invalid answer ends the episode (default) or is a no-op turn. Ending on an invalid answer forfeits the turns left: its reward is the step penalty of
every remaining turn (``-0.1 * (max_turns - turn + 1)``), so that an episode never pays better for
ending early than for playing on. (Without it GRPO learned to quit: a failing episode that stops at
turn 3 costs -0.3 where one that plays out costs -1.0, and the tiny policy's invalid rate rose from
0.3% to 7% in 10 steps while success fell 13 points.) A branch the rollout stops early (PaTR
prunes it, a loop, the context) is charged the same way (:meth:`SokobanEnv.forfeit_reward`).

After every step ``info`` holds what the progress scorer and the metrics read: ``position``,
``boxes`` (cells as ``[row, col]``), ``boxes_on_target``, ``distance`` (the fewest moves left to
solve the level, ``-1`` when it can no longer be solved), ``start_distance``, ``dead``,
``success``, ``done``, ``action``, ``valid``, ``truncated``, ``turn``.

Levels are generated as gym-sokoban does (:func:`generate_level`): a room carved by a random walk,
boxes placed on their targets, then random reverse play (the player walks and pulls boxes), keeping
the state that moved the boxes farthest. Reverse play from the solved room means every level is
solvable; the solver confirms it and gives the optimal length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout.envs.base import ACTIONS, DELTAS, INVALID_ANSWER, OPPOSITE, GridGame, StepResult, draw_tasks, parse_action
from rollout.envs.sokoban_rules import (Layout, State, dead_squares, distance_table, optimal_moves, parse_level,
                                        push, render_level)

__all__ = ["SokobanTask", "SokobanEnv", "generate_level", "make_tasks", "render_room", "SYSTEM_PROMPT",
           "COMPACT_SYSTEM_PROMPT", "STEP_REWARD", "BOX_ON_REWARD", "BOX_OFF_REWARD", "SOLVED_REWARD",
           "MIN_SIZE", "MAX_SIZE", "MAX_BOXES"]

STEP_REWARD, BOX_ON_REWARD, BOX_OFF_REWARD, SOLVED_REWARD = -0.1, 1.0, -1.0, 10.0
MIN_SIZE, MAX_SIZE, MAX_BOXES = 5, 10, 3

SYSTEM_PROMPT = (
    "You are playing Sokoban on a grid. Symbols: # is a wall, . is floor, O is a target, X is a box, "
    "* is a box on a target, P is you, S is you standing on a target. Push every box onto a target. "
    "You push a box by walking into it; it moves one cell if the cell behind it is free. You cannot pull "
    "boxes, so a box pushed into a corner that is not a target can never be moved again. "
    "Each turn, answer with exactly one move written in a fenced block: ```Left```, ```Down```, "
    "```Right``` or ```Up```. Left/Right change the column, Up/Down change the row (row 0 is the top)."
)

COMPACT_SYSTEM_PROMPT = (
    "Sokoban: push every box X onto a target O; P is you, # wall, . floor, * box on target. "
    "Answer one move: ```Left```, ```Down```, ```Right``` or ```Up```."
)

_SYMBOLS = {"#": "#", "_": ".", ".": "O", "$": "X", "*": "*", "@": "P", "+": "S"}


def render_room(rows: Sequence[str]) -> str:
    """The model's view of a level's rows: the symbols of the module docstring, one a cell."""
    return "\n".join("".join(_SYMBOLS[ch] for ch in row) for row in rows)


@dataclasses.dataclass(frozen=True)
class SokobanTask:
    """One level: ``room`` rows in :mod:`rollout.envs.sokoban_rules`' letters; ``task_id`` names it."""

    room: tuple[str, ...]
    max_turns: int = 20
    task_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "room", tuple(self.room))
        parse_level(self.room)  # raises on a malformed level
        if self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns}; must be >= 1")

    @property
    def optimal_length(self) -> int:
        """The fewest moves that solve the level (``-1``: none)."""
        layout, start = parse_level(self.room)
        return distance_table(layout).get(start, -1)


class SokobanEnv(GridGame):
    """One Sokoban episode (see the module docstring). ``clone()`` copies the episode state.

    ``system_prompt``: the system message (:data:`SYSTEM_PROMPT` by default,
    :data:`COMPACT_SYSTEM_PROMPT` for small policies, ``None`` for none).
    ``invalid_ends_episode``: an invalid answer ends the episode (charged the step penalty of every turn
    left) instead of being a no-op turn.
    """

    def __init__(self, system_prompt: str | None = SYSTEM_PROMPT, *, invalid_ends_episode: bool = False) -> None:
        super().__init__(system_prompt, invalid_ends_episode=invalid_ends_episode)
        self.layout: Layout | None = None
        self.state: State = (0, ())

    async def reset(self, task: SokobanTask) -> str:
        self._start(task, SokobanTask)
        self.layout, self.state = parse_level(task.room)
        self.start_distance = self.distance()
        return self._observation()

    def clone(self) -> SokobanEnv:
        other = self._copy_into(SokobanEnv(self._system_prompt, invalid_ends_episode=self.invalid_ends_episode))
        other.layout, other.state = self.layout, self.state  # immutable
        return other

    def _observation(self) -> str:
        assert self.layout is not None
        return f"Room:\n{render_room(render_level(self.layout, self.state))}\nWhat is your move?"

    def forfeit_reward(self) -> float:
        """The step penalty of every turn left (``-0.1 * (max_turns - turn)``): what an episode
        stopped now would have paid playing on without solving the level."""
        return STEP_REWARD * (self.task.max_turns - self.turn)

    def distance(self) -> int:
        """The fewest moves left to solve the level from the current state (``-1``: unsolvable)."""
        assert self.layout is not None
        return distance_table(self.layout).get(self.state, -1)

    def optimal_actions(self) -> list[str]:
        """The moves that begin a shortest solution (empty once solved or dead)."""
        assert self.layout is not None
        return optimal_moves(self.layout, self.state)

    def _cell(self, cell: int) -> list[int]:
        assert self.layout is not None
        return list(divmod(cell, self.layout.width))

    async def step(self, action_text: str) -> StepResult:
        self._next_turn()
        assert self.layout is not None
        action = parse_action(action_text)
        reward, targets = STEP_REWARD, set(self.layout.targets)
        if action is None:
            msg = INVALID_ANSWER
            if self.invalid_ends_episode:  # the episode ends here: charge every turn it skips
                reward += self.forfeit_reward()
        else:
            new, box_from, box_to = push(self.layout, self.state, action)
            if new == self.state:
                msg = f"You moved {action} and did not move: a wall or a blocked box is in the way."
            elif box_from is None:
                msg = f"You moved {action}."
            else:
                reward += BOX_ON_REWARD * (box_to in targets) + BOX_OFF_REWARD * (box_from in targets)
                msg = f"You moved {action} and pushed a box."
            self.state = new
        on_target = sum(b in targets for b in self.state[1])
        success = on_target == len(self.layout.targets)
        if success:
            reward += SOLVED_REWARD
            msg += " Every box is on a target: solved."
        msg, truncated = self._end_turn(msg, action, ended=success)
        distance = self.distance()
        info = {
            "position": self._cell(self.state[0]),
            "boxes": [self._cell(b) for b in self.state[1]],
            "boxes_on_target": on_target,
            "distance": distance,
            "start_distance": self.start_distance,
            "dead": distance < 0,
            "success": success,
            "done": self.done,
            "action": action,
            "valid": action is not None,
            "truncated": truncated,
            "turn": self.turn,
            "state": [self.state[0], sorted(self.state[1])],  # what identifies the state (anchor-state step groups)
        }
        return StepResult(observation=msg, reward=round(reward, 6), done=self.done, info=info)


# 3x3 shapes the room's random walk carves (gym-sokoban's masks): a cell, lines, corners, a square.
_MASKS = (
    ((0, 0),),
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
    ((0, 0), (0, -1), (-1, 0)),
    ((0, 0), (0, 1), (1, 0), (1, 1)),
)


def _carve(rng: np.random.Generator, size: int) -> set[tuple[int, int]]:
    """Floor cells of a ``size`` x ``size`` room carved by a random walk (the grid's edge is a wall)."""
    lo, hi = 0, size - 1
    r, c = (int(x) for x in rng.integers(lo, hi + 1, size=2))
    direction = DELTAS[ACTIONS[int(rng.integers(4))]]
    floor: set[tuple[int, int]] = set()
    for _ in range(int(1.5 * (2 * size))):
        if rng.random() < 0.35:
            direction = DELTAS[ACTIONS[int(rng.integers(4))]]
        for dr, dc in _MASKS[int(rng.integers(len(_MASKS)))]:
            if lo <= r + dr <= hi and lo <= c + dc <= hi:
                floor.add((r + dr, c + dc))
        r, c = min(max(r + direction[0], lo), hi), min(max(c + direction[1], lo), hi)
    return floor


def _reverse_play(rng: np.random.Generator, layout: Layout, player: int, steps: int) -> State | None:
    """Random reverse play from the solved room (a step, pulling the box behind with probability
    1/2); returns the state whose boxes moved farthest from their targets times the number of box
    moves (gym-sokoban's score), or ``None`` if no box ever left its target."""
    boxes = list(layout.targets)
    best, best_score, pulls = None, 0, 0
    for _ in range(steps):
        action = ACTIONS[int(rng.integers(4))]
        to = layout.step(player, action)
        if not layout.free(to) or to in boxes:
            continue
        behind = layout.step(player, OPPOSITE[action])
        if behind in boxes and rng.random() < 0.5:
            boxes[boxes.index(behind)] = player
            pulls += 1
        player = to
        moved = sum(_manhattan(layout, b, t) for b, t in zip(boxes, layout.targets))
        state = (player, tuple(sorted(boxes)))
        if moved and pulls * moved > best_score and set(boxes) != set(layout.targets):
            best, best_score = state, pulls * moved
    return best


def _manhattan(layout: Layout, a: int, b: int) -> int:
    (ra, ca), (rb, cb) = divmod(a, layout.width), divmod(b, layout.width)
    return abs(ra - rb) + abs(ca - cb)


def generate_level(seed: int | np.random.Generator, size: int = 5, boxes: int = 1, *, min_distance: int = 2,
                   max_tries: int = 1000) -> tuple[str, ...]:
    """A solvable ``size`` x ``size`` level (border walls) with ``boxes`` boxes, whose optimal solution
    takes at least ``min_distance`` moves; deterministic for a seed (see the module docstring)."""
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"size={size}; must be in [{MIN_SIZE}, {MAX_SIZE}]")
    if not 1 <= boxes <= MAX_BOXES:
        raise ValueError(f"boxes={boxes}; must be in [1, {MAX_BOXES}]")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    for _ in range(max_tries):
        floor = sorted(_carve(rng, size))
        if len(floor) < boxes + 3:
            continue
        picks = rng.choice(len(floor), size=boxes + 1, replace=False)
        cells = [floor[int(i)][0] * size + floor[int(i)][1] for i in picks]
        walls = frozenset(r * size + c for r in range(size) for c in range(size)) - {r * size + c for r, c in floor}
        layout = Layout(size, size, walls, tuple(sorted(cells[:boxes])))
        state = _reverse_play(rng, layout, cells[boxes], steps=300)
        if state is None or any(b in dead_squares(layout) for b in state[1]):
            continue
        if distance_table(layout).get(state, -1) >= min_distance:
            return render_level(layout, state)
    raise RuntimeError(f"no level after {max_tries} tries (size={size}, boxes={boxes}, min_distance={min_distance})")


def make_tasks(seed: int, n_train: int, n_eval: int, *, size: int = 5, boxes: int = 1, max_turns: int = 20,
               min_distance: int = 2) -> tuple[list[SokobanTask], list[SokobanTask]]:
    """Train and held-out eval levels from ``seed``; no eval level appears in the train list.
    Deterministic for a given seed."""
    rng = np.random.default_rng(seed)
    return draw_tasks(lambda: generate_level(rng, size, boxes, min_distance=min_distance),
                      lambda room, split, i: SokobanTask(room=room, max_turns=max_turns, task_id=f"{split}-{i}"),
                      n_train, n_eval, f"levels (size={size}, boxes={boxes})")


def describe(task: SokobanTask) -> dict[str, Any]:
    """JSON-friendly summary of a level (for logs)."""
    return {"task_id": task.task_id, "room": list(task.room), "max_turns": task.max_turns,
            "optimal_length": task.optimal_length}
