"""Environments for multi-turn rollouts (layer 4): the async ``Env`` interface and text FrozenLake."""

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

__all__ = [
    "Env", "StepResult", "ACTIONS", "SYSTEM_PROMPT", "COMPACT_SYSTEM_PROMPT", "FrozenLakeEnv", "FrozenLakeTask",
    "bfs_distances", "generate_map", "make_tasks", "parse_action", "render_map",
]
