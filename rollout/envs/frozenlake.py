"""Text FrozenLake: deterministic grid navigation, one fenced action per turn (layer 4).

Maps use gymnasium's letters internally (``S`` start, ``F`` frozen, ``H`` hole, ``G`` goal) and
are rendered for the model as ``P`` (player), ``_`` (frozen), ``O`` (hole), ``G`` (goal), one row
per line, cells separated by spaces. Movement matches gymnasium's ``FrozenLake-v1`` with
``is_slippery=False``: a move into the border leaves the player in place, entering ``H`` ends the
episode with reward 0, entering ``G`` ends it with reward 1.

The action is read from the last fenced block of the reply (```` ```Left``` ````; ``Left``,
``Down``, ``Right``, ``Up``, case-insensitive). Anything else is invalid (``info["valid"] =
False``): a no-op by default, or the end of the episode (reward 0) with
``invalid_ends_episode=True``. An episode also ends after ``max_turns`` steps (valid or not).

After every step ``info`` holds the keys the FrozenLake progress scorer reads: ``position``,
``distance`` (BFS steps to the goal with holes blocked, ``-1`` if unreachable or in a hole),
``start_distance``, ``in_hole``, ``success``, ``done``, ``action``, ``valid``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout.envs.base import ACTIONS, DELTAS as _DELTAS, INVALID_ANSWER, GridGame, StepResult, draw_tasks, parse_action

__all__ = [
    "FrozenLakeTask",
    "FrozenLakeEnv",
    "generate_map",
    "bfs_distances",
    "parse_action",
    "render_map",
    "make_tasks",
    "ACTIONS",
    "SYSTEM_PROMPT",
    "COMPACT_SYSTEM_PROMPT",
]


SYSTEM_PROMPT = (
    "You are playing FrozenLake on a grid. Symbols: P is you, _ is frozen ice (safe), O is a hole "
    "(falling in ends the game), G is the goal. Reach G without stepping into an O. "
    "Each turn, answer with exactly one move written in a fenced block: ```Left```, ```Down```, "
    "```Right``` or ```Up```. Left/Right change the column, Up/Down change the row (row 0 is the top). "
    "Moving into the edge of the grid leaves you where you are."
)

# The same rules in a few words: a third of the tokens, for small policies whose cost grows with the
# prompt (attention over the whole multi-turn history).
COMPACT_SYSTEM_PROMPT = (
    "FrozenLake: reach G, avoid holes O; P is you, _ is ice. "
    "Answer one move: ```Left```, ```Down```, ```Right``` or ```Up```."
)


def bfs_distances(desc: Sequence[str]) -> list[list[int]]:
    """Shortest number of moves from every cell to the goal, holes blocked.

    ``desc`` rows use ``S F H G`` (or the rendered ``P _ O G`` without spaces). Returns a
    ``[rows][cols]`` list; holes and cells that cannot reach the goal get ``-1``.
    """
    rows, cols = len(desc), len(desc[0])
    dist = [[-1] * cols for _ in range(rows)]
    goal = [(r, c) for r in range(rows) for c in range(cols) if desc[r][c] == "G"]
    if len(goal) != 1:
        raise ValueError(f"map must have exactly one goal G, found {len(goal)}")
    q = collections.deque(goal)
    dist[goal[0][0]][goal[0][1]] = 0
    while q:
        r, c = q.popleft()
        for dr, dc in _DELTAS.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < rows and 0 <= nc < cols and dist[nr][nc] < 0 and desc[nr][nc] not in "HO":
                dist[nr][nc] = dist[r][c] + 1
                q.append((nr, nc))
    return dist


def generate_map(seed: int | np.random.Generator, size: int = 4, p_frozen: float = 0.8, *,
                 random_start_goal: bool = True, max_tries: int = 10_000) -> tuple[str, ...]:
    """A ``size x size`` map (rows of ``S F H G``) with a path from ``S`` to ``G``.

    Each cell is frozen with probability ``p_frozen`` (gymnasium's ``p``), else a hole. With
    ``random_start_goal`` the start and goal are two distinct random cells, otherwise top-left and
    bottom-right as in gymnasium. Maps without a hole-free path are redrawn.
    """
    if size < 2:
        raise ValueError(f"size={size}; must be >= 2")
    if not 0.0 < p_frozen <= 1.0:
        raise ValueError(f"p_frozen={p_frozen}; must be in (0, 1]")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    for _ in range(max_tries):
        board = np.where(rng.random((size, size)) < p_frozen, "F", "H").astype("<U1")
        if random_start_goal:
            s, g = rng.choice(size * size, size=2, replace=False)
        else:
            s, g = 0, size * size - 1
        board[divmod(int(s), size)] = "S"
        board[divmod(int(g), size)] = "G"
        desc = tuple("".join(row) for row in board)
        if bfs_distances(desc)[int(s) // size][int(s) % size] > 0:
            return desc
    raise RuntimeError(f"no solvable map after {max_tries} tries (size={size}, p_frozen={p_frozen})")


def render_map(desc: Sequence[str], position: tuple[int, int]) -> str:
    """Rows of ``P _ O G`` separated by spaces; the player ``P`` is drawn over its cell."""
    sym = {"S": "_", "F": "_", "H": "O", "G": "G"}
    out = []
    for r, row in enumerate(desc):
        out.append(" ".join("P" if (r, c) == tuple(position) else sym[ch] for c, ch in enumerate(row)))
    return "\n".join(out)


@dataclasses.dataclass(frozen=True)
class FrozenLakeTask:
    """One map. ``desc`` rows use ``S F H G``; ``task_id`` names it in logs and exports."""

    desc: tuple[str, ...]
    max_turns: int = 10
    task_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "desc", tuple(self.desc))
        if len({len(r) for r in self.desc}) != 1 or not self.desc:
            raise ValueError("desc must be a non-empty list of equal-length rows")
        bad = set("".join(self.desc)) - set("SFHG")
        if bad:
            raise ValueError(f"desc has letters {sorted(bad)}; allowed: S F H G")
        if "".join(self.desc).count("S") != 1 or "".join(self.desc).count("G") != 1:
            raise ValueError("desc needs exactly one S and one G")
        if self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns}; must be >= 1")

    @property
    def start(self) -> tuple[int, int]:
        return next((r, row.index("S")) for r, row in enumerate(self.desc) if "S" in row)


class FrozenLakeEnv(GridGame):
    """One FrozenLake episode (see the module docstring). ``clone()`` copies the episode state.

    ``system_prompt``: the system message (:data:`SYSTEM_PROMPT` by default,
    :data:`COMPACT_SYSTEM_PROMPT` for small policies, ``None`` for none).
    ``invalid_ends_episode``: an invalid answer ends the episode with reward 0 instead of being a
    no-op. As a no-op, an invalid answer is a safe move that RL can learn to prefer where every
    move looks risky (the tiny policy's invalid rate rose from 1% to 16-20% in 20 GRPO steps).
    """

    def __init__(self, system_prompt: str | None = SYSTEM_PROMPT, *, invalid_ends_episode: bool = False) -> None:
        super().__init__(system_prompt, invalid_ends_episode=invalid_ends_episode)
        self._dist: list[list[int]] = []
        self.position = (0, 0)

    async def reset(self, task: FrozenLakeTask) -> str:
        self._start(task, FrozenLakeTask)
        self._dist = bfs_distances(task.desc)
        self.position = task.start
        self.start_distance = self._dist[self.position[0]][self.position[1]]
        return self._observation()

    def clone(self) -> FrozenLakeEnv:
        other = self._copy_into(FrozenLakeEnv(self._system_prompt, invalid_ends_episode=self.invalid_ends_episode))
        other._dist, other.position = self._dist, self.position  # the distances are never mutated
        return other

    def _observation(self) -> str:
        assert self.task is not None
        r, c = self.position
        return f"Map:\n{render_map(self.task.desc, self.position)}\nYou are at row {r}, column {c}. What is your move?"

    def optimal_actions(self) -> list[str]:
        """The moves that step onto a shortest hole-free path to the goal (empty from a hole or a
        cell that cannot reach it); a move into the edge is never one."""
        assert self.task is not None
        best, out = None, []
        for a in ACTIONS:
            (r, c), hole, goal = self.move(a)
            d = 0 if goal else (-1 if hole else self._dist[r][c])
            if d < 0 or (r, c) == self.position:
                continue
            if best is None or d < best:
                best, out = d, [a]
            elif d == best:
                out.append(a)
        return out

    def move(self, action: str) -> tuple[tuple[int, int], bool, bool]:
        """Apply a valid action: returns ``(new_position, in_hole, at_goal)`` (no turn counting)."""
        assert self.task is not None
        rows, cols = len(self.task.desc), len(self.task.desc[0])
        dr, dc = _DELTAS[action]
        r = min(max(self.position[0] + dr, 0), rows - 1)
        c = min(max(self.position[1] + dc, 0), cols - 1)
        cell = self.task.desc[r][c]
        return (r, c), cell == "H", cell == "G"

    async def step(self, action_text: str) -> StepResult:
        self._next_turn()
        action = parse_action(action_text)
        in_hole = success = False
        reward = 0.0
        if action is None:
            msg = INVALID_ANSWER
        else:
            new_pos, in_hole, success = self.move(action)
            bumped = new_pos == self.position
            self.position = new_pos
            if success:
                reward = 1.0
                msg = f"You moved {action} and reached the goal."
            elif in_hole:
                msg = f"You moved {action} and fell into a hole."
            elif bumped:
                msg = f"You moved {action} into the edge and stayed in place."
            else:
                msg = f"You moved {action}."
        msg, truncated = self._end_turn(msg, action, ended=success or in_hole)
        r, c = self.position
        info = {
            "position": [r, c],
            "distance": -1 if in_hole else self._dist[r][c],
            "start_distance": self.start_distance,
            "in_hole": in_hole,
            "success": success,
            "done": self.done,
            "action": action,
            "valid": action is not None,
            "truncated": truncated,
            "turn": self.turn,
            "state": [r, c],  # what identifies the state (anchor-state step groups)
        }
        return StepResult(observation=msg, reward=reward, done=self.done, info=info)


def make_tasks(seed: int, n_train: int, n_eval: int, *, sizes: Sequence[int] = (4,),
               p_frozen: float | Sequence[float] = 0.8, max_turns: int = 10,
               random_start_goal: bool = True) -> tuple[list[FrozenLakeTask], list[FrozenLakeTask]]:
    """Train and held-out eval task lists from ``seed``; no eval map appears in the train list.

    Sizes and frozen probabilities are drawn uniformly from ``sizes`` / ``p_frozen`` per map.
    Deterministic for a given seed.
    """
    ps = [p_frozen] if isinstance(p_frozen, (int, float)) else list(p_frozen)
    sizes = list(sizes)
    if not sizes or not ps:
        raise ValueError("sizes and p_frozen must be non-empty")
    rng = np.random.default_rng(seed)

    def generate() -> tuple[str, ...]:
        size = int(sizes[rng.integers(len(sizes))])
        p = float(ps[rng.integers(len(ps))])
        return generate_map(rng, size, p, random_start_goal=random_start_goal)

    return draw_tasks(generate, lambda desc, split, i: FrozenLakeTask(desc=desc, max_turns=max_turns,
                                                                      task_id=f"{split}-{i}"),
                      n_train, n_eval, f"maps (sizes={sizes}, p_frozen={ps})")


def describe(task: FrozenLakeTask) -> dict[str, Any]:
    """JSON-friendly summary of a task (for logs)."""
    return {"task_id": task.task_id, "desc": list(task.desc), "max_turns": task.max_turns}
