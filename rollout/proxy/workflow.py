"""The agent side: the workflow contract, and one group of agents run through the proxy (layer 4).

A *workflow* is ``async def run(task, base_url, api_key, http_client, **kwargs)``: it builds
``openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)``,
runs its loop and returns what the caller sets with ``set_reward``:

- a number: the final reward (set on the session's last interaction);
- ``{interaction_id: number}``: per-interaction rewards (the ids are the answers' ``completion.id``);
- ``{"reward"?: number, "rewards"?: {id: number}, "env_states"?: {id: {...}}}``: the ``set_reward``
  body itself; ``env_states`` (a jaxprm extension) records what the agent's environment reported
  after each turn on ``Interaction.env_state``, for scorers that read it (FrozenLake progress).

:func:`run_agent_group` starts one group of ``group_size`` sessions for a task, runs the agents
concurrently, sets their rewards, and exports the group; a failed agent (an exception, a timeout,
a result ``set_reward`` refuses) turns the export into a discard (the group's sessions are removed,
nothing is scored).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import numbers
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from jaxprm.imports import import_object
from rollout.proxy.service import ExportResult, RecordingProxy

__all__ = ["Workflow", "resolve_workflow", "reward_body", "GroupOutcome", "run_agent_group"]

Workflow = Callable[..., Awaitable[Any]]
_BODY_KEYS = frozenset({"reward", "rewards", "env_states"})


def resolve_workflow(spec: str) -> Workflow:
    """Import ``package.module:function`` and check it is an ``async def``."""
    fn = import_object(spec, where="workflow", colon_only=True, shape="package.module:function")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"workflow {spec!r} must be an async function run(task, base_url, api_key, http_client)")
    return fn


def reward_body(result: Any) -> dict[str, Any]:
    """The ``set_reward`` body for a workflow's return value (see the module docstring)."""
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        return {"reward": float(result)}
    if isinstance(result, Mapping):
        if result and set(result) <= _BODY_KEYS:
            return dict(result)
        return {"rewards": dict(result)}
    raise TypeError(f"a workflow must return a number or a mapping, got {type(result).__name__}")


@dataclasses.dataclass
class GroupOutcome:
    """One group's result. ``status``: ``ok`` (rows), ``rejected`` (missing session or a scoring
    failure: ``export.rejected`` says why) or ``agent_failed`` (discarded; ``errors`` per agent).
    ``results``: each agent's ``set_reward`` body (``None`` for a failed agent)."""

    group_id: str
    status: str
    export: ExportResult
    errors: list[str] = dataclasses.field(default_factory=list)
    results: list[dict[str, Any] | None] = dataclasses.field(default_factory=list)


async def run_agent_group(proxy: RecordingProxy, base_url: str, task: Any, task_id: str, group_size: int,
                          workflow: Workflow, *, http_client: Any, timeout_s: float,
                          kwargs: Mapping[str, Any] | None = None, discount: float = 1.0, is_eval: bool = False,
                          limiter: asyncio.Semaphore | None = None, seed: int | str | None = None) -> GroupOutcome:
    """Start a group, run ``group_size`` agents concurrently, set their rewards, export the group.

    Each agent run is bounded by ``timeout_s`` (and by ``limiter``, if given, for concurrency).
    ``seed``: the sessions' sampling seeds (``rollout.proxy.sessions``; ``None``: the server draws).
    Cancelling the caller cancels the agents and removes the group's sessions.
    """
    gid, sessions = proxy.start_session(task_id, group_size, seed=seed)
    ids = [s.id for s in sessions]
    kw = dict(kwargs or {})

    async def one(session) -> dict[str, Any]:
        async with limiter if limiter is not None else contextlib.nullcontext():
            result = await asyncio.wait_for(workflow(task, base_url, session.api_key, http_client, **kw), timeout_s)
        body = reward_body(result)
        proxy.set_reward(session, body)
        return body

    try:
        results = await asyncio.gather(*(one(s) for s in sessions), return_exceptions=True)
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
        errors = [f"{s.id}: {type(r).__name__}: {r}" for s, r in zip(sessions, results) if isinstance(r, BaseException)]
        bodies = [None if isinstance(r, BaseException) else r for r in results]
        if errors:
            res = await proxy.export({"session_ids": ids, "group_id": gid, "discard_trajectory": True})
            return GroupOutcome(gid, "agent_failed", res, errors, bodies)
        res = await proxy.export({"session_ids": ids, "group_id": gid, "discount": discount, "is_eval": is_eval})
        return GroupOutcome(gid, "rejected" if res.rejected is not None else "ok", res, [], bodies)
    except BaseException:
        for s in sessions:
            proxy.store.remove(s)
        raise

