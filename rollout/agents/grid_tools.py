"""A grid game (FrozenLake or Sokoban) played by a tool-calling agent: the environment on the
agent's side, the model behind the proxy, every move a ``move(direction)`` function call.

The agent talks only through the official ``openai`` SDK (``chat.completions.create`` with
``tools=[MOVE_TOOL]`` and ``tool_choice`` naming ``move``, so the proxy prefills the call's opening
and the model writes its arguments); it answers each call with a ``tool`` message carrying the
environment's observation and the call's id. An answer that is not one valid ``move`` call is an
invalid move, answered (when the episode goes on) as a ``user`` message. This is the format of
``env.action_format: tool_call`` (``rollout.envs.tool_moves``), so the tree path, the held-out
evaluation and the warm start see the same tokens.

It returns what ``rollout.agents.grid_chat`` returns: per-turn rewards and environment states by
completion id.
"""

from __future__ import annotations

from typing import Any

import openai

from rollout.agents.grid_chat import EpisodeLog
from rollout.envs.registry import get_env
from rollout.envs.tool_moves import MOVE_TOOL, ToolMoveEnv, direction_of, move_answer

__all__ = ["run"]

_CHOICE = {"type": "function", "function": {"name": "move"}}


async def run(task: Any, base_url: str, api_key: str, http_client: Any = None, *, env: str = "frozenlake",
              model: str = "jaxprm", system_prompt: str = "compact", invalid_ends_episode: bool = True,
              max_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
              theta: int | None = 6) -> dict[str, Any]:
    """Play one episode of ``env`` through the proxy by ``move`` calls; see the module docstring."""
    spec = get_env(env)
    task = spec.task(task)
    game = spec.factory(system_prompt, invalid_ends_episode=invalid_ends_episode)()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
    observation = await game.reset(task)
    system = ToolMoveEnv(game).system_prompt(task)  # the tool format's instruction
    messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": observation})
    log = EpisodeLog(theta)
    while True:
        completion = await client.chat.completions.create(
            model=model, messages=messages, tools=[MOVE_TOOL], tool_choice=_CHOICE, parallel_tool_calls=False,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        message = completion.choices[0].message
        calls = [c for c in message.tool_calls or () if c.function.name == "move"]
        direction = direction_of(calls[0].function.arguments) if calls else None
        step = await game.step(move_answer(direction))
        if log.record(completion.id, step):
            return log.result()
        reply = ({"role": "tool", "tool_call_id": calls[0].id, "content": step.observation} if direction is not None
                 else {"role": "user", "content": step.observation})
        messages += [message.model_dump(exclude_none=True), reply]
