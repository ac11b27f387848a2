"""A grid game (FrozenLake or Sokoban) as a plain chat loop: the environment on the agent's side,
the model behind the proxy.

The agent talks only through the official ``openai`` SDK (``chat.completions.create``), exactly the
way an unmodified agent would; it keeps the conversation in the same shape as the tree rollouts
(system rules, the map as a user message, the assistant's fenced move, the environment's answer as
the next user message), so a policy warm-started or evaluated on the tree path sees the same text.

It returns ``{"rewards": {completion id: step reward}, "env_states": {completion id: step info}}``:
per-turn rewards (their sum is the episode's outcome: FrozenLake's 1 on reaching the goal,
Sokoban's gym-sokoban rewards) and what the environment reported after each turn (position,
distance to go, hole or dead state, success), which the environment's progress scorer
(``scorers.FrozenLakeProgressScorer``, ``scorers.SokobanProgressScorer``) reads as a process reward.

``env`` names the game (``rollout.envs.get_env``). A task is the game's task object (in-process)
or its JSON form: FrozenLake ``{"desc": [...], "max_turns": N}``, Sokoban ``{"room": [...],
"max_turns": N}``.
"""

from __future__ import annotations

from typing import Any

import openai

from rollout.envs.registry import get_env

__all__ = ["run", "EpisodeLog"]


class EpisodeLog:
    """An agent episode's record: the step reward and environment info by completion id, and the
    tree rollouts' loop rule (``theta`` identical consecutive actions end it; ``None``: never)."""

    def __init__(self, theta: int | None) -> None:
        self.theta = theta
        self.rewards: dict[str, float] = {}
        self.states: dict[str, dict[str, Any]] = {}
        self.actions: list[Any] = []

    def record(self, completion_id: str, step: Any) -> bool:
        """Record one turn's ``StepResult``; ``True`` when the episode is over."""
        self.rewards[completion_id] = float(step.reward)
        self.states[completion_id] = dict(step.info)
        self.actions.append(step.info.get("action"))
        if step.done:
            return True
        t = self.theta
        return t is not None and len(self.actions) >= t and len(set(map(repr, self.actions[-t:]))) == 1

    def result(self) -> dict[str, Any]:
        """What a workflow returns: ``{"rewards": {...}, "env_states": {...}}``."""
        return {"rewards": self.rewards, "env_states": self.states}


async def run(task: Any, base_url: str, api_key: str, http_client: Any = None, *, env: str = "frozenlake",
              model: str = "jaxprm", system_prompt: str = "compact", invalid_ends_episode: bool = True, max_tokens: int = 8,
              temperature: float = 1.0, top_p: float = 1.0, theta: int | None = 6) -> dict[str, Any]:
    """Play one episode of ``env`` through the proxy; see the module docstring.

    ``theta``: stop after this many identical consecutive actions (the tree rollouts' loop rule;
    ``None``: never). ``system_prompt``: ``compact`` | ``full`` | ``none``.
    """
    spec = get_env(env)
    task = spec.task(task)
    game = spec.factory(system_prompt, invalid_ends_episode=invalid_ends_episode)()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
    observation = await game.reset(task)
    system = game.system_prompt(task)
    messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": observation})
    log = EpisodeLog(theta)
    while True:
        completion = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          temperature=temperature, top_p=top_p)
        text = completion.choices[0].message.content or ""
        step = await game.step(text)
        if log.record(completion.id, step):
            return log.result()
        messages += [{"role": "assistant", "content": text}, {"role": step.role, "content": step.observation}]
