"""Environments for multi-turn rollouts (layer 4): the async ``Env`` interface and text FrozenLake."""

from rollout.envs.base import Env, StepResult
from rollout.envs.frozenlake import (
    ACTIONS,
    SYSTEM_PROMPT,
    FrozenLakeEnv,
    FrozenLakeTask,
    bfs_distances,
    generate_map,
    make_tasks,
    parse_action,
    render_map,
)

__all__ = [
    "Env", "StepResult", "ACTIONS", "SYSTEM_PROMPT", "FrozenLakeEnv", "FrozenLakeTask",
    "bfs_distances", "generate_map", "make_tasks", "parse_action", "render_map",
]
