"""FrozenLake as a plain chat loop: the environment on the agent's side, the model behind the proxy.

The agent talks only through the official ``openai`` SDK (``chat.completions.create``), exactly the
way an unmodified agent would; it keeps the conversation in the same shape as the tree rollouts
(system rules, the map as a user message, the assistant's fenced move, the environment's answer as
the next user message), so a policy warm-started or evaluated on the tree path sees the same text.

It returns ``{"rewards": {completion id: step reward}, "env_states": {completion id: step info}}``:
per-turn rewards (the last turn's reward is the episode's outcome: 1 on reaching the goal) and what
the environment reported after each turn (position, distance to the goal, hole, success), which
``scorers.FrozenLakeProgressScorer`` reads as a process reward.

A task is a ``rollout.envs.FrozenLakeTask`` (in-process) or its JSON form ``{"desc": [...],
"max_turns": N}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai

from rollout.envs.frozenlake import COMPACT_SYSTEM_PROMPT, SYSTEM_PROMPT, FrozenLakeEnv, FrozenLakeTask

__all__ = ["run"]

_PROMPTS = {"compact": COMPACT_SYSTEM_PROMPT, "full": SYSTEM_PROMPT, "none": None}


async def run(task: Any, base_url: str, api_key: str, http_client: Any = None, *, model: str = "jaxprm",
              system_prompt: str = "compact", invalid_ends_episode: bool = True, max_tokens: int = 8,
              temperature: float = 1.0, top_p: float = 1.0, theta: int | None = 6) -> dict[str, Any]:
    """Play one FrozenLake episode through the proxy; see the module docstring.

    ``theta``: stop after this many identical consecutive actions (the tree rollouts' loop rule;
    ``None``: never). ``system_prompt``: ``compact`` | ``full`` | ``none``.
    """
    if isinstance(task, Mapping):
        task = FrozenLakeTask(desc=tuple(task["desc"]), max_turns=int(task.get("max_turns", 10)),
                              task_id=str(task.get("task_id", "")))
    if system_prompt not in _PROMPTS:
        raise ValueError(f"system_prompt={system_prompt!r}; allowed: {sorted(_PROMPTS)}")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
    env = FrozenLakeEnv(_PROMPTS[system_prompt], invalid_ends_episode=invalid_ends_episode)
    observation = await env.reset(task)
    system = env.system_prompt(task)
    messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": observation})
    rewards: dict[str, float] = {}
    states: dict[str, dict[str, Any]] = {}
    actions: list[Any] = []
    while True:
        completion = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          temperature=temperature, top_p=top_p)
        text = completion.choices[0].message.content or ""
        step = await env.step(text)
        rewards[completion.id] = float(step.reward)
        states[completion.id] = dict(step.info)
        actions.append(step.info.get("action"))
        if step.done:
            break
        if theta is not None and len(actions) >= theta and len(set(map(repr, actions[-theta:]))) == 1:
            break
        messages += [{"role": "assistant", "content": text}, {"role": step.role, "content": step.observation}]
    return {"rewards": rewards, "env_states": states}
