"""Importable helpers for the scorer tests: interaction builders and small scorers that dotted
config paths (``prm_test_scorers.X``) can resolve."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from rollout.types import Interaction, InteractionTree, ModelResponse
from scorers import BaseScorer, BaseTrajectoryScorer, PRMMetricObservation, PRMScorerResult


def response(output_len: int, stop_reason: str = "stop", input_len: int = 3) -> ModelResponse:
    return ModelResponse(
        input_tokens=np.arange(input_len),
        output_tokens=np.arange(output_len) + 100,
        output_logprobs=np.full(output_len, -0.5),
        stop_reason=stop_reason,
    )


def turn(
    iid: str,
    parent: str | None,
    output_len: int = 4,
    *,
    messages: list[dict] | None = None,
    output: str | None = None,
    reward: float | None = None,
    env_state: dict | None = None,
) -> Interaction:
    return Interaction(
        id=iid,
        parent_id=parent,
        messages=messages if messages is not None else [{"role": "user", "content": f"task for {iid}"}],
        output_messages=[{"role": "assistant", "content": output if output is not None else f"action {iid}"}],
        model_response=response(output_len),
        reward=reward,
        env_state=env_state or {},
    )


def chain(lengths: list[int], prefix: str = "t") -> list[Interaction]:
    """A branch of turns whose messages grow like a concat conversation."""
    out: list[Interaction] = []
    msgs: list[dict] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "solve the task"}]
    for i, n in enumerate(lengths):
        it = turn(f"{prefix}{i}", out[-1].id if out else None, n, messages=list(msgs), output=f"act {i}")
        out.append(it)
        msgs = [*msgs, *it.output_messages, {"role": "tool", "content": f"obs {i}"}]
    return out


def agent_branch(steps: list[tuple[str, str]], *, task: str, system: str = "sys", prefix: str = "t",
                 output_len: int = 4, rewards: list[float] | None = None) -> list[Interaction]:
    """A concat-style agent branch: one turn per ``(action, observation)``, observations as tool
    messages, each turn's messages the whole conversation before it."""
    msgs: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    out: list[Interaction] = []
    for i, (action, observation) in enumerate(steps):
        it = Interaction(
            id=f"{prefix}{i}",
            parent_id=out[-1].id if out else None,
            messages=list(msgs),
            output_messages=[{"role": "assistant", "content": action}],
            model_response=response(output_len),
            reward=None if rewards is None else rewards[i],
        )
        out.append(it)
        msgs = [*msgs, *it.output_messages, {"role": "tool", "content": observation}]
    return out


def tree_of(*branches: list[Interaction]) -> InteractionTree:
    tree = InteractionTree()
    for b in branches:
        for it in b:
            if it.id not in tree:
                tree.add(it)
    return tree


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- scorers -------------------------------------------------------------------------------------


