"""Environments for multi-turn rollouts (layer 4): the async ``Env`` interface, text FrozenLake and
text Sokoban, and the registry that names them (``get_env``)."""

from rollout.envs.base import Env, StepResult
from rollout.envs.frozenlake import (
    ACTIONS,
    COMPACT_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    FrozenLakeEnv,
    FrozenLakeTask,
    bfs_distances,
    generate_map,
    make_tasks,
    parse_action,
    render_map,
)
from rollout.envs.registry import ENV_NAMES, ENVS, EnvSpec, get_env
from rollout.envs.sokoban import SokobanEnv, SokobanTask

__all__ = [
    "Env", "StepResult", "ACTIONS", "SYSTEM_PROMPT", "COMPACT_SYSTEM_PROMPT", "FrozenLakeEnv", "FrozenLakeTask",
    "bfs_distances", "generate_map", "make_tasks", "parse_action", "render_map",
    "ENVS", "ENV_NAMES", "EnvSpec", "get_env", "SokobanEnv", "SokobanTask",
]
