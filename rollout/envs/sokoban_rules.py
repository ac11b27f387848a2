"""Sokoban's rules, its exact solver and its dead squares, on a level's static layout (layer 4).

A level is rows of XSB-like letters: ``#`` wall, ``_`` floor, ``.`` target, ``$`` box, ``*`` box
on a target, ``@`` player, ``+`` player on a target. :class:`Layout` keeps what never changes
(walls, targets); a :data:`State` is ``(player, boxes)`` with cells as ``row * width + col`` and
``boxes`` a sorted tuple.

A move (``Left``/``Down``/``Right``/``Up``) steps the player one cell. Into a wall it is a no-op;
into a box it pushes the box one cell on if that cell is floor or target without a box, else it is
a no-op. Nothing pulls a box, so a box pushed into a corner off a target can never leave it.

The solver is a backward breadth-first search over states, from every solved state (all boxes on
targets, the player on any free cell) through reversed moves (a step back, or a step back pulling
the box in front). It labels every state from which the level can be solved with its exact
distance, the fewest moves to solve it; a state it never reaches cannot be solved (dead). One
search per layout, cached (:func:`distance_table`), serves every state of every episode on that
level: rewards, the progress scorer, warm-start teachers and each eval level's optimal length.
Dead squares (:func:`dead_squares`) are the cells from which no box can reach any target, the
cheap test a player learns first; a box on one means a dead state.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

from rollout.envs.base import ACTIONS, DELTAS, OPPOSITE

__all__ = ["Layout", "State", "parse_level", "render_level", "push", "distance_table", "dead_squares",
           "optimal_moves", "solve"]

State = tuple[int, tuple[int, ...]]  # (player cell, sorted box cells)

_LETTERS = set("#_.$*@+")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A level's static part: its size, wall cells and target cells (as ``row * width + col``)."""

    height: int
    width: int
    walls: frozenset[int]
    targets: tuple[int, ...]

    def step(self, cell: int, action: str) -> int | None:
        """The neighbour of ``cell`` in ``action``'s direction (``None`` off the grid)."""
        dr, dc = DELTAS[action]
        r, c = divmod(cell, self.width)
        r, c = r + dr, c + dc
        if not (0 <= r < self.height and 0 <= c < self.width):
            return None
        return r * self.width + c

    def free(self, cell: int | None) -> bool:
        """On the grid and not a wall."""
        return cell is not None and cell not in self.walls


def parse_level(rows: Sequence[str]) -> tuple[Layout, State]:
    """``(layout, start state)`` of a level written in the letters of the module docstring."""
    rows = tuple(rows)
    if not rows or len({len(r) for r in rows}) != 1:
        raise ValueError("a level is a non-empty list of equal-length rows")
    bad = set("".join(rows)) - _LETTERS
    if bad:
        raise ValueError(f"level has letters {sorted(bad)}; allowed: {''.join(sorted(_LETTERS))}")
    width = len(rows[0])
    cells = [(r * width + c, ch) for r, row in enumerate(rows) for c, ch in enumerate(row)]
    players = [i for i, ch in cells if ch in "@+"]
    boxes = tuple(sorted(i for i, ch in cells if ch in "$*"))
    targets = tuple(sorted(i for i, ch in cells if ch in ".*+"))
    if len(players) != 1:
        raise ValueError(f"a level needs exactly one player (@ or +), found {len(players)}")
    if not boxes or len(boxes) != len(targets):
        raise ValueError(f"a level needs as many targets as boxes (>= 1), found {len(boxes)} boxes, {len(targets)} targets")
    layout = Layout(len(rows), width, frozenset(i for i, ch in cells if ch == "#"), targets)
    return layout, (players[0], boxes)


def render_level(layout: Layout, state: State) -> tuple[str, ...]:
    """The rows of ``state`` in the letters of the module docstring (inverse of :func:`parse_level`)."""
    player, boxes = state
    box_set, target_set = set(boxes), set(layout.targets)
    out = []
    for r in range(layout.height):
        row = []
        for c in range(layout.width):
            i = r * layout.width + c
            if i in layout.walls:
                row.append("#")
            elif i == player:
                row.append("+" if i in target_set else "@")
            elif i in box_set:
                row.append("*" if i in target_set else "$")
            else:
                row.append("." if i in target_set else "_")
        out.append("".join(row))
    return tuple(out)


def push(layout: Layout, state: State, action: str) -> tuple[State, int | None, int | None]:
    """One move: ``(new state, box moved from, box moved to)`` (``None`` when no box moved). A blocked
    move returns ``state`` itself."""
    player, boxes = state
    nxt = layout.step(player, action)
    if not layout.free(nxt):
        return state, None, None
    if nxt not in boxes:
        return (nxt, boxes), None, None
    beyond = layout.step(nxt, action)
    if not layout.free(beyond) or beyond in boxes:
        return state, None, None
    moved = tuple(sorted(beyond if b == nxt else b for b in boxes))
    return (nxt, moved), nxt, beyond


def _reverse(layout: Layout, state: State):
    """The states one move before ``state`` (a step back, or a step back pulling the box ahead)."""
    player, boxes = state
    for action in ACTIONS:
        back = layout.step(player, OPPOSITE[action])
        if not layout.free(back) or back in boxes:
            continue
        yield back, boxes  # the move was a plain step from ``back``
        ahead = layout.step(player, action)
        if ahead in boxes:  # the move pushed the box from ``player`` to ``ahead``
            yield back, tuple(sorted(player if b == ahead else b for b in boxes))



@functools.lru_cache(maxsize=512)
def distance_table(layout: Layout) -> dict[State, int]:
    """Every solvable state of ``layout`` and its fewest moves to the solution (backward BFS from the
    solved states, see the module docstring). A state not in it cannot be solved."""
    goal = layout.targets
    dist: dict[State, int] = {}
    queue: collections.deque[State] = collections.deque()
    for cell in range(layout.height * layout.width):
        if cell not in layout.walls and cell not in goal:
            dist[(cell, goal)] = 0
            queue.append((cell, goal))
    while queue:
        state = queue.popleft()
        d = dist[state] + 1
        for prev in _reverse(layout, state):
            if prev not in dist:
                dist[prev] = d
                queue.append(prev)
    return dist


@functools.lru_cache(maxsize=512)
def dead_squares(layout: Layout) -> frozenset[int]:
    """Free cells from which a lone box can reach no target: the cells a box is never pulled onto
    when pulled from a target (a pull needs the player's cell and the one behind it free)."""
    live = set(layout.targets)
    queue = collections.deque(layout.targets)
    while queue:
        box = queue.popleft()
        for action in ACTIONS:
            to = layout.step(box, action)  # the box moves here, pulled by a player standing one further
            if layout.free(to) and layout.free(layout.step(to, action)) and to not in live:
                live.add(to)
                queue.append(to)
    return frozenset(c for c in range(layout.height * layout.width) if c not in layout.walls and c not in live)


def optimal_moves(layout: Layout, state: State) -> list[str]:
    """The moves that begin a shortest solution from ``state`` (empty if solved or dead)."""
    table = distance_table(layout)
    d = table.get(state)
    if not d:
        return []
    return [a for a in ACTIONS if table.get(push(layout, state, a)[0]) == d - 1]


def solve(layout: Layout, state: State) -> list[str] | None:
    """A shortest solution from ``state`` (``[]`` if solved), or ``None`` when there is none."""
    if state not in distance_table(layout):
        return None
    plan = []
    while moves := optimal_moves(layout, state):
        plan.append(moves[0])
        state = push(layout, state, moves[0])[0]
    return plan