class ConstScorer(BaseScorer):
    """Returns ``value`` (scalar) for every turn."""

    name = "const"

    def __init__(self, value: Any = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value = value

    async def evaluate(self, interaction, ctx):
        return self.value


class OtherConstScorer(ConstScorer):
    name = "other_const"


class DenseScorer(BaseScorer):
    """Returns ``arange(output_len) * scale`` (or a fixed array per id via ``table``)."""

    name = "dense"

    def __init__(self, scale: float = 1.0, table: dict | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = scale
        self.table = table or {}

    async def evaluate(self, interaction, ctx):
        if interaction.id in self.table:
            return self.table[interaction.id]
        return np.arange(interaction.output_len, dtype=np.float64) * self.scale


class PerTurnScorer(BaseScorer):
    """Looks up ``table[interaction.id]``; an Exception instance in the table is raised."""

    name = "per_turn"

    def __init__(self, table: dict, default: Any = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table = table
        self.default = default

    async def evaluate(self, interaction, ctx):
        value = self.table.get(interaction.id, self.default)
        if isinstance(value, BaseException):
            raise value
        return value


class ObservingScorer(BaseScorer):
    """Score 0.5 and observations supplied by a callable ``make(interaction) -> list``."""

    name = "observing"

    def __init__(self, make=None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.make = make or (lambda it: [])

    async def evaluate(self, interaction, ctx):
        return 0.5

    def prepare_result(self, interaction, result, ctx):
        return PRMScorerResult(result, tuple(self.make(interaction)))


class MutatingScorer(BaseScorer):
    """Vandalizes everything it is given, then scores 1.0."""

    name = "mutating"

    async def evaluate(self, interaction, ctx):
        interaction.messages.append({"role": "user", "content": "INJECTED"})
        interaction.messages[0]["content"] = "OVERWRITTEN"
        interaction.output_messages.clear()
        interaction.env_state["hacked"] = True
        interaction.reward = 123.0
        if interaction.token_rewards is not None:
            interaction.token_rewards[:] = 99.0
        ctx["messages"].append({"role": "user", "content": "INJECTED"})
        ctx["messages"][0]["content"] = "OVERWRITTEN"
        ctx["branch"].clear()
        return 1.0


class CtxRecordingScorer(BaseScorer):
    """Records (id, number of ctx messages, branch ids, turn_index, is_eval) into a shared list."""

    name = "ctx_recording"

    def __init__(self, sink: list, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sink = sink

    async def evaluate(self, interaction, ctx):
        self.sink.append(
            (interaction.id, len(ctx["messages"]), [b.id for b in ctx["branch"]], ctx.get("turn_index"), ctx["is_eval"])
        )
        return 0.0


class TrajScorer(BaseTrajectoryScorer):
    """Returns ``result`` (or ``fn(interactions)``) and records the order it was given."""

    name = "traj"

    def __init__(self, result: Any = None, fn=None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.result = result
        self.fn = fn
        self.seen_order: list[str] = []

    async def evaluate_trajectory(self, interactions, ctx):
        self.seen_order = [it.id for it in interactions]
        if self.fn is not None:
            return self.fn(interactions)
        return self.result


class SlowScorer(BaseScorer):
    """Waits on ``gate`` (an asyncio.Event created in the loop) while recording starts/cancels."""

    name = "slow"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started = 0
        self.cancelled = 0
        self.gate: asyncio.Event | None = None

    async def evaluate(self, interaction, ctx):
        self.started += 1
        try:
            assert self.gate is not None
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return 1.0


class ResourceScorer(BaseScorer):
    """Configured scorer with observable, optionally failing or blocking cleanup."""

    name = "resource"
    instances: list[ResourceScorer] = []
    close_order: list[str] = []

    def __init__(self, label: str = "resource", fail_close: bool = False, fail_init: bool = False, **kwargs: Any):
        if fail_init:
            raise RuntimeError(f"cannot start {label}")
        super().__init__(**kwargs)
        self.label = label
        self.fail_close = fail_close
        self.close_calls = 0
        self.flushed = False
        self.release: asyncio.Event | None = None
        self.close_started: asyncio.Event | None = None
        ResourceScorer.instances.append(self)

    async def evaluate(self, interaction, ctx):
        return 1.0

    async def aclose(self):
        self.close_calls += 1
        ResourceScorer.close_order.append(self.label)
        if self.close_started is not None:
            self.close_started.set()
        if self.release is not None:
            await self.release.wait()
        if self.fail_close:
            raise ValueError(f"cannot flush {self.label}")
        self.flushed = True


def resource_class(name: str) -> type[ResourceScorer]:
    """A ResourceScorer subclass with its own ``name`` (names must be unique within a runner)."""
    return type(f"Resource_{name}", (ResourceScorer,), {"name": name})


# Distinctly named resource scorers for config paths.
ResourceA = resource_class("res_a")
ResourceB = resource_class("res_b")
ResourceC = resource_class("res_c")
ResourceD = resource_class("res_d")


class NotAScorer:
    name = "nope"


def obs(metric: str, target: str, value: Any = True, vtype: str = "boolean", aggs=("count", "rate"), scope="turn"):
    return PRMMetricObservation(metric, scope, target, value, vtype, aggs)
