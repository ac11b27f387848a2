"""Reading a (partial) trajectory out of a scorer's inputs: the turn's conversation, the task, the
agent's steps and the branch prefix. Shared by the built-in scorers; plain Python."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from rollout.types import Interaction

__all__ = ["Step", "branch_prefix", "message_text", "split_steps", "turn_conversation"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One agent step: what it did (its assistant message) and what came back (tool/user messages)."""

    action: str
    observation: str
    reward: float | None = None


def message_text(msg: Mapping[str, Any]) -> str:
    """The text of a chat message: string content, text parts of list content, and tool calls
    rendered as ``name(arguments)``."""
    content = msg.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, Sequence):
        for p in content:
            if isinstance(p, Mapping) and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, str):
                parts.append(p)
    for call in msg.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            continue
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
        name = fn.get("name", "tool")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, default=str, sort_keys=True)
        parts.append(f"{name}({args})")
    return "\n".join(p for p in parts if p)


def turn_conversation(interaction: Interaction, ctx: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The conversation up to and including ``interaction``'s output, plus the observations that
    followed it when ``ctx["messages"]`` (the branch conversation) extends this turn.

    Falls back to ``interaction.messages + interaction.output_messages``.
    """
    own = [*interaction.messages, *interaction.output_messages]
    full = None if ctx is None else ctx.get("messages")
    if full is None:
        return own
    full = list(full)
    n = len(own)
    if len(full) >= n and full[:n] == own:
        tail = []
        for msg in full[n:]:
            if msg.get("role") == "assistant":
                break
            tail.append(msg)
        return own + tail
    if not own:
        return full
    return own


def branch_prefix(interaction: Interaction, ctx: Mapping[str, Any] | None) -> list[Interaction]:
    """The branch's turns from the root up to ``interaction`` (from ``ctx["branch"]``, located by
    id; ``[*branch, interaction]`` if it is not there; ``[interaction]`` without a branch)."""
    branch = None if ctx is None else ctx.get("branch")
    if not branch:
        return [interaction]
    branch = list(branch)
    for i, it in enumerate(branch):
        if getattr(it, "id", None) == interaction.id:
            return [*branch[:i], interaction]
    return [*branch, interaction]


def split_steps(messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[Step]]:
    """``(task, steps)``: the task is the first user message (system prompts are not the task);
    every later assistant message starts a step whose observation is the non-assistant messages
    that follow it."""
    task = ""
    start = len(messages)
    for i, msg in enumerate(messages):
        if msg.get("role") == "user":
            task = message_text(msg)
            start = i + 1
            break
    steps: list[Step] = []
    action: str | None = None
    obs: list[str] = []
    for msg in messages[start:]:
        if msg.get("role") == "assistant":
            if action is not None:
                steps.append(Step(action, "\n".join(obs)))
            action, obs = message_text(msg), []
        elif action is not None:
            text = message_text(msg)
            if text:
                obs.append(text)
    if action is not None:
        steps.append(Step(action, "\n".join(obs)))
    return task, steps


def with_step_rewards(steps: list[Step], prefix: Sequence[Interaction]) -> list[Step]:
    """Attach each turn's env ``reward`` to the steps, aligned from the end (the last step is the
    scored turn); steps without a matching turn keep ``reward=None``."""
    out = list(steps)
    for k in range(1, min(len(steps), len(prefix)) + 1):
        r = getattr(prefix[-k], "reward", None)
        if r is not None:
            out[-k] = dataclasses.replace(out[-k], reward=float(r))
    return out
