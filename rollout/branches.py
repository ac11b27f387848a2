"""A branch of a group rollout and the concurrency helper the group runner and its strategies share
(layer 4, internal to ``rollout.tree`` and ``rollout.strategies``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from rollout.envs.base import Env

__all__ = ["Branch", "gather"]


@dataclasses.dataclass
class Branch:
    """One trajectory being grown: its env (forked with ``env.clone()``), chat messages, token prompt,
    last interaction id, depth (turns taken), actions, summed reward and how it started (``origin``:
    root | child | refill); ``status`` is set when it ends."""

    id: str
    env: Env
    messages: list[dict[str, Any]]
    prompt: list[int]
    last_id: str | None
    depth: int
    actions: list[Any]
    reward: float
    origin: str
    lineage_len: int = 0  # prompt+output tokens of the previous request on this lineage
    status: str | None = None
    score: float | None = None
    truncated: bool = False
    h_init: float | None = None  # arpo: entropy of the lineage's first turn
    h_now: float | None = None  # arpo: entropy of the last turn

    def fork(self, new_id: str, origin: str) -> Branch:
        return Branch(id=new_id, env=self.env.clone(), messages=list(self.messages), prompt=list(self.prompt),
                       last_id=self.last_id, depth=self.depth, actions=list(self.actions), reward=self.reward,
                       origin=origin, lineage_len=self.lineage_len, score=self.score, h_init=self.h_init,
                       h_now=self.h_now)

    def stop(self, status: str) -> None:
        """End the branch before its episode ended (pruned, a loop, out of context or of the
        rollout's turns), charging the env's ``forfeit_reward()`` (what playing out the turns left
        without progress would cost; 0 for an env without the method), so that being stopped never
        pays better than playing on: with a per-step penalty (Sokoban) a branch cut at turn 3
        would otherwise look better than one that failed at the turn limit."""
        self.status = status
        forfeit = getattr(self.env, "forfeit_reward", None)
        self.reward += float(forfeit()) if forfeit is not None else 0.0

    def loops(self, theta: int | None) -> bool:
        """Whether the last ``theta`` actions are identical (the theta rule; ``None``: never)."""
        return theta is not None and len(self.actions) >= theta and len(set(map(repr, self.actions[-theta:]))) == 1

    def entropy_delta(self) -> float:
        """``H_now - H_init`` (0 when either is unknown)."""
        if self.h_now is None or self.h_init is None:
            return 0.0
        return self.h_now - self.h_init


async def gather(coros: Sequence[Any]) -> list[Any]:
    """Run concurrently; on the first failure cancel the rest and raise it (cancellation propagates).

    The error is raised as its raiser built it: outside the ``except`` block, so Python neither
    overwrites its ``__cause__`` (the scorer's error under a :class:`GroupRejected`) nor sets the
    TaskGroup's ``ExceptionGroup`` as its context."""
    tasks: list[asyncio.Task] = []
    first: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        errs = [e for e in eg.exceptions if not isinstance(e, asyncio.CancelledError)]
        first = errs[0] if errs else eg.exceptions[0]
    if first is not None:
        raise first
    return [t.result() for t in tasks]
