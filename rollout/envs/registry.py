"""The environments by name (layer 4): what the trainer, the evaluation, the warm start, every
rollout strategy and the proxy's example agent build from ``env.name``.

An :class:`EnvSpec` says how to build an episode (``make_env(system_prompt, invalid_ends_episode=)``),
its system prompts by style (``compact``, ``full``, ``none``), its task type (and how a task is
read back from JSON) and the progress scorer that reads its recorded states.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from rollout.envs import frozenlake, sokoban
from rollout.envs.base import Env
from rollout.envs.tool_moves import ACTION_FORMATS, ToolMoveEnv

__all__ = ["EnvSpec", "ENVS", "ENV_NAMES", "get_env", "PROMPT_STYLES"]

PROMPT_STYLES = ("compact", "full", "none")


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One environment (see the module docstring)."""

    name: str
    env_class: Callable[..., Env]
    task_class: type
    prompts: Mapping[str, str | None]
    progress_scorer: str  # a ``scorers`` class path

    def factory(self, system_prompt: str = "compact", *, invalid_ends_episode: bool = True,
                action_format: str = "fenced") -> Callable[[], Env]:
        """A zero-argument constructor of episodes with the ``system_prompt`` style; moves are fenced
        answers or, with ``action_format="tool_call"``, ``move`` calls (``rollout.envs.tool_moves``)."""
        if system_prompt not in self.prompts:
            raise ValueError(f"system_prompt={system_prompt!r}; allowed: {PROMPT_STYLES}")
        if action_format not in ACTION_FORMATS:
            raise ValueError(f"action_format={action_format!r}; allowed: {ACTION_FORMATS}")
        game = functools.partial(self.env_class, self.prompts[system_prompt], invalid_ends_episode=invalid_ends_episode)
        if action_format == "tool_call":
            return lambda: ToolMoveEnv(game())
        return game

    def task(self, data: Any) -> Any:
        """A task of this environment, or one from its JSON form (the dataclass's fields)."""
        if isinstance(data, self.task_class):
            return data
        if not isinstance(data, Mapping):
            raise TypeError(f"a {self.name} task is a {self.task_class.__name__} or a mapping, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(self.task_class)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown {self.name} task keys {sorted(unknown)}; allowed: {sorted(fields)}")
        return self.task_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


ENVS: dict[str, EnvSpec] = {
    "frozenlake": EnvSpec(
        "frozenlake", frozenlake.FrozenLakeEnv, frozenlake.FrozenLakeTask,
        {"compact": frozenlake.COMPACT_SYSTEM_PROMPT, "full": frozenlake.SYSTEM_PROMPT, "none": None},
        "scorers.FrozenLakeProgressScorer"),
    "sokoban": EnvSpec(
        "sokoban", sokoban.SokobanEnv, sokoban.SokobanTask,
        {"compact": sokoban.COMPACT_SYSTEM_PROMPT, "full": sokoban.SYSTEM_PROMPT, "none": None},
        "scorers.SokobanProgressScorer"),
}
ENV_NAMES = tuple(ENVS)


def get_env(name: str) -> EnvSpec:
    """The environment called ``name`` (``ValueError`` naming the allowed ones otherwise)."""
    try:
        return ENVS[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; allowed: {ENV_NAMES}") from None
